"""Client and binary-finder behaviour that needs no manager: canned answers from a loopback server
or an ``httpx.MockTransport``."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from elastic_rollout import (
    TOKEN_ENV,
    AsyncRolloutClient,
    AutoscalerDecision,
    AutoscalerStatus,
    BinaryNotFoundError,
    EnginesView,
    EngineUpdateProgress,
    EngineWeights,
    PublishResult,
    RolloutApiError,
    RolloutClient,
    RolloutConnectionError,
    RolloutTimeoutError,
    ScaleOperation,
    StepReport,
    WeightsView,
    WeightUpdate,
    find_binary,
)

# -- a canned HTTP server ----------------------------------------------------------------------

Answer = tuple[int, bytes]


@dataclass
class SeenRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class CannedServer:
    """Routes ``(method, path)`` to a function returning ``(status, body)``; records requests."""

    url: str = ""
    routes: dict[tuple[str, str], Callable[[], Answer]] = field(default_factory=dict)
    seen: list[SeenRequest] = field(default_factory=list)

    def answer(self, method: str, path: str, status: int, body: Any) -> None:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.routes[(method, path)] = lambda: (status, payload)

    def sequence(self, method: str, path: str, bodies: list[Any]) -> None:
        """Answer 200 with each body in turn, then keep repeating the last one."""
        remaining = list(bodies)

        def next_answer() -> Answer:
            body = remaining.pop(0) if len(remaining) > 1 else remaining[0]
            return 200, json.dumps(body).encode()

        self.routes[(method, path)] = next_answer


@pytest.fixture
def server() -> Iterator[CannedServer]:
    canned = CannedServer()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            canned.seen.append(
                SeenRequest(self.command, self.path, dict(self.headers), json.loads(raw) if raw else None)
            )
            route = canned.routes.get((self.command, self.path))
            status, payload = route() if route else (404, b'{"error":{"code":"not_found","message":"no route"}}')
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    canned.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield canned
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def op_record(status: str, request_id: str = "op-1", **extra: Any) -> dict[str, Any]:
    return {"request_id": request_id, "status": status, "model_name": "default", **extra}


# -- errors ------------------------------------------------------------------------------------


def test_api_error_parsed_from_error_model(server: CannedServer) -> None:
    server.answer("POST", "/rollout/scale_in", 400, {"error": {"code": "below_initial", "message": "keep at least 2"}})
    with pytest.raises(RolloutApiError) as caught:
        RolloutClient(server.url).scale_in(num_replicas=1)
    assert (caught.value.status, caught.value.code, caught.value.message) == (400, "below_initial", "keep at least 2")
    assert "400" in str(caught.value) and "keep at least 2" in str(caught.value)


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        (b"upstream exploded", "http_500", "upstream exploded"),
        (b"", "http_500", "HTTP 500"),
        (b'{"detail": "x"}', "http_500", '{"detail": "x"}'),
        (b'{"error": "plain string"}', "http_500", "plain string"),
    ],
)
def test_api_error_tolerates_other_bodies(server: CannedServer, body: bytes, code: str, message: str) -> None:
    server.answer("GET", "/rollout/engines", 500, body)
    with pytest.raises(RolloutApiError) as caught:
        RolloutClient(server.url).engines()
    assert (caught.value.status, caught.value.code, caught.value.message) == (500, code, message)


def test_unknown_route_is_404_error(server: CannedServer) -> None:
    with pytest.raises(RolloutApiError) as caught:
        RolloutClient(server.url).scale_out_status("nope")
    assert caught.value.status == 404 and caught.value.code == "not_found"


# -- requests --------------------------------------------------------------------------------


def test_token_and_json_bodies(server: CannedServer) -> None:
    server.answer("POST", "/rollout/scale_out", 200, {"request_id": "r1", "status": "PENDING", "message": "ok"})
    server.answer("POST", "/rollout/scale_in", 200, {"request_id": "r2", "status": "PENDING", "message": "ok"})
    client = RolloutClient(server.url + "/", token="s3cret")
    out = client.scale_out(num_replicas=4)
    assert (out.request_id, out.status, out.message, out.dry_run) == ("r1", "PENDING", "ok", False)
    client.scale_out(engine_urls=["http://10.0.0.1:30000"], timeout_secs=5)
    client.scale_in(num_replicas=2, force=True)
    first, second, third = server.seen
    assert first.headers["Authorization"] == "Bearer s3cret"
    assert first.headers["Content-Type"] == "application/json"
    assert first.body == {"model_name": "default", "num_replicas": 4}
    assert second.body == {"model_name": "default", "engine_urls": ["http://10.0.0.1:30000"], "timeout_secs": 5}
    assert third.body == {"model_name": "default", "num_replicas": 2, "force": True, "dry_run": False}


def test_no_token_no_authorization_header(server: CannedServer) -> None:
    server.answer("GET", "/health", 200, {"status": "ok"})
    assert RolloutClient(server.url).health() == {"status": "ok"}
    assert "Authorization" not in server.seen[0].headers


def test_request_id_is_quoted(server: CannedServer) -> None:
    server.answer("POST", "/rollout/scale_out/a%2Fb/cancel", 200, {"request_id": "a/b", "status": "CANCELLED"})
    assert RolloutClient(server.url).cancel_scale_out("a/b")["status"] == "CANCELLED"


# -- parsing ---------------------------------------------------------------------------------


ENGINES: dict[str, Any] = {
    "models": {
        "default": {
            "engines": [
                {
                    "engine_id": "engine_0", "url": "http://127.0.0.1:1", "status": "ACTIVE", "is_healthy": True,
                    "origin": "initial", "model_name": "default", "weight_version": "default",
                    "gpu_ids": [0], "pid": 11, "started_at": 1.5, "log_path": "/tmp/l0", "future_field": 1,
                },
                {"engine_id": "engine_1", "url": "http://127.0.0.1:2", "status": "CREATING", "is_healthy": False},
            ]
        }
    },
    "total_engines": 2,
}  # fmt: skip


def test_engines_view_parsing() -> None:
    view = EnginesView.from_json(ENGINES)
    assert view.total_engines == 2 and len(view.engines) == 2
    first = view.engines[0]
    assert (first.gpu_ids, first.pid, first.started_at, first.origin) == ((0,), 11, 1.5, "initial")
    assert first.raw["future_field"] == 1
    assert [e.engine_id for e in view.with_status("CREATING")] == ["engine_1"]
    assert view.by_id("engine_1") is not None and view.by_id("engine_9") is None
    assert view.engines[1].pid is None and view.engines[1].gpu_ids == ()


def test_dry_run_response_lists_engines(server: CannedServer) -> None:
    engine = ENGINES["models"]["default"]["engines"][0]
    server.answer("POST", "/rollout/scale_in", 200, {"dry_run": True, "engines": [engine]})
    response = RolloutClient(server.url).scale_in(num_replicas=2, dry_run=True)
    assert response.dry_run and response.request_id is None
    assert [e.engine_id for e in response.engines] == ["engine_0"]
    assert server.seen[0].body["dry_run"] is True


def test_operation_record_parsing() -> None:
    op = ScaleOperation.from_json(
        "scale_out",
        op_record(
            "ACTIVE", num_replicas=4, engine_ids=["engine_2"], created_at=1, updated_at=2,
            history=[{"status": "PENDING", "at": 1}, {"status": "ACTIVE", "at": 2}],
        ),
    )  # fmt: skip
    assert op.is_terminal and op.statuses == ["PENDING", "ACTIVE"] and op.engine_ids == ("engine_2",)
    assert op.num_replicas == 4 and op.error_message is None
    assert not ScaleOperation.from_json("scale_in", op_record("ACTIVE")).is_terminal
    assert ScaleOperation.from_json("scale_in", op_record("COMPLETED")).is_terminal


def test_scale_out_requests_listing(server: CannedServer) -> None:
    server.answer("GET", "/rollout/scale_out", 200, {"requests": [op_record("NOOP"), op_record("ACTIVE", "op-2")]})
    ops = RolloutClient(server.url).scale_out_requests()
    assert [(o.request_id, o.status) for o in ops] == [("op-1", "NOOP"), ("op-2", "ACTIVE")]


# -- waiting ---------------------------------------------------------------------------------


def test_wait_for_operation_returns_terminal_record(server: CannedServer) -> None:
    server.sequence(
        "GET", "/rollout/scale_out/op-1", [op_record("PENDING"), op_record("CREATING"), op_record("ACTIVE")]
    )
    op = RolloutClient(server.url).wait_for_operation("scale_out", "op-1", timeout=10, poll_interval=0.01)
    assert op.status == "ACTIVE"
    assert len(server.seen) == 3


def test_wait_for_operation_returns_failed_without_raising(server: CannedServer) -> None:
    server.sequence("GET", "/rollout/scale_in/op-1", [op_record("FAILED", error_message="boom")])
    op = RolloutClient(server.url).wait_for_operation("scale_in", "op-1", timeout=10, poll_interval=0.01)
    assert (op.status, op.error_message) == ("FAILED", "boom")


def test_wait_for_operation_timeout_names_last_status(server: CannedServer) -> None:
    server.sequence("GET", "/rollout/scale_in/op-1", [op_record("PENDING"), op_record("DRAINING")])
    with pytest.raises(TimeoutError, match="DRAINING"):
        RolloutClient(server.url).wait_for_operation("scale_in", "op-1", timeout=0.2, poll_interval=0.01)


def test_wait_for_operation_rejects_unknown_kind(server: CannedServer) -> None:
    with pytest.raises(ValueError, match="scale_sideways"):
        RolloutClient(server.url).wait_for_operation("scale_sideways", "x", timeout=1)  # type: ignore[arg-type]


def test_wait_for_engines(server: CannedServer) -> None:
    creating = json.loads(json.dumps(ENGINES))
    active = json.loads(json.dumps(ENGINES))
    active["models"]["default"]["engines"][1]["status"] = "ACTIVE"
    server.sequence("GET", "/rollout/engines", [creating, active])
    client = RolloutClient(server.url)
    assert len(client.wait_for_engines(2, timeout=10, poll_interval=0.01).with_status("ACTIVE")) == 2
    with pytest.raises(TimeoutError, match="engine_1=ACTIVE"):
        client.wait_for_engines(3, timeout=0.1, poll_interval=0.01)


# -- find_binary -----------------------------------------------------------------------------


def make_executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No overrides, and a PATH holding only an empty directory."""
    monkeypatch.delenv("ELASTIC_ROLLOUT_MANAGER_BIN", raising=False)
    monkeypatch.delenv("ELASTIC_ROLLOUT_SIM_BIN", raising=False)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    return empty


