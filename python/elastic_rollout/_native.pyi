"""Type stub of ``elastic_rollout._native``, built from ``rust/rollout-py`` (the manager's own code)."""

from typing import Any

def parse_serve_args(argv: list[str]) -> dict[str, Any]:
    """Parse and validate ``rollout-manager serve`` arguments exactly as the binary does.

    ``argv`` excludes the program and subcommand names. Returns the configuration as a dict
    (the field names of the manager's ``ServeConfig`` JSON form, e.g. ``rollout_num_gpus``).

    Raises:
        ValueError: the binary's own error message for the same arguments (it names the flag).
    """

def binary_path() -> str:
    """Path of the ``rollout-manager`` binary matching this module.

    ``$ELASTIC_ROLLOUT_MANAGER_BIN`` if set, else ``elastic_rollout/_bin/rollout-manager``, else
    the newest cargo build (``target/release`` or ``target/debug``) of the source tree it was built
    from, else ``PATH``.

    Raises:
        FileNotFoundError: nothing found; the message lists every place tried.
    """

def autoscaler_replay(config_yaml: str, trace_jsonl: str) -> list[dict[str, Any]]:
    """Replay a metrics trace through the autoscaler's ``decide()`` (as ``rollout-manager autoscaler-replay``).

    Returns one dict per evaluation: ``at``, ``action`` (``scale_out``/``scale_in``/``none``),
    ``reason``, ``signal``, ``conditions``, ``metrics`` and, for scaling actions, ``delta``,
    ``from_engines``, ``to_engines``, ``triggered_conditions``.

    Raises:
        ValueError: the config or the trace is invalid (the message says which and why).
    """
