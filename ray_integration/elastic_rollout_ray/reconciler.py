"""Reconciles the manager's placements (docs/ray.md) with Ray, driven by events.

An asyncio actor. One task long-polls ``GET /rollout/placements?after=<rev>&wait_secs=<n>`` on the
manager's Unix socket and hands every placement to its own :class:`PlacementWorker`, which brings
Ray in line with it independently of the others (a slow or dead host never delays another
placement). A worker waits on events, never on a timer:

- desired present: a placement group ``er-<engine_id>`` (the placement's bundles and strategy) is
  created, and its readiness awaited (one ``pg.ready()``, not polled); a host actor
  ``er-host-<engine_id>`` then starts the node agent in bundle 0 and the worker binds it
  (``POST .../bind``). One call to the host's ``watch`` stays pending: Ray fails it when the actor
  or its node dies, and the worker reports ``POST .../lost`` and places the engine again (Ray
  reschedules the group when the node is gone). Death is confirmed first: Ray's
  ``ActorUnavailableError`` (a transient loss of contact, a network blip) counts only if the
  host's node is dead in the GCS or the host fails :data:`UNAVAILABLE_PROBES` more probes;
  otherwise the worker logs it (event ``host_unavailable_transient``) and watches again. A
  change of the placement wakes the worker too, e.g. the manager unbinding an agent it found
  gone: if the host no longer answers, the worker replaces its group, avoiding the suspect node.
- desired absent and not BOUND (the manager stopped the engine): the host is stopped and killed,
  the group removed, then ``POST .../released``.

Placement groups and host actors named ``er-*`` that match no placement are removed (so a new
reconciler adopts or cleans what an old one left). ``request_resources`` gets the bundles of every
present placement while any is PENDING_RESOURCES, and nothing once none is. Errors of one
placement are recorded (``status()["errors"]``) and retried with backoff; they never stop the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypedDict, TypeVar

import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastic_rollout import AsyncRolloutClient, RolloutApiError
from elastic_rollout_ray.actors import EngineHost
from elastic_rollout_ray.wire import BindRequest, HostInfo, LostRequest, Placement, parse_placement_list

__all__ = ["HOST_PREFIX", "PG_PREFIX", "PlacementWorker", "Reconciler", "ReconcilerImpl", "ReconcilerStatus"]

log = logging.getLogger("elastic_rollout_ray.reconciler")

PG_PREFIX = "er-"
HOST_PREFIX = "er-host-"
#: Long-poll window of the placements API (the manager's changes end it early).
WAIT_SECS = 30
#: How long a host may take to answer ``info`` before it is taken for dead.
HOST_ANSWER_SECS = 5.0
#: How long a host may take to start its agent (the agent's own ready timeout is 60 s).
HOST_START_SECS = 90.0
#: How long a group that avoids a suspect node may wait for room elsewhere before it is made
#: again without the exclusion, if Ray still counts that node alive (Ray finds a dead node in
#: about 15-30 s with its default health checks).
AVOID_SECS = 30.0

#: Probes of a host whose ``watch`` failed with ``ActorUnavailableError`` before it is taken for
#: dead, with the pauses between them (seconds).
UNAVAILABLE_PROBES = (0.5, 1.0, 2.0)

T = TypeVar("T")


def pg_name(engine_id: str) -> str:
    return f"{PG_PREFIX}{engine_id}"


def host_name(engine_id: str) -> str:
    return f"{HOST_PREFIX}{engine_id}"


class ReconcilerStatus(TypedDict):
    revision: int | None
    placements: list[Placement]
    hosts: dict[str, HostInfo]
    requested_bundles: list[dict[str, float]] | None
    errors: list[str]
    #: ``[unix time, engine_id, event]`` for the latest events (pg_created, pg_ready, host_started,
    #: bound, host_lost, released, ...): what the bench draws its timeline from.
    events: list[tuple[float, str, str]]


class _Changed(Exception):
    """The placement changed while a worker waited; it re-reads it."""


class PlacementWorker:
    """Brings Ray in line with one placement, as long as the manager lists it."""

    def __init__(self, owner: ReconcilerImpl, placement: Placement) -> None:
        self.owner = owner
        self.engine_id = placement["engine_id"]
        self.placement = placement
        self.changed = asyncio.Event()
        self.pg: PlacementGroup | None = None
        self._pg_ready: asyncio.Future[Any] | None = None
        self.host: Any = None
        self.info: HostInfo | None = None
        self._watch: asyncio.Future[Any] | None = None
        #: an error the next wait on ``watch`` raises at once (:meth:`ReconcilerImpl.inject_watch_error`)
        self.watch_fault: RayActorError | None = None
        self._started = "host_started"
        #: the agent URL this worker last bound
        self.bound_url: str | None = None
        #: node ids a new group must avoid (its previous host there stopped answering)
        self.avoid: set[str] = set()
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"placement {self.engine_id}")

    def update(self, placement: Placement) -> None:
        if placement != self.placement:
            self.placement = placement
            self.changed.set()

    # -- waiting -----------------------------------------------------------------------------

    async def _until(self, fut: Awaitable[T], timeout: float | None = None) -> T:
        """``fut``'s result, unless the placement changes first (raises :class:`_Changed`; the
        future is kept running) or ``timeout`` passes (raises ``TimeoutError``)."""
        if self.changed.is_set():
            raise _Changed
        waiter = asyncio.ensure_future(fut)
        changed = asyncio.ensure_future(self.changed.wait())
        try:
            done, _ = await asyncio.wait({waiter, changed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
        if waiter in done:
            return waiter.result()
        if changed in done:
            raise _Changed
        raise TimeoutError

    async def _pause(self, seconds: float) -> None:
        """Sleeps ``seconds`` or until the placement changes."""
        try:
            await asyncio.wait_for(self.changed.wait(), seconds)
        except TimeoutError:
            pass

    # -- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.5
        while True:
            p = self.placement
            self.changed.clear()
            try:
                if p["desired"] == "absent":
                    if p["status"] == "BOUND":  # the manager is still stopping its engine
                        await self.changed.wait()
                        continue
                    await self._release()
                    return
                await self._present(p)
                backoff = 0.5
            except _Changed:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as err:  # one placement's trouble never ends its worker
                self.owner.error(f"{self.engine_id}: {err!r}; retrying in {backoff:g}s")
                await self._pause(backoff)
                backoff = min(backoff * 2, 10.0)

    async def _present(self, p: Placement) -> None:
        """Placement group ready, host started, agent bound; then wait for a change or a death."""
        if self._pg_ready is None:
            if self.pg is None:
                self.pg = await self._ensure_pg(p)
            # One readiness call per group incarnation (a node's death reschedules the group).
            self._pg_ready = asyncio.wrap_future(self.pg.ready().future())
        if not self._pg_ready.done():
            try:
                await self._until(asyncio.shield(self._pg_ready), AVOID_SECS if self.avoid else None)
            except TimeoutError:
                alive = {n["NodeID"] for n in await asyncio.to_thread(ray.nodes) if n.get("Alive")}
                if self.avoid & alive:
                    self.owner.event(self.engine_id, f"no room away from {sorted(self.avoid)}; allowing them again")
                    self.avoid.clear()
                    await self._remove_pg()
                else:
                    self.avoid.clear()  # Ray knows they are dead: it places nothing there
                return
            self.owner.event(self.engine_id, "pg_ready")
        if (failed := self._pg_ready.exception()) is not None:  # the group was removed under us
            self._pg_ready, self.pg = None, None
            raise RuntimeError(f"its placement group failed: {failed!r}")
        info = await self._ensure_host(p)
        bound = p["agent"]["url"] if p["agent"] is not None else None
        if bound is None and self.bound_url == info["url"]:
            # The manager unbound our agent (it found it gone). A host that still answers with
            # a running agent (restarted on the same port) is bound again; else it is replaced.
            try:
                info = await self._until(self._ask_info(), HOST_ANSWER_SECS)
            except TimeoutError:
                await self._host_lost("host does not answer after the manager lost its agent")
                return
            except RayActorError as err:
                await self._host_lost(f"host actor died: {err}")
                return
            if not info["running"]:
                await self._pause(1.0)  # its agent is being restarted; look again
                raise _Changed
        if bound != info["url"]:
            await self._bind(info)
        assert self._watch is not None  # set by _ensure_host
        try:
            if self.watch_fault is not None:
                fault, self.watch_fault = self.watch_fault, None
                raise fault
            await self._until(asyncio.shield(self._watch))
        except RayActorError as err:
            why = await self._why_dead(err)
            if why is None:
                # Transient: the host answers and its node is alive. Watch it again.
                self._watch = asyncio.wrap_future(self.host.watch.remote().future())
                return
            await self._host_lost(why)
            return
        # watch returned: the host was stopped (by us, or a reconciler before us); start anew.
        self._forget_host()

    async def _why_dead(self, err: RayActorError) -> str | None:
        """Why the host is dead after its ``watch`` failed with ``err``, or None when it is not:
        Ray's ``ActorDiedError`` is final; an ``ActorUnavailableError`` (contact lost, maybe for
        a moment) is death only if the host's node is dead in the GCS, or the host fails every
        probe of :data:`UNAVAILABLE_PROBES` too."""
        if not isinstance(err, ActorUnavailableError):
            return f"host actor died: {err}"
        node = self.info["node_id"] if self.info is not None else None
        for pause in UNAVAILABLE_PROBES:
            if node is not None:
                alive = {n["NodeID"] for n in await asyncio.to_thread(ray.nodes) if n.get("Alive")}
                if node not in alive:
                    return f"host's node {node} is dead ({err})"
            try:
                await self._until(self._ask_info(), HOST_ANSWER_SECS)
            except (TimeoutError, ActorUnavailableError):
                await self._pause(pause)
                continue
            except RayActorError as again:
                return f"host actor died: {again}"
            log.warning(
                "%s: host was unavailable for a moment (%s); it answers, watching it again", self.engine_id, err
            )
            self.owner.event(self.engine_id, "host_unavailable_transient")
            return None
        return f"host actor unavailable after {len(UNAVAILABLE_PROBES) + 1} tries: {err}"

    async def _ask_info(self) -> HostInfo:
        info: HostInfo = await asyncio.wrap_future(self.host.info.remote().future())
        self.info = info
        return info

    async def _ensure_pg(self, p: Placement) -> PlacementGroup:
        name = pg_name(self.engine_id)
        try:
            pg: PlacementGroup = await asyncio.to_thread(get_placement_group, name)
            self.owner.event(self.engine_id, "pg_adopted")
            return pg
        except ValueError:
            pass
        selector = (
            [{"ray.io/node-id": f"!in({','.join(sorted(self.avoid))})"}] * len(p["bundles"]) if self.avoid else None
        )
        pg = placement_group(
            [dict(b) for b in p["bundles"]],
            strategy=p["strategy"],
            name=name,
            bundle_label_selector=selector,
        )
        self.owner.event(self.engine_id, "pg_created" + (f" avoiding {sorted(self.avoid)}" if self.avoid else ""))
        return pg

    async def _ensure_host(self, p: Placement) -> HostInfo:
        """A host in the group that answers, with a pending ``watch`` call: the running one, one
        left by an earlier reconciler (adopted), or a new one. A change of the placement while
        waiting leaves the host starting (the next pass waits for it again)."""
        if self.host is not None and self._watch is not None and self.info is not None:
            return self.info
        if self.host is None:
            try:
                self.host = await asyncio.to_thread(ray.get_actor, host_name(self.engine_id))
                started = "host_adopted"
            except ValueError:
                assert self.pg is not None
                bundle = p["bundles"][0]
                self.host = EngineHost.options(  # type: ignore[attr-defined]
                    name=host_name(self.engine_id),
                    num_cpus=float(bundle.get("CPU", 0)),
                    num_gpus=float(bundle.get("GPU", 0)),
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=0
                    ),
                ).remote(
                    self.engine_id, self.owner.binary, self.owner.namespace, self.owner.token, self.owner.agent_dir
                )
                started = "host_started"
            self._started = started
        try:
            info = await self._until(self._ask_info(), HOST_START_SECS)
        except _Changed:
            raise
        except (TimeoutError, RayActorError) as err:
            ray.kill(self.host, no_restart=True)
            self._forget_host()
            raise RuntimeError(f"its host did not start: {err!r}") from err
        self._watch = asyncio.wrap_future(self.host.watch.remote().future())
        self.owner.event(self.engine_id, self._started)
        return info

    async def _bind(self, info: HostInfo) -> None:
        body = BindRequest(agent_url=info["url"], node_id=info["node_id"], gpu_ids=info["gpu_ids"])
        try:
            await self.owner.client.post(f"/rollout/placements/{self.engine_id}/bind", body)
        except RolloutApiError as err:
            if err.status == 409:  # no longer wanted, or another live agent: re-read the placement
                self.owner.error(f"{self.engine_id}: bind to {info['url']} refused: {err}")
                await self.changed.wait()
                raise _Changed from err
            raise
        self.bound_url = info["url"]
        self.owner.event(self.engine_id, "bound")

    async def _host_lost(self, why: str) -> None:
        """The host (and its agent and engine) is gone: tell the manager, and place it again in
        a new group that avoids the host's node. Ray may count a node alive for many seconds
        after it died, and would keep the old group's bundle there; if the node is in fact fine
        and the only one with room, the exclusion is dropped after :data:`AVOID_SECS`."""
        info = self.info
        self.owner.event(self.engine_id, "host_lost")
        self.owner.error(f"{self.engine_id}: {why}")
        if self.host is not None:
            ray.kill(self.host, no_restart=True)
        self._forget_host()
        self.bound_url = None
        if info is not None:
            try:
                await self.owner.client.post(
                    f"/rollout/placements/{self.engine_id}/lost", LostRequest(agent_url=info["url"], reason=why)
                )
            except RolloutApiError as err:
                if err.status != 404:
                    self.owner.error(f"{self.engine_id}: reporting the lost agent failed: {err}")
        if info is not None:
            self.avoid.add(info["node_id"])
        await self._remove_pg()

    def _forget_host(self) -> None:
        self.host = None
        self.info = None
        if self._watch is not None:
            self._watch.cancel()
        self._watch = None

    async def _remove_pg(self) -> None:
        self._pg_ready = None
        pg, self.pg = self.pg, None
        if pg is None:
            try:
                pg = await asyncio.to_thread(get_placement_group, pg_name(self.engine_id))
            except ValueError:
                return
        await asyncio.to_thread(remove_placement_group, pg)

    async def _release(self) -> None:
        await self.owner.stop_host(self.engine_id, self.host)
        self._forget_host()
        await self._remove_pg()
        try:
            await self.owner.client.post(f"/rollout/placements/{self.engine_id}/released")
        except RolloutApiError as err:
            if err.status != 404:
                raise
        self.owner.event(self.engine_id, "released")


class ReconcilerImpl:
    """The reconciler's state and poll loop; :data:`Reconciler` is the Ray actor over it."""

    def __init__(
        self, api_socket: str, binary: str, namespace: str, token: str | None = None, agent_dir: str | None = None
    ) -> None:
        # An explicit token ("" for none): the launcher read it as the manager does.
        self.client = AsyncRolloutClient(uds=api_socket, token=token or "", timeout=WAIT_SECS + 15.0)
        self.token = token
        self.agent_dir = agent_dir
        self.binary = binary
        self.namespace = namespace
        self.revision: int | None = None
        self.placements: list[Placement] = []
        self.workers: dict[str, PlacementWorker] = {}
        self.requested: list[dict[str, float]] | None = None
        self.errors: deque[str] = deque(maxlen=50)
        self.events: deque[tuple[float, str, str]] = deque(maxlen=2000)
        self._poll: asyncio.Task[None] | None = None
        self._last_sweep = 0.0

    async def start(self) -> None:
        """Starts the poll loop (idempotent); returns at once."""
        if self._poll is None or self._poll.done():
            self._poll = asyncio.get_running_loop().create_task(self._poll_loop(), name="placements poll")

    def error(self, message: str) -> None:
        log.warning("%s", message)
        self.errors.append(f"{time.strftime('%H:%M:%S')} {message}")

    def event(self, engine_id: str, what: str) -> None:
        log.info("%s: %s", engine_id, what)
        self.events.append((time.time(), engine_id, what))

    async def _poll_loop(self) -> None:
        while True:
            after = "" if self.revision is None else f"after={self.revision}&"
            try:
                raw = await self.client.get(f"/rollout/placements?{after}wait_secs={WAIT_SECS}")
                view = parse_placement_list(raw)
            except (RolloutApiError, ValueError) as err:
                self.error(f"cannot read placements: {err}")
                self.revision = None
                await asyncio.sleep(1.0)
                continue
            self.revision = view["revision"]
            self.placements = view["placements"]
            self._apply(self.placements)
            try:
                await self._request_resources(self.placements)
                await self._sweep()
            except Exception as err:  # Ray's GCS busy or restarting: next pass
                self.error(f"resource request or orphan sweep failed: {err!r}")

    def _apply(self, placements: list[Placement]) -> None:
        listed = set()
        for p in placements:
            engine_id = p["engine_id"]
            listed.add(engine_id)
            worker = self.workers.get(engine_id)
            if worker is None or worker.task.done():
                self.workers[engine_id] = PlacementWorker(self, p)
            else:
                worker.update(p)
        for engine_id in [e for e, w in self.workers.items() if e not in listed and w.task.done()]:
            del self.workers[engine_id]

    async def _sweep(self) -> None:
        """Removes ``er-*`` groups and hosts that no placement (and no worker) accounts for; at
        most every 10 s, since it reads Ray's whole tables."""
        if time.monotonic() - self._last_sweep < 10.0:
            return
        self._last_sweep = time.monotonic()
        known = set(self.workers)
        table = await asyncio.to_thread(placement_group_table)
        for info in table.values():
            name = info.get("name") or ""
            engine_id = name[len(PG_PREFIX) :]
            if name.startswith(PG_PREFIX) and info.get("state") != "REMOVED" and engine_id not in known:
                self.error(f"placement group {name} matches no placement; removing it")
                await self.stop_host(engine_id, None)
                try:
                    await asyncio.to_thread(remove_placement_group, await asyncio.to_thread(get_placement_group, name))
                except ValueError:
                    pass
        for name in await asyncio.to_thread(ray.util.list_named_actors):
            if name.startswith(HOST_PREFIX) and name[len(HOST_PREFIX) :] not in known:
                await self.stop_host(name[len(HOST_PREFIX) :], None)

    async def stop_host(self, engine_id: str, host: Any, grace: float = 30.0) -> None:
        """Stops a host's agent politely (its engine with it), then kills the actor."""
        if host is None:
            try:
                host = await asyncio.to_thread(ray.get_actor, host_name(engine_id))
            except ValueError:
                return
        try:
            await asyncio.wait_for(asyncio.wrap_future(host.stop.remote(grace).future()), grace + 15.0)
        except (TimeoutError, RayActorError) as err:
            self.error(f"host of {engine_id} did not stop cleanly: {err!r}")
        ray.kill(host, no_restart=True)

    async def _request_resources(self, placements: list[Placement]) -> None:
        from ray.autoscaler.sdk import request_resources

        present = [p for p in placements if p["desired"] == "present"]
        pending = any(p["status"] == "PENDING_RESOURCES" for p in present)
        want = [dict(b) for p in present for b in p["bundles"]] if pending else []
        if want == (self.requested or []) and (self.requested is not None or not want):
            return
        await asyncio.to_thread(request_resources, bundles=want)
        self.requested = want

    # -- control ---------------------------------------------------------------------------

    def inject_watch_error(self, engine_id: str) -> bool:
        """Fault injection (tests): the host watch of ``engine_id`` fails with Ray's
        ``ActorUnavailableError``, as when contact with its node is lost for a moment. False if
        no worker holds that engine."""
        worker = self.workers.get(engine_id)
        if worker is None or worker.task.done():
            return False
        worker.watch_fault = ActorUnavailableError("injected: contact lost for a moment", None)
        worker.changed.set()
        return True

    def status(self) -> ReconcilerStatus:
        return ReconcilerStatus(
            revision=self.revision,
            placements=self.placements,
            hosts={e: w.info for e, w in self.workers.items() if w.info is not None},
            requested_bundles=self.requested,
            errors=list(self.errors),
            events=list(self.events),
        )

    async def shutdown(self) -> None:
        """Stops the loop, every host (concurrently) and every group; resets the resource request."""
        tasks = [t for t in (self._poll, *(w.task for w in self.workers.values())) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        names = await asyncio.to_thread(ray.util.list_named_actors)
        hosts = {n[len(HOST_PREFIX) :] for n in names if n.startswith(HOST_PREFIX)}
        await asyncio.gather(*(self.stop_host(e, None, grace=10.0) for e in hosts | set(self.workers)))
        for info in (await asyncio.to_thread(placement_group_table)).values():
            name = info.get("name") or ""
            if name.startswith(PG_PREFIX) and info.get("state") != "REMOVED":
                try:
                    await asyncio.to_thread(remove_placement_group, await asyncio.to_thread(get_placement_group, name))
                except ValueError:
                    pass
        if self.requested:
            from ray.autoscaler.sdk import request_resources

            await asyncio.to_thread(request_resources, bundles=[])
            self.requested = []
        await self.client.aclose()


#: The reconciler as a Ray actor: asyncio, so every placement's worker runs concurrently.
Reconciler: Callable[..., Any] = ray.remote(num_cpus=0, max_restarts=0)(ReconcilerImpl)