def test_find_binary_lists_every_place_tried(clean_env: Path, tmp_path: Path) -> None:
    (tmp_path / "repo" / "Cargo.toml").parent.mkdir()
    (tmp_path / "repo" / "Cargo.toml").write_text("[workspace]\n")
    package = tmp_path / "repo" / "python" / "elastic_rollout"
    package.mkdir(parents=True)
    with pytest.raises(BinaryNotFoundError) as caught:
        find_binary("rollout-manager", package_dir=package)
    message = str(caught.value)
    assert isinstance(caught.value, FileNotFoundError)
    for place in (
        "ELASTIC_ROLLOUT_MANAGER_BIN",
        str(package / "bin" / "rollout-manager"),
        str(tmp_path / "repo" / "target" / "release" / "rollout-manager"),
        str(tmp_path / "repo" / "target" / "debug" / "rollout-manager"),
        str(clean_env),
        "cargo build --release -p rollout-manager",
    ):
        assert place in message, f"{place!r} missing from: {message}"


def test_find_binary_without_cargo_tree_says_so(clean_env: Path, tmp_path: Path) -> None:
    with pytest.raises(BinaryNotFoundError, match="ELASTIC_ROLLOUT_SIM_BIN") as caught:
        find_binary("sglang-sim", package_dir=tmp_path / "site-packages" / "elastic_rollout")
    assert "no Cargo.toml" in str(caught.value)
    assert "cargo build --release -p sglang-sim" in str(caught.value)


