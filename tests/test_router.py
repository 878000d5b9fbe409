"""The data plane: routing policies, session and prompt affinity, version pins, admin routes,
fan-out, and the router's Prometheus metrics. Real manager, real sglang-sim engines."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
from typing import Any

import pytest
from _support import STARTUP_TIMEOUT, ManagerHandle, StartManager, http, metric_total, sse_events, wait_until


def generate(fleet: ManagerHandle, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[str, Any]:
    resp = http("POST", f"{fleet.router_url}/generate", body, headers=headers)
    assert resp.status == 200, (resp.status, resp.body)
    return resp.headers["x-rollout-engine-id"], resp.json()


@pytest.fixture
def four(start_fleet: StartManager) -> ManagerHandle:
    fleet = start_fleet("--rollout-num-gpus", "4", "--weight-version", "v3", "--version-wait-secs", "1", wait=False)
    fleet.wait_engines(4, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
    return fleet


def test_round_robin_and_least_requests_use_every_engine(four: ManagerHandle) -> None:
    for policy in ("round_robin", "least_requests"):
        seen = collections.Counter(
            generate(four, {"text": f"p{i}", "sampling_params": {"max_new_tokens": 1}}, {"x-routing-policy": policy})[0]
            for i in range(8)
        )
        assert len(seen) == 4, (policy, seen)


def test_unknown_policy_is_a_clear_400(four: ManagerHandle) -> None:
    resp = http("POST", f"{four.router_url}/generate", {"text": "x"}, headers={"x-routing-policy": "cache_aware"})
    assert resp.status == 400
    assert "round_robin" in resp.json()["error"]["message"]


def test_session_requests_stay_on_one_engine(four: ManagerHandle) -> None:
    homes = {}
    for session in ("alice", "bob", "carol"):
        engines = {
            generate(four, {"text": f"turn {t}", "sampling_params": {"max_new_tokens": 2}}, {"x-session-id": session})[
                0
            ]
            for t in range(5)
        }
        assert len(engines) == 1, (session, engines)
        homes[session] = engines.pop()
    # The body's session_params.id works the same way.
    engines = {
        generate(
            four,
            {"text": f"t{t}", "session_params": {"id": "dave"}, "sampling_params": {"max_new_tokens": 1}},
            {"x-routing-policy": "session"},
        )[0]
        for t in range(4)
    }
    assert len(engines) == 1


def test_grpo_siblings_share_an_engine_until_it_fills(start_fleet: StartManager) -> None:
    # Small KV pools so one prompt group can fill an engine.
    fleet = start_fleet("--engine-arg=--max-total-tokens=2048", "--engine-arg=--time-scale=0.2")
    wait_until(
        lambda: (
            metric_total(http("GET", f"{fleet.control_url}/metrics").body.decode(), "rollout_engine_kv_capacity_tokens")
            == 2 * 2048
        ),
        STARTUP_TIMEOUT,
        "the engines' KV pool sizes to be polled",
    )
    prompt = "solve: " + "x " * 50
    sibling = {"text": prompt, "sampling_params": {"max_new_tokens": 8}}
    first = {generate(fleet, sibling)[0] for _ in range(4)}
    assert len(first) == 1, f"sequential siblings of one prompt should share an engine: {first}"
    # A burst of long siblings exceeds one engine's pool: the gate spills them to the other.
    burst = {"text": prompt, "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
    seen: list[str] = []
    threads = [threading.Thread(target=lambda: seen.append(generate(fleet, burst)[0])) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(seen) == 6 and len(set(seen)) == 2, collections.Counter(seen)
    metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
    assert metric_total(metrics, 'rollout_router_affinity_total{outcome="kept"}') >= 3
    assert metric_total(metrics, 'rollout_router_affinity_total{outcome="moved"}') >= 1


def test_capacity_spreads_a_burst_by_tokens(start_fleet: StartManager) -> None:
    fleet = start_fleet("--engine-arg=--time-scale=0.2")
    long = {"sampling_params": {"max_new_tokens": 800, "ignore_eos": True}}
    seen: list[str] = []
    threads = [
        threading.Thread(target=lambda i=i: seen.append(generate(fleet, {"text": f"distinct prompt {i}", **long})[0]))
        for i in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    counts = collections.Counter(seen)
    assert len(counts) == 2 and max(counts.values()) - min(counts.values()) <= 2, counts


def test_version_pins(four: ManagerHandle) -> None:
    for pin in ("v3", {"exact_version": "v3"}, {"min_version": "v2"}, {"min_version": "v3"}):
        _, body = generate(four, {"text": "x", "weight_version": pin, "sampling_params": {"max_new_tokens": 1}})
        assert body["meta_info"]["weight_version"] == "v3"
    _, body = generate(four, {"text": "x"}, {"x-min-weight-version": "v1"})
    assert body["meta_info"]["weight_version"] == "v3"
    for pin in ({"exact_version": "v4"}, {"min_version": "v10"}):
        resp = http("POST", f"{four.router_url}/generate", {"text": "x", "weight_version": pin})
        assert resp.status == 503
        err = resp.json()["error"]
        assert err["code"] == "version_unavailable" and "v3" in err["message"], err
    bad = http("POST", f"{four.router_url}/generate", {"text": "x", "weight_version": {"newest": True}})
    assert bad.status == 400 and bad.json()["error"]["code"] == "invalid_weight_version"


def test_pinned_request_waits_for_a_serving_engine(start_fleet: StartManager) -> None:
    fleet = start_fleet("--engine-arg=--startup-delay=1", "--weight-version", "7", wait=False)
    # No engine is ACTIVE yet: an unpinned request fails at once, a pinned one waits.
    assert http("POST", f"{fleet.router_url}/generate", {"text": "x"}).status == 503
    _, body = generate(
        fleet, {"text": "x", "weight_version": {"min_version": "7"}, "sampling_params": {"max_new_tokens": 1}}
    )
    assert body["meta_info"]["weight_version"] == "7"


def test_admin_routes_are_not_forwarded_and_abort_fans_out(four: ManagerHandle) -> None:
    resp = http("POST", f"{four.router_url}/update_weights_from_disk", {"model_path": "/tmp/x"})
    assert resp.status == 403 and resp.json()["error"]["code"] == "admin_route"
    resp = http("POST", f"{four.router_url}/abort_request", {"abort_all": True})
    assert resp.status == 200
    body = resp.json()
    assert body["success"] is True and len(body["engines"]) == 4


def test_workers_list_is_smgs_shape_and_read_only(four: ManagerHandle) -> None:
    """Trainers written against smg (slime) list the router's workers to abort each engine."""
    resp = http("GET", f"{four.router_url}/workers")
    assert resp.status == 200, resp.body[:300]
    listed = resp.json()
    active = {e.engine_id: e for e in four.engines().with_status("ACTIVE")}
    assert listed["total"] == len(listed["workers"]) == len(active) == 4
    assert listed["stats"]["regular_count"] == 4
    for worker in listed["workers"]:
        engine = active[worker["id"]]
        assert worker["url"] == engine.url and worker["weight_version"] == engine.weight_version
        assert worker["is_healthy"] is True and worker["worker_type"] == "regular"
    # slime's end-of-rollout abort, as it does it: each listed URL's /abort_request, then its load.
    for worker in listed["workers"]:
        assert http("POST", f"{worker['url']}/abort_request", {"abort_all": True}).status == 200
        loads = http("GET", f"{worker['url']}/v1/loads?include=core").json()["loads"]
        assert sum(r["num_running_reqs"] + r["num_waiting_reqs"] for r in loads) == 0
    # The manager owns the list: registering or removing through the router is refused.
    for method, path in [("POST", "/workers"), ("DELETE", f"/workers/{listed['workers'][0]['id']}")]:
        resp = http(method, f"{four.router_url}{path}", {"url": "http://127.0.0.1:9"} if method == "POST" else None)
        assert resp.status == 403, (method, path, resp.body)
        error = resp.json()["error"]
        assert error["code"] == "workers_managed" and "/rollout/scale_out" in error["message"]
    assert len(four.engines().with_status("ACTIVE")) == 4


