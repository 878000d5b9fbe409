"""Reconciles the manager's placements (docs/ray.md) with Ray, driven by events.

An asyncio actor. One task long-polls ``GET /rollout/placements?after=<rev>&wait_secs=<n>`` on the
manager's Unix socket and hands every placement to its own :class:`PlacementWorker`, which brings
Ray in line with it independently of the others (a slow or dead node never delays another
placement). A worker waits on events, never on a timer:

- desired present: a placement group ``er-<engine_id>`` (the placement's bundles and strategy) is
  created, and its readiness awaited (one ``pg.ready()``, not polled); a small task in bundle 0
  (:func:`~elastic_rollout_ray.actors.bundle_gpus`) reads the node and the GPU ids Ray gave the
  bundle; the node's agent (:class:`AgentHandle`: one actor ``er-agent-<node_id>`` per node,
  started by the first placement there and shared by the others) hosts the engine, and the worker
  binds it (``POST .../bind`` with the bundle's GPU ids). The handle keeps one call to the
  agent's ``watch`` pending: Ray fails it when the actor or its node dies. Death is confirmed
  first: Ray's ``ActorUnavailableError`` (a transient loss of contact, a network blip) counts
  only if the node is dead in the GCS or the agent fails :data:`UNAVAILABLE_PROBES` more probes;
  otherwise it is logged (event ``agent_unavailable_transient``) and the agent watched again. On
  a death every worker on that node reports ``POST .../lost`` and places its engine again (Ray
  reschedules the group when the node is gone). A change of the placement wakes the worker too,
  e.g. the manager unbinding an agent it found gone: if the agent no longer answers, it is
  taken for dead and the groups on its node are replaced, avoiding the suspect node.
- desired absent and not BOUND (the manager stopped its engine): the group is removed, then
  ``POST .../released``. The agent stays for the node's other engines; one that no placement has
  used for :data:`AGENT_IDLE_SECS` is stopped.

Placement groups named ``er-*`` that match no placement are removed, and agent actors no handle
accounts for are stopped (so a new reconciler cleans what an old one left). ``request_resources``
gets the bundles of every present placement while any is PENDING_RESOURCES, and nothing once none
is. Errors of one placement are recorded (``status()["errors"]``) and retried with backoff; they
never stop the others.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from elastic_rollout import AsyncRolloutClient, RolloutApiError
from elastic_rollout_ray.actors import NodeAgent, bundle_gpus
from elastic_rollout_ray.wire import AgentInfo, BindRequest, BundleBinding, LostRequest, Placement, parse_placement_list

__all__ = [
    "AGENT_PREFIX",
    "PG_PREFIX",
    "AgentHandle",
    "PlacementWorker",
    "Reconciler",
    "ReconcilerImpl",
    "ReconcilerStatus",
]

log = logging.getLogger("elastic_rollout_ray.reconciler")

PG_PREFIX = "er-"
AGENT_PREFIX = "er-agent-"
#: Long-poll window of the placements API (the manager's changes end it early).
WAIT_SECS = 30
#: How long an agent may take to answer ``info`` before it is taken for dead.
AGENT_ANSWER_SECS = 5.0
#: How long an agent may take to start (its own ready timeout is 60 s), and a bundle's GPU ids
#: to be read.
AGENT_START_SECS = 90.0
#: How long a group that avoids a suspect node may wait for room elsewhere before it is made
#: again without the exclusion, if Ray still counts that node alive (Ray finds a dead node in
#: about 15-30 s with its default health checks).
AVOID_SECS = 30.0
#: An agent no placement has used for this long is stopped. It holds no Ray resources, so it
#: never keeps a node from being scaled down; kept meanwhile, it spares a later scale-out onto
#: its node the agent's start (a Ray worker process and the agent: 1-2 s, benches/README.md).
AGENT_IDLE_SECS = 600.0

#: Probes of an agent whose ``watch`` failed with ``ActorUnavailableError`` before it is taken
#: for dead, with the pauses between them (seconds).
UNAVAILABLE_PROBES = (0.5, 1.0, 2.0)

T = TypeVar("T")


def pg_name(engine_id: str) -> str:
    return f"{PG_PREFIX}{engine_id}"


def agent_name(node_id: str) -> str:
    return f"{AGENT_PREFIX}{node_id}"


class ReconcilerStatus(TypedDict):
    revision: int | None
    placements: list[Placement]
    #: node id -> its agent
    agents: dict[str, AgentInfo]
    #: engine id -> the agent and GPUs its bundle is bound to
    bindings: dict[str, BundleBinding]
    requested_bundles: list[dict[str, float]] | None
    errors: list[str]
    #: ``[unix time, key, event]`` for the latest events: what the bench draws its timeline from.
    #: Per placement (key: the engine id): pg_created, pg_ready, gpus_read, bound, node_lost,
    #: released; per agent (key ``agent:<node_id>``): agent_started, agent_adopted,
    #: agent_unavailable_transient, agent_lost, agent_stopped.
    events: list[tuple[float, str, str]]


class _Changed(Exception):
    """The placement changed while a worker waited; it re-reads it."""


class AgentHandle:
    """The agent actor of one node, shared by the placements there: started (or adopted) once,
    watched through one pending ``watch`` call, its death confirmed before it is reported.
    ``dead`` resolves with the reason once it is gone (or stopped: ``stopped``); a new handle
    replaces it."""

    def __init__(self, owner: ReconcilerImpl, node_id: str) -> None:
        self.owner = owner
        self.node_id = node_id
        self.key = f"agent:{node_id}"
        self.actor: Any = None
        self.info: AgentInfo | None = None
        loop = asyncio.get_running_loop()
        self.dead: asyncio.Future[str] = loop.create_future()
        #: stopped by the reconciler (idle, or shutdown), as opposed to found dead
        self.stopped = False
        #: engines whose placement uses this agent
        self.users: set[str] = set()
        self.idle_since = time.monotonic()
        #: an error the next wait on ``watch`` raises at once (:meth:`ReconcilerImpl.inject_watch_error`)
        self.watch_fault: RayActorError | None = None
        self._poke = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self.ready: asyncio.Task[AgentInfo] = loop.create_task(self._start(), name=self.key)
        # Its failure is read by the workers (through ``dead``), whether or not one awaits it.
        self.ready.add_done_callback(lambda t: t.cancelled() or t.exception())

    def use(self, engine_id: str) -> None:
        self.users.add(engine_id)

    def leave(self, engine_id: str) -> None:
        if engine_id in self.users:
            self.users.discard(engine_id)
            if not self.users:
                self.idle_since = time.monotonic()

    async def ask_info(self) -> AgentInfo:
        info: AgentInfo = await asyncio.wrap_future(self.actor.info.remote().future())
        self.info = info
        return info

    async def _start(self) -> AgentInfo:
        try:
            # An agent of this node being stopped goes first (its name is still registered).
            if (stopping := self.owner.stopping.get(self.node_id)) is not None:
                await asyncio.shield(stopping)
            try:
                self.actor = await asyncio.to_thread(ray.get_actor, agent_name(self.node_id))
                started = "agent_adopted"
            except ValueError:
                self.actor = NodeAgent.options(  # type: ignore[attr-defined]
                    name=agent_name(self.node_id),
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=self.node_id, soft=False),
                ).remote(self.owner.binary, self.owner.namespace, self.owner.token, self.owner.agent_dir)
                started = "agent_started"
            info = await asyncio.wait_for(self.ask_info(), AGENT_START_SECS)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # unschedulable (the node is gone), no answer, the GCS busy
            self.fail(f"the agent did not start: {err!r}")
            raise RuntimeError(f"the agent of node {self.node_id} did not start: {err!r}") from err
        self.owner.event(self.key, started)
        self._watcher = asyncio.get_running_loop().create_task(self._watch(), name=f"watch {self.key}")
        return info

    async def _watch(self) -> None:
        watch: asyncio.Future[Any] | None = None
        while not self.dead.done():
            try:
                watch = await self._watch_once(watch)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the GCS busy or restarting: look again
                self.owner.error(f"{self.key}: watching it failed: {err!r}; looking again in 1s")
                watch = None
                await asyncio.sleep(1.0)

    async def _watch_once(self, watch: asyncio.Future[Any] | None) -> asyncio.Future[Any] | None:
        """Waits for the pending ``watch`` call to end (or a fault to be injected) and acts on it;
        the call to keep waiting on (None: a new one)."""
        if watch is None:
            watch = asyncio.wrap_future(self.actor.watch.remote().future())
        poke = asyncio.ensure_future(self._poke.wait())
        try:
            await asyncio.wait({watch, poke}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            poke.cancel()
        self._poke.clear()
        fault, self.watch_fault = self.watch_fault, None
        try:
            if fault is not None:
                raise fault
            if watch.done():
                watch.result()
                self._gone("its agent was stopped", "agent_stopped")
        except RayActorError as err:
            await self.confirm(err)
            return watch if fault is not None else None  # a failed call is over: a new one
        return watch

    async def confirm(self, err: RayActorError) -> None:
        """``err`` came from a call to the agent: fails it if that means it is dead (see
        :meth:`why_dead`), else leaves it be."""
        why = await self.why_dead(err)
        if why is not None:
            self.fail(why)

    async def why_dead(self, err: RayActorError) -> str | None:
        """Why the agent is dead after a call failed with ``err``, or None when it is not: Ray's
        ``ActorDiedError`` is final; an ``ActorUnavailableError`` (contact lost, maybe for a
        moment) is death only if the node is dead in the GCS, or the agent fails every probe of
        :data:`UNAVAILABLE_PROBES` too."""
        if not isinstance(err, ActorUnavailableError):
            return f"agent actor died: {err}"
        for pause in UNAVAILABLE_PROBES:
            if self.node_id not in await alive_nodes():
                return f"node {self.node_id} is dead ({err})"
            try:
                await asyncio.wait_for(self.ask_info(), AGENT_ANSWER_SECS)
            except (TimeoutError, ActorUnavailableError):
                await asyncio.sleep(pause)
                continue
            except RayActorError as again:
                return f"agent actor died: {again}"
            log.warning("%s was unavailable for a moment (%s); it answers, watching it again", self.key, err)
            self.owner.event(self.key, "agent_unavailable_transient")
            return None
        return f"agent unavailable after {len(UNAVAILABLE_PROBES) + 1} tries: {err}"

    def fail(self, why: str) -> None:
        """The agent is taken for dead: killed, and every placement on it told (``dead``)."""
        if self.dead.done():
            return
        self.owner.error(f"{self.key}: {why}")
        self._gone(why, "agent_lost")
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)

    def _gone(self, why: str, event: str) -> None:
        if self.dead.done():
            return
        self.dead.set_result(why)
        self.owner.event(self.key, event)
        if self.owner.agents.get(self.node_id) is self:
            del self.owner.agents[self.node_id]

    def stop(self, grace: float = 30.0) -> asyncio.Task[None]:
        """Stops the agent politely (its engines with it), then kills the actor, in a task that
        a new agent of the node waits for (``owner.stopping``)."""
        self.stopped = True
        self._gone("stopped by the reconciler", "agent_stopped")
        if self._watcher is not None:
            self._watcher.cancel()
        if not self.ready.done():
            self.ready.cancel()

        async def run() -> None:
            try:
                if self.actor is not None:
                    await stop_agent(self.owner, self.actor, self.key, grace)
            finally:
                if self.owner.stopping.get(self.node_id) is task:
                    del self.owner.stopping[self.node_id]

        task = asyncio.get_running_loop().create_task(run(), name=f"stop {self.key}")
        self.owner.stopping[self.node_id] = task
        return task


async def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in await asyncio.to_thread(ray.nodes) if n.get("Alive")}


async def stop_agent(owner: ReconcilerImpl, actor: Any, key: str, grace: float) -> None:
    """Stops an agent actor's agent politely (its engines with it), then kills the actor."""
    try:
        await asyncio.wait_for(asyncio.wrap_future(actor.stop.remote(grace).future()), grace + 15.0)
    except (TimeoutError, RayActorError) as err:
        owner.error(f"{key} did not stop cleanly: {err!r}")
    ray.kill(actor, no_restart=True)


