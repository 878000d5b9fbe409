"""Black-box tests of ``rollout-manager serve`` with ``sglang-sim`` engines: real processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from _support import (
    INITIAL_ENGINES,
    ManagerHandle,
    ProcessIdentity,
    StartManager,
    http,
    metric_total,
    sse_events,
    wait_until,
)

from elastic_rollout import Engine, RolloutApiError, ScaleOperation

SCALE_TIMEOUT = 60.0
GENERATE_BODY = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}}
SCALE_OUT_ORDER = ["PENDING", "CREATING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "READY", "ACTIVE"]
SCALE_IN_ORDER = ["PENDING", "DRAINING", "REMOVING", "COMPLETED"]


def assert_disjoint_gpus(engines: list[Engine] | tuple[Engine, ...], pool: int = 4) -> None:
    seen: dict[int, str] = {}
    for engine in engines:
        assert engine.gpu_ids, f"{engine.engine_id} has no gpu_ids"
        for gpu in engine.gpu_ids:
            assert 0 <= gpu < pool, f"{engine.engine_id} got gpu {gpu}, outside the pool of {pool}"
            assert gpu not in seen, f"gpu {gpu} given to both {seen[gpu]} and {engine.engine_id}"
            seen[gpu] = engine.engine_id


def assert_error_body(result_body: bytes, status: int) -> dict[str, str]:
    """The body follows the error model ``{"error": {"code", "message"}}``."""
    try:
        body = json.loads(result_body)
    except ValueError:
        raise AssertionError(f"HTTP {status} body is not JSON: {result_body[:300]!r}") from None
    error = body.get("error") if isinstance(body, dict) else None
    assert isinstance(error, dict), f"HTTP {status} body has no error object: {body}"
    assert isinstance(error.get("code"), str) and error["code"], f"no error.code in {body}"
    assert isinstance(error.get("message"), str) and error["message"], f"no error.message in {body}"
    return error


def assert_history_in_order(op: ScaleOperation, order: list[str]) -> None:
    statuses = op.statuses
    assert statuses, f"{op.kind} {op.request_id} has no history: {op.raw}"
    assert statuses[-1] == op.status, f"history {statuses} does not end in the status {op.status}"
    indexes = [order.index(s) for s in statuses if s in order]
    assert indexes == sorted(indexes), f"{op.kind} history out of order: {statuses}"
    unknown = [s for s in statuses if s not in order]
    assert not unknown, f"{op.kind} history has unexpected statuses {unknown}: {statuses}"


def engine_request_counts(engines: list[Engine] | tuple[Engine, ...]) -> dict[str, float]:
    """Each engine's own ``sglang:num_requests_total`` counter, read from its /metrics."""
    counts = {}
    for engine in engines:
        result = http("GET", f"{engine.url}/metrics")
        assert result.status == 200, f"{engine.engine_id} /metrics -> {result.status}: {result.body[:200]!r}"
        counts[engine.engine_id] = metric_total(result.body.decode(), "sglang:num_requests_total")
    return counts


def generate(router_url: str, body: Mapping[str, Any] = GENERATE_BODY) -> dict[str, Any]:
    result = http("POST", f"{router_url}/generate", body)
    assert result.status == 200, f"/generate -> {result.status}: {result.body[:500]!r}"
    answer = result.json()
    assert isinstance(answer, dict), answer
    return answer


# -- the initial fleet (shared, read-only) --------------------------------------------------


def test_health(shared_fleet: ManagerHandle) -> None:
    assert shared_fleet.client.health() == {"status": "ok"}