def test_find_binary_env_override(clean_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = make_executable(tmp_path / "custom" / "rollout-manager")
    monkeypatch.setenv("ELASTIC_ROLLOUT_MANAGER_BIN", str(binary))
    assert find_binary(package_dir=tmp_path) == binary.resolve()


@pytest.mark.parametrize("problem", ["missing", "not-executable", "directory"])
def test_find_binary_bad_env_override_is_an_error(
    clean_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, problem: str
) -> None:
    target = tmp_path / "sglang-sim"
    if problem == "not-executable":
        target.write_text("not a program")
    elif problem == "directory":
        target.mkdir()
    make_executable(clean_env / "sglang-sim")  # on PATH, but the override must win or fail
    monkeypatch.setenv("ELASTIC_ROLLOUT_SIM_BIN", str(target))
    with pytest.raises(BinaryNotFoundError, match="ELASTIC_ROLLOUT_SIM_BIN"):
        find_binary("sglang-sim", package_dir=tmp_path)


def test_find_binary_lookup_order(clean_env: Path, tmp_path: Path) -> None:
    (tmp_path / "Cargo.toml").write_text("[workspace]\n")
    package = tmp_path / "python" / "elastic_rollout"
    on_path = make_executable(clean_env / "rollout-manager")
    assert find_binary(package_dir=package) == on_path
    debug = make_executable(tmp_path / "target" / "debug" / "rollout-manager")
    assert find_binary(package_dir=package) == debug
    release = make_executable(tmp_path / "target" / "release" / "rollout-manager")
    assert find_binary(package_dir=package) == release
    bundled = make_executable(package / "bin" / "rollout-manager")
    assert find_binary(package_dir=package) == bundled


def test_find_binary_skips_non_executable_candidates(clean_env: Path, tmp_path: Path) -> None:
    (tmp_path / "Cargo.toml").write_text("[workspace]\n")
    package = tmp_path / "python" / "elastic_rollout"
    (package / "bin").mkdir(parents=True)
    (package / "bin" / "rollout-manager").write_text("not executable")
    debug = make_executable(tmp_path / "target" / "debug" / "rollout-manager")
    assert find_binary(package_dir=package) == debug
    assert os.access(debug, os.X_OK)


def test_waits_poll_through_a_restarting_manager(server: CannedServer) -> None:
    """While the manager restarts (the Ray ingress answers 503 manager_unreachable), a wait
    keeps polling until its deadline instead of failing on the first refused poll."""
    answers: list[Answer] = [
        (503, json.dumps({"error": {"code": "manager_unreachable", "message": "restarting"}}).encode()),
        (503, json.dumps({"error": {"code": "manager_unreachable", "message": "restarting"}}).encode()),
        (200, json.dumps(op_record("ACTIVE")).encode()),
    ]
    server.routes[("GET", "/rollout/scale_out/op-1")] = lambda: answers.pop(0) if len(answers) > 1 else answers[0]
    op = RolloutClient(server.url).wait_for_operation("scale_out", "op-1", timeout=30, poll_interval=0.01)
    assert op.status == "ACTIVE"
    # Other errors are not swallowed.
    server.answer("GET", "/rollout/scale_out/op-2", 404, {"error": {"code": "unknown_request", "message": "no"}})
    with pytest.raises(RolloutApiError) as err:
        RolloutClient(server.url).wait_for_operation("scale_out", "op-2", timeout=30)
    assert err.value.status == 404


def test_a_wait_on_a_manager_that_never_answers_times_out() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TimeoutError, match="did not answer"):
        RolloutClient(f"http://127.0.0.1:{port}").wait_for_operation(
            "scale_out", "op-1", timeout=0.3, poll_interval=0.05
        )


