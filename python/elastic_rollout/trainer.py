"""Trainer-side helper for weights the trainer broadcasts over NCCL (the trainer is rank 0).

The manager runs the update, so the fleet's version, the registry, the version pins and the
metrics follow it, and engines that start later copy the new version from an engine that has
it. This helper is the trainer's side of that API; the trainer keeps its torch callables:

1. ``POST /rollout/weights/trainer_updates`` opens the update and answers the group layout
   (the trainer's group from the last update when the engines did not change, else a new one
   with a new name at ``master_address:master_port``; engine *k* gets ``rank_offset = 1 + the
   earlier engines' tp_size`` and ``world_size = 1 + every tp_size``);
2. for a new group, ``join_group(layout)`` joins it as rank 0 while the manager has every
   engine call ``/init_weights_update_group``;
3. ``POST /rollout/weights/updates/{id}/broadcast``, then ``broadcast(layout, specs)`` sends
   every tensor in order while the manager has each engine pause, open its update session
   (SGLang 0.5.21 and later), receive (``/update_weights_from_distributed``), close the
   session, continue, and report the version;
4. the helper waits for the update to end and raises :class:`WeightSyncError` if no engine got
   the version. Engines that failed their part are out of routing and restarted on a copy of
   the new version; :attr:`UpdateResult.failed` names them.

A trainer that fails to join tells the manager (the update ends FAILED, the group is destroyed,
nothing was paused) and the exception is raised. Membership is frozen while an update runs:
a scale-out's engines wait out of routing, a scale-in waits before removing a member.

Example::

    sync = DistributedWeightSync("http://manager:8000", master_address="10.0.0.5",
                                 join_group=lambda layout: init_group(layout),
                                 broadcast=lambda layout, specs: send_tensors(layout, specs))
    sync.update("step-12", [TensorSpec("lm_head.weight", "bfloat16", (151936, 4096)), ...])

:class:`AsyncDistributedWeightSync` is the same for asyncio trainers (its callables may be
coroutine functions).
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic_rollout.client import AsyncRolloutClient, RolloutApiError, RolloutClient, _poll
from elastic_rollout.models import WeightUpdate

__all__ = [
    "AsyncDistributedWeightSync",
    "BucketedUpdate",
    "DistributedWeightSync",
    "EngineFailure",
    "FixedGroupSync",
    "GroupLayout",
    "GroupMember",
    "TensorSpec",
    "UpdateResult",
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

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GroupLayout:
        members = tuple(
            GroupMember(str(m["engine_id"]), str(m["url"]), int(m["tp_size"]), int(m["rank_offset"]))
            for m in data.get("members") or ()
        )
        return cls(
            str(data["group_name"]),
            str(data["master_address"]),
            int(data["master_port"]),
            int(data["world_size"]),
            members,
        )


def plan_layout(
    engines: Sequence[tuple[str, str, int]], *, group_name: str, master_address: str, master_port: int
) -> GroupLayout:
    """The rank rule the manager applies: ``engines`` (``(engine_id, url, tp_size)``, in order)
    behind the trainer's rank 0."""
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
    """What went wrong, where: an engine's part of an update (``route`` empty: the manager's
    record says what), or the manager's refusal (``engine_id`` ``"-"``)."""

    engine_id: str
    route: str
    status: int
    message: str

    def __str__(self) -> str:
        where = f" {self.route}" if self.route else ""
        code = f" -> {self.status}" if self.status else ""
        return f"{self.engine_id}{where}{code}: {self.message}"


class WeightSyncError(Exception):
    """An update failed; ``step`` says where (``open``, ``join_group``, ``broadcast``, ``update``)
    and ``failures`` which engines (or the manager) and why."""

    def __init__(self, step: str, failures: list[EngineFailure], update: WeightUpdate | None = None) -> None:
        self.step = step
        self.failures = failures
        self.update = update
        super().__init__(f"{step} failed: " + "; ".join(str(f) for f in failures))


@dataclass(frozen=True)
class UpdateResult:
    version: str
    layout: GroupLayout
    #: True when this update built a new group (first use or the engine set changed).
    rebuilt: bool
    #: The manager's record of the update (per-engine progress in ``update.engines``).
    update: WeightUpdate | None = None
    #: Engines that failed their part (restarted by the manager on a copy of the version).
    failed: dict[str, str] = field(default_factory=dict)


