"""Chaos under load (short CI version of benches/chaos.py; the harness is tests/_chaos.py).

Eight simulated engines serve a steady mix of streaming and non-streaming requests through the
router while a seeded chaos loop kills engines with -9, hangs one, freezes one (SIGSTOP), slows
one's health checks, scales out and in (and publishes weight versions).
Asserted: no client-visible failure of a request that had not started streaming while an engine
was routable, no answer from an older weight version than the fleet's, every broken engine back,
and no process left behind once the manager stopped.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from _chaos import Chaos, Load, Report, Watcher, chaos_args, resume_frozen, shut_down
from _support import STARTUP_TIMEOUT, http, metric_total, start_manager, wait_until

ENGINES = 8
SPARE = 2
ACTIONS = 18
BREAKAGES = ("kill", "hang", "freeze", "slow_health")
SECONDS_BETWEEN_ACTIONS = 2.5


def test_chaos_under_load(manager_bin: Path, tmp_path: Path) -> None:
    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 100_000))
    print(f"chaos seed {seed} (rerun with CHAOS_SEED={seed})")
    fleet = start_manager(manager_bin, tmp_path / "chaos", chaos_args(ENGINES, SPARE, 0.1))
    watcher: Watcher | None = None
    chaos: Chaos | None = None
    try:
        fleet.wait_engines(ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        watcher = Watcher(fleet)
        watcher.start()
        chaos = Chaos(fleet, watcher, seed, ENGINES, ENGINES + SPARE)
        load = Load(fleet.router_url, threads=6, seed=seed, fleet_version=chaos.fleet_version)
        load.start()
        try:
            pending = chaos.schedule(ACTIONS)
            retries = 0
            while pending:
                action = pending.pop(0)
                time.sleep(SECONDS_BETWEEN_ACTIONS)
                chaos.step(action)
                # A breakage skipped because too many engines were broken at that moment is
                # tried again later, so every kind happens at least once.
                if action in BREAKAGES and action not in chaos.done() and retries < 2 * len(BREAKAGES):
                    pending.append(action)
                    retries += 1
            chaos.clear_slow_health(force=True)
            # Every broken engine comes back (restarted by the manager) while the load goes on.
            wait_until(lambda: not chaos.broken(), 60, lambda: f"broken engines to recover: {chaos.broken()}")  # type: ignore[union-attr]
        finally:
            load.stop()
            watcher.stop()
        report = Report.from_run(load, watcher, chaos)
        print(report.describe())
        for when, action, detail in chaos.log:
            print(f"  {when - chaos.log[0][0]:7.2f}s {action}: {detail}")
        assert report.requests > 100, report.describe()
        assert set(BREAKAGES) <= report.actions.keys(), report.describe()
        assert not report.unexcused, report.describe()
        assert not report.wrong_version, report.describe()
        assert not report.unrecovered, report.describe()
        # The fleet metrics saw it too: every crash, hang and freeze cost a restart.
        metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
        restarted = sum(report.actions.get(a, 0) for a in ("kill", "hang", "freeze"))
        gone = removed_since_broken(chaos, {e.engine_id for e in fleet.engines().engines})
        assert metric_total(metrics, "rollout_engine_restarts") >= restarted - len(gone), metrics
        active = len(watcher.latest().engines)
        assert f'rollout_engines{{status="ACTIVE"}} {active}' in metrics, metrics
        assert "rollout_store_write_failures_total 0" in metrics, metrics
    finally:
        if chaos is not None:
            resume_frozen(chaos)
        if watcher is not None:
            watcher.stop()
        leaks = shut_down(fleet)
    assert fleet.process.returncode == 0, f"manager exit code {fleet.process.returncode}\n{fleet.stderr_tail()}"
    assert not leaks, f"processes outlived the manager: {leaks}"


def removed_since_broken(chaos: Chaos, present: set[str]) -> list[str]:
    """Breakages (kill, hang, freeze) of engines a scale-in has removed since: their restart
    counters left the registry, and /metrics, with them, whether or not they had recovered."""
    return [
        b.engine_id for b in chaos.breakages if b.action in ("kill", "hang", "freeze") and b.engine_id not in present
    ]
