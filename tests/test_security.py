"""Security measures that docs/security.md promises: the allow-list of external engine networks,
the warnings when something listens beyond loopback, private keeper sockets, and no secret in
the manager's log even at the most verbose level."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _support import (
    STARTUP_TIMEOUT,
    ManagerHandle,
    StartManager,
    file_tail,
    freshest_build,
    health_ok,
    http,
    wait_until,
)

from elastic_rollout import RolloutApiError
from elastic_rollout._find import find_binary


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@pytest.fixture
def sim_on(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """Starts a standalone sglang-sim on a given loopback address (someone else's engine)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(host: str) -> str:
        port = free_port(host)
        log = open(tmp_path / f"sim-{host}-{port}.log", "ab")
        argv = [
            str(freshest_build(find_binary("sglang-sim"))),
            "--model-path",
            "sim-model",
            "--host",
            host,
            "--port",
            str(port),
            "--time-scale",
            "0.01",
        ]
        started.append(subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL))
        url = f"http://{host}:{port}"

        wait_until(lambda: health_ok(url, timeout=5), 30, f"sglang-sim on {url}")
        return url

    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=10)


def test_external_engines_only_from_allowed_networks(start_fleet: StartManager, sim_on: Callable[[str], str]) -> None:
    fleet = start_fleet("--external-allow-cidr", "127.0.0.2/32", "--external-allow-cidr", "fd00::/8")
    allowed = sim_on("127.0.0.2")
    refused_port = free_port()
    for url, shown in [
        (f"http://127.0.0.1:{refused_port}", "127.0.0.1"),
        (f"http://localhost:{refused_port}", "127.0.0.1"),  # a name: every address it resolves to
        (f"http://[::ffff:127.0.0.1]:{refused_port}", "127.0.0.1"),  # IPv4-mapped IPv6 is IPv4
        ("http://10.0.0.7:30000", "10.0.0.7"),
    ]:
        with pytest.raises(RolloutApiError) as err:
            fleet.client.scale_out(engine_urls=[url])
        assert err.value.status == 400, url
        assert err.value.code == "engine_url_not_allowed", (url, err.value.message)
        assert shown in err.value.message and "127.0.0.2/32" in err.value.message, err.value.message
    # Malformed URLs are still refused for what they are.
    with pytest.raises(RolloutApiError) as err:
        fleet.client.scale_out(engine_urls=["http://user:pw@127.0.0.2:1"])
    assert err.value.code == "invalid_engine_url"
    # Nothing was attached, and an engine inside the allowed network is.
    assert fleet.engines().total_engines == 2
    op = fleet.client.wait_for_operation(
        "scale_out", fleet.client.scale_out(engine_urls=[allowed]).request_id, timeout=STARTUP_TIMEOUT
    )
    assert op.status == "ACTIVE", op.raw
    assert allowed in {e.url for e in fleet.engines().engines}


def test_bad_allow_list_is_refused_naming_the_flag(manager_bin: Path, tmp_path: Path) -> None:
    argv = [str(manager_bin), "serve", "--port", "0", "--router-port", "0", "--state-dir", str(tmp_path),
            "--external-allow-cidr", "10.0.0.0/33"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, timeout=20, stdin=subprocess.DEVNULL, check=False)
    assert result.returncode == 2
    assert "--external-allow-cidr" in result.stderr.decode(), result.stderr


def test_warnings_when_listening_beyond_loopback(start_fleet: StartManager, tmp_path: Path) -> None:
    exposed = start_fleet("--host", "0.0.0.0", "--engine-host", "0.0.0.0", "--rollout-num-gpus", "0", wait=False)
    wait_until(lambda: "beyond loopback" in exposed.stderr_tail(), 20, lambda: f"the warnings; {exposed.stderr_tail()}")
    text = exposed.stderr_tail(100_000)
    assert "the control API listens beyond loopback without a token" in text
    assert "engines listen beyond loopback" in text
    # With a token the control API warning goes; loopback engines give no engine warning.
    token = tmp_path / "token"
    token.write_text("t0ken-value\n")
    token.chmod(0o600)
    guarded = start_fleet("--host", "0.0.0.0", "--api-token-file", str(token), "--rollout-num-gpus", "0", wait=False)
    wait_until(lambda: "listening" in guarded.stdout_path.read_text(), 20, "the guarded manager to listen")
    assert "beyond loopback" not in guarded.stderr_tail(100_000), guarded.stderr_tail()
    quiet = start_fleet("--rollout-num-gpus", "0", wait=False)
    wait_until(lambda: "listening" in quiet.stdout_path.read_text(), 20, "the loopback manager to listen")
    assert "beyond loopback" not in quiet.stderr_tail(100_000)