#: Seconds between polls of the update's record once the trainer has broadcast: the update ends
#: a few milliseconds after the engines answer, and a trainer waits on it every step.
POLL = 0.01


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def _refused(step: str, err: RolloutApiError) -> WeightSyncError:
    return WeightSyncError(step, [EngineFailure("-", err.path or "", err.status, err.message)])


def _outcome(version: str, layout: GroupLayout, rebuilt: bool, done: WeightUpdate) -> UpdateResult:
    failed = {k: p.error or "failed" for k, p in done.engines.items() if p.status == "FAILED"}
    if done.status != "COMPLETED":
        failures = [EngineFailure(k, "", 0, why) for k, why in failed.items()]
        if not failures:
            failures = [EngineFailure("-", "", 0, done.error_message or done.status)]
        raise WeightSyncError("update", failures, done)
    return UpdateResult(version, layout, rebuilt, done, failed)


def _tensors(specs: Sequence[TensorSpec]) -> list[tuple[str, str, tuple[int, ...]]]:
    if not specs:
        raise ValueError("specs is empty: name at least one tensor to broadcast")
    return [(s.name, s.dtype, tuple(s.shape)) for s in specs]


def _open_args(
    sync: _SyncBase, version: str, specs: Sequence[TensorSpec] | None, flush_cache: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The open's arguments; ``specs`` None opens a bucketed update (no tensors)."""
    port = sync.master_port if sync.master_port is not None else _free_port(sync.master_address)
    tensors = [] if specs is None else _tensors(specs)
    kwargs = {
        "group_name": sync.layout.group_name if sync.layout is not None else None,
        "pause_mode": sync.pause_mode,
        "flush_cache": flush_cache,
        "group_prefix": sync.group_prefix,
        "backend": sync.backend,
    }
    return (version, tensors, sync.master_address, port), kwargs


def _layout_of(opened: WeightUpdate) -> tuple[GroupLayout, bool]:
    group = (opened.trainer or {}).get("group")
    if not isinstance(group, Mapping):
        raise WeightSyncError("open", [EngineFailure("-", "", 0, "the manager's answer has no group layout")], opened)
    return GroupLayout.from_json(group), bool(group.get("new"))


class _SyncBase:
    def __init__(
        self,
        *,
        master_address: str,
        master_port: int | None,
        group_prefix: str,
        pause_mode: str,
        timeout: float,
        backend: str = "nccl",
    ) -> None:
        if pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_mode must be abort, retract or in_place, got {pause_mode!r}")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo (engines on CPU), got {backend!r}")
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.group_prefix = group_prefix
        self.pause_mode = pause_mode
        self.timeout = timeout
        #: The group the trainer holds (joined as rank 0), if any.
        self.layout: GroupLayout | None = None