def test_initial_engines_are_active_and_disjoint(shared_fleet: ManagerHandle) -> None:
    view = shared_fleet.engines()
    engines = view.engines
    assert view.total_engines == len(engines) == INITIAL_ENGINES
    assert list(view.models) == ["default"]
    for engine in engines:
        assert engine.status == "ACTIVE" and engine.is_healthy, engine
        assert engine.origin == "initial", engine
        assert engine.model_name == "default"
        assert engine.url.startswith("http://127.0.0.1:"), engine.url
        assert len(engine.gpu_ids) == 1, engine
        assert engine.pid is not None and ProcessIdentity.of(engine.pid) is not None, f"{engine} pid not running"
        assert engine.started_at is not None and engine.started_at > 0
        assert engine.log_path is not None, engine
        assert Path(engine.log_path).resolve().is_relative_to((shared_fleet.state_dir / "logs").resolve()), (
            engine.log_path
        )
        assert Path(engine.log_path).is_file(), engine.log_path
    assert len({e.engine_id for e in engines}) == len(engines)
    assert len({e.url for e in engines}) == len(engines)
    assert len({e.pid for e in engines}) == len(engines)
    assert_disjoint_gpus(engines)


def test_one_engine_by_id(shared_fleet: ManagerHandle) -> None:
    listed = shared_fleet.engines().engines[0]
    one = shared_fleet.client.engine(listed.engine_id)
    assert (one.engine_id, one.url, one.pid, one.gpu_ids) == (listed.engine_id, listed.url, listed.pid, listed.gpu_ids)
    with pytest.raises(RolloutApiError) as missing:
        shared_fleet.client.engine("engine_999")
    assert missing.value.status == 404 and missing.value.code == "unknown_engine"
    assert "GET /rollout/engines" in str(missing.value)


def test_engines_answer_directly(shared_fleet: ManagerHandle) -> None:
    for engine in shared_fleet.engines().engines:
        result = http("GET", f"{engine.url}/health")
        assert result.status == 200, f"{engine.engine_id} /health -> {result.status}"


def test_generate_through_router(shared_fleet: ManagerHandle) -> None:
    answer = generate(shared_fleet.router_url)
    assert isinstance(answer["text"], str)
    output_ids = answer["output_ids"]
    assert isinstance(output_ids, list) and all(isinstance(t, int) for t in output_ids)
    meta = answer["meta_info"]
    assert isinstance(meta, dict), answer
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version"):
        assert key in meta, f"meta_info lacks {key}: {meta}"
    assert 0 < meta["completion_tokens"] <= 8
    assert meta["completion_tokens"] == len(output_ids)
    assert meta["weight_version"] == "default"


def test_generate_streaming_ends_with_done(shared_fleet: ManagerHandle) -> None:
    events = list(sse_events(f"{shared_fleet.router_url}/generate", {**GENERATE_BODY, "stream": True}))
    assert events, "no SSE events"
    assert events[-1] == "[DONE]", f"stream did not end with [DONE]: {events[-3:]}"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks, "no data chunk before [DONE]"
    for chunk in chunks:
        assert "error" not in chunk, chunk
        assert isinstance(chunk["text"], str) and "meta_info" in chunk, chunk
    assert chunks[-1]["meta_info"]["finish_reason"] is not None, chunks[-1]


def test_router_model_routes(shared_fleet: ManagerHandle) -> None:
    info = http("GET", f"{shared_fleet.router_url}/model_info")
    assert info.status == 200, info
    assert "model_path" in info.json() and "weight_version" in info.json(), info.json()
    models = http("GET", f"{shared_fleet.router_url}/v1/models")
    assert models.status == 200, models
    assert models.json()["object"] == "list" and models.json()["data"], models.json()


