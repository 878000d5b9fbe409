#!/usr/bin/env python3
"""Chaos under load, the long version of tests/test_chaos.py (issue 8, part 1).

    .venv/bin/python benches/chaos.py [--minutes 10 --seed 7 --engines 8 --threads 8]

One invocation: a release (or the freshest) `rollout-manager serve` with `--engines` simulated
engines (`--enable-fault-api`, time scale 0.1) and room for 2 more; `--threads` clients send
streaming and non-streaming `/generate` (16-400 tokens) through the router without pause while
the chaos loop of tests/_chaos.py performs one action every `--interval` seconds for
`--minutes`: kill -9, hang, freeze (SIGSTOP), slow health checks, scale out by one, scale in by
one, publish a weight version (a TODO hook: skipped until `POST /rollout/weights/publish`
exists). At most 3 engines are broken at once. At the end it waits for every engine to recover,
stops the manager with SIGTERM and looks for leftover processes.

Reports (printed, and in benches/results/chaos.{json,md}): requests, failures (unexcused: the
client had no stream data and an engine was routable; excused: after stream data, or while no
engine was routable), wrong-version answers, recovery time per action kind (median, p90, max),
leaked processes. Exit status 1 if any goal (0 unexcused failures, 0 wrong versions, 0 leaks,
every engine recovered) is missed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "python")]

from _chaos import Chaos, Load, Report, Watcher, chaos_args, resume_frozen, shut_down  # noqa: E402
from _support import STARTUP_TIMEOUT, start_manager  # noqa: E402
from conftest import _manager_binary  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between chaos actions")
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=ROOT / "benches" / "results")
    args = parser.parse_args()
    binary = _manager_binary()
    print(f"seed {args.seed}; manager {binary}", flush=True)
    state = Path(tempfile.mkdtemp(prefix="chaos-bench-"))
    load_before = os.getloadavg()
    fleet = start_manager(binary, state / "fleet", chaos_args(args.engines, 2, args.time_scale))
    watcher = Watcher(fleet)
    chaos = Chaos(fleet, watcher, args.seed, args.engines, args.engines + 2)
    load = Load(fleet.router_url, threads=args.threads, seed=args.seed, fleet_version=chaos.fleet_version)
    recovered = True
    try:
        fleet.wait_engines(args.engines, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        watcher.start()
        load.start()
        started = time.monotonic()
        n = 0
        try:
            while time.monotonic() - started < args.minutes * 60:
                for action in chaos.schedule(20):
                    time.sleep(args.interval)
                    chaos.step(action)
                    n += 1
                    if time.monotonic() - started >= args.minutes * 60:
                        break
                print(
                    f"{(time.monotonic() - started) / 60:.1f} min, {n} actions, {len(load.outcomes)} requests",
                    flush=True,
                )
            chaos.clear_slow_health(force=True)
            deadline = time.monotonic() + 120
            while chaos.broken() and time.monotonic() < deadline:
                time.sleep(0.5)
            recovered = not chaos.broken()
        finally:
            load.stop()
            watcher.stop()
    finally:
        resume_frozen(chaos)
        leaks = shut_down(fleet)

    report = Report.from_run(load, watcher, chaos)
    print(report.describe())
    recovery = {}
    for action, times in sorted(report.recoveries.items()):
        ordered = sorted(times)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        recovery[action] = {
            "n": len(times),
            "median_s": round(statistics.median(times), 2),
            "p90_s": round(p90, 2),
            "max_s": round(max(times), 2),
        }
    duration = max((o.end for o in load.outcomes), default=0) - min((o.start for o in load.outcomes), default=0)
    results = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "seed": args.seed,
        "manager_binary": str(binary),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "minutes": round(duration / 60, 2),
        "requests": report.requests,
        "streams": report.streams,
        "requests_per_s": round(report.requests / duration, 1) if duration else 0,
        "failures": len(report.failures),
        "unexcused": len(report.unexcused),
        "excused_after_stream_data": report.excused_streaming,
        "excused_no_routable_engine": report.excused_no_engine,
        "wrong_version": len(report.wrong_version),
        "actions": report.actions,
        "weight_publish": "on" if "publish" in report.actions else "not drawn",
        "recovery": recovery,
        "unrecovered": [f"{b.action} {b.engine_id}" for b in report.unrecovered],
        "leaked_processes": leaks,
        "manager_exit_code": fleet.process.returncode,
        "unexcused_examples": [o.error for o in report.unexcused[:5]],
    }
    md = render(results)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "chaos.md").write_text(md)
    ok = recovered and not report.unexcused and not report.wrong_version and not leaks
    return 0 if ok else 1


def render(r: dict) -> str:
    lines = [
        f"Results, {r['date']}, {r['machine']}, seed {r['seed']}",
        f"`{r['command']}`; load average before {r['loadavg_before']}, after {r['loadavg_after']}",
        "",
        "| measure | value | goal |",
        "|---|---|---|",
        f"| requests (streaming) over {r['minutes']} min "
        f"| {r['requests']} ({r['streams']}), {r['requests_per_s']}/s | |",
        f"| client-visible failures, no stream data yet, an engine routable | {r['unexcused']} | 0 |",
        f"| failures after stream data had reached the client | {r['excused_after_stream_data']} | (allowed) |",
        f"| failures while no engine was routable | {r['excused_no_routable_engine']} | (allowed) |",
        f"| answers from an older weight version than the fleet's | {r['wrong_version']} | 0 ({r['weight_publish']}) |",
        f"| engines not recovered at the end | {len(r['unrecovered'])} | 0 |",
        f"| processes left after the manager stopped | {len(r['leaked_processes'])} | 0 |",
        f"| actions performed | {', '.join(f'{k} {v}' for k, v in sorted(r['actions'].items()))} | |",
        "",
        "| engine broken by | n | recovery median s | p90 s | max s |",
        "|---|---|---|---|---|",
    ]
    for action, v in r["recovery"].items():
        lines.append(f"| {action} | {v['n']} | {v['median_s']} | {v['p90_s']} | {v['max_s']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
