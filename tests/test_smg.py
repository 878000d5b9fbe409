"""External router mode against the real SGLang router (smg, from PyPI): the manager keeps
smg's worker list equal to its ACTIVE engines."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _support import INITIAL_ENGINES, STARTUP_TIMEOUT, StartManager, http, wait_until

SMG = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def smg(tmp_path: Path) -> Iterator[str]:
    if SMG is None:
        pytest.fail("smg is not installed: pip install -e 'python[test]' installs it")
    port, metrics = free_port(), free_port()
    argv = [
        SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
        "--disable-tokenizer-autoload", "--health-check-interval-secs", "1",
    ]  # fmt: skip
    # smg would fetch a tokenizer from the internet: point it at a dead loopback address.
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / "smg.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return http("GET", f"{url}/workers", timeout=2).status == 200
        except OSError:
            return proc.poll() is not None and pytest.fail(f"smg exited: {(tmp_path / 'smg.log').read_text()[-2000:]}")

    wait_until(up, 30, "smg to listen")
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def smg_workers(url: str) -> dict[str, str]:
    """smg's workers: engine URL -> status."""
    return {w["url"].rstrip("/"): w.get("status", "?") for w in http("GET", f"{url}/workers").json()["workers"]}


def test_engines_are_registered_and_unregistered(start_fleet: StartManager, smg: str) -> None:
    fleet = start_fleet("--router", f"smg={smg}")
    engines = {e.url for e in fleet.engines().engines}
    wait_until(
        lambda: set(smg_workers(smg)) == engines, STARTUP_TIMEOUT, lambda: f"smg to list {engines}: {smg_workers(smg)}"
    )
    wait_until(lambda: set(smg_workers(smg).values()) == {"ready"}, STARTUP_TIMEOUT, "smg to find the engines ready")
    # Traffic through smg reaches our engines.
    resp = http("POST", f"{smg}/generate", {"text": "via smg", "sampling_params": {"max_new_tokens": 2}})
    assert resp.status == 200 and resp.json()["meta_info"]["completion_tokens"] == 2

    op = fleet.client.wait_for_operation(
        "scale_out", fleet.client.scale_out(num_replicas=3).request_id, STARTUP_TIMEOUT
    )
    assert op.status == "ACTIVE"
    engines = {e.url for e in fleet.engines().engines}
    wait_until(
        lambda: set(smg_workers(smg)) == engines, STARTUP_TIMEOUT, lambda: f"smg to list 3 engines: {smg_workers(smg)}"
    )

    victim_id = op.raw["engine_ids"][0]
    victim = next(e.url for e in fleet.engines().engines if e.engine_id == victim_id)
    done = fleet.client.wait_for_operation(
        "scale_in", fleet.client.scale_in(num_replicas=INITIAL_ENGINES).request_id, STARTUP_TIMEOUT
    )
    assert done.status == "COMPLETED"
    # smg drains a deleted worker before forgetting it: out of its rotation either way.
    assert smg_workers(smg).get(victim, "draining") == "draining"

    # On shutdown the manager takes its engines out of smg before stopping them.
    fleet.process.send_signal(signal.SIGTERM)
    fleet.process.wait(timeout=60)
    assert set(smg_workers(smg).values()) <= {"draining"}, smg_workers(smg)