# -- httpx transport: parsing, errors and the token without a server ----------------------------

WEIGHT_UPDATE: dict[str, Any] = {
    "update_id": "u-1", "version": "v3", "path": "/ckpt/v3", "checksum": "ab" * 32, "engine_path": "/ckpt/v3",
    "previous_version": "v2", "strategy": "rolling", "max_unavailable": 1, "pause_mode": "abort",
    "transport": "disk", "status": "UPDATING",
    "engines": {
        "engine_0": {"status": "VERIFIED", "error": None, "started_at": 1.0, "finished_at": 1.5},
        "engine_1": {"status": "UPDATING", "error": None, "started_at": 1.5, "finished_at": None},
    },
    "created_at": 1.0, "updated_at": 1.5, "finished_at": None, "error_message": None, "message": "publishing v3",
    "history": [{"status": "PENDING", "at": 1.0}, {"status": "UPDATING", "at": 1.0}], "resumed": 0,
    "future_field": {"x": 1},
}  # fmt: skip

WEIGHTS: dict[str, Any] = {
    "version": "v2", "path": "/ckpt/v2", "checksum": "cd" * 32, "source": "publish", "since": 0.5,
    "update_id": "u-0", "strategy": "rolling", "transport": "disk", "update": WEIGHT_UPDATE,
    "engines": [
        {"engine_id": "engine_0", "status": "ACTIVE", "weight_version": "v3", "weights_checksum": "ab" * 32},
        {"engine_id": "engine_1", "status": "WEIGHT_SYNCING", "weight_version": "v2", "weights_checksum": None},
    ],
    "history": [
        {"update_id": "u-1", "version": "v3", "path": "/ckpt/v3", "checksum": "ab" * 32, "strategy": "rolling",
         "status": "UPDATING", "published_at": 1.0, "finished_at": None, "error_message": None, "resumed": 0},
    ],
}  # fmt: skip