def test_router_metrics(four: ManagerHandle) -> None:
    before = metric_total(http("GET", f"{four.control_url}/metrics").body.decode(), "rollout_router_requests_total")
    for i in range(5):
        generate(four, {"text": f"m{i}", "sampling_params": {"max_new_tokens": 1}})
    resp = http("GET", f"{four.control_url}/metrics")
    assert resp.status == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.body.decode()
    assert metric_total(text, "rollout_router_requests_total") == before + 5
    assert metric_total(text, 'rollout_router_responses_total{class="2xx"}') >= 5
    assert metric_total(text, "rollout_engine_served_total") >= 5
    assert metric_total(text, "rollout_router_request_duration_seconds_count") >= 5
    # The load poller has read every engine's KV pool size.
    wait_until(
        lambda: (
            metric_total(http("GET", f"{four.control_url}/metrics").body.decode(), "rollout_engine_kv_capacity_tokens")
            >= 4 * 65536
        ),
        STARTUP_TIMEOUT,
        "the engines' KV pool sizes to be polled",
    )
    assert json.loads(http("GET", f"{four.router_url}/readiness").body)["routable_engines"] == 4


def test_data_plane_on_several_threads_routes_and_streams(start_fleet: StartManager) -> None:
    """--router-threads 4 (more threads than this machine's cores): client connections are
    handed to four threads in turn; concurrent plain and streamed answers, over many client
    connections, all arrive whole and reach both engines."""
    fleet = start_fleet("--rollout-num-gpus", "2", "--router-threads", "4", wait=False)
    fleet.wait_engines(2, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
    assert "threads=4" in fleet.stderr_tail(100_000), fleet.stderr_tail()
    body = {"text": "s", "stream": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}

    def one(i: int) -> tuple[str, int]:
        engine = generate(
            fleet, {"text": f"p{i}", "sampling_params": {"max_new_tokens": 2}}, {"x-routing-policy": "round_robin"}
        )[0]
        events = list(sse_events(f"{fleet.router_url}/generate", body))
        assert events[-1] == "[DONE]", events
        return engine, json.loads(events[-2])["meta_info"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(32)))
    assert {e for e, _ in answers} == {"engine_0", "engine_1"}, answers
    assert all(tokens == 4 for _, tokens in answers), answers


