"""Client and binary-finder behaviour that needs no manager: canned answers from a loopback server."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from elastic_rollout import (
    BinaryNotFoundError,
    EnginesView,
    RolloutApiError,
    RolloutClient,
    ScaleOperation,
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