STEP_REPORT: dict[str, Any] = {
    "accepted": True, "step": 7, "signal": "pipeline", "trainer_starved": False, "rollout_throttled": False,
    "rollout_short": True,
    "decision": {"action": "scale_out", "delta": 1, "reason": "rollout short",
                 "triggered_conditions": ["rollout_short"], "signal": "pipeline", "at": 2.0},
}  # fmt: skip

AUTOSCALER_STATUS: dict[str, Any] = {
    "enabled": True, "running": True, "config_path": "/etc/as.yaml", "current_engines": 2, "active_engines": 2,
    "starting_engines": 0, "min_engines": 1, "max_engines": 4, "effective_min_engines": 2, "effective_max_engines": 4,
    "last_scale_time": None, "last_scale_action": None, "last_decision": None, "pending_requests": ["r-1"],
    "recent_metrics": None, "signal": None, "next_evaluation_in_secs": 1.5, "expected_time_to_ready_secs": 20.0,
    "config": {"min_engines": 1, "max_engines": 4},
}  # fmt: skip

Handler = Callable[[httpx.Request], httpx.Response]


def mock(handler: Handler, **kwargs: Any) -> RolloutClient:
    return RolloutClient("http://manager", transport=httpx.MockTransport(handler), **kwargs)


def amock(handler: Handler, **kwargs: Any) -> AsyncRolloutClient:
    return AsyncRolloutClient("http://manager", transport=httpx.MockTransport(handler), **kwargs)


def routes(table: dict[tuple[str, str], Any]) -> Handler:
    """A handler answering ``(method, path)`` with ``(status, json)`` or a list of them in turn
    (the last one repeating)."""

    def handle(request: httpx.Request) -> httpx.Response:
        answer = table.get((request.method, request.url.path))
        if answer is None:
            return httpx.Response(404, json={"error": {"code": "no_such_route", "message": request.url.path}})
        if isinstance(answer, list):
            answer = answer.pop(0) if len(answer) > 1 else answer[0]
        status, body = answer
        return httpx.Response(status, json=body)

    return handle


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def test_weights_results_are_typed_and_stay_dicts() -> None:
    client = mock(routes({("GET", "/rollout/weights"): (200, WEIGHTS)}))
    weights = client.weights()
    assert isinstance(weights, WeightsView)
    assert (weights.version, weights.source, weights.since) == ("v2", "publish", 0.5)
    assert weights.engine_versions() == {"engine_0": "v3", "engine_1": "v2"}
    assert weights.engines[1] == EngineWeights("engine_1", "WEIGHT_SYNCING", "v2", None)
    flight = weights.in_flight
    assert flight is not None and flight.update_id == "u-1" and not flight.is_terminal
    assert flight.engines["engine_0"] == EngineUpdateProgress("VERIFIED", None, 1.0, 1.5)
    assert [(u.update_id, u.created_at) for u in weights.history] == [("u-1", 1.0)]
    # The answer as the dict the client returned before: subscripts, get, json, equality.
    assert weights["version"] == "v2" and weights["update"]["update_id"] == "u-1"
    assert json.loads(json.dumps(weights)) == WEIGHTS and weights == WEIGHTS
    with pytest.raises(TypeError, match="read-only"):
        weights["version"] = "v9"
    with pytest.raises(TypeError, match="read-only"):
        weights.update({"version": "v9"})
    assert pickle.loads(pickle.dumps(weights)).in_flight == flight