@pytest.mark.parametrize("order", ["fifo", "longest_first"])
def test_queue_order_decides_which_waiting_request_gets_a_freed_slot(start_fleet: StartManager, order: str) -> None:
    """One engine with room for one request: requests that queue in the router behind it are
    served one at a time, in arrival order (fifo) or largest max_new_tokens first."""
    fleet = start_fleet(
        "--rollout-num-gpus",
        "1",
        "--max-inflight-per-engine",
        "1",
        "--queue-order",
        order,
        "--engine-arg=--time-scale=1",
        wait=False,
    )
    fleet.wait_engines(1, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
    finished: list[int] = []
    lock = threading.Lock()

    def send(tokens: int) -> None:
        generate(fleet, {"text": "same prompt", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}})
        with lock:
            finished.append(tokens)

    def queued_at_least(n: int) -> float | None:
        q = metric_total(http("GET", f"{fleet.control_url}/metrics").body.decode(), "rollout_router_queued_requests")
        return q if q >= n else None

    blocker = threading.Thread(target=send, args=(150,))  # holds the only slot for ~1.2 s
    blocker.start()
    wait_until(
        lambda: (
            metric_total(http("GET", f"{fleet.control_url}/metrics").body.decode(), "rollout_engine_in_flight") >= 1
            or None
        ),
        30,
        "the first request in flight",
    )
    waiting = []
    for i, tokens in enumerate((10, 60, 30), start=1):  # arrival order: 10, 60, 30
        t = threading.Thread(target=send, args=(tokens,))
        t.start()
        waiting.append(t)
        wait_until(lambda i=i: queued_at_least(i), 30, f"{i} requests waiting in the router")
    for t in (blocker, *waiting):
        t.join(timeout=60)
    expected = [150, 10, 60, 30] if order == "fifo" else [150, 60, 30, 10]
    assert finished == expected, f"{order}: served {finished}, expected {expected}"


def test_late_binding_hands_queued_requests_to_a_new_engine(start_fleet: StartManager) -> None:
    """With --max-inflight-per-engine, work beyond the cap waits in the router, so an engine that
    joins takes it; without the cap all of it would already sit in the first engine's queue."""
    fleet = start_fleet(
        "--rollout-num-gpus", "1", "--max-inflight-per-engine", "1", "--engine-arg=--time-scale=1", wait=False
    )
    fleet.wait_engines(1, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
    slow = {"sampling_params": {"max_new_tokens": 150, "ignore_eos": True}}  # ~1.2 s each at 8 ms/token
    served: list[str] = []
    peak_in_flight = 0
    stop = threading.Event()

    def sample_in_flight() -> None:
        nonlocal peak_in_flight
        while not stop.is_set():
            text = http("GET", f"{fleet.control_url}/metrics").body.decode()
            peak_in_flight = max(peak_in_flight, int(metric_total(text, "rollout_engine_in_flight")))
            stop.wait(0.05)

    sampler = threading.Thread(target=sample_in_flight, daemon=True)
    sampler.start()
    threads = [
        threading.Thread(target=lambda i=i: served.append(generate(fleet, {"text": f"job {i}", **slow})[0]))
        for i in range(6)
    ]
    for t in threads:
        t.start()

    def queued() -> float | None:
        n = metric_total(http("GET", f"{fleet.control_url}/metrics").body.decode(), "rollout_router_queued_requests")
        return n if n >= 4 else None

    wait_until(queued, 60, "requests waiting in the router")
    resp = http("POST", f"{fleet.control_url}/rollout/scale_out", {"num_replicas": 2})
    assert resp.status in (200, 202), resp.body
    fleet.wait_engines(2, "ACTIVE", STARTUP_TIMEOUT)
    for t in threads:
        t.join(timeout=120)
    stop.set()
    sampler.join(timeout=10)
    counts = collections.Counter(served)
    assert sum(counts.values()) == 6, counts
    assert len(counts) == 2, f"the engine added while requests waited served none of them: {counts}"
    # One engine at a time held at most one request; with two engines, at most two in all.
    assert peak_in_flight <= 2, peak_in_flight
    text = http("GET", f"{fleet.control_url}/metrics").body.decode()
    assert metric_total(text, "rollout_router_queued_requests") == 0
