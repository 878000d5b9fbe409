"""Trainer-side helper for SGLang's distributed weight update (the trainer is NCCL rank 0).

The manager knows which engines are ACTIVE; this helper turns that into a weight-update group
layout and drives every engine's side over HTTP in the order SGLang 0.5.x requires:

1. ``/init_weights_update_group`` on every engine, in parallel, while the trainer joins the
   group as rank 0 (``join_group``); engine *k* gets ``rank_offset = 1 + sum of the earlier
   engines' tp_size`` and ``world_size = 1 + sum of every tp_size``;
2. ``/pause_generation``, 3. ``/begin_weight_update``;
4. ``/update_weights_from_distributed`` on every engine, in parallel, while the trainer
   broadcasts each tensor in the same order (``broadcast``);
5. ``/end_weight_update``, ``/continue_generation``.

SGLang before 0.5.23 has no ``/begin_weight_update`` / ``/end_weight_update`` (and needs
none): an engine that answers 404 to the first is updated without a session, and is not
asked the second. Releases before 0.5.6 have no ``/server_info``; ``/get_server_info`` is read
instead.

A group cannot grow: when the set of ACTIVE engines changed since the group was built, the
old group is destroyed on the engines still there and a new one (new name, new port) is built.

Guarantees: every engine that was paused is continued and every session that was begun is
ended, also when a step fails; a failure raises :class:`WeightSyncError` naming each engine,
route and SGLang's message. Nothing here touches torch: ``join_group`` and ``broadcast`` are
the trainer's own callables (``init_custom_process_group(rank=0)`` and
``torch.distributed.broadcast(t, src=0, group)`` in a real trainer).

Example::

    sync = DistributedWeightSync("http://manager:8000", master_address="10.0.0.5",
                                 join_group=lambda layout: init_group(layout),
                                 broadcast=lambda layout, specs: send_tensors(layout, specs))
    sync.update("step-12", [TensorSpec("lm_head.weight", "bfloat16", (151936, 4096)), ...])
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from elastic_rollout.client import RolloutClient

__all__ = [
    "DistributedWeightSync",
    "GroupLayout",
    "GroupMember",
    "TensorSpec",
    "WeightSyncError",
    "plan_layout",
]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a broadcast, in broadcast order."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class GroupMember:
    """One engine's place in a weight-update group."""

    engine_id: str
    url: str
    tp_size: int
    rank_offset: int


@dataclass(frozen=True)
class GroupLayout:
    """A weight-update group: the trainer is rank 0, engines follow in order."""

    group_name: str
    master_address: str
    master_port: int
    world_size: int
    members: tuple[GroupMember, ...]

    def engine_set(self) -> tuple[tuple[str, str, int], ...]:
        """What makes two layouts the same group: each engine's id, url and tp_size, in order."""
        return tuple((m.engine_id, m.url, m.tp_size) for m in self.members)


def plan_layout(
    engines: Sequence[tuple[str, str, int]], *, group_name: str, master_address: str, master_port: int
) -> GroupLayout:
    """Ranks for ``engines`` (``(engine_id, url, tp_size)``, in order) behind the trainer's rank 0."""
    members = []
    next_rank = 1
    for engine_id, url, tp_size in engines:
        if tp_size < 1:
            raise ValueError(f"engine {engine_id} has tp_size {tp_size}; it must be at least 1")
        members.append(GroupMember(engine_id, url, tp_size, next_rank))
        next_rank += tp_size
    return GroupLayout(group_name, master_address, master_port, next_rank, tuple(members))


@dataclass
class EngineFailure:
    engine_id: str
    route: str
    status: int
    message: str

    def __str__(self) -> str:
        return f"{self.engine_id} {self.route} -> {self.status}: {self.message}"


class WeightSyncError(Exception):
    """One or more engines refused a step; ``failures`` says which, where and why."""

    def __init__(self, step: str, failures: list[EngineFailure]) -> None:
        self.step = step
        self.failures = failures
        super().__init__(f"{step} failed on {len(failures)} engine(s): " + "; ".join(str(f) for f in failures))


@dataclass(frozen=True)
class UpdateResult:
    version: str
    layout: GroupLayout
    #: True when this update built a new group (first use or the engine set changed).
    rebuilt: bool
    responses: dict[str, Any] = field(default_factory=dict)


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


