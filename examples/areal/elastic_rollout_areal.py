"""AReaL remote SGLang engine for an Elastic Rollout fleet (checked against inclusionAI/AReaL
4aef98d8).

``ElasticSGLangEngine`` is AReaL's ``RemoteSGLangEngine`` with these changes:

- every ``/generate`` carries ``weight_version: {"min_version": "<AReaL's current version>"}``;
- versions are named after the fleet's: AReaL numbers them ``global_step + 1`` and starts
  again from a checkpoint's step when it recovers (or from 0 in a new trial), and the manager
  refuses a name it already served. The first time a name is needed, AReaL's version then is
  given the fleet's version when that is a larger number, and every later one the same offset;
- ``xccl`` (AReaL's default): ``init_weights_update_group`` asks the manager for a group of
  AReaL's world size (``POST /rollout/weights/trainer_group``; the manager fills it with its first
  engines and has them join while AReaL's trainer joins as rank 0), each
  ``update_weights_from_distributed`` bucket goes through the manager's trainer update, and
  ``continue_generation`` ends it (``elastic_rollout.trainer.FixedGroupSync``);
- ``update_weights_from_disk`` publishes AReaL's HF checkpoint through the manager (version =
  AReaL's new version number) instead of calling each server, and never deletes the directory;
- ``pause_generation`` does nothing (the manager pauses the members before the first bucket, and
  a disk publish drains engines instead).

It also reports each step to the autoscaler when ``ELASTIC_ROLLOUT_REPORT_STEPS=1``. Install it
in your training script before the trainer is built (SPMD mode; see README.md):

    import elastic_rollout_areal
    elastic_rollout_areal.install()

Environment: ``AREAL_LLM_SERVER_ADDRS=<manager-host>:30000`` (AReaL's own variable),
``ELASTIC_ROLLOUT_MANAGER`` (default ``http://127.0.0.1:8000``), ``ROLLOUT_MANAGER_API_TOKEN``.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from elastic_rollout import RolloutClient
from elastic_rollout.trainer import FixedGroupSync, TensorSpec

__all__ = ["ElasticSGLangEngine", "install"]

_publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-rollout-publish")
#: One worker: AReaL waits on a bucket before it sends the next, and the end follows the last.
_updater = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-rollout-xccl")


def _client() -> RolloutClient:
    url = os.environ.get("ELASTIC_ROLLOUT_MANAGER", "http://127.0.0.1:8000")
    return RolloutClient(url, token=os.environ.get("ROLLOUT_MANAGER_API_TOKEN"), timeout=60.0)


class _VersionNames:
    """AReaL's version numbers as the fleet's version names (see the module docs)."""

    def __init__(self) -> None:
        self.offset: int | None = None
        self._lock = threading.Lock()

    def name(self, version: int, current: int) -> str:
        """The fleet's name for AReaL's ``version``; ``current`` is AReaL's version now."""
        with self._lock:
            if self.offset is None:
                fleet = str(_client().weights().get("version"))
                self.offset = max(0, int(fleet) - current) if fleet.isdigit() else 0
            return str(version + self.offset)

    def step(self, name: str) -> int:
        """The AReaL step whose training made the version named ``name``."""
        return int(name) - (self.offset or 0) - 1


_names = _VersionNames()


def _areal(name: str) -> Any:
    return importlib.import_module(name)


def _base(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:  # not inside AReaL: the classes below stay importable for reading
        return object


class ElasticSGLangBackend(_base("areal.engine.sglang_remote", "SGLangBackend")):  # type: ignore[misc]
    """AReaL's SGLang request builder plus the version pin."""

    def build_generation_request(self, req: Any, with_lora: bool, version: int) -> Any:
        http_req = super().build_generation_request(req, with_lora, version)
        http_req.payload["weight_version"] = {"min_version": _names.name(version, version)}
        return http_req


class _Pipeline:
    """Step timing on the rank that updates weights: time spent waiting in ``prepare_batch`` /
    ``rollout_batch``, and time the staleness limit held rollout back (sampled every 0.5 s)."""

    def __init__(self) -> None:
        self.wait = 0.0
        self.throttled = 0.0
        self.accepted_at_report = 0
        self.last_report: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start_sampling(self, engine: Any) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._sample, args=(engine,), daemon=True)
            self._thread.start()

    def _sample(self, engine: Any) -> None:
        while not self._stop.wait(0.5):
            try:
                manager = engine.workflow_executor.staleness_manager
                running = manager.get_stats().running
                limit = getattr(manager, "max_concurrent_rollouts", None)
                if manager.get_capacity() <= 0 and (limit is None or running < limit):
                    self.throttled += 0.5
            except Exception:  # not initialized yet, or shutting down
                continue


