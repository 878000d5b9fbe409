"""Restart from --state-dir: kill -9 the manager, start it again on the same state directory."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from _support import INITIAL_ENGINES, STARTUP_TIMEOUT, ManagerHandle, http, start_manager, wait_until

from elastic_rollout import RolloutApiError


@pytest.fixture
def managers(manager_bin: Path) -> Iterator[list[ManagerHandle]]:
    """Managers started by a test; each is stopped at teardown and no engine may survive."""
    started: list[ManagerHandle] = []
    yield started
    for handle in started:
        handle.signal(signal.SIGTERM)
        try:
            handle.process.wait(timeout=30)
        finally:
            handle.kill_leftovers()
    for handle in started:
        assert not handle.surviving_engines(), f"engines survived: {handle.surviving_engines()}"


def kill_manager(handle: ManagerHandle) -> None:
    handle.engines()
    handle.track_children()
    handle.process.send_signal(signal.SIGKILL)
    handle.process.wait(timeout=10)
    wait_until(lambda: not handle.surviving_engines(), 15, "engines to die with the killed manager")


def test_restart_restores_fleet_and_history(manager_bin: Path, tmp_path: Path, managers: list[ManagerHandle]) -> None:
    state = tmp_path / "state"
    first = start_manager(manager_bin, state)
    managers.append(first)
    first.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
    accepted = first.client.scale_out(num_replicas=3)
    first.client.wait_for_operation("scale_out", accepted.request_id, timeout=STARTUP_TIMEOUT)
    before = {e.engine_id: e for e in first.wait_engines(3).engines}
    kill_manager(first)

    second = start_manager(manager_bin, state)
    managers.append(second)
    after = {e.engine_id: e for e in second.wait_engines(3, "ACTIVE", STARTUP_TIMEOUT).engines}
    second.track_children()
    assert after.keys() == before.keys()
    for engine_id, engine in after.items():
        old = before[engine_id]
        assert engine.origin == old.origin
        assert engine.gpu_ids == old.gpu_ids
        assert engine.pid != old.pid
        assert engine.restarts == old.restarts + 1
        assert engine.weight_version == "default"
    # Finished operations keep their record and history.
    op = second.client.scale_out_status(accepted.request_id)
    assert op.status == "ACTIVE"
    assert [h["status"] for h in op.raw["history"]][-1] == "ACTIVE"
    # The restored fleet scales like any other: LIFO removes the restored dynamic engine.
    scale_in = second.client.scale_in(num_replicas=2)
    second.client.wait_for_operation("scale_in", scale_in.request_id, timeout=STARTUP_TIMEOUT)
    remaining = sorted(e.engine_id for e in second.wait_engines(2).engines)
    assert remaining == sorted(e.engine_id for e in before.values() if e.origin == "initial")


def test_restart_mid_scale_out_rolls_it_back(manager_bin: Path, tmp_path: Path, managers: list[ManagerHandle]) -> None:
    state = tmp_path / "state"
    # Every engine takes 3 s to open its port, so the scale-out is surely in flight when killed.
    slow = ("--engine-arg=--startup-delay=3",)
    first = start_manager(manager_bin, state, slow)
    managers.append(first)
    first.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
    accepted = first.client.scale_out(num_replicas=3)
    wait_until(
        lambda: first.client.scale_out_status(accepted.request_id).status == "HEALTH_CHECKING",
        STARTUP_TIMEOUT,
        "the scale-out to be waiting for its engine",
    )
    kill_manager(first)

    second = start_manager(manager_bin, state, slow)
    managers.append(second)
    view = second.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT)
    second.track_children()
    assert view.total_engines == INITIAL_ENGINES
    op = second.client.scale_out_status(accepted.request_id)
    assert op.status == "FAILED"
    assert "restarted" in (op.raw.get("error_message") or "")
    # The lock is free again: a new scale-out is accepted, not 409.
    again = second.client.scale_out(num_replicas=3)
    assert again.status == "PENDING"
    second.client.wait_for_operation("scale_out", again.request_id, timeout=STARTUP_TIMEOUT)
    second.wait_engines(3)


def test_second_manager_on_same_state_dir_is_refused(
    manager_bin: Path, tmp_path: Path, managers: list[ManagerHandle]
) -> None:
    import subprocess

    state = tmp_path / "state"
    first = start_manager(manager_bin, state)
    managers.append(first)
    first.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT)
    argv = [str(manager_bin), "serve", "--port", "0", "--router-port", "0", "--state-dir", str(state)]
    result = subprocess.run(argv, capture_output=True, timeout=20, stdin=subprocess.DEVNULL, check=False)
    assert result.returncode != 0
    assert "fleet.redb" in result.stderr.decode(), result.stderr
    # The first manager is untouched.
    assert first.client.engines().total_engines == INITIAL_ENGINES
    with pytest.raises(RolloutApiError):
        first.client.scale_out_status("no-such-id")


def test_live_engines_are_readopted_without_restart(
    manager_bin: Path, tmp_path: Path, managers: list[ManagerHandle]
) -> None:
    state = tmp_path / "state"
    keep = ("--reattach-grace-secs", "60")
    first = start_manager(manager_bin, state, keep)
    managers.append(first)
    first.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
    first.client.wait_for_operation("scale_out", first.client.scale_out(num_replicas=3).request_id, STARTUP_TIMEOUT)
    before = {e.engine_id: e for e in first.wait_engines(3).engines}
    first.track_children()  # the keepers
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=10)
    # The engines outlive the killed manager (within the grace period)...
    assert all(first.engine_processes[e.pid].alive() for e in before.values() if e.pid is not None)

    second = start_manager(manager_bin, state, keep)
    managers.append(second)
    after = {e.engine_id: e for e in second.wait_engines(3, "ACTIVE", STARTUP_TIMEOUT).engines}
    # ... and are re-adopted: same processes, never restarted.
    assert {k: (e.pid, e.restarts) for k, e in after.items()} == {k: (e.pid, e.restarts) for k, e in before.items()}
    for _ in range(6):
        assert (
            http(
                "POST",
                f"{second.router_url}/generate",
                {"text": "still here", "sampling_params": {"max_new_tokens": 2}},
            ).status
            == 200
        )
    # Scale-in of a re-adopted engine stops it through its keeper.
    removal = second.client.scale_in(num_replicas=2)
    assert second.client.wait_for_operation("scale_in", removal.request_id, STARTUP_TIMEOUT).status == "COMPLETED"
    victim = next(e for e in before.values() if e.origin == "dynamic")
    wait_until(lambda: not first.engine_processes[victim.pid].alive(), 15, "the removed engine's process to exit")  # type: ignore[index]


def test_unclaimed_engines_die_after_the_grace_period(
    manager_bin: Path, tmp_path: Path, managers: list[ManagerHandle]
) -> None:
    handle = start_manager(manager_bin, tmp_path / "state", ("--reattach-grace-secs", "1"))
    managers.append(handle)
    handle.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
    handle.engines()
    handle.track_children()
    assert len(handle.engine_processes) == 2 * INITIAL_ENGINES  # engines and their keepers
    handle.process.send_signal(signal.SIGKILL)
    handle.process.wait(timeout=10)
    wait_until(
        lambda: not handle.surviving_engines(),
        20,
        lambda: f"orphans to die after the grace: {handle.surviving_engines()}",
    )