class DistributedWeightSync:
    """Keeps one weight-update group matching the manager's ACTIVE engines and runs updates.

    ``join_group(layout)`` must join the group as rank 0 and return once every engine has
    joined (it runs while the engines' ``/init_weights_update_group`` calls are in flight).
    ``broadcast(layout, specs)`` must broadcast every tensor of ``specs`` in order (it runs
    while the engines' ``/update_weights_from_distributed`` calls are in flight).
    ``destroy_group(layout)``, if given, leaves the trainer's side of an old group.
    """

    def __init__(
        self,
        manager: RolloutClient | str,
        *,
        join_group: Callable[[GroupLayout], None],
        broadcast: Callable[[GroupLayout, Sequence[TensorSpec]], None],
        destroy_group: Callable[[GroupLayout], None] | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_prefix: str = "elastic_rollout_weights",
        pause_mode: str = "retract",
        engine_api_key: str | None = None,
        model_name: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        if pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_mode must be abort, retract or in_place, got {pause_mode!r}")
        self.manager = manager if isinstance(manager, RolloutClient) else RolloutClient(manager)
        self.join_group = join_group
        self.broadcast = broadcast
        self.destroy_group = destroy_group
        self.master_address = master_address
        self.master_port = master_port
        self.group_prefix = group_prefix
        self.pause_mode = pause_mode
        self.engine_api_key = engine_api_key
        self.model_name = model_name
        self.timeout = timeout
        self.layout: GroupLayout | None = None
        self._generation = 0
        self._lock = threading.Lock()

    # -- engines -------------------------------------------------------------------------

    def _engine_call(self, url: str, route: str, body: Any = None, method: str = "POST") -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.engine_api_key:
            headers["Authorization"] = f"Bearer {self.engine_api_key}"
        req = urllib.request.Request(url.rstrip("/") + route, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as err:
            raw, status = err.read(), err.code
            err.close()
        except OSError as err:
            return 0, {"message": f"unreachable: {err}"}
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, {"message": raw.decode(errors="replace")}

    def active_engines(self) -> list[tuple[str, str, int]]:
        """``(engine_id, url, tp_size)`` of every ACTIVE engine, sorted by id; tp_size from
        the engine's own ``/server_info``."""
        view = self.manager.engines()
        out = []
        for e in sorted(view.with_status("ACTIVE"), key=lambda e: e.engine_id):
            if self.model_name is not None and e.model_name != self.model_name:
                continue
            status, info = self._engine_call(e.url, "/server_info", method="GET")
            if status == 404:  # SGLang before 0.5.6
                status, info = self._engine_call(e.url, "/get_server_info", method="GET")
            tp = int(info.get("tp_size", 0) or 0) if status == 200 and isinstance(info, dict) else 0
            out.append((e.engine_id, e.url, tp or max(1, len(e.gpu_ids))))
        return out

    def _on_all(
        self, step: str, members: Sequence[GroupMember], route: str, body: Callable[[GroupMember], Any]
    ) -> dict[str, Any]:
        """``route`` on every member in parallel; raises with every failure."""
        if not members:
            return {}
        with ThreadPoolExecutor(max_workers=len(members)) as pool:
            futures = {m.engine_id: pool.submit(self._engine_call, m.url, route, body(m)) for m in members}
            results = {k: f.result() for k, f in futures.items()}
        failures = [
            EngineFailure(k, route, status, _message(out))
            for k, (status, out) in results.items()
            if status != 200 or (isinstance(out, dict) and out.get("success") is False)
        ]
        if failures:
            raise WeightSyncError(step, failures)
        return {k: out for k, (_, out) in results.items()}

    # -- the group -----------------------------------------------------------------------

    def ensure_group(self) -> tuple[GroupLayout, bool]:
        """The current group, rebuilt first if the ACTIVE engines changed. True if rebuilt."""
        with self._lock:
            engines = self.active_engines()
            if not engines:
                raise WeightSyncError("group layout", [EngineFailure("-", "/rollout/engines", 0, "no ACTIVE engines")])
            if self.layout is not None and self.layout.engine_set() == tuple(engines):
                return self.layout, False
            self._leave_current(keep={url for _, url, _ in engines})
            self._generation += 1
            port = self.master_port if self.master_port is not None else _free_port(self.master_address)
            layout = plan_layout(
                engines,
                group_name=f"{self.group_prefix}_{self._generation}",
                master_address=self.master_address,
                master_port=port,
            )

            def body(m: GroupMember) -> dict[str, Any]:
                return {
                    "master_address": layout.master_address,
                    "master_port": layout.master_port,
                    "rank_offset": m.rank_offset,
                    "world_size": layout.world_size,
                    "group_name": layout.group_name,
                    "backend": "nccl",
                }

            with ThreadPoolExecutor(max_workers=1) as pool:
                engines_side = pool.submit(
                    self._on_all, "init_weights_update_group", layout.members, "/init_weights_update_group", body
                )
                trainer_error: BaseException | None = None
                try:
                    self.join_group(layout)
                except BaseException as err:  # re-raised below, after the engines answered
                    trainer_error = err
                try:
                    engines_side.result()
                except WeightSyncError:
                    self._destroy_on(layout, layout.members)
                    raise
            if trainer_error is not None:
                self._destroy_on(layout, layout.members)
                raise trainer_error
            self.layout = layout
            return layout, True

    def _destroy_on(self, layout: GroupLayout, members: Sequence[GroupMember]) -> None:
        """Best effort: engines that are gone or never joined answer with an error, ignored."""
        for m in members:
            self._engine_call(m.url, "/destroy_weights_update_group", {"group_name": layout.group_name})

    def _leave_current(self, keep: set[str]) -> None:
        old = self.layout
        if old is None:
            return
        self._destroy_on(old, [m for m in old.members if m.url in keep])
        if self.destroy_group is not None:
            self.destroy_group(old)
        self.layout = None

    def close(self) -> None:
        """Destroys the group on every engine still ACTIVE (and on the trainer's side)."""
        with self._lock:
            try:
                keep = {url for _, url, _ in self.active_engines()}
            except Exception:  # the manager is gone: still try every member
                keep = {m.url for m in self.layout.members} if self.layout else set()
            self._leave_current(keep)

    # -- one update ----------------------------------------------------------------------

    def _begin_sessions(self, members: Sequence[GroupMember]) -> list[GroupMember]:
        """``/begin_weight_update`` on every member; the members now in a session. An engine
        that answers 404 (SGLang before 0.5.23) has no sessions and is updated without one."""
        with ThreadPoolExecutor(max_workers=len(members)) as pool:
            results = list(pool.map(lambda m: (m, self._engine_call(m.url, "/begin_weight_update", {})), members))
        in_session = [m for m, (status, out) in results if status == 200 and _succeeded(out)]
        failures = [
            EngineFailure(m.engine_id, "/begin_weight_update", status, _message(out))
            for m, (status, out) in results
            if status not in (200, 404) or (status == 200 and not _succeeded(out))
        ]
        if failures:
            for m in in_session:
                self._engine_call(m.url, "/end_weight_update", {})
            raise WeightSyncError("begin_weight_update", failures)
        return in_session

    def update(self, version: str, specs: Sequence[TensorSpec], *, flush_cache: bool = True) -> UpdateResult:
        """Broadcasts one weight version to every ACTIVE engine (see the module docs)."""
        if not specs:
            raise ValueError("specs is empty: name at least one tensor to broadcast")
        layout, rebuilt = self.ensure_group()
        members = layout.members
        paused: list[GroupMember] = []
        in_session: list[GroupMember] = []
        try:
            self._on_all("pause_generation", members, "/pause_generation", lambda m: {"mode": self.pause_mode})
            paused = list(members)
            in_session = self._begin_sessions(members)
            body = {
                "names": [s.name for s in specs],
                "dtypes": [s.dtype for s in specs],
                "shapes": [list(s.shape) for s in specs],
                "group_name": layout.group_name,
                "weight_version": version,
                "flush_cache": flush_cache,
            }
            with ThreadPoolExecutor(max_workers=1) as pool:
                engines_side = pool.submit(
                    self._on_all,
                    "update_weights_from_distributed",
                    members,
                    "/update_weights_from_distributed",
                    lambda m: body,
                )
                self.broadcast(layout, specs)
                responses = engines_side.result()
            self._on_all("end_weight_update", in_session, "/end_weight_update", lambda m: {})
            in_session = []
            self._on_all("continue_generation", members, "/continue_generation", lambda m: {})
            paused = []
            return UpdateResult(version, layout, rebuilt, responses)
        finally:
            # A failed step must not leave engines in a session or paused.
            for m in in_session:
                self._engine_call(m.url, "/end_weight_update", {})
            for m in paused:
                self._engine_call(m.url, "/continue_generation", {})


def _succeeded(out: Any) -> bool:
    return not (isinstance(out, dict) and out.get("success") is False)


def _message(out: Any) -> str:
    if isinstance(out, dict):
        if isinstance(out.get("error"), dict):
            return str(out["error"].get("message"))
        if "message" in out:
            return str(out["message"])
    return json.dumps(out)[:500]