def test_requests_are_spread_over_both_engines(shared_fleet: ManagerHandle) -> None:
    engines = shared_fleet.engines().engines
    before = engine_request_counts(engines)
    sent = 20
    for i in range(sent):
        generate(shared_fleet.router_url, {"text": f"prompt {i}", "sampling_params": {"max_new_tokens": 2}})
    after = engine_request_counts(engines)
    served = {engine_id: after[engine_id] - before[engine_id] for engine_id in after}
    assert sum(served.values()) >= sent, f"engines counted fewer requests than sent: {served}"
    assert all(count >= sent // 4 for count in served.values()), f"requests not spread: {served}"


# -- errors (shared: none of these change the fleet) ------------------------------------------


def test_scale_in_below_initial_is_400(shared_fleet: ManagerHandle) -> None:
    result = http("POST", f"{shared_fleet.control_url}/rollout/scale_in", {"num_replicas": 1})
    assert result.status == 400, f"{result.status}: {result.body!r}"
    assert_error_body(result.body, 400)
    with pytest.raises(RolloutApiError) as caught:
        shared_fleet.client.scale_in(num_replicas=INITIAL_ENGINES - 1)
    assert caught.value.status == 400 and caught.value.code and caught.value.message
    assert len(shared_fleet.engines().with_status("ACTIVE")) == INITIAL_ENGINES


@pytest.mark.parametrize("path", ["/rollout/scale_out", "/rollout/scale_in"])
def test_negative_num_replicas_is_400(shared_fleet: ManagerHandle, path: str) -> None:
    result = http("POST", f"{shared_fleet.control_url}{path}", {"num_replicas": -1})
    assert result.status == 400, f"{result.status}: {result.body!r}"
    assert_error_body(result.body, 400)


@pytest.mark.parametrize("path", ["/rollout/scale_out", "/rollout/scale_in"])
def test_malformed_json_is_400(shared_fleet: ManagerHandle, path: str) -> None:
    result = http("POST", f"{shared_fleet.control_url}{path}", raw_body=b'{"num_replicas": ')
    assert result.status == 400, f"{result.status}: {result.body!r}"
    assert_error_body(result.body, 400)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/rollout/scale_out/no-such-request"),
        ("GET", "/rollout/scale_in/no-such-request"),
        ("POST", "/rollout/scale_out/no-such-request/cancel"),
    ],
)
def test_unknown_request_id_is_404(shared_fleet: ManagerHandle, method: str, path: str) -> None:
    result = http(method, f"{shared_fleet.control_url}{path}", {} if method == "POST" else None)
    assert result.status == 404, f"{method} {path} -> {result.status}: {result.body!r}"
    assert_error_body(result.body, 404)


def test_client_raises_typed_errors(shared_fleet: ManagerHandle) -> None:
    with pytest.raises(RolloutApiError) as not_found:
        shared_fleet.client.scale_out_status("no-such-request")
    assert not_found.value.status == 404 and not_found.value.code
    with pytest.raises(RolloutApiError) as bad:
        shared_fleet.client.scale_out(num_replicas=-1)
    assert bad.value.status == 400 and bad.value.code and bad.value.message
    assert "HTTP 400" in str(bad.value)


def test_scale_out_to_current_size_is_noop(shared_fleet: ManagerHandle) -> None:
    response = shared_fleet.client.scale_out(num_replicas=INITIAL_ENGINES)
    assert response.status == "NOOP" and response.request_id, response.raw
    op = shared_fleet.client.wait_for_operation("scale_out", response.request_id, timeout=10)
    assert op.status == "NOOP"
    listed = {record.request_id for record in shared_fleet.client.scale_out_requests()}
    assert response.request_id in listed


def test_scale_in_dry_run_changes_nothing(shared_fleet: ManagerHandle) -> None:
    before = shared_fleet.engines()
    response = shared_fleet.client.scale_in(num_replicas=INITIAL_ENGINES, dry_run=True)
    assert response.dry_run and response.engines == (), response.raw
    after = shared_fleet.engines()
    assert [(e.engine_id, e.status) for e in after.engines] == [(e.engine_id, e.status) for e in before.engines]


# -- scaling (each test owns its fleet) ---------------------------------------------------------


def scale_out_and_wait(fleet: ManagerHandle, target: int) -> ScaleOperation:
    response = fleet.client.scale_out(num_replicas=target)
    assert response.status == "PENDING" and response.request_id, response.raw
    op = fleet.client.wait_for_operation("scale_out", response.request_id, timeout=SCALE_TIMEOUT)
    assert op.status == "ACTIVE", f"scale_out -> {op.status}: {op.error_message}\n{fleet.stderr_tail()}"
    assert_history_in_order(op, SCALE_OUT_ORDER)
    return op