class DistributedWeightSync(_SyncBase):
    """Runs trainer updates through the manager (see the module docs).

    ``join_group(layout)`` must join the group as rank 0 and return once every engine has
    joined (it runs while the engines' ``/init_weights_update_group`` calls are in flight).
    ``broadcast(layout, specs)`` must broadcast every tensor of ``specs`` in order.
    ``destroy_group(layout)``, if given, leaves the trainer's side of an old group.
    ``backend`` is the group's collective backend: ``nccl``, or ``gloo`` where the engines
    run on CPU (the trainer's side must then join over gloo too). ``engine_api_key`` and
    ``model_name`` are accepted for compatibility and not used: the manager calls the engines.
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
        backend: str = "nccl",
    ) -> None:
        super().__init__(
            master_address=master_address,
            master_port=master_port,
            group_prefix=group_prefix,
            pause_mode=pause_mode,
            timeout=timeout,
            backend=backend,
        )
        del engine_api_key, model_name
        self.manager = manager if isinstance(manager, RolloutClient) else RolloutClient(manager)
        self.join_group = join_group
        self.broadcast = broadcast
        self.destroy_group = destroy_group
        self._lock = threading.Lock()

    def update(
        self,
        version: str,
        specs: Sequence[TensorSpec] | None = None,
        *,
        buckets: Iterable[Sequence[TensorSpec]] | None = None,
        flush_cache: bool = True,
    ) -> UpdateResult:
        """Broadcasts one weight version to the fleet through the manager (see the module docs):
        every tensor of ``specs`` in one ``broadcast(layout, specs)`` call, or ``buckets`` (an
        iterable, consumed as the broadcast goes) with one ``broadcast(layout, bucket)`` call
        per bucket, each received by the engines before the next is sent."""
        if (specs is None) == (buckets is None):
            raise ValueError("give the tensors as specs (one broadcast) or as buckets, not both or neither")
        if buckets is not None:
            with self.begin(version, flush_cache=flush_cache) as bucketed:
                for bucket in buckets:
                    bucketed.send(bucket)
                    self.broadcast(bucketed.layout, bucket)
                return bucketed.end()
        assert specs is not None
        with self._lock:
            opened, layout, rebuilt = self._open(version, specs, flush_cache)
            try:
                self.manager.start_broadcast(opened.update_id)
            except RolloutApiError as err:
                self.layout = None
                done = self.manager.weight_update(opened.update_id)
                raise WeightSyncError("join_group", [EngineFailure("-", "", err.status, err.message)], done) from err
            self.broadcast(layout, specs)
            done = self.manager.wait_for_weight_update(opened.update_id, timeout=self.timeout, poll_interval=POLL)
            return _outcome(version, layout, rebuilt, done)

    def begin(self, version: str, *, flush_cache: bool = True) -> BucketedUpdate:
        """Opens an update whose tensors the trainer sends in buckets, for trainers that make
        each bucket as they go: :meth:`BucketedUpdate.send` before broadcasting a bucket,
        :meth:`BucketedUpdate.end` after the last, :meth:`BucketedUpdate.abort` to give up
        between two. Other updates wait until it ends. As a context manager it ends on a
        normal exit and aborts on an exception."""
        self._lock.acquire()
        try:
            opened, layout, rebuilt = self._open(version, None, flush_cache)
        except BaseException:
            self._lock.release()
            raise
        return BucketedUpdate(self, version, opened, layout, rebuilt)

    def _open(
        self, version: str, specs: Sequence[TensorSpec] | None, flush_cache: bool
    ) -> tuple[WeightUpdate, GroupLayout, bool]:
        """Opens the update and, for a new group, joins it as rank 0 (under the lock)."""
        args, kwargs = _open_args(self, version, specs, flush_cache)
        try:
            opened = self.manager.open_trainer_update(*args, **kwargs)
        except RolloutApiError as err:
            raise _refused("open", err) from err
        layout, rebuilt = _layout_of(opened)
        if rebuilt:
            old, self.layout = self.layout, None
            if old is not None and self.destroy_group is not None:
                self.destroy_group(old)
            try:
                self.join_group(layout)
            except BaseException as err:
                self._abort(opened.update_id, f"the trainer could not join group {layout.group_name}: {err}")
                raise
            self.layout = layout
        return opened, layout, rebuilt

    def _abort(self, update_id: str, reason: str) -> None:
        try:
            self.manager.abort_weight_update(update_id, reason)
        except RolloutApiError:
            pass  # the update ends by its timeout instead

    def close(self) -> None:
        """Leaves the group: the manager destroys it on the engines, then the trainer's side."""
        with self._lock:
            old, self.layout = self.layout, None
            try:
                self.manager.destroy_trainer_group()
            except RolloutApiError:
                pass  # the manager is gone or an update runs: the next update builds a new group
            if old is not None and self.destroy_group is not None:
                self.destroy_group(old)


