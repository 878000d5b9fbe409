"""Scale-in drains: in-flight requests to a removed engine finish; `force` aborts them."""

from __future__ import annotations

import threading
from typing import Any

from _support import STARTUP_TIMEOUT, ManagerHandle, StartManager, http, wait_until

LONG = {"max_new_tokens": 1500, "ignore_eos": True}


def start_long_requests(fleet: ManagerHandle, n: int) -> tuple[list[threading.Thread], list[tuple[str, Any]]]:
    results: list[tuple[str, Any]] = []

    def one(i: int) -> None:
        try:
            resp = http(
                "POST",
                f"{fleet.router_url}/generate",
                {"text": f"long request {i}", "sampling_params": LONG},
                timeout=120,
            )
        except OSError as err:  # the connection was cut (only acceptable under force)
            results.append(("connection-cut", str(err)))
            return
        results.append(
            (resp.headers.get("x-rollout-engine-id", "?"), resp.json() if resp.status == 200 else resp.status)
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results


def grow_to_three(fleet: ManagerHandle) -> str:
    op = fleet.client.wait_for_operation(
        "scale_out", fleet.client.scale_out(num_replicas=3).request_id, STARTUP_TIMEOUT
    )
    assert op.status == "ACTIVE"
    (victim,) = op.raw["engine_ids"]
    return str(victim)


def in_flight(fleet: ManagerHandle, engine_id: str) -> int:
    engine = fleet.engines().by_id(engine_id)
    return int(engine.raw.get("in_flight", 0)) if engine else 0


def test_graceful_drain_lets_requests_finish(start_fleet: StartManager) -> None:
    # Engines 10x slower than the default test speed: a 1500-token request lasts about a second.
    # Moves off: with them the requests continue on the engines that stay (tests/test_moves.py).
    fleet = start_fleet("--engine-arg=--time-scale=0.1", "--scale-in-drain-timeout", "120", "--move-on-drain", "false")
    victim = grow_to_three(fleet)
    threads, results = start_long_requests(fleet, 6)
    wait_until(lambda: in_flight(fleet, victim) >= 1, 30, f"{victim} to have requests in flight")

    accepted = fleet.client.scale_in(num_replicas=2)
    assert fleet.engines().by_id(victim).status == "DRAINING"  # type: ignore[union-attr]
    # While draining, new requests go elsewhere.
    for _ in range(4):
        resp = http("POST", f"{fleet.router_url}/generate", {"text": "short", "sampling_params": {"max_new_tokens": 2}})
        assert resp.status == 200 and resp.headers["x-rollout-engine-id"] != victim
    for t in threads:
        t.join(timeout=120)
    op = fleet.client.wait_for_operation("scale_in", accepted.request_id, STARTUP_TIMEOUT)
    assert op.status == "COMPLETED"
    assert len(results) == 6
    served_by_victim = [body for engine, body in results if engine == victim]
    assert served_by_victim, f"no request reached {victim}: {[e for e, _ in results]}"
    for engine, body in results:
        assert isinstance(body, dict), (engine, body)
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 1500}, (engine, body["meta_info"])
    assert fleet.engines().by_id(victim) is None


def test_force_scale_in_aborts_in_flight(start_fleet: StartManager) -> None:
    # A 1500-token request lasts several seconds. Moves off: with them, force still moves the
    # requests (nothing waits for them) instead of aborting them.
    fleet = start_fleet("--engine-arg=--time-scale=0.5", "--move-on-drain", "false")
    victim = grow_to_three(fleet)
    threads, results = start_long_requests(fleet, 3)
    wait_until(lambda: in_flight(fleet, victim) >= 1, 30, f"{victim} to have requests in flight")
    accepted = fleet.client.scale_in(num_replicas=2, force=True)
    op = fleet.client.wait_for_operation("scale_in", accepted.request_id, STARTUP_TIMEOUT)
    assert op.status == "COMPLETED"
    for t in threads:
        t.join(timeout=120)
    on_victim = [body for engine, body in results if engine in (victim, "connection-cut")]
    assert on_victim, results
    for body in on_victim:
        # Aborted by the engine (finish_reason abort) or cut when its process stopped; never complete.
        if isinstance(body, dict):
            assert body["meta_info"]["finish_reason"]["type"] == "abort", body["meta_info"]
