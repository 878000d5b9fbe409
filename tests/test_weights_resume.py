"""A fleet weight update interrupted by a manager crash resumes under the same id.

Real manager, real ``sglang-sim`` engines under keepers (``--reattach-grace-secs``, so they
outlive the manager's SIGKILL), a slow weight load so the kill lands mid-update, and pinned
requests flowing through the router the whole time: every answer must come from the version
its pin allows, so an engine put back into routing on a version other than the one recorded
for it would show up here.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from _checkpoints import write_checkpoint
from _support import STARTUP_TIMEOUT, ManagerHandle, ProcessIdentity, start_manager, stop_manager, wait_until
from test_weights import UPDATE_TIMEOUT, assert_fleet_on, publish

ENGINES = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PinnedTraffic:
    """One thread sending /generate requests through the router, alternating a pin on the old
    version (``exact_version``) and on the new one (``min_version``), and checking each answer's
    ``meta_info.weight_version`` (and that no answer spans two versions)."""

    def __init__(self, router_url: str, old: str, new: str) -> None:
        self.url = f"{router_url}/generate"
        self.pins = [("exact", old, {"exact_version": old}), ("min", new, {"min_version": new})]
        self.served = {"exact": 0, "min": 0}
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PinnedTraffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            kind, version, pin = self.pins[n % 2]
            n += 1
            body = {"text": f"request {n}", "sampling_params": {"max_new_tokens": 8}, "weight_version": pin}
            request = urllib.request.Request(
                self.url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=20) as response:
                    answer = json.loads(response.read())
                    engine = response.headers.get("x-rollout-engine-id")
            except (urllib.error.URLError, OSError, ValueError):
                # The manager is down, or no engine serves the pinned version (503): allowed.
                self._stop.wait(0.05)
                continue
            meta = answer.get("meta_info") or {}
            served = meta.get("weight_version")
            # Only two versions exist here, so either pin allows exactly one of them.
            if served != version:
                self.violations.append(f"{kind} {version} pin answered by {engine} on {served!r}")
            # SGLang 0.5.23 reports the spans on every finished answer; more than one version
            # in them is an answer across versions.
            if len({span["version"] for span in meta.get("weight_versions") or ()}) > 1:
                self.violations.append(f"{engine} answered across versions: {meta['weight_versions']}")
            self.served[kind] += 1


def start(
    manager_bin: Path, state: Path, ports: tuple[int, int], load_delay: float, more: tuple[str, ...] = ()
) -> ManagerHandle:
    extra = (
        "--rollout-num-gpus", str(ENGINES),
        "--reattach-grace-secs", "60",
        f"--engine-arg=--weight-load-delay={load_delay}",
        "--version-wait-secs", "1",
        "--port", str(ports[0]), "--router-port", str(ports[1]),
        *more,
    )  # fmt: skip
    return start_manager(manager_bin, state, extra)


def engine_identities(fleet: ManagerHandle) -> dict[str, ProcessIdentity]:
    out = {}
    for engine in fleet.engines().engines:
        identity = engine.pid and ProcessIdentity.of(engine.pid)
        if identity:
            out[engine.engine_id] = identity
    return out


def crash_mid_update(
    manager_bin: Path,
    tmp_path: Path,
    strategy: str,
    caught: Any,
    load_delay: float,
    more: tuple[str, ...] = (),
    while_down: Any = None,
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Starts a fleet on the startup version (``more``: extra flags), publishes v1 with
    ``strategy`` while pinned traffic flows, kills the manager with SIGKILL once
    ``caught(update, engines)`` holds, runs ``while_down()``, restarts it on the same state dir
    and ports, and waits for the update to end. Answers the update as seen just before the
    kill, as it ended, and the published checksum."""
    state = tmp_path / "state"
    checksum = write_checkpoint(tmp_path / "v1", 1)
    ports = (free_port(), free_port())
    first = start(manager_bin, state, ports, load_delay, more)
    second: ManagerHandle | None = None
    identities: dict[str, ProcessIdentity] = {}
    try:
        first.wait_engines(ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        with PinnedTraffic(first.router_url, "default", "v1") as traffic:
            wait_until(lambda: traffic.served["exact"] > 0, 30, "a request served on the startup version")
            update_id = publish(first, "v1", tmp_path / "v1", strategy=strategy, max_unavailable=1)["update_id"]

            def mid_update() -> dict[str, Any] | None:
                update = first.client.weight_update(update_id)
                engines = first.client.weights()["engines"]
                return update if caught(update, engines) else None

            before = wait_until(mid_update, UPDATE_TIMEOUT, f"the {strategy} update caught mid-way")
            identities = engine_identities(first)
            first.process.kill()
            first.process.wait()
            if while_down is not None:
                while_down()

            second = start(manager_bin, state, ports, load_delay, more)
            ended = wait_until(
                lambda: (u := second.client.weight_update(update_id))["status"] in ("COMPLETED", "FAILED") and u,
                UPDATE_TIMEOUT,
                lambda: f"the resumed update to end\nmanager stderr:\n{second.stderr_tail() if second else ''}",
            )
            assert ended["status"] == "COMPLETED", json.dumps(ended, indent=1) + second.stderr_tail()
            assert_fleet_on(second, "v1", checksum, ENGINES)
            wait_until(lambda: traffic.served["min"] > 0, 30, "a request served on v1 after the resume")
        assert not traffic.violations, traffic.violations
        # Re-adopted, not restarted: the engines are the processes that were running at the kill.
        assert engine_identities(second) == identities, (identities, engine_identities(second))
        weights = second.client.weights()
        assert weights["update_id"] == update_id and weights["history"][0]["resumed"] == 1, weights
        return before, ended, checksum
    finally:
        stop_both(first, second, identities)


def stop_both(first: ManagerHandle, second: ManagerHandle | None, identities: dict[str, ProcessIdentity]) -> None:
    """After a test that killed ``first`` and started ``second`` on its state: stops whichever
    runs; no engine seen at the kill (``identities``) may outlive the second manager, and if
    there was none, the first one's engines are killed so nothing leaks."""
    if first.process.poll() is None:
        stop_manager(first, check=False)
    if second is not None:
        stop_manager(second)
        assert not [i for i in identities.values() if i.alive()], "engine processes outlived the manager"
    else:
        for identity in identities.values():
            first.engine_processes.setdefault(identity.pid, identity)
        first.kill_leftovers()


def test_a_rolling_update_killed_mid_wave_resumes_and_commits(manager_bin: Path, tmp_path: Path) -> None:
    """kill -9 once one engine serves v1 and the next is loading it: the restarted manager
    finishes the interrupted wave and the remaining one under the same update id."""

    def caught(update: dict[str, Any], engines: list[dict[str, Any]]) -> bool:
        on_v1 = [e for e in engines if e["weight_version"] == "v1"]
        loading = [i for i, e in update["engines"].items() if e["status"] == "UPDATING"]
        return bool(on_v1) and len(on_v1) < ENGINES and bool(loading)

    before, ended, _ = crash_mid_update(manager_bin, tmp_path, "rolling", caught, load_delay=2)
    assert before["status"] == "UPDATING", before
    assert ended["resumed"] == 1, ended
    assert [h["status"] for h in ended["history"]] == ["CHECKSUMMING", "PENDING", "UPDATING", "RESUMED", "COMPLETED"], (
        ended
    )
    assert {e["status"] for e in ended["engines"].values()} == {"VERIFIED"}, ended["engines"]
    assert len(ended["engines"]) == ENGINES, ended["engines"]
    # Engines already done at the kill were not taken out again.
    done = [i for i, e in before["engines"].items() if e["status"] == "VERIFIED"]
    for engine_id in done:
        assert ended["engines"][engine_id]["started_at"] == before["engines"][engine_id]["started_at"], engine_id


def test_a_relay_update_whose_staged_copy_vanished_with_the_manager_stages_it_again(
    manager_bin: Path, tmp_path: Path
) -> None:
    """Relay transport: the staged copy under --relay-dir is gone when the manager comes back
    (as after a reboot empties /dev/shm); the resumed update stages it again from the published
    directory and completes."""
    relay_dir = tmp_path / "relay"
    staged: list[Path] = []

    def caught(update: dict[str, Any], engines: list[dict[str, Any]]) -> bool:
        return any(e["weight_version"] == "v1" for e in engines) and any(
            e["status"] == "UPDATING" for e in update["engines"].values()
        )

    def remove_staged_copy() -> None:
        staged[:] = [p for p in relay_dir.iterdir() if p.name.startswith("v1-")]
        assert len(staged) == 1, list(relay_dir.iterdir())
        shutil.rmtree(staged[0])

    more = ("--weight-transport", "relay", "--relay-dir", str(relay_dir))
    _, ended, _ = crash_mid_update(
        manager_bin, tmp_path, "rolling", caught, load_delay=1, more=more, while_down=remove_staged_copy
    )
    assert ended["resumed"] == 1 and ended["engine_path"] == str(staged[0]), ended
    assert (staged[0] / ".relay-manifest.json").is_file(), list(relay_dir.iterdir())
    assert {e["status"] for e in ended["engines"].values()} == {"VERIFIED"}, ended["engines"]


def test_an_all_at_once_update_killed_while_loading_resumes_and_commits(manager_bin: Path, tmp_path: Path) -> None:
    """kill -9 while every engine is paused and loading: the restarted manager runs their turns
    again (pause, load, continue, verify), so no engine is left paused or on the old version."""

    def caught(update: dict[str, Any], engines: list[dict[str, Any]]) -> bool:
        loading = [e for e in update["engines"].values() if e["status"] == "UPDATING"]
        return len(loading) == ENGINES and all(e["weight_version"] != "v1" for e in engines)

    before, ended, _ = crash_mid_update(manager_bin, tmp_path, "all_at_once", caught, load_delay=2)
    assert before["status"] == "UPDATING", before
    assert ended["resumed"] == 1 and ended["strategy"] == "all_at_once", ended
    assert {e["status"] for e in ended["engines"].values()} == {"VERIFIED"}, ended["engines"]


def test_an_update_interrupted_by_an_orderly_shutdown_resumes_after_the_restart(
    manager_bin: Path, tmp_path: Path
) -> None:
    """SIGTERM while an engine loads: the shutdown stops the engines but leaves the update in
    flight (a turn cut short by the shutdown is not a failure); the next manager starts the
    engines again on the target and commits the same update."""
    state = tmp_path / "state"
    checksum = write_checkpoint(tmp_path / "v1", 1)
    extra = ("--engine-arg=--weight-load-delay=2",)
    first = start_manager(manager_bin, state, extra)
    try:
        first.wait_engines(2, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        update_id = publish(first, "v1", tmp_path / "v1", max_unavailable=1)["update_id"]
        wait_until(
            lambda: any(e["status"] == "UPDATING" for e in first.client.weight_update(update_id)["engines"].values()),
            UPDATE_TIMEOUT,
            "an engine loading v1",
        )
    finally:
        stop_manager(first)
    second = start_manager(manager_bin, state, extra)
    try:
        ended = wait_until(
            lambda: (u := second.client.weight_update(update_id))["status"] in ("COMPLETED", "FAILED") and u,
            UPDATE_TIMEOUT,
            lambda: f"the resumed update to end\nmanager stderr:\n{second.stderr_tail()}",
        )
        assert ended["status"] == "COMPLETED" and ended["resumed"] == 1, json.dumps(ended, indent=1)
        assert_fleet_on(second, "v1", checksum, 2)
    finally:
        stop_manager(second)