class BucketedUpdate:
    """One trainer update sent in buckets (from :meth:`DistributedWeightSync.begin`)."""

    def __init__(
        self, sync: DistributedWeightSync, version: str, opened: WeightUpdate, layout: GroupLayout, rebuilt: bool
    ) -> None:
        self.sync = sync
        self.version = version
        self.update_id = opened.update_id
        #: The group to broadcast over (the trainer is rank 0).
        self.layout = layout
        self.rebuilt = rebuilt
        #: Buckets sent so far.
        self.sent = 0
        self._open = True

    def _release(self) -> None:
        if self._open:
            self._open = False
            self.sync._lock.release()

    def send(self, specs: Sequence[TensorSpec]) -> None:
        """Tells the manager the next bucket; broadcast it once this returns (the engines are
        paused and about to receive it). Waits until every engine received the bucket before."""
        if not self._open:
            raise RuntimeError(f"update {self.update_id} has ended; begin another")
        tensors = _tensors(specs)
        try:
            self.sync.manager.start_broadcast(self.update_id, tensors, last=False)
        except RolloutApiError as err:
            done = self.sync.manager.weight_update(self.update_id)
            if done.status in ("COMPLETED", "FAILED"):
                if self.sent == 0:  # the engines could not join: the group is gone
                    self.sync.layout = None
                self._release()
            step = "join_group" if self.sent == 0 else "broadcast"
            raise WeightSyncError(step, [EngineFailure("-", "", err.status, err.message)], done) from err
        self.sent += 1

    def end(self) -> UpdateResult:
        """After the last bucket's broadcast: waits until the fleet serves the version (raises
        :class:`WeightSyncError` if no engine got it)."""
        if not self._open:
            raise RuntimeError(f"update {self.update_id} has ended")
        if self.sent == 0:
            self.abort("the trainer ended the update before sending any bucket")
            raise ValueError("no bucket was sent: send at least one before end()")
        manager = self.sync.manager
        try:
            manager.start_broadcast(self.update_id, None, last=True)
        except RolloutApiError as err:
            done = manager.weight_update(self.update_id)
            if done.status not in ("COMPLETED", "FAILED"):
                self.abort(f"the manager refused the end of the broadcast: {err.message}")
            self._release()
            raise WeightSyncError("broadcast", [EngineFailure("-", "", err.status, err.message)], done) from err
        try:
            done = manager.wait_for_weight_update(self.update_id, timeout=self.sync.timeout, poll_interval=POLL)
            return _outcome(self.version, self.layout, self.rebuilt, done)
        finally:
            self._release()

    def abort(self, reason: str) -> None:
        """Gives up between buckets: the update ends FAILED, the fleet stays on its version, and
        engines that received part of this one are started again on it."""
        if not self._open:
            return
        try:
            self.sync._abort(self.update_id, reason)
        finally:
            self._release()

    def __enter__(self) -> BucketedUpdate:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, _tb: Any) -> None:
        if err is not None:
            self.abort(f"the trainer failed: {err}")
        elif self._open:
            self.end()


