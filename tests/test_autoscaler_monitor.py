"""`rollout-manager monitor`, used as a person would: in a real terminal (tmux), read the
screen, press `r`, press `q`. Rendering details are tested in Rust on ratatui's TestBackend."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _support import ManagerHandle, wait_until

TMUX = shutil.which("tmux")


@pytest.fixture
def tmux() -> Iterator[list[str]]:
    """A private tmux server (its own socket), killed at teardown."""
    if TMUX is None:
        pytest.skip("tmux is not installed (make test installs it: apt-get install -y tmux)")
    base = [TMUX, "-L", f"elastic-rollout-test-{os.getpid()}", "-f", "/dev/null"]
    yield base
    subprocess.run([*base, "kill-server"], capture_output=True, check=False)


def screen(tmux: list[str]) -> str:
    out = subprocess.run([*tmux, "capture-pane", "-p", "-t", "monitor"], capture_output=True, text=True, check=False)
    return out.stdout


def test_monitor_shows_the_fleet_and_quits_on_q(
    tmux: list[str], shared_fleet: ManagerHandle, manager_bin: Path
) -> None:
    command = (
        f"{shlex.quote(str(manager_bin))} monitor --url {shared_fleet.control_url}/autoscaler; "
        "echo MONITOR-EXITED rc=$?; sleep 60"
    )
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "monitor", "-x", "140", "-y", "40", command],
        check=True,
        env={**os.environ, "TERM": "xterm-256color"},
    )
    engine_ids = [e.engine_id for e in shared_fleet.engines().engines]
    wait_until(
        lambda: all(e in screen(tmux) for e in engine_ids) and "ACTIVE" in screen(tmux),
        20,
        lambda: f"the engines {engine_ids} on the monitor's screen; it shows:\n{screen(tmux)}",
    )
    text = screen(tmux)
    for needle in (
        "Elastic Rollout monitor",
        "DISABLED",
        "Conditions",
        "token_usage_high",
        "Recent decisions",
        "weights: default (no update running)",
        "q quit",
    ):
        assert needle in text, f"{needle!r} not on screen:\n{text}"
    subprocess.run([*tmux, "send-keys", "-t", "monitor", "r"], check=True)
    assert "MONITOR-EXITED" not in screen(tmux)
    subprocess.run([*tmux, "send-keys", "-t", "monitor", "q"], check=True)
    wait_until(
        lambda: "MONITOR-EXITED rc=0" in screen(tmux), 10, lambda: f"the monitor to exit; screen:\n{screen(tmux)}"
    )
