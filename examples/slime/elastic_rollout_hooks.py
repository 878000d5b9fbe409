"""slime hooks for an Elastic Rollout fleet (checked against THUDM/slime 624b824a).

slime launches no SGLang engine: its only engine is the manager's trainer port
(``--rollout-external-engine-addrs <manager-host>:<trainer port>``), generation goes to the
manager's router, and each weight sync (NCCL, or from disk) reaches every engine through the
port. Flags (README.md in this directory has the full list):

    --rollout-function-path elastic_rollout_hooks.generate_rollout

With the NCCL transport, for a run against a fleet that already holds versions:

    --custom-megatron-init-path elastic_rollout_hooks.continue_fleet_versions

Optional on the disk transport (step reports for the autoscaler, pruning old checkpoints):

    --custom-update-weight-post-write-path elastic_rollout_hooks.publish_weights
    --custom-megatron-before-train-step-hook-path elastic_rollout_hooks.mark_train_start

Environment: ``ELASTIC_ROLLOUT_MANAGER`` (control API, default ``http://127.0.0.1:8000``),
``ROLLOUT_MANAGER_API_TOKEN`` (if the manager has one), ``ELASTIC_ROLLOUT_MAX_ENGINES`` (engines
slime sizes its client concurrency for; default: the ACTIVE engines at the first rollout),
``ELASTIC_ROLLOUT_INNER`` (slime rollout function to wrap; default slime's own),
``ELASTIC_ROLLOUT_KEEP_VERSIONS`` (published ``weight_v*`` dirs to keep; 0 keeps all),
``ELASTIC_ROLLOUT_REPORT_STEPS`` (``1``: report steps to the autoscaler; for async loops only).

Only the stdlib and ``elastic_rollout`` are imported at module level; slime's modules are looked
up when a hook runs, inside slime's own processes.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_rollout import RolloutClient

__all__ = ["continue_fleet_versions", "generate_rollout", "mark_train_start", "publish_weights"]

_VERSION_DIR = re.compile(r"^weight_v(\d+)$")
_lock = threading.Lock()
_prepared = False
_pin: str | None = None
# Trainer rank 0 only: step timing for the pipeline reports.
_last_publish_end: float | None = None
_last_publish_secs = 0.0
_wait_before_train: float | None = None


def _client() -> RolloutClient:
    url = os.environ.get("ELASTIC_ROLLOUT_MANAGER", "http://127.0.0.1:8000")
    return RolloutClient(url, token=os.environ.get("ROLLOUT_MANAGER_API_TOKEN"), timeout=60.0)


def _fleet_version(client: RolloutClient) -> str | None:
    version = client.weights().get("version")
    return None if version is None else str(version)


# -- rollout side (slime's RolloutManager actor) ----------------------------------------------


def _prepare(args: Any) -> None:
    """Once per process: give slime an engine count and an HTTP client, and wrap its module-level
    ``post`` so ``/generate`` carries the pin."""
    global _prepared
    with _lock:
        if _prepared:
            return
        http_utils = importlib.import_module("slime.utils.http_utils")
        rollout_mod: Any = importlib.import_module("slime.rollout.sglang_rollout")
        if getattr(args, "rollout_num_engines", None) is None:
            configured = os.environ.get("ELASTIC_ROLLOUT_MAX_ENGINES")
            active = len(_client().engines().with_status("ACTIVE"))
            args.rollout_num_engines = max(1, int(configured) if configured else active)
        http_utils.init_http_client(args)
        original_post: Callable[..., Any] = rollout_mod.post

        async def post(url: str, payload: dict[str, Any], *rest: Any, **kwargs: Any) -> Any:
            if _pin is not None and url.endswith("/generate") and "weight_version" not in payload:
                payload = {**payload, "weight_version": {"min_version": _pin}}
            return await original_post(url, payload, *rest, **kwargs)

        rollout_mod.post = post
        _prepared = True


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """``--rollout-function-path``: slime's rollout (or ``ELASTIC_ROLLOUT_INNER``), with every
    ``/generate`` pinned to at least the fleet's committed weight version."""
    global _pin
    _check_weight_path(args)
    _prepare(args)
    _pin = _fleet_version(_client())
    module, _, name = os.environ.get(
        "ELASTIC_ROLLOUT_INNER", "slime.rollout.sglang_rollout.generate_rollout"
    ).rpartition(".")
    inner = getattr(importlib.import_module(module), name)
    return inner(args, rollout_id, data_source, evaluation=evaluation)


