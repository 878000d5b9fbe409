"""Token authentication of mutating requests (--api-token-file / ROLLOUT_MANAGER_API_TOKEN)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from _support import StartManager, http

from elastic_rollout import RolloutApiError, RolloutClient


def test_mutations_need_the_token(start_fleet: StartManager, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    fleet = start_fleet("--api-token-file", str(token))
    # Reads stay open.
    assert http("GET", f"{fleet.control_url}/rollout/engines").status == 200
    for path, body in [("/rollout/scale_out", {"num_replicas": 2}), ("/rollout/scale_in", {"num_replicas": 2})]:
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"}):
            resp = http("POST", f"{fleet.control_url}{path}", body, headers=headers)
            assert resp.status == 401, (path, headers, resp.status)
            assert resp.json()["error"]["code"] == "unauthorized"
            assert b"s3cret" not in resp.body
    with pytest.raises(RolloutApiError) as err:
        fleet.client.scale_out(num_replicas=2)
    assert err.value.status == 401
    authed = RolloutClient(fleet.control_url, token="s3cret-token")
    assert authed.scale_out(num_replicas=2).status == "NOOP"
    # The router's fan-out routes are guarded too; generation is not.
    assert http("POST", f"{fleet.router_url}/abort_request", {"abort_all": True}).status == 401
    ok = http(
        "POST",
        f"{fleet.router_url}/abort_request",
        {"abort_all": True},
        headers={"Authorization": "Bearer s3cret-token"},
    )
    assert ok.status == 200
    assert (
        http("POST", f"{fleet.router_url}/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}}).status
        == 200
    )
    # The token never reaches the logs or the engines' command lines.
    assert "s3cret" not in fleet.stderr_tail(1_000_000)
    for engine in fleet.engines().engines:
        assert engine.pid is not None
        assert b"s3cret" not in Path(f"/proc/{engine.pid}/cmdline").read_bytes()
        assert b"s3cret" not in Path(f"/proc/{engine.pid}/environ").read_bytes()


def test_token_file_readable_by_others_is_refused(manager_bin: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    token.chmod(0o644)
    argv = [
        str(manager_bin),
        "serve",
        "--port",
        "0",
        "--router-port",
        "0",
        "--state-dir",
        str(tmp_path),
        "--api-token-file",
        str(token),
    ]
    result = subprocess.run(
        argv, capture_output=True, timeout=20, stdin=subprocess.DEVNULL, check=False, env={**os.environ}
    )
    assert result.returncode != 0
    assert "--api-token-file" in result.stderr.decode() and "chmod 600" in result.stderr.decode()


def test_token_from_the_environment_is_not_inherited_by_engines(manager_bin: Path, tmp_path: Path) -> None:
    from _support import start_manager

    os.environ["ROLLOUT_MANAGER_API_TOKEN"] = "env-s3cret"
    try:
        handle = start_manager(manager_bin, tmp_path / "state")
    finally:
        del os.environ["ROLLOUT_MANAGER_API_TOKEN"]
    try:
        view = handle.wait_engines(2)
        assert http("POST", f"{handle.control_url}/rollout/scale_out", {"num_replicas": 2}).status == 401
        for engine in view.engines:
            assert engine.pid is not None
            assert b"env-s3cret" not in Path(f"/proc/{engine.pid}/environ").read_bytes()
    finally:
        handle.signal(__import__("signal").SIGTERM)
        handle.process.wait(timeout=30)
        handle.kill_leftovers()