def test_scale_out_noop_and_scale_in_lifo(fleet: ManagerHandle) -> None:
    initial = {e.engine_id for e in fleet.engines().engines}

    first = scale_out_and_wait(fleet, 3)
    assert len(first.engine_ids) == 1 and first.num_replicas == 3, first.raw
    second = scale_out_and_wait(fleet, 4)
    assert len(second.engine_ids) == 1, second.raw
    view = fleet.wait_engines(4)
    engines = view.engines
    assert view.total_engines == 4
    assert_disjoint_gpus(engines)
    assert len({e.pid for e in engines}) == 4
    dynamic = {e.engine_id for e in engines if e.origin == "dynamic"}
    assert dynamic == {*first.engine_ids, *second.engine_ids}
    assert initial | dynamic == {e.engine_id for e in engines}

    # the new engines take traffic too
    before = engine_request_counts(engines)
    for i in range(16):
        generate(fleet.router_url, {"text": f"after scale-out {i}", "sampling_params": {"max_new_tokens": 2}})
    after = engine_request_counts(engines)
    assert all(after[e] > before[e] for e in dynamic), f"new engines got no traffic: {before} -> {after}"

    noop = fleet.client.scale_out(num_replicas=4)
    assert noop.status == "NOOP" and noop.request_id, noop.raw

    # LIFO: the newest dynamic engine goes first; dry runs change nothing
    newest = fleet.client.scale_in(num_replicas=3, dry_run=True)
    assert newest.dry_run and [e.engine_id for e in newest.engines] == list(second.engine_ids), newest.raw
    both = fleet.client.scale_in(num_replicas=2, dry_run=True)
    assert {e.engine_id for e in both.engines} == dynamic, both.raw
    assert len(fleet.engines().with_status("ACTIVE")) == 4

    removed_pids = {e.engine_id: e.pid for e in engines if e.engine_id in dynamic}
    response = fleet.client.scale_in(num_replicas=2)
    assert response.request_id and response.status in ("PENDING", "DRAINING"), response.raw
    op = fleet.client.wait_for_operation("scale_in", response.request_id, timeout=SCALE_TIMEOUT)
    assert op.status == "COMPLETED", f"scale_in -> {op.status}: {op.error_message}\n{fleet.stderr_tail()}"
    assert_history_in_order(op, SCALE_IN_ORDER)

    wait_until(
        lambda: {e.engine_id for e in fleet.engines().engines} == initial,
        10,
        lambda: f"only the initial engines to remain; have {[e.engine_id for e in fleet.engines().engines]}",
    )
    remaining = fleet.engines()
    assert remaining.total_engines == INITIAL_ENGINES
    assert all(e.status == "ACTIVE" for e in remaining.engines)
    identities = [fleet.engine_processes[pid] for pid in removed_pids.values() if pid in fleet.engine_processes]
    assert len(identities) == 2
    wait_until(lambda: not any(i.alive() for i in identities), 10, f"removed engines {removed_pids} to exit")
    generate(fleet.router_url)

    # initial engines are protected from scale-in by URL too
    with pytest.raises(RolloutApiError) as protected:
        fleet.client.scale_in(engine_urls=[remaining.engines[0].url])
    assert protected.value.status == 400, protected.value
    assert len(fleet.engines().with_status("ACTIVE")) == INITIAL_ENGINES


def test_scale_out_two_at_once_then_scale_in_by_url(fleet: ManagerHandle) -> None:
    added = scale_out_and_wait(fleet, 4)
    assert len(added.engine_ids) == 2 and added.num_replicas == 4, added.raw
    view = fleet.wait_engines(4)
    assert_disjoint_gpus(view.engines)
    assert len({e.url for e in view.engines}) == len({e.pid for e in view.engines}) == 4
    victim = view.by_id(added.engine_ids[0])
    assert victim is not None and victim.origin == "dynamic" and victim.pid is not None, victim
    identity = fleet.engine_processes[victim.pid]

    response = fleet.client.scale_in(engine_urls=[victim.url])
    assert response.request_id, response.raw
    op = fleet.client.wait_for_operation("scale_in", response.request_id, timeout=SCALE_TIMEOUT)
    assert op.status == "COMPLETED", f"{op.status}: {op.error_message}\n{fleet.stderr_tail()}"
    assert op.engine_ids == (victim.engine_id,), op.raw
    wait_until(lambda: fleet.engines().by_id(victim.engine_id) is None, 10, f"{victim.engine_id} to leave the list")
    wait_until(lambda: not identity.alive(), 10, f"{victim.engine_id} (pid {victim.pid}) to exit")
    remaining = fleet.engines()
    assert remaining.total_engines == 3 and len(remaining.with_status("ACTIVE")) == 3, remaining.engines