def test_weight_update_parsing_keeps_unknown_statuses_and_fields() -> None:
    update = WeightUpdate.from_json({**WEIGHT_UPDATE, "status": "VERIFYING_SOMETHING_NEW"})
    assert update.status == "VERIFYING_SOMETHING_NEW" and not update.is_terminal
    assert update.raw["future_field"] == {"x": 1} and update["future_field"] == {"x": 1}
    assert update.statuses == ["PENDING", "UPDATING"] and update.previous_version == "v2"
    assert update.engines["engine_1"].finished_at is None and update.max_unavailable == 1
    failed = WeightUpdate.from_json({**WEIGHT_UPDATE, "status": "FAILED", "error_message": "engine_1: bad shard"})
    assert failed.is_terminal and not failed.succeeded and failed.error_message == "engine_1: bad shard"
    assert "u-1" in repr(update) and "future_field" not in repr(update)


@pytest.mark.parametrize(("status", "accepted"), [(202, True), (200, False)])
def test_publish_accepts_202_and_200(status: int, accepted: bool) -> None:
    answer = {"update_id": "u-1", "status": "CHECKSUMMING", "version": "v3", "checksum": None, "message": "hashing"}
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, json=answer)

    result = mock(handle).publish_weights("v3", "/ckpt/v3", strategy="all_at_once", pause_mode="retract")
    assert isinstance(result, PublishResult)
    assert (result.update_id, result.status, result.checksum, result.accepted) == (
        "u-1",
        "CHECKSUMMING",
        None,
        accepted,
    )
    assert result["update_id"] == "u-1"
    body = json.loads(seen[0].content)
    assert body == {"version": "v3", "path": "/ckpt/v3", "strategy": "all_at_once", "pause_mode": "retract"}


def test_wait_for_weight_update_runs_through_every_non_terminal_status() -> None:
    states = ["CHECKSUMMING", "CHECKSUMMING", "PENDING", "UPDATING", "SOMETHING_NEW", "COMPLETED"]
    answers = [(200, {**WEIGHT_UPDATE, "status": s}) for s in states]
    client = mock(routes({("GET", "/rollout/weights/updates/u-1"): list(answers)}))
    done = client.wait_for_weight_update("u-1", timeout=30, poll_interval=0)
    assert done.status == "COMPLETED" and done.succeeded
    stuck = mock(routes({("GET", "/rollout/weights/updates/u-1"): (200, {**WEIGHT_UPDATE, "status": "CHECKSUMMING"})}))
    with pytest.raises(TimeoutError, match="last status CHECKSUMMING"):
        stuck.wait_for_weight_update("u-1", timeout=0.05, poll_interval=0.01)


