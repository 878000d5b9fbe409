"""The autoscaler through the real API: load drives a scale-out and its absence a scale-in, the
RL pipeline signal scales both ways, and the status/conditions/health/history/enable endpoints
answer as documented. Waits are on state, with timeouts; nothing asserts on timing."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from _support import (
    DEFAULT_ARGS,
    STARTUP_TIMEOUT,
    ManagerHandle,
    StartManager,
    http,
    start_manager,
    stop_manager,
    wait_until,
)
from test_openapi import check

from elastic_rollout.client import RolloutClient

#: Seconds instead of minutes, so a whole cycle fits in a test.
FAST_YAML = """
min_engines: 2
max_engines: 3
metrics_interval_secs: 0.25
evaluation_interval_secs: 0.5
condition_window_secs: 1.0
scale_out_cooldown_secs: 1.0
scale_in_cooldown_secs: 1.0
scale_out_policy:
  queue_depth_per_engine: 2
  condition_duration_secs: 0.5
scale_in_policy:
  condition_duration_secs: 1.5
pipeline_policy:
  min_steps: 2
  report_max_age_secs: 5.0
"""

#: Small engines: at most 4 running requests each, so a few clients build a queue.
ENGINE_ARGS = ("--engine-arg=--time-scale=0.05", "--engine-arg=--max-running-requests=4")


def start(start_fleet: StartManager, tmp_path: Path, yaml: str = FAST_YAML) -> ManagerHandle:
    config = tmp_path / "autoscaler.yaml"
    config.write_text(yaml)
    return start_fleet("--autoscaler-config", str(config), *ENGINE_ARGS)


#: The OpenAPI schema of each GET answer (checked on every call).
SCHEMAS = {
    "/autoscaler/status": "AutoscalerStatus",
    "/autoscaler/conditions": "AutoscalerConditions",
    "/autoscaler/health": "AutoscalerHealth",
    "/autoscaler/scale_history": "ScaleHistory",
    "/rollout/pipeline": "PipelineReports",
}


def get(fleet: ManagerHandle, path: str) -> Any:
    resp = http("GET", f"{fleet.control_url}{path}")
    assert resp.status == 200, (path, resp.status, resp.body)
    schema = SCHEMAS.get(path.split("?")[0])
    if schema:
        check(http("GET", f"{fleet.control_url}/openapi.json").json(), schema, resp.json())
    return resp.json()


def history(fleet: ManagerHandle, **query: str) -> list[dict[str, Any]]:
    qs = "&".join(f"{k}={v}" for k, v in query.items())
    entries: list[dict[str, Any]] = get(fleet, f"/autoscaler/scale_history?{qs}")["history"]
    return entries


def finished(fleet: ManagerHandle, action: str, status: str) -> dict[str, Any] | None:
    return next((h for h in history(fleet, action=action) if h["status"] == status), None)


class Load:
    """A bounded closed loop of clients on the router, until stopped (or 120 s at most)."""

    def __init__(self, fleet: ManagerHandle, clients: int) -> None:
        self.stop = threading.Event()
        self.completed = 0
        self.lock = threading.Lock()
        deadline = time.monotonic() + 120
        body = {"text": "rollout " * 40, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}

        def client() -> None:
            while not self.stop.is_set() and time.monotonic() < deadline:
                resp = http("POST", f"{fleet.router_url}/generate", body, timeout=60)
                if resp.status == 200:
                    with self.lock:
                        self.completed += 1

        self.threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def test_disabled_without_a_config_but_served(shared_fleet: ManagerHandle) -> None:
    status = get(shared_fleet, "/autoscaler/status")
    assert status["enabled"] is False and status["config_path"] is None
    assert status["min_engines"] == 1 and status["max_engines"] == 32  # the seed's defaults
    wait_until(lambda: get(shared_fleet, "/autoscaler/status")["running"], 10, "the autoscaler task to run")
    # It still reads the engines, so conditions and health are live.
    health = wait_until(
        lambda: (h := get(shared_fleet, "/autoscaler/health"))["ticks"] > 0 and h, 30, "a first metrics tick"
    )
    assert health["status"] in ("ok", "degraded") and health["running"] is True
    conditions = get(shared_fleet, "/autoscaler/conditions")["conditions"]
    assert conditions["token_usage_high"]["type"] == "scale_out"
    assert conditions["no_queue"]["type"] == "scale_in"
    assert get(shared_fleet, "/autoscaler/scale_history") == {
        "history": [],
        "total_count": 0,
        "action_filter": None,
        "limit": 100,
    }


def test_bad_requests_are_json_400s(shared_fleet: ManagerHandle) -> None:
    url = shared_fleet.control_url
    cases = [
        ("POST", "/autoscaler/enable", {}, "invalid_body"),
        ("POST", "/autoscaler/enable", {"enabled": "yes"}, "invalid_body"),
        ("GET", "/autoscaler/scale_history?limit=0", None, "invalid_limit"),
        ("GET", "/autoscaler/scale_history?limit=ten", None, "invalid_limit"),
        ("GET", "/autoscaler/scale_history?action=grow", None, "invalid_action"),
        ("POST", "/rollout/pipeline", {"step": 1, "trainer_wait_secs": 1}, "invalid_body"),
        (
            "POST",
            "/rollout/pipeline",
            {"step": 1, "trainer_wait_secs": 9, "rollout_throttled_secs": 0, "step_secs": 3},
            "invalid_pipeline_report",
        ),
    ]
    for method, path, body, code in cases:
        resp = http(method, f"{url}{path}", body)
        assert resp.status == 400, (path, body, resp.body)
        error = resp.json()["error"]
        assert error["code"] == code, (path, body, error)
        assert error["message"]


def test_load_scales_out_and_its_absence_scales_in(start_fleet: StartManager, tmp_path: Path) -> None:
    fleet = start(start_fleet, tmp_path)
    status = get(fleet, "/autoscaler/status")
    assert status["enabled"] is True and status["config_path"].endswith("autoscaler.yaml")
    load = Load(fleet, clients=24)
    try:
        out = wait_until(lambda: finished(fleet, "scale_out", "ACTIVE"), 60, "a scale-out to finish under load")
    finally:
        load.end()
    assert load.completed > 0
    assert (out["from_engines"], out["to_engines"], out["delta"]) == (2, 3, 1)
    assert "queue_backlog" in out["triggered_conditions"] and out["reason"].startswith("Conditions met")
    assert out["metrics_snapshot"]["total_queue_reqs"] > 0 and out["completed_at"] >= out["triggered_at"]
    # The autoscaler went through the same scale API as a user.
    record = get(fleet, f"/rollout/scale_out/{out['request_id']}")
    assert record["num_replicas"] == 3 and record["status"] == "ACTIVE"

    # No load: back to min_engines, one engine at a time, through the graceful drain.
    removal = wait_until(lambda: finished(fleet, "scale_in", "COMPLETED"), 60, "a scale-in once the load stopped")
    assert (removal["from_engines"], removal["to_engines"], removal["delta"]) == (3, 2, 1)
    assert set(removal["triggered_conditions"]) == {
        "token_usage_low",
        "no_queue",
        "throughput_stable",
        "projected_usage_ok",
    }
    assert get(fleet, f"/rollout/scale_in/{removal['request_id']}")["status"] == "COMPLETED"
    fleet.wait_engines(2)

    # Filters and the status summary.
    assert [h["action"] for h in history(fleet, action="scale_in")] == ["scale_in"]
    assert len(history(fleet, limit="1")) == 1
    status = get(fleet, "/autoscaler/status")
    assert status["last_scale_action"] == "scale_in" and status["pending_requests"] == []
    assert status["expected_time_to_ready_secs"] is not None  # learned from the scale-out

    # Disabled, it decides but does not act.
    resp = http("POST", f"{fleet.control_url}/autoscaler/enable", {"enabled": False})
    assert resp.status == 200 and resp.json()["enabled"] is False
    assert get(fleet, "/autoscaler/status")["enabled"] is False


def test_pipeline_signal_scales_out_when_the_trainer_starves(start_fleet: StartManager, tmp_path: Path) -> None:
    fleet = start(start_fleet, tmp_path)

    def report(step: int, wait: float, throttled: float, step_secs: float = 10.0) -> dict[str, Any]:
        body = {"step": step, "trainer_wait_secs": wait, "rollout_throttled_secs": throttled, "step_secs": step_secs}
        resp = http("POST", f"{fleet.control_url}/rollout/pipeline", body)
        assert resp.status == 200, resp.body
        answer: dict[str, Any] = resp.json()
        check(http("GET", f"{fleet.control_url}/openapi.json").json(), "PipelineAccepted", answer)
        return answer

    # The trainer waits 40% of every step for rollout data: below the severe threshold (0.5),
    # so it takes min_steps (2) such steps.
    first = report(1, 4.0, 0.0)
    assert first["signal"] == "pipeline" and first["trainer_starved"] is False
    assert report(2, 4.0, 0.0)["trainer_starved"] is True
    out = wait_until(lambda: finished(fleet, "scale_out", "ACTIVE"), 60, "a scale-out for the starving trainer")
    assert out["triggered_conditions"] == ["trainer_starved"] and out["signal"] == "pipeline"
    assert out["to_engines"] == 3  # ceil(2 / (1 - 0.4)) = 4 wanted, max_engines 3

    # Now rollout runs ahead and waits on its staleness limit: one engine goes. (Only steps
    # that began after the scale-out count, so these steps are short.)
    step = 3

    def throttled() -> dict[str, Any] | None:
        nonlocal step
        report(step, 0.0, 0.6, step_secs=1.0)
        step += 1
        return finished(fleet, "scale_in", "COMPLETED")

    removal = wait_until(throttled, 60, "a scale-in for the throttled rollout", interval=0.3)
    assert removal["triggered_conditions"] == ["rollout_throttled"]
    reports = get(fleet, "/rollout/pipeline")["reports"]
    assert reports[0]["step"] == step - 1 and reports[0]["rollout_throttled_secs"] == 0.6
    fleet.wait_engines(2, timeout=STARTUP_TIMEOUT)


def test_pipeline_rates_scale_out_before_the_trainer_waits(start_fleet: StartManager, tmp_path: Path) -> None:
    config = tmp_path / "autoscaler.yaml"
    config.write_text(FAST_YAML)
    # One request per engine at a time: more load waits in the router, where it counts as queued.
    fleet = start_fleet("--autoscaler-config", str(config), *ENGINE_ARGS, "--max-inflight-per-engine", "1")
    client = RolloutClient(fleet.control_url)

    # No wait yet, but the next step takes 20 samples per second of training (20 in a 1 s step)
    # while rollout made 10 per second with 2 engines: short, and sized with 20% headroom
    # (2 * 20 * 1.2 / 10 = 4.8 engines), capped by max_engines 3.
    answer = client.report_step(1, 0.0, 0.0, 1.0, rollout_samples=10, next_step_samples=20)
    check(http("GET", f"{fleet.control_url}/openapi.json").json(), "PipelineAccepted", answer)
    assert answer["rollout_short"] is True and answer["trainer_starved"] is False
    out = wait_until(lambda: finished(fleet, "scale_out", "ACTIVE"), 60, "a scale-out on the rates")
    assert out["triggered_conditions"] == ["rollout_short"] and out["to_engines"] == 3
    reports = get(fleet, "/rollout/pipeline")["reports"]
    assert reports[0]["demand_samples_per_sec"] == 20.0 and reports[0]["supply_samples_per_sec"] == 10.0

    # Keep the fleet busy (requests queue in the router), so rollout's rate is its capacity.
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            body = {"text": "busy", "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
            http("POST", f"{fleet.router_url}/generate", body)

    workers = [threading.Thread(target=load, daemon=True) for _ in range(8)]
    for w in workers:
        w.start()

    # Rollout is held back half of every step, but without one of the 3 engines it would make
    # 30 * 2/3 = 20 samples/s against a demand of 20/s: less than the 1.2x headroom.
    step = 2

    def throttled(next_step_samples: int) -> None:
        nonlocal step
        client.report_step(step, 0.0, 0.5, 1.0, rollout_samples=15, next_step_samples=next_step_samples)
        step += 1

    def held_back() -> dict[str, Any] | None:
        throttled(20)
        c: dict[str, Any] = get(fleet, "/autoscaler/conditions")["conditions"]
        return c if c["rollout_throttled"]["triggered"] and "supply_after_removal" in c else None

    try:
        conditions = wait_until(held_back, 60, "throttled steps on a busy fleet", interval=0.3)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=60)
    assert conditions["supply_after_removal"]["triggered"] is False
    assert abs(conditions["supply_after_removal"]["value"] - 1.0) < 1e-6
    assert conditions["supply_after_removal"]["threshold"] == 1.2
    assert finished(fleet, "scale_in", "COMPLETED") is None

    # The load is gone and the next steps take 10 per second: one engine goes.
    def spare() -> dict[str, Any] | None:
        throttled(10)
        return finished(fleet, "scale_in", "COMPLETED")

    removal = wait_until(spare, 60, "a scale-in once supply is to spare", interval=0.3)
    assert removal["triggered_conditions"][0] == "rollout_throttled"


def test_replay_runs_the_example_trace(manager_bin: Path) -> None:
    example = Path(__file__).resolve().parents[1] / "benches" / "autoscaler"
    argv = [str(manager_bin), "autoscaler-replay", "--config", str(example / "example.yaml"),
            "--trace", str(example / "example-trace.jsonl")]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    decisions = [json.loads(line) for line in done.stdout.splitlines()]
    actions = [d["action"] for d in decisions]
    assert "scale_out" in actions and "scale_in" in actions, actions
    assert actions.index("scale_out") < actions.index("scale_in")
    assert "decisions:" in done.stderr
    # A bad config names the field.
    bad = example.parent.parent / "tests" / "_no_such.yaml"
    done = subprocess.run(
        [*argv[:2], "--config", str(bad), "--trace", argv[5]], capture_output=True, text=True, check=False
    )
    assert done.returncode == 1 and "cannot read" in done.stderr


def test_one_severe_step_scales_out_and_the_history_survives_a_restart(
    manager_bin: Path, tmp_path: Path, start_fleet: StartManager
) -> None:
    fleet = start(start_fleet, tmp_path)
    body = {"step": 1, "trainer_wait_secs": 8.0, "rollout_throttled_secs": 0.0, "step_secs": 10.0}
    answer = http("POST", f"{fleet.control_url}/rollout/pipeline", body).json()
    assert answer["trainer_starved"] is True  # one step, 80% waiting: no need for min_steps (2)
    out = wait_until(lambda: finished(fleet, "scale_out", "ACTIVE"), 60, "a scale-out after one severe step")
    assert out["triggered_conditions"] == ["trainer_starved"]
    learned = get(fleet, "/autoscaler/status")["expected_time_to_ready_secs"]
    assert learned is not None

    # Restart on the same state directory: the history and the learned time to ready are back.
    state_dir, argv = fleet.state_dir, fleet.process.args
    stop_manager(fleet)
    extra = tuple(argv[argv.index("--state-dir") + 2 + len(DEFAULT_ARGS) :])
    again = start_manager(manager_bin, state_dir, extra)
    try:
        entries = history(again, action="scale_out")
        assert [(h["request_id"], h["status"]) for h in entries] == [(out["request_id"], "ACTIVE")]
        assert entries[0]["triggered_conditions"] == ["trainer_starved"]
        # Learned again from the stored timestamps (JSON floats: equal to well under a millisecond).
        assert abs(get(again, "/autoscaler/status")["expected_time_to_ready_secs"] - learned) < 1e-3
    finally:
        stop_manager(again)