def test_cancel_scale_out_stops_its_engines(start_fleet: StartManager) -> None:
    fleet = start_fleet("--engine-arg=--startup-delay=1")
    response = fleet.client.scale_out(num_replicas=3)
    assert response.status == "PENDING" and response.request_id, response.raw
    wait_until(
        lambda: any(e.origin == "dynamic" and e.pid for e in fleet.engines().engines),
        10,
        "the new engine's process to start (so that it is recorded, and cancelled mid-creation)",
    )
    fleet.track_children()
    cancelled = fleet.client.cancel_scale_out(response.request_id)
    assert cancelled.get("request_id") == response.request_id, cancelled
    op = fleet.client.wait_for_operation("scale_out", response.request_id, timeout=SCALE_TIMEOUT)
    assert op.status == "CANCELLED", f"{op.status}: {op.raw}\n{fleet.stderr_tail()}"
    initial_ids = {e.engine_id for e in fleet.engines().engines if e.origin == "initial"}
    wait_until(
        lambda: {e.engine_id for e in fleet.engines().engines} == initial_ids,
        10,
        lambda: (
            f"the cancelled engines to be removed; have {[(e.engine_id, e.status) for e in fleet.engines().engines]}"
        ),
    )
    fleet.track_children()
    wait_until(
        lambda: len(fleet.surviving_engines()) == INITIAL_ENGINES,
        10,
        lambda: f"only the initial engines' processes to remain; alive {fleet.surviving_engines()}",
    )
    with pytest.raises(RolloutApiError) as finished:
        fleet.client.cancel_scale_out(response.request_id)
    assert finished.value.status == 409, finished.value
    # the lock is free again
    again = fleet.client.scale_out(num_replicas=3)
    assert again.status == "PENDING", again.raw
    assert fleet.client.wait_for_operation("scale_out", str(again.request_id), timeout=SCALE_TIMEOUT).status == "ACTIVE"


def test_concurrent_scale_operations_conflict(start_fleet: StartManager) -> None:
    fleet = start_fleet("--engine-arg=--startup-delay=1")
    accepted = fleet.client.scale_out(num_replicas=3)
    assert accepted.status == "PENDING" and accepted.request_id, accepted.raw

    attempts: list[Callable[[], object]] = [
        lambda: fleet.client.scale_out(num_replicas=4),
        lambda: fleet.client.scale_in(num_replicas=2),
    ]
    for attempt in attempts:
        with pytest.raises(RolloutApiError) as conflict:
            attempt()
        assert conflict.value.status == 409, conflict.value
        assert accepted.request_id in conflict.value.message, f"409 does not name the running op: {conflict.value}"

    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, timeout=SCALE_TIMEOUT)
    assert op.status == "ACTIVE", f"{op.status}: {op.error_message}\n{fleet.stderr_tail()}"

    # a burst of simultaneous requests: one wins, the rest get 409 (or NOOP once the winner's
    # in-flight engine meets their target); the fleet is never over-provisioned
    outcomes: list[str] = []
    accepted_ids: list[str] = []
    barrier = threading.Barrier(4)

    def fire() -> None:
        barrier.wait(timeout=10)
        try:
            response = fleet.client.scale_out(num_replicas=4)
        except RolloutApiError as err:
            outcomes.append(str(err.status))
            return
        outcomes.append(str(response.status))
        if response.status == "PENDING" and response.request_id:
            accepted_ids.append(response.request_id)

    threads = [threading.Thread(target=fire) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(outcomes) == 4 and outcomes.count("PENDING") == 1, f"burst outcomes: {outcomes}"
    assert set(outcomes) <= {"PENDING", "409", "NOOP"}, f"burst outcomes: {outcomes}"
    winner = fleet.client.wait_for_operation("scale_out", accepted_ids[0], timeout=SCALE_TIMEOUT)
    assert winner.status == "ACTIVE", winner.raw
    assert fleet.engines().total_engines == 4


def test_killed_engine_is_reported_failed(start_fleet: StartManager) -> None:
    fleet = start_fleet("--health-check-interval-secs", "1", "--restart-failed-engines", "false")
    victim, survivor = fleet.engines().engines
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)

    def victim_failed() -> Engine | None:
        engine = fleet.engines().by_id(victim.engine_id)
        return engine if engine is not None and engine.status == "FAILED" and not engine.is_healthy else None

    failed = wait_until(
        victim_failed, 20, lambda: f"{victim.engine_id} to be FAILED; engines: {fleet.engines().engines}"
    )
    assert failed.last_error is not None and "signal 9" in failed.last_error, failed
    assert fleet.engines().by_id(survivor.engine_id) is not None
    # The router keeps serving from the survivor only.
    for _ in range(4):
        response = generate(fleet.router_url)
        assert response["meta_info"]["weight_version"] == "default"
    assert fleet.engines().by_id(victim.engine_id).status == "FAILED"  # type: ignore[union-attr]


