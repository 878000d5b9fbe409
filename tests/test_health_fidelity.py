"""Engines paused by a trainer, as the manager's health monitor sees them.

SGLang's ``/health`` and ``/health_generate`` (the manager's default probe) run a 1-token
generation, which waits while generation is paused: on a paused engine every probe fails after
``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s by default). A trainer that calls SGLang itself (an
unmodified slime) pauses the engines for as long as its broadcast takes, and the manager is not
told; a trainer update through the manager takes its members out of routing instead, so they are
not probed while paused. Before ``--health-pause-grace-secs`` the manager took both engines out of routing after 3
failed probes and killed them mid-update after 9, losing the trainer's update. Now a failed
probe whose engine's scheduler still answers ``/v1/loads`` is a pause and is not counted, for
at most the grace; a pause past the grace counts again, so an engine that never resumes is
still taken out and restarted.

The engines get ``SGLANG_HEALTH_CHECK_TIMEOUT=1`` and the manager probes every 0.2 s, so the
sequences take seconds instead of minutes; the tests wait on the manager's own count of
probes (``rollout_health_probes_total``), not on time.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from _support import ManagerHandle, StartManager, http, metric_total, wait_until
from _trainer import SPECS, StandInRank0

from elastic_rollout.trainer import DistributedWeightSync, GroupLayout, TensorSpec

THRESHOLD = 2
FAST_PROBES = ("--health-check-interval-secs", "0.2", "--health-check-timeout-secs", "3")
FAST_PROBES += ("--health-failure-threshold", str(THRESHOLD))
#: Probes after which a managed engine failing them all is restarted (3 x the threshold).
RESTART_AFTER = 3 * THRESHOLD


def probes(fleet: ManagerHandle, result: str) -> float:
    text = http("GET", f"{fleet.control_url}/metrics").body.decode()
    return metric_total(text, f'rollout_health_probes_total{{result="{result}"}}')


def snapshot(fleet: ManagerHandle) -> dict[str, tuple[str, int]]:
    return {e.engine_id: (e.status, e.restarts) for e in fleet.engines().engines}


def test_a_trainer_pause_is_not_a_failure(start_fleet: StartManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer that pauses the engines itself (an unmodified slime, which calls SGLang
    directly): the manager is not told, and must not take the pause for a failure."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    fleet = start_fleet(*FAST_PROBES)
    before = snapshot(fleet)
    engines = fleet.engines().with_status("ACTIVE")
    during: list[dict[str, tuple[str, int]]] = []
    for e in engines:
        assert http("POST", e.url + "/pause_generation", {"mode": "retract"}).status == 200
        assert http("GET", e.url + "/ready").status == 503, "the engine should be paused"
    # Hold them paused until the manager has seen twice as many failed probes per engine as
    # would restart it.
    start = probes(fleet, "paused")
    target = start + 2 * RESTART_AFTER * len(engines)

    def enough() -> bool:
        during.append(snapshot(fleet))
        return probes(fleet, "paused") >= target

    wait_until(enough, 120, f"{target - start:.0f} probes of the paused engines")
    for e in engines:
        assert http("POST", e.url + "/continue_generation", {}).status == 200
    # Throughout the pause: every engine ACTIVE, none restarted.
    assert during and all(state == before for state in during), during
    # After it: the engines pass their probes again.
    passed = probes(fleet, "passed")
    wait_until(lambda: probes(fleet, "passed") >= passed + len(before), 30, "passing probes after the pause")
    assert snapshot(fleet) == before


def test_a_pause_the_manager_drives_is_out_of_routing_not_probed(start_fleet: StartManager) -> None:
    """A trainer update through the manager: its members are paused out of routing
    (WEIGHT_SYNCING) for as long as the broadcast takes, and come back on the new version."""
    fleet = start_fleet(*FAST_PROBES)
    before = snapshot(fleet)
    rank0 = StandInRank0()
    seen: list[dict[str, tuple[str, int]]] = []

    def slow_broadcast(layout: GroupLayout, specs: Sequence[TensorSpec]) -> None:
        for m in layout.members:
            assert http("GET", m.url + "/ready").status == 503, "the engine should be paused"
        seen.append(snapshot(fleet))
        rank0.broadcast(layout, specs)

    sync = DistributedWeightSync(fleet.client, join_group=rank0.join_group, broadcast=slow_broadcast, timeout=120)
    sync.update("step-1", SPECS)
    assert seen == [{k: ("WEIGHT_SYNCING", restarts) for k, (_, restarts) in before.items()}]
    assert snapshot(fleet) == before
    for e in fleet.engines().with_status("ACTIVE"):
        assert http("GET", f"{e.url}/model_info").json()["weight_version"] == "step-1"


def test_a_pause_past_the_grace_counts(start_fleet: StartManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine paused and never resumed: after the grace its probes count, it is taken out
    and restarted (and comes back unpaused)."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    fleet = start_fleet(*FAST_PROBES, "--health-pause-grace-secs", "2")
    engine = fleet.engines().with_status("ACTIVE")[0]
    assert http("POST", f"{engine.url}/pause_generation", {"mode": "in_place"}).status == 200
    wait_until(lambda: probes(fleet, "paused") >= 1, 30, "a probe of the paused engine")

    def restarted() -> bool:
        e = fleet.engines().by_id(engine.engine_id)
        return e is not None and e.restarts > engine.restarts and e.status == "ACTIVE"

    wait_until(restarted, 120, f"{engine.engine_id} restarted after its pause outlasted the grace")
    assert probes(fleet, "failed") >= RESTART_AFTER
    assert http("GET", f"{fleet.engines().by_id(engine.engine_id).url}/ready").status == 200


def test_a_hung_scheduler_is_not_a_pause(start_fleet: StartManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler that hangs while its HTTP process still answers `/v1/loads` (SGLang 0.5.23
    serves it from the last load snapshot) and `/model_info`: the failed probes count, and the
    engine is restarted within the usual threshold instead of being kept as paused for the whole
    `--health-pause-grace-secs` (600 s by default)."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    fleet = start_fleet(*FAST_PROBES, "--engine-arg=--enable-fault-api")
    engine = fleet.engines().with_status("ACTIVE")[0]
    paused_before = probes(fleet, "paused")
    out = http("POST", f"{engine.url}/sim/faults", {"hang_scheduler": True})
    assert out.status == 200 and out.json()["scheduler_hung"] is True
    assert http("GET", f"{engine.url}/v1/loads").status == 200, "the load snapshot still answers"
    assert http("GET", f"{engine.url}/model_info").status == 200

    def restarted() -> bool:
        e = fleet.engines().by_id(engine.engine_id)
        return e is not None and e.restarts > engine.restarts and e.status == "ACTIVE"

    wait_until(restarted, 120, f"{engine.engine_id} restarted after its scheduler hung")
    assert probes(fleet, "failed") >= RESTART_AFTER
    assert probes(fleet, "paused") == paused_before, "a hung scheduler was taken for a pause"
    fleet.track_children()
    back = fleet.engines().by_id(engine.engine_id)
    assert back is not None and http("GET", f"{back.url}/server_info").status == 200