class PlacementWorker:
    """Brings Ray in line with one placement, as long as the manager lists it."""

    def __init__(self, owner: ReconcilerImpl, placement: Placement) -> None:
        self.owner = owner
        self.engine_id = placement["engine_id"]
        self.placement = placement
        self.changed = asyncio.Event()
        self.pg: PlacementGroup | None = None
        self._pg_ready: asyncio.Future[Any] | None = None
        #: (node id, GPU ids) of bundle 0, read in the bundle
        self.bundle: tuple[str, list[str]] | None = None
        self.agent: AgentHandle | None = None
        #: the agent URL this worker last bound
        self.bound_url: str | None = None
        #: node ids a new group must avoid (its agent there stopped answering)
        self.avoid: set[str] = set()
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"placement {self.engine_id}")

    def update(self, placement: Placement) -> None:
        if placement != self.placement:
            self.placement = placement
            self.changed.set()

    def binding(self) -> BundleBinding | None:
        if self.bundle is None or self.bound_url is None:
            return None
        node_id, gpu_ids = self.bundle
        return BundleBinding(
            engine_id=self.engine_id, bundle_index=0, node_id=node_id, gpu_ids=gpu_ids, agent_url=self.bound_url
        )

    # -- waiting -----------------------------------------------------------------------------

    async def _until(self, fut: Awaitable[T], timeout: float | None = None) -> T:
        """``fut``'s result, unless the placement changes first (raises :class:`_Changed`) or
        ``timeout`` passes (raises ``TimeoutError``); then ``fut`` is cancelled (pass a shield to
        keep it going)."""
        if self.changed.is_set():
            raise _Changed
        waiter = asyncio.ensure_future(fut)
        changed = asyncio.ensure_future(self.changed.wait())
        try:
            done, _ = await asyncio.wait({waiter, changed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
        if waiter in done:
            if waiter.cancelled():  # e.g. a shielded agent start cancelled by its stop
                raise RuntimeError("what the worker waited for was cancelled")
            return waiter.result()
        # What is shielded goes on (a group's readiness, an agent's start); the rest is dropped.
        waiter.cancel()
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
        try:
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
        finally:
            self._leave_agent()

    async def _present(self, p: Placement) -> None:
        """Group ready, GPU ids read, the node's agent up and bound; then wait for a change or
        for the agent's death."""
        if self.agent is not None and self.agent.dead.done():
            # Its agent went while this worker was elsewhere (a backoff, a pause).
            if self.bound_url is not None:
                await self._node_lost(self.agent, self.agent.dead.result())
                return
            self._leave_agent()
            self.bundle = None
        if not await self._group_ready(p):
            return
        if self.bundle is None:
            # The node's agent starts while the bundle's GPU ids are read (both may start a
            # process); the GCS already says where the bundle is.
            if (node := await self._bundle_node()) is not None:
                self._use_agent(node)
            self.bundle = await self._until(self._read_bundle(p, node), AGENT_START_SECS)
        node_id, gpu_ids = self.bundle
        agent = self._use_agent(node_id)
        if agent.ready.cancelled():
            raise RuntimeError(f"the agent of node {node_id} was stopped while it started")
        try:
            info = await self._until(asyncio.shield(agent.ready), AGENT_START_SECS)
        except (RuntimeError, TimeoutError):
            self.bundle = None  # Ray may have moved the group meanwhile: read it again
            raise
        bound = p["agent"]["url"] if p["agent"] is not None else None
        if bound is None and self.bound_url == info["url"] and not agent.dead.done():
            # The manager unbound our agent (it found it gone). An agent that still answers with
            # a running process (restarted on the same port) is bound again; else it is dead.
            # No further probes here: the manager's unbind is already a second, independent sign
            # (its agent refused connections or was silent for 10 s), and the manager counts the
            # engines on it as exited either way; probing longer only delays their new placement
            # (the bench's node loss took 11 s with the probes, 2-3 s without).
            try:
                info = await self._until(agent.ask_info(), AGENT_ANSWER_SECS)
            except (TimeoutError, RayActorError) as err:
                agent.fail(f"the manager lost its agent, and the agent actor does not answer: {err!r}")
                raise _Changed from err  # look again: reported lost, placed anew
            if not info["running"]:
                await self._pause(1.0)  # its process is being restarted; look again
                raise _Changed
        if not agent.dead.done() and bound != info["url"]:
            await self._bind(info["url"], node_id, gpu_ids)
        why = await self._until(asyncio.shield(agent.dead))
        await self._node_lost(agent, why)

    async def _group_ready(self, p: Placement) -> bool:
        """The group exists and is placed; False when the worker should look again."""
        if self._pg_ready is None:
            if self.pg is None:
                self.pg = await self._ensure_pg(p)
            # One readiness call per group incarnation (a node's death reschedules the group).
            self._pg_ready = asyncio.wrap_future(self.pg.ready().future())
        if not self._pg_ready.done():
            try:
                await self._until(asyncio.shield(self._pg_ready), AVOID_SECS if self.avoid else None)
            except TimeoutError:
                if self.avoid & await alive_nodes():
                    self.owner.event(self.engine_id, f"no room away from {sorted(self.avoid)}; allowing them again")
                    self.avoid.clear()
                    await self._remove_pg()
                else:
                    self.avoid.clear()  # Ray knows they are dead: it places nothing there
                return False
            self.owner.event(self.engine_id, "pg_ready")
        if (failed := self._pg_ready.exception()) is not None:  # the group was removed under us
            self._pg_ready, self.pg, self.bundle = None, None, None
            raise RuntimeError(f"its placement group failed: {failed!r}")
        return True

    def _use_agent(self, node_id: str) -> AgentHandle:
        """The agent of ``node_id`` for this placement (started if none is)."""
        agent = self.agent
        if agent is None or agent.dead.done() or agent.node_id != node_id:
            self._leave_agent()
            agent = self.agent = self.owner.agent_for(node_id)
            agent.use(self.engine_id)
        return agent

    async def _bundle_node(self) -> str | None:
        """The node bundle 0 of the group is on, as the GCS has it (None if it does not say)."""
        assert self.pg is not None
        table = await asyncio.to_thread(placement_group_table, self.pg)
        node = (table.get("bundles_to_node_id") or {}).get(0)
        return node if isinstance(node, str) and node else None

    async def _read_bundle(self, p: Placement, node: str | None) -> tuple[str, list[str]]:
        """The node of bundle 0 and the GPU ids Ray gave it, read by a task in the bundle. One
        such task at a time per node (``node``: where the GCS says the bundle is): a task with
        GPUs runs only in a worker process that has run GPU tasks, so tasks one after another
        reuse one worker where tasks side by side would each start one (about a second of CPU
        each)."""
        async with self.owner.probe_lock(node):
            return await self._read_bundle_now(p)

    async def _read_bundle_now(self, p: Placement) -> tuple[str, list[str]]:
        assert self.pg is not None
        ref = bundle_gpus.options(
            num_gpus=float(p["bundles"][0].get("GPU", 0)),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=0
            ),
        ).remote()
        try:
            # Bounded, so that a task that never runs cannot hold the node's lock.
            node_id, gpu_ids = await asyncio.wait_for(asyncio.wrap_future(ref.future()), AGENT_START_SECS)
        except (TimeoutError, asyncio.CancelledError):
            with contextlib.suppress(Exception):  # already finished, or Ray busy: nothing to undo
                ray.cancel(ref)
            raise
        self.owner.event(self.engine_id, "gpus_read")
        return str(node_id), [str(g) for g in gpu_ids]

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

    async def _bind(self, url: str, node_id: str, gpu_ids: list[str]) -> None:
        body = BindRequest(agent_url=url, node_id=node_id, gpu_ids=gpu_ids)
        asked = time.monotonic()
        try:
            await self.owner.client.post(f"/rollout/placements/{self.engine_id}/bind", body)
        except RolloutApiError as err:
            if err.status == 409:  # no longer wanted, or another live agent: re-read the placement
                self.owner.error(f"{self.engine_id}: bind to {url} refused: {err}")
                await self.changed.wait()
                raise _Changed from err
            raise
        self.bound_url = url
        self.owner.event(self.engine_id, f"bound (the manager answered in {time.monotonic() - asked:.2f}s)")

    async def _node_lost(self, agent: AgentHandle, why: str) -> None:
        """The node's agent (and the engine with it) is gone: tell the manager, and place the
        engine again in a new group that avoids that node. Ray may count a node alive for many
        seconds after it died, and would keep the old group's bundle there; if the node is in
        fact fine and the only one with room, the exclusion is dropped after :data:`AVOID_SECS`."""
        self.owner.event(self.engine_id, "node_lost")
        self._leave_agent()
        url = agent.info["url"] if agent.info is not None else self.bound_url
        self.bound_url, self.bundle = None, None
        if url is not None:
            try:
                await self.owner.client.post(
                    f"/rollout/placements/{self.engine_id}/lost", LostRequest(agent_url=url, reason=why)
                )
            except RolloutApiError as err:
                if err.status != 404:
                    self.owner.error(f"{self.engine_id}: reporting the lost agent failed: {err}")
        if not agent.stopped:  # a node whose agent died; a stopped one is fine
            self.avoid.add(agent.node_id)
        await self._remove_pg()

    def _leave_agent(self) -> None:
        if self.agent is not None:
            self.agent.leave(self.engine_id)
        self.agent = None

    async def _remove_pg(self) -> None:
        self._pg_ready, self.bundle = None, None
        pg, self.pg = self.pg, None
        if pg is None:
            try:
                pg = await asyncio.to_thread(get_placement_group, pg_name(self.engine_id))
            except ValueError:
                return
        await asyncio.to_thread(remove_placement_group, pg)

    async def _release(self) -> None:
        """The manager stopped the engine: its group goes (the agent stays for the node's others)."""
        self._leave_agent()
        self.bound_url = None
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
        #: node id -> the agent there
        self.agents: dict[str, AgentHandle] = {}
        self._probe_locks: dict[str, asyncio.Lock] = {}
        #: node id -> the stop of its previous agent, still running
        self.stopping: dict[str, asyncio.Task[None]] = {}
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

    def probe_lock(self, node_id: str | None) -> asyncio.Lock:
        """The lock that lets one GPU-id task at a time run on ``node_id`` (a fresh lock, held by
        nobody else, when the node is unknown)."""
        if node_id is None:
            return asyncio.Lock()
        return self._probe_locks.setdefault(node_id, asyncio.Lock())

    def agent_for(self, node_id: str) -> AgentHandle:
        """The agent of ``node_id``: the live one, or a new handle that starts (or adopts) it."""
        agent = self.agents.get(node_id)
        if agent is None or agent.dead.done():
            agent = self.agents[node_id] = AgentHandle(self, node_id)
        return agent

    async def _sweep(self) -> None:
        """Removes ``er-*`` groups that no placement (and no worker) accounts for, stops agent
        actors no handle accounts for and agents idle for :data:`AGENT_IDLE_SECS`; at most every
        10 s, since it reads Ray's whole tables."""
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
                try:
                    await asyncio.to_thread(remove_placement_group, await asyncio.to_thread(get_placement_group, name))
                except ValueError:
                    pass
        now = time.monotonic()
        for agent in list(self.agents.values()):
            if not agent.users and now - agent.idle_since > AGENT_IDLE_SECS and agent.ready.done():
                agent.stop()  # in the background; a new agent of the node waits for it
        handled = {agent_name(n) for n in (*self.agents, *self.stopping)}
        for name in await asyncio.to_thread(ray.util.list_named_actors):
            if name.startswith(AGENT_PREFIX) and name not in handled:
                self.error(f"agent actor {name} matches no node of the fleet; stopping it")
                await self._stop_named_agent(name, 30.0)

    async def _stop_named_agent(self, name: str, grace: float) -> None:
        try:
            actor = await asyncio.to_thread(ray.get_actor, name)
        except ValueError:
            return
        await stop_agent(self, actor, name, grace)

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
        """Fault injection (tests): the watch of the agent hosting ``engine_id`` fails with Ray's
        ``ActorUnavailableError``, as when contact with its node is lost for a moment. False if
        no worker holds that engine or its agent is not watched yet."""
        worker = self.workers.get(engine_id)
        agent = worker.agent if worker is not None and not worker.task.done() else None
        if agent is None or agent.dead.done() or agent._watcher is None:
            return False
        agent.watch_fault = ActorUnavailableError("injected: contact lost for a moment", None)
        agent._poke.set()
        return True

    def status(self) -> ReconcilerStatus:
        return ReconcilerStatus(
            revision=self.revision,
            placements=self.placements,
            agents={n: a.info for n, a in self.agents.items() if a.info is not None and not a.dead.done()},
            bindings={e: b for e, w in self.workers.items() if (b := w.binding()) is not None},
            requested_bundles=self.requested,
            errors=list(self.errors),
            events=list(self.events),
        )

    async def shutdown(self) -> None:
        """Stops the loop, every agent (concurrently; each stops its engines) and every group;
        resets the resource request."""
        tasks = [t for t in (self._poll, *(w.task for w in self.workers.values())) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        agents = list(self.agents.values())
        handled = {agent_name(a.node_id) for a in agents}
        stops = [a.stop(grace=10.0) for a in agents]
        names = [n for n in await asyncio.to_thread(ray.util.list_named_actors) if n.startswith(AGENT_PREFIX)]
        await asyncio.gather(
            *stops,
            *self.stopping.values(),
            *(self._stop_named_agent(n, 10.0) for n in names if n not in handled),
            return_exceptions=True,
        )
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
