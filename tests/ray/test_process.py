"""The shim's process wrapper without Ray: a real ``rollout-manager serve --api-socket`` supervised
by :class:`~elastic_rollout_ray.process.SupervisedProcess` (readiness over the socket, restart on
crash with the same ports, stderr tail in errors, clean stop)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from _support import ProcessIdentity, wait_until

from elastic_rollout import RolloutClient, RolloutConnectionError
from elastic_rollout_ray.manager import ManagerSupervisor, manager_argv
from elastic_rollout_ray.process import ProcessStartError, SupervisedProcess


def local_manager(manager_bin: Path, tmp_path: Path) -> tuple[SupervisedProcess, str]:
    sock = str(tmp_path / "api.sock")
    argv = [str(manager_bin), "serve", "--rollout-num-gpus", "0", "--port", "0", "--router-port", "0",
            "--api-socket", sock, "--state-dir", str(tmp_path / "state")]  # fmt: skip

    def ready(_p: SupervisedProcess) -> bool:
        with RolloutClient(uds=sock, timeout=2) as client:
            client.engines()
        return True

    proc = SupervisedProcess(argv, log_path=tmp_path / "manager.log", ready=ready, ready_timeout=60, restart=True)
    return proc, sock


def test_ready_over_the_socket_restart_on_crash_and_stop(manager_bin: Path, tmp_path: Path) -> None:
    proc, sock = local_manager(manager_bin, tmp_path)
    proc.start()
    try:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        first = ProcessIdentity.of(proc.pid or 0)
        assert first is not None and os.getpgid(first.pid) == first.pid  # its own process group
        urls = proc.wait_listening(10)
        assert urls["control"].startswith("http://127.0.0.1:")
        with RolloutClient(uds=sock) as client:
            assert client.engines().total_engines == 0
        os.kill(first.pid, signal.SIGKILL)
        wait_until(lambda: proc.restarts == 1 and proc.running(), 60, "the manager restarted")
        assert proc.pid != first.pid and not first.alive()
        with RolloutClient(uds=sock) as client:
            assert client.engines().total_engines == 0
        assert "exited with status -9" in (proc.last_error or "")
    finally:
        code = proc.stop(grace=30)
    assert code == 0  # SIGTERM: the manager shuts down cleanly
    assert not proc.running()
    with pytest.raises(RolloutConnectionError) as caught, RolloutClient(uds=sock, timeout=2) as client:
        client.engines()
    assert caught.value.status == 0 and caught.value.code == "unreachable" and sock in str(caught.value)


def test_a_manager_that_cannot_start_reports_its_stderr(manager_bin: Path, tmp_path: Path) -> None:
    argv = [str(manager_bin), "serve", "--gpus", "1", "--rollout-num-gpus", "2"]
    proc = SupervisedProcess(argv, log_path=tmp_path / "m.log", ready=lambda _p: False, ready_timeout=30)
    with pytest.raises(ProcessStartError) as caught:
        proc.start()
    message = str(caught.value)
    assert "exited with status 2" in message
    assert "invalid --gpus" in message  # the manager's own error, from its stderr


def test_readiness_deadline_stops_the_child(tmp_path: Path) -> None:
    proc = SupervisedProcess(["sleep", "600"], log_path=tmp_path / "s.log", ready=lambda _p: False, ready_timeout=0.5)
    with pytest.raises(ProcessStartError, match=r"not ready within 0\.5s"):
        proc.start()
    assert not proc.running()


def test_supervisor_pins_ports_for_restarts(manager_bin: Path, tmp_path: Path) -> None:
    argv = manager_argv("rollout-manager", ["--fully-async"], api_socket="/s", state_dir="/d")
    assert argv[:3] == ["rollout-manager", "serve", "--fully-async"]
    assert argv[-6:] == ["--placement", "ray", "--api-socket", "/s", "--state-dir", "/d"]
    # A real supervisor in ray mode: ready over the socket, same ports after a crash.
    sock = str(tmp_path / "api.sock")
    sup = ManagerSupervisor(
        str(manager_bin), ["--fully-async", "--port", "0", "--router-port", "0", "--rollout-num-gpus", "0"],
        api_socket=sock, state_dir=str(tmp_path / "state"),
    )  # fmt: skip
    try:
        info = sup.info()
        assert info["running"] and info["router_url"].startswith("http://127.0.0.1:")
        os.kill(info["pid"], signal.SIGKILL)
        wait_until(lambda: sup.info()["restarts"] == 1 and sup.info()["running"], 60, "a restarted manager")
        again = sup.info()
        assert again["pid"] != info["pid"]
        assert (again["control_url"], again["router_url"]) == (info["control_url"], info["router_url"])
    finally:
        assert sup.stop(grace=30) == 0


def test_the_child_dies_with_the_process_that_supervises_it(manager_bin: Path, tmp_path: Path) -> None:
    """A supervisor killed outright (as a Ray worker is when its node or job goes) takes its child
    with it: the binary set its own parent-death signal from ROLLOUT_MANAGER_PARENT_PID."""
    ready = tmp_path / "agent.json"
    argv = [str(manager_bin), "agent", "--listen", "127.0.0.1:0", "--ready-file", str(ready),
            "--state-dir", str(tmp_path / "state")]  # fmt: skip
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from elastic_rollout_ray.process import SupervisedProcess\n"
        f"p = SupervisedProcess({argv!r}, log_path=Path({str(tmp_path / 'agent.log')!r}),\n"
        f"                      ready=lambda _p: Path({str(ready)!r}).exists(), ready_timeout=30)\n"
        "p.start()\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    supervisor = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert supervisor.stdout is not None
        child = int(supervisor.stdout.readline())
        assert json.loads(ready.read_text())["pid"] == child
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        assert f"ROLLOUT_MANAGER_PARENT_PID={supervisor.pid}".encode() in environ
        ident = ProcessIdentity.of(child)
        assert ident is not None and ident.alive()
    finally:
        supervisor.kill()
        supervisor.wait(timeout=30)
    wait_until(lambda: not ident.alive(), 30, f"the agent (pid {child}) gone with its supervisor")