def test_step_report_and_autoscaler_status() -> None:
    seen: list[Any] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/rollout/pipeline":
            seen.append(json.loads(request.content))
            return httpx.Response(200, json=STEP_REPORT)
        if request.url.path == "/autoscaler/enable":
            return httpx.Response(200, json={"enabled": False, "message": "autoscaler disabled"})
        return httpx.Response(200, json=AUTOSCALER_STATUS)

    client = mock(handle)
    report = client.report_step(7, 0.5, 0.0, 2.0, rollout_samples=10, next_step_samples=20)
    assert isinstance(report, StepReport) and report.rollout_short and not report.trainer_starved
    assert report.decision == AutoscalerDecision("scale_out", 1, "rollout short", ("rollout_short",), "pipeline", 2.0)
    assert report["rollout_short"] is True  # the dict the client returned before
    assert seen == [
        {"step": 7, "trainer_wait_secs": 0.5, "rollout_throttled_secs": 0.0, "step_secs": 2.0,
         "rollout_samples": 10, "next_step_samples": 20},
    ]  # fmt: skip
    status = client.autoscaler_status()
    assert isinstance(status, AutoscalerStatus) and status.enabled and status.pending_requests == ("r-1",)
    assert (status.effective_min_engines, status.expected_time_to_ready_secs) == (2, 20.0)
    assert status.last_decision is None and status.config["max_engines"] == 4
    assert client.set_autoscaler_enabled(False)["enabled"] is False


def test_error_keeps_body_and_details() -> None:
    body = {"error": {"code": "operation_in_progress", "message": "scale_out r-1 is running", "request_id": "r-1"}}
    client = mock(lambda _r: httpx.Response(409, json=body))
    with pytest.raises(RolloutApiError) as caught:
        client.scale_out(num_replicas=3)
    err = caught.value
    assert (err.status, err.code, err.message) == (409, "operation_in_progress", "scale_out r-1 is running")
    assert err.body == body and err.details["request_id"] == "r-1"
    assert (err.method, err.path) == ("POST", "/rollout/scale_out")
    assert str(err) == "POST /rollout/scale_out -> HTTP 409 operation_in_progress: scale_out r-1 is running"
    assert not isinstance(err, RolloutConnectionError)
    again = pickle.loads(pickle.dumps(err))  # crosses Ray's process boundaries
    assert (type(again), again.status, again.code, again.body) == (RolloutApiError, 409, err.code, body)


@pytest.mark.parametrize(
    ("raised", "kind", "code"),
    [
        (httpx.ConnectError("connection refused"), RolloutConnectionError, "unreachable"),
        (httpx.RemoteProtocolError("server disconnected"), RolloutConnectionError, "unreachable"),
        (httpx.ReadTimeout("timed out"), RolloutTimeoutError, "timeout"),
    ],
)
def test_no_answer_is_a_connection_error_with_status_0(raised: Exception, kind: type[Exception], code: str) -> None:
    def handle(_request: httpx.Request) -> httpx.Response:
        raise raised

    with pytest.raises(kind) as caught:
        mock(handle, token="s3cret").engines()
    err = caught.value
    assert isinstance(err, RolloutApiError) and isinstance(err, ConnectionError) and isinstance(err, OSError)
    assert isinstance(err, TimeoutError) == (kind is RolloutTimeoutError)
    assert (err.status, err.code) == (0, code) and "http://manager" in str(err)
    assert "s3cret" not in str(err) and "s3cret" not in repr(err)


def test_token_from_the_environment_explicit_wins_and_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(401, json={"error": {"code": "unauthorized", "message": "bad token"}})

    monkeypatch.setenv(TOKEN_ENV, " env-s3cret\n")
    from_env, explicit, none = mock(handle), mock(handle, token="arg-s3cret"), mock(handle, token="")
    for client in (from_env, explicit, none):
        with pytest.raises(RolloutApiError) as caught:
            client.scale_in(num_replicas=1)
        assert "s3cret" not in str(caught.value) and "s3cret" not in repr(client)
    assert [r.headers.get("authorization") for r in seen] == ["Bearer env-s3cret", "Bearer arg-s3cret", None]
    assert (
        repr(from_env) == "RolloutClient('http://manager', token=<set>)"
        and repr(none) == "RolloutClient('http://manager')"
    )
    monkeypatch.delenv(TOKEN_ENV)
    assert mock(handle).token is None  # read when the client is made


def test_client_needs_an_address_and_closes() -> None:
    with pytest.raises(ValueError, match="uds="):
        RolloutClient()
    with mock(routes({("GET", "/health"): (200, {"status": "ok"})})) as client:
        assert client.health() == {"status": "ok"}
    with pytest.raises(RuntimeError):  # closed by the with block
        client.health()
    assert repr(RolloutClient(uds="/run/x.sock")) == "RolloutClient(uds='/run/x.sock')"


