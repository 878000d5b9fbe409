"""The control API on a Unix socket (``--api-socket``) and the placements API of ``--placement ray``.

The placement tests play the Ray shim by hand: they read ``/rollout/placements``, start real
``rollout-manager agent`` processes on loopback and bind them, so no Ray is needed.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _support import HttpResult, StartManager


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def unix_http(
    path: Path, method: str, target: str, body: Any = None, headers: dict[str, str] | None = None
) -> HttpResult:
    """One HTTP request over a Unix socket."""
    conn = _UnixConnection(str(path), timeout=30.0)
    try:
        data = None if body is None else json.dumps(body).encode()
        hdrs = {**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
        conn.request(method, target, body=data, headers=hdrs)
        resp = conn.getresponse()
        return HttpResult(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short private directory: Unix socket paths are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="er-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_api_socket_is_private_and_serves_the_api_with_the_same_auth(
    start_fleet: StartManager, tmp_path: Path, short_dir: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("sock-s3cret\n")
    token.chmod(0o600)
    sock = short_dir / "api.sock"
    fleet = start_fleet("--api-socket", str(sock), "--api-token-file", str(token))
    mode = sock.stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600, oct(stat.S_IMODE(mode))
    engines = unix_http(sock, "GET", "/rollout/engines")
    assert engines.status == 200
    assert engines.json()["total_engines"] == 2
    assert unix_http(sock, "GET", "/metrics").status == 200
    assert unix_http(sock, "GET", "/autoscaler/status").status == 200
    # Mutations need the token here exactly as on the TCP port.
    denied = unix_http(sock, "POST", "/rollout/scale_out", {"num_replicas": 2})
    assert denied.status == 401 and denied.json()["error"]["code"] == "unauthorized"
    ok = unix_http(sock, "POST", "/rollout/scale_out", {"num_replicas": 2}, {"Authorization": "Bearer sock-s3cret"})
    assert ok.status == 200 and ok.json()["status"] == "NOOP"
    assert unix_http(sock, "GET", "/rollout/nope").status == 404
    assert fleet.process.poll() is None


def test_stale_socket_is_replaced_and_a_live_one_is_refused(
    start_fleet: StartManager, manager_bin: Path, tmp_path: Path, short_dir: Path
) -> None:
    sock = short_dir / "api.sock"
    # A socket file whose listener is gone, as a killed manager leaves it.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))
    stale.close()
    assert sock.exists()
    fleet = start_fleet("--api-socket", str(sock))
    assert unix_http(sock, "GET", "/rollout/engines").status == 200
    # A second manager must not steal the socket of a live one.
    argv = [
        str(manager_bin), "serve", "--port", "0", "--router-port", "0",
        "--state-dir", str(tmp_path / "second"), "--api-socket", str(sock),
    ]  # fmt: skip
    second = subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL, check=False)
    assert second.returncode != 0
    assert "--api-socket" in second.stderr.decode() and "listening" in second.stderr.decode()
    assert unix_http(sock, "GET", "/rollout/engines").status == 200
    # A path that is not a socket is never deleted.
    plain = short_dir / "plain"
    plain.write_text("keep me")
    argv[argv.index(str(sock))] = str(plain)
    third = subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL, check=False)
    assert third.returncode != 0 and "not a socket" in third.stderr.decode()
    assert plain.read_text() == "keep me"
    assert fleet.process.poll() is None
    # The manager removes its socket when it stops.
    os.kill(fleet.process.pid, 15)
    fleet.process.wait(timeout=30)
    assert not sock.exists()