class FixedGroupSync:
    """Trainer updates over a group whose name and world size the trainer fixes itself.

    For trainers that build their NCCL group once, before any update, from their own view of
    the fleet (AReaL: ``world_size = rollout GPUs + 1``, in ``connect_engine``). The manager
    places its engines into that layout: the first engines whose ranks fill ``world_size - 1``
    are the members; engines beyond the world copy each new version from a member; members are
    held against scale-in; the group is never rebuilt (a lost member makes the next update fail
    with ``group_member_lost``: the trainer must build another group).

    1. :meth:`build` asks the manager for the group; the trainer joins it as rank 0 while the
       members join, then :meth:`wait_joined`.
    2. Per bucket of a version: :meth:`send` (the first bucket of a version opens its update),
       the trainer's broadcast, and :meth:`wait_received` before the next bucket.
    3. :meth:`end` after the last bucket: the version is told to the members, which continue;
       returns once the fleet serves it. :meth:`abort` gives up between buckets.
    """

    def __init__(
        self,
        manager: RolloutClient | str,
        *,
        group_name: str,
        master_address: str,
        master_port: int,
        world_size: int,
        pause_mode: str = "retract",
        timeout: float = 600.0,
        backend: str = "nccl",
    ) -> None:
        self.manager = manager if isinstance(manager, RolloutClient) else RolloutClient(manager)
        self.backend = backend
        self.group_name = group_name
        self.master_address = master_address
        self.master_port = master_port
        self.world_size = world_size
        self.pause_mode = pause_mode
        self.timeout = timeout
        #: The group as the manager built it (members, rank offsets), once :meth:`build` answered.
        self.layout: GroupLayout | None = None
        #: The update in flight (opened by the first bucket of a version) and its version.
        self.update_id: str | None = None
        self.version: str | None = None
        self._sent = 0

    def build(self) -> GroupLayout:
        """Asks the manager to build the group; its members start joining at once. Join it as
        rank 0 now, then call :meth:`wait_joined`."""
        try:
            data = self.manager.build_trainer_group(
                self.group_name, self.master_address, self.master_port, self.world_size, self.backend
            )
        except RolloutApiError as err:
            raise _refused("open", err) from err
        self.layout = GroupLayout.from_json(data)
        return self.layout

    def wait_joined(self) -> GroupLayout:
        """Waits until every member joined (raises :class:`WeightSyncError` if one could not)."""

        def state(group: Mapping[str, Any]) -> str:
            return str((group.get("fixed") or {}).get("state") or "")

        def late(group: Mapping[str, Any] | None) -> str:
            seen = "nothing" if group is None else state(group)
            return f"group {self.group_name} not joined within {self.timeout}s (last state: {seen})"

        group = _poll(self.manager.trainer_group, lambda g: state(g) != "joining", late, self.timeout, POLL)
        if group.get("group_name") != self.group_name:
            why = f"the engines hold group {group.get('group_name')}, not {self.group_name}: it was replaced"
            raise WeightSyncError("join_group", [EngineFailure("-", "", 0, why)])
        if state(group) != "joined":
            why = str((group.get("fixed") or {}).get("error") or "the members could not join")
            raise WeightSyncError("join_group", [EngineFailure("-", "", 0, why)])
        self.layout = GroupLayout.from_json(group)
        return self.layout

    def send(self, version: str, specs: Sequence[TensorSpec]) -> None:
        """Names the next bucket of ``version``; broadcast it once this returns (the members are
        paused and about to receive it). The first bucket of a version opens its update."""
        tensors = _tensors(specs)
        if self.update_id is not None and self.version != version:
            raise RuntimeError(f"the update to {self.version} is still open; end() it before sending {version}")
        if self.update_id is None:
            try:
                opened = self.manager.open_trainer_update(
                    version, [], self.master_address, self.master_port,
                    group_name=self.group_name, pause_mode=self.pause_mode,
                )  # fmt: skip
            except RolloutApiError as err:
                raise _refused("open", err) from err
            self.update_id, self.version, self._sent = opened.update_id, version, 0
        update_id = self.update_id
        try:
            self.manager.start_broadcast(update_id, tensors, last=False)
        except RolloutApiError as err:
            done = self.manager.weight_update(update_id)
            if done.is_terminal:
                self.update_id = None
            else:
                self.abort(f"the manager refused a bucket: {err.message}")
            raise WeightSyncError("broadcast", [EngineFailure("-", "", err.status, err.message)], done) from err
        self._sent += 1

    def wait_received(self) -> None:
        """After a bucket's broadcast: waits until every member received it (raises
        :class:`WeightSyncError` when the update ended meanwhile)."""
        if self.update_id is None:
            raise RuntimeError("no update is open: send() a bucket first")
        update_id, sent = self.update_id, self._sent

        def received(u: WeightUpdate) -> bool:
            return u.is_terminal or int((u.trainer or {}).get("buckets_received") or 0) >= sent

        manager = self.manager

        def late(_u: WeightUpdate | None) -> str:
            return f"bucket {sent} of update {update_id} was not received within {self.timeout}s"

        done = _poll(lambda: manager.weight_update(update_id), received, late, self.timeout, POLL)
        if done.is_terminal:
            self.update_id = None
            why = done.error_message or done.status
            raise WeightSyncError("broadcast", [EngineFailure("-", "", 0, why)], done)

    def end(self) -> UpdateResult:
        """After the last bucket: the members are told the version and continue; returns once
        the fleet serves it (raises :class:`WeightSyncError` if no engine got it)."""
        if self.update_id is None or self.version is None:
            raise RuntimeError("no update is open: send() a bucket first")
        update_id, version = self.update_id, self.version
        self.update_id = None
        try:
            self.manager.start_broadcast(update_id, None, last=True)
        except RolloutApiError as err:
            done = self.manager.weight_update(update_id)
            if not done.is_terminal:
                self.manager.abort_weight_update(update_id, f"the manager refused the end: {err.message}")
            raise WeightSyncError("broadcast", [EngineFailure("-", "", err.status, err.message)], done) from err
        done = self.manager.wait_for_weight_update(update_id, timeout=self.timeout, poll_interval=POLL)
        assert self.layout is not None
        return _outcome(version, self.layout, False, done)

    def abort(self, reason: str) -> None:
        """Gives up the update in flight between buckets (the fleet stays on its version)."""
        update_id, self.update_id = self.update_id, None
        if update_id is not None:
            try:
                self.manager.abort_weight_update(update_id, reason)
            except RolloutApiError:
                pass  # the update ends by its timeout instead


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