def _check_weight_path(args: Any) -> None:
    """Refuses, before the first rollout, a setup whose weight syncs would never reach the
    fleet: with no engine of its own and none listed, slime skips every sync (its actors log
    "No updatable SGLang engines are running; skip weight update.") and the fleet keeps serving
    its startup weights without an error."""
    if getattr(args, "rollout_external_engine_addrs", None):
        return
    if getattr(args, "rollout_num_gpus", None) == 0 or getattr(args, "update_weight_transport", None) == "disk":
        raise RuntimeError(
            "elastic_rollout_hooks: slime has no engine to sync weights to, so it would skip every sync and the fleet "
            "would keep its startup weights. Start the manager with --trainer-port P and pass slime "
            "--rollout-external-engine-addrs <manager-host>:P (both transports, nccl and disk, go through it)"
        )


# -- trainer side (slime's Megatron actors; rank 0 acts) ----------------------------------------


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def continue_fleet_versions(args: Any) -> None:
    """``--custom-megatron-init-path``: number this run's weight syncs after the fleet's version.

    slime numbers its syncs ``1, 2, ...`` from ``args.update_weight_start_version`` (0 unless
    set), read when it builds its weight updater, after this hook (``actor.py``). The manager
    refuses a version name it already served, so a second run against the same fleet would fail
    its first sync; starting from the fleet's version (when it is a number) continues the count.
    """
    version = _fleet_version(_client())
    if version is not None and version.isdigit():
        args.update_weight_start_version = max(int(version), int(getattr(args, "update_weight_start_version", 0) or 0))


def mark_train_start(*_args: Any, **_kwargs: Any) -> None:
    """``--custom-megatron-before-train-step-hook-path``: on the first call of a step, read slime's
    own ``train_wait`` timer (end of the previous train to the start of this one)."""
    global _wait_before_train
    if not _is_rank_zero() or _wait_before_train is not None:
        return
    timers = importlib.import_module("slime.observability.timer").Timer().log_dict()
    _wait_before_train = float(timers.get("train_wait", 0.0))


def publish_weights(args: Any, version_dir: str, rollout_engines: Any) -> None:
    """``--custom-update-weight-post-write-path``: publish the HF checkpoint slime just wrote as
    version ``<n>`` (from ``weight_v<n>``) and wait until the fleet serves it."""
    global _last_publish_end, _last_publish_secs, _wait_before_train
    if not _is_rank_zero():
        return
    if getattr(args, "update_weight_mode", "full") != "full":
        raise RuntimeError("elastic_rollout_hooks needs --update-weight-mode full: a delta dir is no checkpoint")
    path = Path(version_dir)
    match = _VERSION_DIR.match(path.name)
    if match is None:
        raise RuntimeError(f"unexpected weight dir name {path.name!r}; slime writes weight_v<number>")
    version = str(int(match.group(1)))
    started = time.monotonic()
    client = _client()
    update = client.publish_weights(
        version, str(path.resolve()), strategy=os.environ.get("ELASTIC_ROLLOUT_STRATEGY", "rolling")
    )
    record = client.wait_for_weight_update(
        str(update["update_id"]), timeout=float(os.environ.get("ELASTIC_ROLLOUT_PUBLISH_TIMEOUT", "1800"))
    )
    if record.get("status") != "COMPLETED":
        raise RuntimeError(f"publishing {version} failed: {record.get('error_message')}")
    _prune(path.parent, keep=int(os.environ.get("ELASTIC_ROLLOUT_KEEP_VERSIONS", "0")))
    now = time.monotonic()
    if os.environ.get("ELASTIC_ROLLOUT_REPORT_STEPS") == "1" and _last_publish_end is not None:
        # slime's train_wait spans the previous weight sync too; take our publish out of it
        # (the HF write before this hook stays in: it is not measurable from here).
        wait = max(0.0, (_wait_before_train or 0.0) - _last_publish_secs)
        client.report_step(int(version), wait, 0.0, now - _last_publish_end)
    _last_publish_end, _last_publish_secs, _wait_before_train = now, now - started, None


def _prune(root: Path, keep: int) -> None:
    """Removes all but the newest ``keep`` ``weight_v*`` dirs (the manager needs the committed
    one: engines that start or restart later load it)."""
    if keep <= 0:
        return
    dirs = sorted((d for d in root.iterdir() if d.is_dir() and _VERSION_DIR.match(d.name)), key=lambda d: d.name)
    for old in dirs[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
