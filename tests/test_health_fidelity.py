"""A trainer-driven pause longer than SGLang's health-check timeout, as the manager sees it.

SGLang's ``/health`` and ``/health_generate`` (the manager's default probe) run a 1-token
generation, which waits while generation is paused: on a paused engine every probe fails
after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s by default). The trainer's
``DistributedWeightSync`` pauses the engines itself, for as long as its broadcast takes, and
the manager is not told. The manager keeps its default health settings here (a probe every
5 s, 20 s probe timeout, 3 failures); the engines get ``SGLANG_HEALTH_CHECK_TIMEOUT=1`` so that
the same sequence of events takes seconds instead of minutes (with SGLang's default the first
probe alone takes 20 s, so a pause of about a minute does the same).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from _support import ManagerHandle, StartManager, http
from _trainer import SPECS, StandInRank0

from elastic_rollout.trainer import DistributedWeightSync, GroupLayout, TensorSpec

#: How long the trainer holds the engines paused at most: past the manager's restart bound
#: (3 x 3 failed probes, one every 5 s) with room to spare.
PAUSE_LIMIT = 75.0


def snapshot(fleet: ManagerHandle) -> dict[str, tuple[str, int, str | None]]:
    return {e.engine_id: (e.status, e.restarts, e.weight_version) for e in fleet.engines().engines}


@pytest.mark.xfail(
    strict=True,
    reason="known hazard, manager unchanged: both paused engines go UNHEALTHY after 3 failed probes "
    "(~16 s here, ~60 s with SGLang's 20 s timeout) and are killed and restarted after 9 (~46 s here, "
    "~3 min with the defaults), in the middle of the trainer's update, which then fails",
)
def test_trainer_pause_longer_than_the_health_timeout(
    start_fleet: StartManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    fleet = start_fleet()
    before = snapshot(fleet)
    rank0 = StandInRank0()
    seen: list[tuple[float, dict[str, tuple[str, int, str | None]]]] = []
    start = time.monotonic()

    def long_broadcast(layout: GroupLayout, specs: Sequence[TensorSpec]) -> None:
        rank0.broadcast(layout, specs)
        # The engines are paused now (retract mode, the trainer's default). A slow broadcast
        # (a large model) or a trainer that keeps the engines paused during its own step.
        for m in layout.members:
            assert http("GET", m.url + "/ready").status == 503, "paused"
        deadline = time.monotonic() + PAUSE_LIMIT
        while time.monotonic() < deadline:
            now = snapshot(fleet)
            if not seen or seen[-1][1] != now:
                seen.append((round(time.monotonic() - start, 1), now))
            if any(restarts > before[eid][1] for eid, (_, restarts, _) in now.items() if eid in before):
                break
            time.sleep(0.5)

    sync = DistributedWeightSync(fleet.client, join_group=rank0.join_group, broadcast=long_broadcast, timeout=120)
    error: BaseException | None = None
    try:
        sync.update("step-1", SPECS)
    except BaseException as err:
        error = err
    # After the update (or its failure) the trainer has continued generation everywhere.
    settle = time.monotonic() + 60
    while time.monotonic() < settle:
        now = snapshot(fleet)
        if not seen or seen[-1][1] != now:
            seen.append((round(time.monotonic() - start, 1), now))
        if all(s == "ACTIVE" for s, _, _ in now.values()) and len(now) >= len(before):
            break
        time.sleep(0.5)
    report = "\n".join(f"t={t:>5}s {state}" for t, state in seen)
    print(f"\nupdate error: {error!r}\n{report}")
    statuses = {s for _, state in seen for s, _, _ in state.values()}
    restarted = any(state[eid][1] > before[eid][1] for _, state in seen for eid in before if eid in state)
    # What should happen: an engine the trainer paused is healthy and stays in the fleet.
    assert statuses == {"ACTIVE"} and not restarted and error is None, (
        f"a healthy engine paused by the trainer was acted on by the manager\nupdate error: {error!r}\n{report}"
    )