class ElasticSGLangEngine(_base("areal.engine.sglang_remote", "RemoteSGLangEngine")):  # type: ignore[misc]
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        remote_inf_engine = _areal("areal.infra").RemoteInfEngine
        self._engine = remote_inf_engine(config, ElasticSGLangBackend())
        self._pipeline = _Pipeline()
        self._group: FixedGroupSync | None = None

    def pause_generation(self) -> None:
        return None

    def continue_generation(self) -> None:
        """After an xccl update's last bucket: the members are told the version and continue;
        returns once the fleet serves it."""
        group = self._group
        if group is not None and group.update_id is not None:
            _updater.submit(group.end).result()
            self._report(_names.step(group.version or "0"))

    def init_weights_update_group(self, meta: Any, xccl_group_ranks: list[int] | None = None) -> Future[None]:
        """AReaL's trainer builds its group once, of ``rollout GPUs + 1`` ranks, and joins it as
        rank 0 while this future runs: the manager fills it with its first engines."""
        parallel = meta.gen_allocation.parallel
        if xccl_group_ranks is not None or int(getattr(parallel, "pp_size", 1)) != 1:
            raise NotImplementedError("pipeline-parallel rollout (one group per stage) is not supported")
        self._group = FixedGroupSync(
            _client(),
            group_name=str(meta.nccl_group_name),
            master_address=str(meta.nccl_master_address),
            master_port=int(meta.nccl_master_port),
            world_size=int(parallel.world_size) + 1,
            timeout=3600.0,
        )
        group = self._group

        def build() -> None:
            group.build()
            group.wait_joined()

        return _updater.submit(build)

    def update_weights_from_distributed(self, meta: Any, param_specs: Any) -> Future[None]:
        """One bucket of version ``meta.version`` (the first opens the manager's update): the
        future ends once every member received it."""
        group = self._group
        if group is None:
            raise RuntimeError("init_weights_update_group must run first (AReaL's connect_engine)")
        if getattr(meta, "use_lora", False) or meta.version is None:
            raise NotImplementedError("xccl updates need meta.version (meta.with_version) and no LoRA")
        specs = [TensorSpec(str(p.name), str(p.dtype), tuple(int(d) for d in p.shape)) for p in param_specs]
        version = _names.name(int(meta.version), int(meta.version) - 1)
        self._pipeline.start_sampling(self._engine)

        def send() -> None:
            group.send(version, specs)
            group.wait_received()

        return _updater.submit(send)

    def prepare_batch(self, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return super().prepare_batch(*args, **kwargs)
        finally:
            self._pipeline.wait += time.monotonic() - started

    def rollout_batch(self, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return super().rollout_batch(*args, **kwargs)
        finally:
            self._pipeline.wait += time.monotonic() - started

    def update_weights_from_disk(self, meta: Any) -> Future[None]:
        """Waits (in a thread) for AReaL's "checkpoint saved" signal, then publishes ``meta.path``
        as version ``meta.version`` and waits until the fleet serves it."""
        if getattr(meta, "use_lora", False):
            raise NotImplementedError("LoRA adapters are not published by the manager")
        self._pipeline.start_sampling(self._engine)
        config = self.config
        saved_as = self.get_version()
        return _publisher.submit(self._publish, config.experiment_name, config.trial_name, saved_as, meta)

    def _publish(self, experiment: str, trial: str, saved_as: int, meta: Any) -> None:
        names = _areal("areal.utils.names")
        name_resolve = _areal("areal.utils.name_resolve")
        name_resolve.wait(names.update_weights_from_disk(experiment, trial, saved_as), timeout=3600)
        client = _client()
        version = _names.name(int(meta.version), int(meta.version) - 1)
        update = client.publish_weights(version, os.path.abspath(str(meta.path)))
        record = client.wait_for_weight_update(str(update["update_id"]), timeout=3600)
        if record.get("status") != "COMPLETED":
            raise RuntimeError(f"publishing {version} (AReaL's {meta.version}) failed: {record.get('error_message')}")
        self._report(int(meta.version) - 1)

    def _report(self, step: int) -> None:
        pipeline, now = self._pipeline, time.monotonic()
        if os.environ.get("ELASTIC_ROLLOUT_REPORT_STEPS") == "1" and pipeline.last_report is not None:
            manager = self._engine.workflow_executor.staleness_manager
            accepted = int(manager.get_stats().accepted)
            _client().report_step(
                step,
                pipeline.wait,
                min(pipeline.throttled, now - pipeline.last_report),
                now - pipeline.last_report,
                rollout_samples=accepted - pipeline.accepted_at_report,
                next_step_samples=int(manager.consumer_batch_size),
            )
            pipeline.accepted_at_report = accepted
        pipeline.last_report, pipeline.wait, pipeline.throttled = now, 0.0, 0.0


def install() -> None:
    """Makes AReaL's PPO trainer build ``ElasticSGLangEngine`` for ``sglang`` rollouts."""
    rl_trainer = _areal("areal.trainer.rl_trainer")
    rl_trainer.RemoteSGLangEngine = ElasticSGLangEngine