def keeper_sockets() -> list[Path]:
    """Sockets named on the command lines of running keepers."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"keeper" in argv and b"--socket" in argv:
            found.append(Path(argv[argv.index(b"--socket") + 1].decode()))
    return found


def test_keeper_sockets_are_private(start_fleet: StartManager) -> None:
    fleet = start_fleet("--reattach-grace-secs", "5")
    pids = {e.pid for e in fleet.engines().engines}
    sockets = [s for s in keeper_sockets() if s.exists()]
    ours = [s for s in sockets if s.parent.name.startswith("rollout-")]
    assert len(ours) >= 2, (sockets, pids)
    for sock in ours:
        mode = sock.stat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600, (sock, oct(mode))
        parent = sock.parent.stat()
        assert stat.S_IMODE(parent.st_mode) == 0o700 and parent.st_uid == os.geteuid(), (
            sock.parent,
            oct(parent.st_mode),
        )


def test_secrets_never_reach_the_log(start_fleet: StartManager, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("tok-9f8e7d6c5b4a\n")
    token.chmod(0o600)
    os.environ["RUST_LOG"] = "trace"
    try:
        fleet = start_fleet("--api-token-file", str(token), "--engine-arg=--admin-api-key=adm-1a2b3c4d5e")
    finally:
        del os.environ["RUST_LOG"]
    # Requests that carry the token, a wrong token, and secrets in bodies and query strings.
    auth = {"Authorization": "Bearer tok-9f8e7d6c5b4a"}
    assert http("POST", f"{fleet.control_url}/rollout/scale_out", {"num_replicas": 2}, headers=auth).status == 200
    wrong = {"Authorization": "Bearer wrong-7x7x7x7x"}
    assert http("POST", f"{fleet.control_url}/rollout/scale_in", {"num_replicas": 2}, headers=wrong).status == 401
    assert http("POST", f"{fleet.router_url}/abort_request", {"rid": "x"}, headers=wrong).status == 401
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    assert http("POST", f"{fleet.router_url}/generate", body, headers=auth).status == 200
    log = file_tail(fleet.stderr_path, 50_000_000)
    assert "TRACE" in log or "DEBUG" in log, "RUST_LOG=trace did not take effect"
    for secret in ("tok-9f8e7d6c5b4a", "wrong-7x7x7x7x", "adm-1a2b3c4d5e"):
        assert secret not in log, f"{secret} found in the manager's log"
    assert "--admin-api-key=<redacted>" in log


def test_a_refused_request_is_answered_after_its_body_and_keeps_the_connection(
    start_fleet: StartManager, tmp_path: Path
) -> None:
    """A client that sends its headers, then its body (as Python's http.client does), gets its
    401 (no token) or 404 (no such route) and can send its next request on the same connection:
    the manager reads the small body before answering instead of closing under the client
    (which, on the Unix API socket, turned the answer into a broken pipe)."""
    token = tmp_path / "token"
    token.write_text("tok-linger\n")
    token.chmod(0o600)
    fleet = start_fleet("--api-token-file", str(token))
    host, port = fleet.control_url.removeprefix("http://").rsplit(":", 1)
    body = b'{"num_replicas": 2}'
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        reader = conn.makefile("rb")
        cases = (("/rollout/scale_out", "", 401, b"unauthorized"),
                 ("/rollout/nope", "Authorization: Bearer tok-linger\r\n", 404, b"no_such_route"))  # fmt: skip
        for path, auth, status, code in cases:
            conn.sendall(
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
            )
            time.sleep(0.3)  # the body comes in a second write, after the headers were read
            conn.sendall(body)
            answer = read_response(reader)
            assert answer[0] == status and code in answer[1], (path, answer)
        conn.sendall(f"GET /rollout/engines HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        last = read_response(reader)
        assert last[0] == 200 and b"total_engines" in last[1], last
    # The router's fan-out calls need the token too, and are answered the same way.
    host, port = fleet.router_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        reader = conn.makefile("rb")
        conn.sendall(
            f"POST /abort_request HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        time.sleep(0.3)
        conn.sendall(body)
        answer = read_response(reader)
        assert answer[0] == 401 and b"unauthorized" in answer[1], answer
        conn.sendall(f"GET /readiness HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        last = read_response(reader)
        assert last[0] == 200 and b"routable_engines" in last[1], last


def read_response(reader: Any) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length body, read from a socket file."""
    status_line = reader.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return int(status_line.split()[1]), reader.read(length)


def test_the_manager_token_is_not_forwarded_to_engines(start_fleet: StartManager, tmp_path: Path) -> None:
    from _hostile import HostileEngine

    token = tmp_path / "token"
    token.write_text("tok-for-the-manager\n")
    token.chmod(0o600)
    fleet = start_fleet("--api-token-file", str(token), "--routing-policy", "round_robin")
    engine = HostileEngine()
    try:
        auth = {"Authorization": "Bearer tok-for-the-manager"}
        accepted = http("POST", f"{fleet.control_url}/rollout/scale_out", {"engine_urls": [engine.url]}, headers=auth)
        op = fleet.client.wait_for_operation("scale_out", accepted.json()["request_id"], timeout=STARTUP_TIMEOUT)
        assert op.status == "ACTIVE", op.raw
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
        # A client that sends the manager's token (e.g. one client for both ports), and one that
        # sends an engine's own key: the first never reaches the engine, the second does.
        for headers in (auth, {"Authorization": "Bearer engine-own-key"}):
            wait_until(
                lambda h=headers: (
                    http("POST", f"{fleet.router_url}/generate", body, headers=h).headers.get("x-rollout-engine-id")
                    == op.raw["engine_ids"][0]
                ),
                30,
                "a request routed to the external engine",
            )
        # (An abort of a rid the router does not know reaches no engine: abort_all does.)
        assert http("POST", f"{fleet.router_url}/abort_request", {"abort_all": True}, headers=auth).status == 200
        assert engine.hits["/abort_request"] >= 1
        assert "Bearer tok-for-the-manager" not in engine.authorizations
        assert "Bearer engine-own-key" in engine.authorizations
    finally:
        engine.close()


def test_request_bodies_are_limited_everywhere(shared_fleet: ManagerHandle) -> None:
    fleet = shared_fleet
    big = b'{"num_replicas": 2, "x": "' + b"y" * (3 * 1024 * 1024) + b'"}'
    for path in (
        "/rollout/scale_out",
        "/rollout/scale_in",
        "/rollout/scale_out_cancel",
        "/autoscaler/enable",
        "/rollout/pipeline",
    ):
        resp = http("POST", f"{fleet.control_url}{path}", raw_body=big)
        assert resp.status == 413, (path, resp.status, resp.body[:200])
        assert resp.json()["error"]["code"] == "body_too_large", (path, resp.body[:200])
    # The body over the limit is still read to its end before the 413, so a client still writing
    # it gets the answer (not a broken pipe) and keeps its connection: here the body comes in two
    # writes, the second after the server has seen it is over the limit.
    host, port = fleet.control_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        reader = conn.makefile("rb")
        conn.sendall(
            f"POST /rollout/scale_out HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(big)}\r\n\r\n".encode()
        )
        conn.sendall(big[: 2 * 1024 * 1024 + 4096])
        time.sleep(0.3)
        conn.sendall(big[2 * 1024 * 1024 + 4096 :])
        status, answer = read_response(reader)
        assert status == 413 and b"body_too_large" in answer, (status, answer[:200])
        conn.sendall(f"GET /rollout/engines HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        status, answer = read_response(reader)
        assert status == 200 and b"total_engines" in answer, (status, answer[:200])
    # The router: 1 MiB for fan-out calls, 64 MiB for requests it forwards.
    resp = http("POST", f"{fleet.router_url}/abort_request", raw_body=b"{" + b" " * (2 * 1024 * 1024) + b"}")
    assert resp.status == 413 and resp.json()["error"]["code"] == "body_too_large"
    resp = http("POST", f"{fleet.router_url}/generate", raw_body=b"x" * (65 * 1024 * 1024))
    assert resp.status == 413 and resp.json()["error"]["code"] == "body_too_large"
    # Bodies that are JSON but not objects are refused, not read by position.
    for body in (b"[]", b'["default", 4]', b"4", b'"x"'):
        resp = http("POST", f"{fleet.control_url}/rollout/scale_out", raw_body=body)
        assert resp.status == 400 and resp.json()["error"]["code"] == "invalid_body", (body, resp.body)
    assert fleet.engines().total_engines == 2


def test_slow_header_clients_are_disconnected(start_fleet: StartManager) -> None:
    """A client that never finishes its request headers (slowloris) is cut off on both ports,
    and the manager keeps answering everyone else."""
    fleet = start_fleet("--header-read-timeout-secs", "1")
    for url in (fleet.control_url, fleet.router_url):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and nothing more
            received = b""
            while chunk := s.recv(4096):  # ends when the server closes the connection
                received += chunk
            # Closed without an answer, or with a 408 before closing.
            assert received == b"" or received.startswith(b"HTTP/1.1 408"), (url, received[:200])
        assert http("GET", f"{url}/health").status == 200
