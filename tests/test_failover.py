"""Failures under load: requests in flight on an engine that dies continue elsewhere from the
output they had (or are retried when nothing came back yet); scale-out with keep_partial keeps the
engines that came up."""

from __future__ import annotations

import os
import signal

from _support import STARTUP_TIMEOUT, ManagerHandle, StartManager, http, wait_until
from test_drain import in_flight, start_long_requests


def output_tokens_held(url: str) -> int:
    """KV tokens an engine holds now (prompts and the output so far of its running requests)."""
    loads = http("GET", f"{url}/v1/loads").json()
    return sum(int(load["num_used_tokens"]) for load in loads["loads"])


def test_requests_on_a_dying_engine_continue_from_their_output(start_fleet: StartManager) -> None:
    fleet = start_fleet("--engine-arg=--time-scale=0.1", "--restart-failed-engines", "false")
    victim, survivor = fleet.engines().engines
    threads, results = start_long_requests(fleet, 4)
    wait_until(lambda: in_flight(fleet, victim.engine_id) >= 1, 30, "requests in flight on the victim")
    # Each has generated well past the first of the events the router reads them by (every 50
    # tokens, router::moving) before the engine dies.
    running = in_flight(fleet, victim.engine_id)
    wait_until(lambda: output_tokens_held(victim.url) > 300 * running, 30, "output on the victim")
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 4
    lost = 0
    for engine, body in results:
        # Every request completed, ending on the survivor for those that were on the victim.
        assert isinstance(body, dict), (engine, body)
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 1500}
        assert body["meta_info"]["completion_tokens"] == 1500 == len(body["output_ids"])
        assert engine == survivor.engine_id
        if moves := body["meta_info"].get("moves"):
            # Not generated again from nothing: it went on from the output its engine had sent.
            lost += 1
            (move,) = moves
            assert move["reason"] == "lost" and move["from"] == victim.engine_id, move
            assert move["at_token"] > 0, move
            assert body["meta_info"]["engines"] == [victim.engine_id, survivor.engine_id]
    # At least those seen running there moved (another may have landed on it since the count;
    # every request ended on the survivor, so whatever ran on the victim moved).
    assert lost >= running >= 1, results
    assert fleet.engines().by_id(victim.engine_id).status == "FAILED"  # type: ignore[union-attr]


def starting_pids(fleet: ManagerHandle) -> list[int] | None:
    """The pids of the two dynamic engines a scale-out from 2 to 4 is starting, once both run."""
    pids = [e.pid for e in fleet.engines().engines if e.origin == "dynamic" and e.pid is not None]
    return pids if len(pids) == 2 else None


def test_keep_partial_keeps_the_engines_that_came_up(start_fleet: StartManager) -> None:
    fleet = start_fleet(
        "--engine-arg=--startup-delay=2",
        "--scale-out-partial-success-policy",
        "keep_partial",
        "--restart-failed-engines",
        "false",
    )
    accepted = fleet.client.scale_out(num_replicas=4)
    pids = wait_until(lambda: starting_pids(fleet), STARTUP_TIMEOUT, "two dynamic engines to be starting")
    fleet.track_children()
    os.kill(pids[0], signal.SIGKILL)
    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, STARTUP_TIMEOUT)
    assert op.status == "ACTIVE", op.raw
    assert len(op.raw["failed_engines"]) == 1
    assert "keep_partial" in op.raw["error_message"]
    view = fleet.wait_engines(3)
    assert all(e.pid != pids[0] for e in view.engines)


def test_rollback_all_removes_every_new_engine_when_one_fails(start_fleet: StartManager) -> None:
    fleet = start_fleet("--engine-arg=--startup-delay=2", "--restart-failed-engines", "false")
    accepted = fleet.client.scale_out(num_replicas=4)
    pids = wait_until(lambda: starting_pids(fleet), STARTUP_TIMEOUT, "two dynamic engines to be starting")
    fleet.track_children()
    os.kill(pids[0], signal.SIGKILL)
    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, STARTUP_TIMEOUT)
    assert op.status == "FAILED"
    assert fleet.wait_engines(2).total_engines == 2
    assert all(p in fleet.engine_processes for p in pids)
    wait_until(lambda: not any(fleet.engine_processes[p].alive() for p in pids), 15, "rolled-back engines to exit")
