"""Reconciles the manager's placements (docs/ray.md) with Ray: placement groups and host actors.

Flow, in a loop: long-poll ``GET /rollout/placements?after=<rev>&wait_secs=<n>`` on the manager's
Unix socket, then bring Ray in line with every placement, whatever happened before (so a restart
of the reconciler, of the manager, or a lost reply is harmless):

- desired=present: a placement group ``er-<engine_id>`` (the placement's bundles and strategy)
  exists or is created; once it is ready, a host actor ``er-host-<engine_id>`` runs the agent in it
  (bundle 0's GPUs and CPUs); when the manager does not have that agent bound, ``POST .../bind``.
  A host whose agent died is replaced and re-bound.
- desired=absent and not BOUND (the manager stopped the engine, or it never had an agent): stop and
  kill the host actor, remove the placement group, then ``POST .../released``.
- placement groups ``er-*`` and host actors ``er-host-*`` that match no placement are removed.
- ``request_resources`` gets the bundles of every present placement while any is
  PENDING_RESOURCES (the whole desired fleet, so an autoscaler keeps the bound nodes), and is reset
  to nothing once none is pending.

Errors of one placement are recorded (``status()["errors"]``) and retried on the next pass; they
never stop the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastic_rollout_ray.uds import ManagerApiError, UdsClient

__all__ = ["PG_PREFIX", "HOST_PREFIX", "ReconcilerImpl"]

log = logging.getLogger("elastic_rollout_ray.reconciler")

PG_PREFIX = "er-"
HOST_PREFIX = "er-host-"
#: Long-poll window; also the longest time between two liveness checks of the hosts.
WAIT_SECS = 5


def pg_name(engine_id: str) -> str:
    return f"{PG_PREFIX}{engine_id}"


def host_name(engine_id: str) -> str:
    return f"{HOST_PREFIX}{engine_id}"


class ReconcilerImpl:
    """The reconcile loop; the Ray actor class is built from this in :mod:`.actors`."""

    def __init__(
        self, api_socket: str, binary: str, namespace: str, token: str | None = None, agent_dir: str | None = None
    ) -> None:
        self.client = UdsClient(api_socket, token=token, timeout=WAIT_SECS + 10.0)
        self._token = token
        self._agent_dir = agent_dir
        self.binary = binary
        self.namespace = namespace
        self.revision: int | None = None
        self.placements: list[dict[str, Any]] = []
        self.hosts: dict[str, Any] = {}  # engine_id -> actor handle
        self.host_info: dict[str, dict[str, Any]] = {}
        self.requested: list[dict[str, float]] | None = None
        self.errors: deque[str] = deque(maxlen=20)
        self.passes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="er-reconciler", daemon=True)
        self._thread.start()

    # -- the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                after = "" if self.revision is None else f"after={self.revision}&"
                view = self.client.get(f"/rollout/placements?{after}wait_secs={WAIT_SECS}", timeout=WAIT_SECS + 10.0)
            except ManagerApiError as err:
                self._error(f"cannot read placements: {err}")
                self._stop.wait(1.0)
                continue
            if self._stop.is_set():
                return
            self.revision = int(view["revision"])
            self.placements = list(view["placements"])
            try:
                self.reconcile(self.placements)
            except Exception as err:  # one bad pass must not end the loop
                log.exception("reconcile pass failed")
                self._error(f"reconcile pass failed: {err!r}")
                self._stop.wait(1.0)
            self.passes += 1

    def _error(self, message: str) -> None:
        log.warning("%s", message)
        self.errors.append(f"{time.strftime('%H:%M:%S')} {message}")

    # -- one pass -------------------------------------------------------------------------

    def reconcile(self, placements: list[dict[str, Any]]) -> None:
        wanted = {p["engine_id"] for p in placements}
        started: dict[str, Any] = {}
        for p in placements:
            engine_id = p["engine_id"]
            if p["desired"] == "present":
                ref = self._ensure_host(p)
                if ref is not None:
                    started[engine_id] = ref
            elif p["status"] != "BOUND":
                self._release(engine_id)
        for engine_id, ref in started.items():
            self._bind(engine_id, ref, next(p for p in placements if p["engine_id"] == engine_id))
        self._remove_orphans(wanted)
        self._request_resources(placements)

    def _ensure_pg(self, p: dict[str, Any]) -> PlacementGroup:
        name = pg_name(p["engine_id"])
        try:
            return get_placement_group(name)
        except ValueError:
            pass
        bundles = [{k: float(v) for k, v in b.items()} for b in p["bundles"]]
        return placement_group(bundles, strategy=p.get("strategy", "STRICT_PACK"), name=name)

    def _ensure_host(self, p: dict[str, Any]) -> Any | None:
        """Makes sure a live host runs in the engine's placement group; returns a ref to its info
        when it needs (re)binding, else None."""
        from elastic_rollout_ray.actors import EngineHost

        engine_id = p["engine_id"]
        pg = self._ensure_pg(p)
        ready, _ = ray.wait([pg.ready()], timeout=0)
        if not ready:
            return None  # PENDING_RESOURCES: Ray (or its autoscaler) has no room yet
        host = self.hosts.get(engine_id)
        if host is None:
            try:
                host = ray.get_actor(host_name(engine_id))
            except ValueError:
                host = None
        if host is not None:
            try:
                if not ray.get(host.alive.remote(), timeout=10):
                    raise RuntimeError("agent not running")
            except Exception as err:
                self._error(f"host of {engine_id} is not healthy ({err!r}); replacing it")
                ray.kill(host, no_restart=True)
                self.hosts.pop(engine_id, None)
                self.host_info.pop(engine_id, None)
                host = None
        if host is not None:
            self.hosts[engine_id] = host
            info = self.host_info.get(engine_id)
            agent = p.get("agent") or {}
            if info is not None and agent.get("url") == info["url"]:
                return None
            return host.info.remote()
        bundle = p["bundles"][0]
        host = EngineHost.options(
            name=host_name(engine_id),
            num_cpus=float(bundle.get("CPU", 0)),
            num_gpus=float(bundle.get("GPU", 0)),
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0),
        ).remote(engine_id, self.binary, self.namespace, self._token, self._agent_dir)
        self.hosts[engine_id] = host
        return host.info.remote()

    def _bind(self, engine_id: str, info_ref: Any, p: dict[str, Any]) -> None:
        try:
            info = ray.get(info_ref, timeout=120)
        except Exception as err:
            self._error(f"host of {engine_id} did not start: {err!r}")
            host = self.hosts.pop(engine_id, None)
            if host is not None:
                ray.kill(host, no_restart=True)
            return
        self.host_info[engine_id] = info
        agent = p.get("agent") or {}
        if agent.get("url") == info["url"]:
            return
        body = {"agent_url": info["url"], "node_id": info["node_id"], "gpu_ids": info["gpu_ids"]}
        try:
            self.client.post(f"/rollout/placements/{engine_id}/bind", body)
        except ManagerApiError as err:
            self._error(f"bind of {engine_id} to {info['url']} failed: {err}")

    def _stop_host(self, engine_id: str) -> None:
        host = self.hosts.pop(engine_id, None)
        self.host_info.pop(engine_id, None)
        if host is None:
            try:
                host = ray.get_actor(host_name(engine_id))
            except ValueError:
                return
        try:
            ray.get(host.stop.remote(), timeout=60)
        except Exception as err:
            self._error(f"host of {engine_id} did not stop cleanly: {err!r}")
        ray.kill(host, no_restart=True)

    def _remove_pg(self, engine_id: str) -> None:
        try:
            remove_placement_group(get_placement_group(pg_name(engine_id)))
        except ValueError:
            pass

    def _release(self, engine_id: str) -> None:
        self._stop_host(engine_id)
        self._remove_pg(engine_id)
        try:
            self.client.post(f"/rollout/placements/{engine_id}/released")
        except ManagerApiError as err:
            if err.status != 404:
                self._error(f"release of {engine_id} failed: {err}")

    def _remove_orphans(self, wanted: set[str]) -> None:
        for info in placement_group_table().values():
            name = info.get("name") or ""
            if name.startswith(PG_PREFIX) and info.get("state") != "REMOVED" and name[len(PG_PREFIX) :] not in wanted:
                engine_id = name[len(PG_PREFIX) :]
                self._error(f"placement group {name} matches no placement; removing it")
                self._stop_host(engine_id)
                self._remove_pg(engine_id)
        for name in ray.util.list_named_actors():
            if name.startswith(HOST_PREFIX) and name[len(HOST_PREFIX) :] not in wanted:
                self._stop_host(name[len(HOST_PREFIX) :])

    def _request_resources(self, placements: list[dict[str, Any]]) -> None:
        from ray.autoscaler.sdk import request_resources

        present = [p for p in placements if p["desired"] == "present"]
        pending = any(p["status"] == "PENDING_RESOURCES" for p in present)
        want = [dict(b) for p in present for b in p["bundles"]] if pending else []
        if want == (self.requested or []) and self.requested is not None:
            return
        if not want and self.requested is None:
            return
        request_resources(bundles=want)
        self.requested = want

    # -- control ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "revision": self.revision,
            "passes": self.passes,
            "placements": self.placements,
            "hosts": dict(self.host_info),
            "requested_bundles": self.requested,
            "errors": list(self.errors),
        }

    def shutdown(self) -> None:
        """Stop the loop, every host and every placement group; reset the resource request."""
        self._stop.set()
        self._thread.join(timeout=WAIT_SECS + 15.0)
        for engine_id in list(self.hosts):
            self._stop_host(engine_id)
        for name in ray.util.list_named_actors():
            if name.startswith(HOST_PREFIX):
                self._stop_host(name[len(HOST_PREFIX) :])
        for info in placement_group_table().values():
            name = info.get("name") or ""
            if name.startswith(PG_PREFIX) and info.get("state") != "REMOVED":
                self._remove_pg(name[len(PG_PREFIX) :])
        if self.requested:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[])
            self.requested = []
        self.client.close()
