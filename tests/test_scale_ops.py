"""Scale-out failure paths: timeouts, batch cancel, engines that fail to start, GPU and bound limits."""

from __future__ import annotations

import pytest
from _support import INITIAL_ENGINES, STARTUP_TIMEOUT, StartManager, wait_until

from elastic_rollout import RolloutApiError

SLOW = "--engine-arg=--startup-delay=2"


def test_timed_out_scale_out_is_rolled_back(start_fleet: StartManager) -> None:
    fleet = start_fleet(SLOW)
    accepted = fleet.client.scale_out(num_replicas=3, timeout_secs=0.5)
    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, STARTUP_TIMEOUT)
    fleet.track_children()
    assert op.status == "FAILED"
    assert "timed out" in (op.raw["error_message"] or "")
    view = fleet.wait_engines(INITIAL_ENGINES)
    assert view.total_engines == INITIAL_ENGINES
    # The GPU went back to the pool: a new scale-out to the pool's size succeeds.
    ok = fleet.client.wait_for_operation(
        "scale_out", fleet.client.scale_out(num_replicas=4).request_id, STARTUP_TIMEOUT
    )
    assert ok.status == "ACTIVE"


def test_batch_cancel_by_status(start_fleet: StartManager) -> None:
    fleet = start_fleet(SLOW)
    accepted = fleet.client.scale_out(num_replicas=4)
    wait_until(
        lambda: fleet.client.scale_out_status(accepted.request_id).status == "HEALTH_CHECKING",
        STARTUP_TIMEOUT,
        "the scale-out to wait on its engines",
    )
    fleet.track_children()
    preview = fleet.client.request(
        "POST", "/rollout/scale_out_cancel", {"dry_run": True, "status_filter": "health_checking"}
    )
    assert preview["cancelled"] == [accepted.request_id] and preview["dry_run"] is True
    assert fleet.client.scale_out_status(accepted.request_id).status == "HEALTH_CHECKING"
    done = fleet.client.request("POST", "/rollout/scale_out_cancel", {"status_filter": "HEALTH_CHECKING"})
    assert done["cancelled"] == [accepted.request_id]
    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, STARTUP_TIMEOUT)
    assert op.status == "CANCELLED"
    assert fleet.wait_engines(INITIAL_ENGINES).total_engines == INITIAL_ENGINES
    with pytest.raises(RolloutApiError) as err:
        fleet.client.request("POST", "/rollout/scale_out_cancel", {"status_filter": "ACTIVE"})
    assert err.value.status == 400


def test_engines_that_fail_to_start_are_reported_and_cleaned_up(start_fleet: StartManager) -> None:
    # Every engine exits with an error during startup.
    broken = start_fleet("--engine-arg=--fail-startup", "--restart-failed-engines", "false", wait=False)
    initial_op = wait_until(
        lambda: next(iter(broken.client.scale_out_requests()), None),
        STARTUP_TIMEOUT,
        "the initial bring-up to be listed",
    )
    assert initial_op.raw["trigger"] == "initial"
    done = broken.client.wait_for_operation("scale_out", initial_op.request_id, STARTUP_TIMEOUT)
    assert done.status == "FAILED"
    assert len(done.raw["failed_engines"]) == INITIAL_ENGINES
    # Initial engines stay listed as FAILED, with the reason, and hold no process.
    view = broken.wait_engines(INITIAL_ENGINES, "FAILED", STARTUP_TIMEOUT)
    for engine in view.engines:
        assert engine.origin == "initial"
        assert "exited" in (engine.last_error or ""), engine


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"num_replicas": 9}, "insufficient_gpus"),
        ({"num_replicas": 300}, "above_max_engines"),
        ({"num_replicas": 3, "model_name": "other"}, "unknown_model"),
        ({"num_replicas": 3, "timeout_secs": -1}, "invalid_timeout"),
        ({}, "missing_target"),
    ],
)
def test_scale_out_rejections_name_the_problem(start_fleet: StartManager, body: dict[str, object], code: str) -> None:
    fleet = start_fleet()
    with pytest.raises(RolloutApiError) as err:
        fleet.client.request("POST", "/rollout/scale_out", body)
    assert err.value.status == 400 and err.value.code == code, err.value
    assert fleet.client.engines().total_engines == INITIAL_ENGINES
