"""Type stub of ``elastic_rollout._native``, built from ``rust/rollout-py`` (the manager's own code)."""

from typing import Any

def parse_serve_args(argv: list[str]) -> dict[str, Any]:
    """Parse and validate ``rollout-manager serve`` arguments exactly as the binary does.

    ``argv`` excludes the program and subcommand names. Layered as in the binary: ``argv``, then
    this process's ``ROLLOUT_MANAGER_*`` environment variables, then the ``--config`` file (or
    ``ROLLOUT_MANAGER_CONFIG``), then the defaults. Returns the configuration as a dict (the
    field names of the manager's ``ServeConfig`` JSON form, e.g. ``rollout_num_gpus``).

    Raises:
        ValueError: the binary's own error message for the same arguments, environment and file
            (it names the flag; for the file, also the file and the key).
    """

def describe_serve_args(argv: list[str]) -> dict[str, Any]:
    """:func:`parse_serve_args`, and where each value came from.

    Returns ``{"config": <parse_serve_args' dict>, "config_file": <the --config path as given,
    or None>, "log_format": "text" | "json", "sources": {<ServeConfig field, "config_file" or
    "log_format">: "command_line" | "env" | "config_file" | "default"}}``.

    Raises:
        ValueError: as :func:`parse_serve_args`.
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