def test_async_client_same_calls_same_results() -> None:
    polls = [(200, {**WEIGHT_UPDATE, "status": s}) for s in ("CHECKSUMMING", "PENDING", "UPDATING", "COMPLETED")]
    table: dict[tuple[str, str], Any] = {
        ("GET", "/rollout/engines"): (200, ENGINES),
        ("GET", "/rollout/weights"): (200, WEIGHTS),
        ("POST", "/rollout/weights/publish"): (202, {"update_id": "u-1", "status": "PENDING", "version": "v3"}),
        ("GET", "/rollout/weights/updates/u-1"): polls,
        ("POST", "/rollout/pipeline"): (200, STEP_REPORT),
        ("GET", "/rollout/scale_out/op-1"): [(200, op_record("PENDING")), (200, op_record("ACTIVE"))],
        ("POST", "/rollout/scale_in"): (400, {"error": {"code": "below_initial_engines", "message": "keep 2"}}),
    }

    async def main() -> None:
        async with amock(routes(table), token="t0k") as client:
            assert (await client.engines()) == EnginesView.from_json(ENGINES)
            assert (await client.weights()).in_flight is not None
            published = await client.publish_weights("v3", "/ckpt/v3")
            assert published.accepted and published.update_id == "u-1"
            done = await client.wait_for_weight_update("u-1", timeout=30, poll_interval=0)
            assert done.status == "COMPLETED"
            assert (await client.report_step(7, 0.5, 0.0, 2.0)).rollout_short
            op = await client.wait_for_operation("scale_out", "op-1", timeout=30, poll_interval=0)
            assert op.status == "ACTIVE"
            with pytest.raises(RolloutApiError) as caught:
                await client.scale_in(num_replicas=1)
            assert (caught.value.status, caught.value.code) == (400, "below_initial_engines")
            with pytest.raises(ValueError, match="scale_sideways"):
                await client.wait_for_operation("scale_sideways", "x", timeout=1)  # type: ignore[arg-type]

    asyncio.run(main())


def test_async_wait_polls_through_a_restarting_manager_and_times_out() -> None:
    calls = 0

    def handle(_request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, json=op_record("CREATING") if calls < 4 else op_record("ACTIVE"))

    async def main() -> None:
        async with amock(handle) as client:
            op = await client.wait_for_operation("scale_out", "op-1", timeout=30, poll_interval=0)
            assert op.status == "ACTIVE" and calls == 4
            with pytest.raises(TimeoutError, match="did not answer"):
                async with amock(lambda _r: (_ for _ in ()).throw(httpx.ConnectError("refused"))) as down:
                    await down.wait_for_operation("scale_out", "op-1", timeout=0.05, poll_interval=0.01)

    asyncio.run(main())


def test_checkpoint_checksum_is_what_coreutils_prints(tmp_path: Path) -> None:
    """``checkpoint_checksum`` equals ``LC_ALL=C sha256sum -- *.safetensors | sha256sum``, the rule
    the manager, sglang-sim and the relay use (docs/api.md)."""
    import shutil
    import subprocess

    from elastic_rollout import checkpoint_checksum

    if shutil.which("sha256sum") is None:
        pytest.skip("coreutils sha256sum is not installed")
    for name, size in (("model-00002.safetensors", 70_000), ("B.safetensors", 3), ("model-00001.safetensors", 0)):
        (tmp_path / name).write_bytes(bytes(i % 251 for i in range(size)))
    (tmp_path / "config.json").write_text("{}")  # not part of the checksum
    listing = subprocess.run(
        ["sha256sum", "--", *sorted((p.name for p in tmp_path.glob("*.safetensors")), key=str.encode)],
        cwd=tmp_path,
        capture_output=True,
        check=True,
        env={**os.environ, "LC_ALL": "C"},
    ).stdout
    whole = subprocess.run(["sha256sum"], input=listing, capture_output=True, check=True).stdout.split()[0].decode()
    assert checkpoint_checksum(tmp_path) == whole
    with pytest.raises(FileNotFoundError):
        checkpoint_checksum(tmp_path / "nothing-here")