class AsyncDistributedWeightSync(_SyncBase):
    """:class:`DistributedWeightSync` for asyncio trainers: ``join_group``, ``broadcast`` and
    ``destroy_group`` may be plain or coroutine functions."""

    def __init__(
        self,
        manager: AsyncRolloutClient | str,
        *,
        join_group: Callable[[GroupLayout], Awaitable[None] | None],
        broadcast: Callable[[GroupLayout, Sequence[TensorSpec]], Awaitable[None] | None],
        destroy_group: Callable[[GroupLayout], Awaitable[None] | None] | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_prefix: str = "elastic_rollout_weights",
        pause_mode: str = "retract",
        timeout: float = 600.0,
        backend: str = "nccl",
    ) -> None:
        super().__init__(
            master_address=master_address,
            master_port=master_port,
            group_prefix=group_prefix,
            pause_mode=pause_mode,
            timeout=timeout,
            backend=backend,
        )
        self.manager = manager if isinstance(manager, AsyncRolloutClient) else AsyncRolloutClient(manager)
        self.join_group = join_group
        self.broadcast = broadcast
        self.destroy_group = destroy_group
        self._lock = asyncio.Lock()

    async def update(
        self,
        version: str,
        specs: Sequence[TensorSpec] | None = None,
        *,
        buckets: Iterable[Sequence[TensorSpec]] | None = None,
        flush_cache: bool = True,
    ) -> UpdateResult:
        """As :meth:`DistributedWeightSync.update`."""
        if (specs is None) == (buckets is None):
            raise ValueError("give the tensors as specs (one broadcast) or as buckets, not both or neither")
        async with self._lock:
            args, kwargs = _open_args(self, version, specs, flush_cache)
            try:
                opened = await self.manager.open_trainer_update(*args, **kwargs)
            except RolloutApiError as err:
                raise _refused("open", err) from err
            layout, rebuilt = _layout_of(opened)
            if rebuilt:
                await self._join(opened.update_id, layout)
            sent = 0
            try:
                if specs is not None:
                    await self.manager.start_broadcast(opened.update_id)
                    await _maybe_await(self.broadcast(layout, specs))
                else:
                    assert buckets is not None
                    for bucket in buckets:
                        await self.manager.start_broadcast(opened.update_id, _tensors(bucket), last=False)
                        sent += 1
                        await _maybe_await(self.broadcast(layout, bucket))
                    if sent == 0:
                        await self._abort(opened.update_id, "the trainer had no bucket to send")
                        raise ValueError("buckets is empty: send at least one")
                    await self.manager.start_broadcast(opened.update_id, None, last=True)
            except RolloutApiError as err:
                if sent == 0:
                    self.layout = None
                done = await self.manager.weight_update(opened.update_id)
                if specs is None and done.status not in ("COMPLETED", "FAILED"):
                    await self._abort(opened.update_id, f"the manager refused a step of the broadcast: {err.message}")
                step = "join_group" if sent == 0 else "broadcast"
                raise WeightSyncError(step, [EngineFailure("-", "", err.status, err.message)], done) from err
            except BaseException as err:
                if specs is None:
                    await self._abort(opened.update_id, f"the trainer failed: {err}")
                raise
            done = await self.manager.wait_for_weight_update(opened.update_id, timeout=self.timeout, poll_interval=POLL)
            return _outcome(version, layout, rebuilt, done)

    async def _join(self, update_id: str, layout: GroupLayout) -> None:
        old, self.layout = self.layout, None
        if old is not None and self.destroy_group is not None:
            await _maybe_await(self.destroy_group(old))
        try:
            await _maybe_await(self.join_group(layout))
        except BaseException as err:
            await self._abort(update_id, f"the trainer could not join group {layout.group_name}: {err}")
            raise
        self.layout = layout

    async def _abort(self, update_id: str, reason: str) -> None:
        try:
            await self.manager.abort_weight_update(update_id, reason)
        except RolloutApiError:
            pass  # the update ends by its timeout instead

    async def close(self) -> None:
        """As :meth:`DistributedWeightSync.close`."""
        async with self._lock:
            old, self.layout = self.layout, None
            try:
                await self.manager.destroy_trainer_group()
            except RolloutApiError:
                pass
            if old is not None and self.destroy_group is not None:
                await _maybe_await(self.destroy_group(old))
