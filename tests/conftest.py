"""Fixtures that start real ``rollout-manager serve`` processes (with ``sglang-sim`` engines).

Binary lookup: :func:`elastic_rollout._find.find_binary` (``ELASTIC_ROLLOUT_MANAGER_BIN``,
bundled, ``target/{release,debug}``, ``PATH``). When both cargo builds exist, the more recently
built one is used, so a stale release build never shadows a fresh ``cargo build``.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from _support import (
    INITIAL_ENGINES,
    STARTUP_TIMEOUT,
    ManagerHandle,
    StartManager,
    freshest_build,
    start_manager,
    stop_manager,
)

from elastic_rollout._find import BinaryNotFoundError, find_binary


def _manager_binary() -> Path:
    return freshest_build(find_binary("rollout-manager"))


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