def test_killed_engine_is_restarted_with_fleet_weights(start_fleet: StartManager) -> None:
    fleet = start_fleet("--health-check-interval-secs", "1")
    victim = fleet.engines().engines[0]
    assert victim.pid is not None
    fleet.track_children()
    os.kill(victim.pid, signal.SIGKILL)

    def recovered() -> Engine | None:
        engine = fleet.engines().by_id(victim.engine_id)
        ok = engine is not None and engine.status == "ACTIVE" and engine.restarts == 1 and engine.pid != victim.pid
        return engine if ok else None

    engine = wait_until(
        recovered, 30, lambda: f"{victim.engine_id} to be restarted; engines: {fleet.engines().engines}"
    )
    assert engine.gpu_ids == victim.gpu_ids
    assert engine.weight_version == "default"
    assert engine.origin == "initial"
    fleet.track_children()
    fleet.wait_engines(INITIAL_ENGINES)


# -- process lifecycle ---------------------------------------------------------------------


def test_manager_sigterm_stops_every_engine(fleet: ManagerHandle) -> None:
    fleet.engines()
    fleet.track_children()
    assert len(fleet.engine_processes) >= INITIAL_ENGINES
    fleet.process.send_signal(signal.SIGTERM)
    assert fleet.process.wait(timeout=30) == 0, f"exit code {fleet.process.returncode}\n{fleet.stderr_tail()}"
    wait_until(lambda: not fleet.surviving_engines(), 10, lambda: f"engines to exit: {fleet.surviving_engines()}")


def test_manager_sigkill_takes_engines_down(fleet: ManagerHandle) -> None:
    fleet.engines()
    fleet.track_children()
    assert len(fleet.engine_processes) >= INITIAL_ENGINES
    fleet.process.kill()
    fleet.process.wait(timeout=10)
    wait_until(
        lambda: not fleet.surviving_engines(),
        15,
        lambda: f"engines to die with the manager (PR_SET_PDEATHSIG): alive {fleet.surviving_engines()}",
    )


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (
            ["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "3", "--gpus", "4"],
            "--rollout-num-gpus-per-engine",
        ),
        (["--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "1", "--gpus", "4"], "--gpus"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--port", "not-a-port"], "--port"),
    ],
)
def test_bad_flag_exits_nonzero_naming_it(manager_bin: Path, tmp_path: Path, args: list[str], flag: str) -> None:
    ports = [] if "--port" in args else ["--port", "0", "--router-port", "0"]
    argv = [str(manager_bin), "serve", *ports, "--state-dir", str(tmp_path), *args]
    try:
        result = subprocess.run(argv, check=False, capture_output=True, timeout=15, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"manager kept running with bad flags {args}: {err.stderr!r}") from None
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode != 0, f"exit 0 with {args}; stderr: {stderr}"
    assert flag in stderr, f"stderr does not name {flag}: {stderr}"
