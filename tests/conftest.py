"""Fixtures that start real ``rollout-manager serve`` processes (with ``sglang-sim`` engines).

Binary lookup: :func:`elastic_rollout._find.find_binary` (``ELASTIC_ROLLOUT_MANAGER_BIN``,
bundled, ``target/{release,debug}``, ``PATH``). When both cargo builds exist, the more recently
built one is used, so a stale release build never shadows a fresh ``cargo build``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from _support import (
    DEFAULT_ARGS,
    INITIAL_ENGINES,
    LISTEN_TIMEOUT,
    LISTENING_RE,
    SHUTDOWN_TIMEOUT,
    STARTUP_TIMEOUT,
    ManagerHandle,
    StartManager,
    file_tail,
    wait_until,
)
from elastic_rollout import RolloutClient
from elastic_rollout._find import ENV_OVERRIDES, BinaryNotFoundError, find_binary


def _freshest_build(found: Path) -> Path:
    """Prefer target/debug over target/release when the debug build is newer."""
    if os.environ.get(ENV_OVERRIDES["rollout-manager"]) or found.parent.name != "release":
        return found
    debug = found.parent.parent / "debug" / found.name
    if debug.is_file() and os.access(debug, os.X_OK) and debug.stat().st_mtime > found.stat().st_mtime:
        return debug
    return found


def _manager_binary() -> Path:
    return _freshest_build(find_binary("rollout-manager"))


def pytest_report_header() -> str:
    try:
        path = _manager_binary()
    except BinaryNotFoundError as err:
        return f"rollout-manager: NOT FOUND ({str(err).splitlines()[0]})"
    built = datetime.fromtimestamp(path.stat().st_mtime).isoformat(timespec="seconds")
    return f"rollout-manager: {path} (built {built})"


@pytest.fixture(scope="session")
def manager_bin() -> Path:
    """The rollout-manager binary under test (errors with how to build it if missing)."""
    return _manager_binary()


def start_manager(binary: Path, state_dir: Path, extra_args: tuple[str, ...] = ()) -> ManagerHandle:
    """Start ``rollout-manager serve`` on loopback with free ports and parse its listening line.

    Does not wait for engines. On failure the manager is killed and its stderr is quoted.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    stdout_path, stderr_path = state_dir / "manager.stdout", state_dir / "manager.stderr"
    argv = [
        str(binary), "serve",
        "--host", "127.0.0.1", "--port", "0", "--router-port", "0",
        "--state-dir", str(state_dir),
        *DEFAULT_ARGS, *extra_args,
    ]  # fmt: skip
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        env = {**os.environ, "NO_COLOR": "1"}
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)

    def listening() -> tuple[str, str] | None:
        for line in stdout_path.read_text(errors="replace").splitlines():
            match = LISTENING_RE.match(line)
            if match:
                return match["control"], match["router"]
        if process.poll() is not None:
            raise AssertionError(
                f"manager exited with {process.returncode} before listening; argv: {argv}\n"
                f"stderr tail:\n{file_tail(stderr_path)}"
            )
        return None

    try:
        control, router = wait_until(
            listening,
            LISTEN_TIMEOUT,
            lambda: (
                "the manager's 'rollout-manager listening control=... router=...' line"
                f"\nstdout:\n{file_tail(stdout_path, 2000)}"
                f"\nstderr tail:\n{file_tail(stderr_path)}"
            ),
        )
    except BaseException:
        process.kill()
        process.wait()
        raise
    return ManagerHandle(
        process=process,
        control_url=control,
        router_url=router,
        client=RolloutClient(control, timeout=10.0),
        state_dir=state_dir,
        stdout_path=stdout_path,
        stderr_path=stderr_path,
    )


def stop_manager(handle: ManagerHandle, *, check: bool = True) -> None:
    """SIGTERM the manager, wait for it, and check that no engine process survived it."""
    try:
        if handle.process.poll() is None:
            handle.track_children()
            handle.signal(signal.SIGTERM)
            try:
                handle.process.wait(timeout=SHUTDOWN_TIMEOUT)
            except subprocess.TimeoutExpired:
                handle.process.kill()
                handle.process.wait()
                if check:
                    raise AssertionError(
                        f"manager ignored SIGTERM for {SHUTDOWN_TIMEOUT}s\nstderr tail:\n{handle.stderr_tail()}"
                    ) from None
        if check:
            wait_until(
                lambda: not handle.surviving_engines(),
                10.0,
                lambda: (
                    f"engine processes to exit after the manager stopped; alive: {handle.surviving_engines()}"
                    f"\nstderr tail:\n{handle.stderr_tail()}"
                ),
            )
    finally:
        handle.kill_leftovers()


@pytest.fixture
def start_fleet(manager_bin: Path, tmp_path: Path) -> Iterator[StartManager]:
    """Factory: ``start_fleet(*extra_args, wait=True)`` starts a manager owned by this test.

    With ``wait`` it returns once the initial engines are ACTIVE. Every manager started is
    stopped with SIGTERM at teardown, and the teardown fails if an engine process survives.
    """
    started: list[ManagerHandle] = []

    def start(*extra_args: str, wait: bool = True) -> ManagerHandle:
        handle = start_manager(manager_bin, tmp_path / f"fleet{len(started)}", tuple(extra_args))
        started.append(handle)
        if wait:
            handle.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        return handle

    yield start
    errors: list[str] = []
    for handle in started:
        try:
            stop_manager(handle)
        except AssertionError as err:
            errors.append(str(err))
    assert not errors, "\n\n".join(errors)


@pytest.fixture
def fleet(start_fleet: StartManager) -> ManagerHandle:
    """A fresh manager with its 2 initial engines ACTIVE, owned by one test."""
    return start_fleet()


@pytest.fixture(scope="module")
def shared_fleet(manager_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagerHandle]:
    """One manager shared by a module's read-only tests (they must not change the fleet)."""
    handle = start_manager(manager_bin, tmp_path_factory.mktemp("shared_fleet"))
    try:
        handle.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        yield handle
    finally:
        stop_manager(handle)
