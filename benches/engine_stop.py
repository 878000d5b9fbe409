#!/usr/bin/env python3
"""How long a drained SGLang engine takes to be gone: the manager's scale-in of an idle engine,
against SGLang's own exit on each signal (the physical limit), on SGLang 0.5.23 on CPU.

For each manager binary given (this build, and optionally a baseline build to compare), a
manager starts one real engine, scales out to two, and scales in to one with nothing in flight;
we time the scale-in from the call until its operation is COMPLETED and until every process of
the removed engine (its main process, scheduler and detokenizer) is gone, and read its log for
SGLang's crash diagnostics. Then one SGLang server alone is stopped by SIGINT and one by
SIGTERM to its main process, timed the same way. Everything runs on this machine, in one run.

Needs the SGLang venv (``make sglang-venv``). Run from the repository root:

    .venv/bin/python benches/engine_stop.py --rounds 2
    .venv/bin/python benches/engine_stop.py --baseline-binary /tmp/base/rollout-manager
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _sglang import (  # noqa: E402
    MANAGER_ENGINE_ARGS,
    children,
    make_models,
    sglang_python,
    start_sglang,
    wait_gone,
)
from _support import start_manager, stop_manager  # noqa: E402

RESULTS = ROOT / "benches" / "results"


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    for child in children(pid):
        out += [child, *descendants(child)]
    return out


def via_manager(binary: Path, python: Path, model: Path, state: Path) -> dict[str, Any]:
    args = (
        "--engine", "sglang", "--engine-program", str(python), "--model-path", str(model), "--model-name", "tiny",
        "--gpus", "2", "--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine", "1", *MANAGER_ENGINE_ARGS,
    )  # fmt: skip
    handle = start_manager(binary, state, base_args=args)
    try:
        handle.wait_engines(1, "ACTIVE", 300, fail_on_failed=True)
        op = handle.client.scale_out(num_replicas=2, model_name="tiny")
        handle.client.wait_for_operation("scale_out", op.request_id, 300)
        handle.wait_engines(2, "ACTIVE", 300)
        engine = handle.engines().by_id("engine_1")
        assert engine is not None and engine.pid is not None
        processes = [engine.pid, *descendants(engine.pid)]
        log = Path(engine.log_path or "")
        start = time.monotonic()
        op = handle.client.scale_in(num_replicas=1, model_name="tiny")
        done = handle.client.wait_for_operation("scale_in", op.request_id, 300)
        completed = time.monotonic() - start
        gone = wait_gone(processes, 120) + completed
        text = log.read_text(errors="replace") if log.is_file() else ""
        return {
            "status": done.status,
            "completed_s": round(completed, 2),
            "gone_s": round(gone, 2),
            "crash_diagnostics": "crashed with exit code" in text,
        }
    finally:
        stop_manager(handle, check=False)


def alone(python: Path, model: Path, log: Path, signum: signal.Signals) -> float:
    server = start_sglang(python, model, log)
    try:
        processes = [server.process.pid, *descendants(server.process.pid)]
        os.kill(server.process.pid, signum)
        return round(wait_gone(processes, 120), 2)
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--binary", type=Path, default=ROOT / "target" / "release" / "rollout-manager")
    ap.add_argument("--baseline-binary", type=Path, default=None, help="a base build to compare (before a change)")
    args = ap.parse_args()
    python = sglang_python()
    work = Path(tempfile.mkdtemp(prefix="engine-stop-"))
    models = make_models(python, work)
    builds = {"ours": args.binary}
    if args.baseline_binary:
        builds["baseline"] = args.baseline_binary
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in builds}
    runs.update({"sglang_sigint": [], "sglang_sigterm": []})
    for r in range(args.rounds):
        for name, binary in builds.items():
            runs[name].append(via_manager(binary, python, models.a, work / f"{name}-{r}"))
            print(name, runs[name][-1], flush=True)
        for name, signum in (("sglang_sigint", signal.SIGINT), ("sglang_sigterm", signal.SIGTERM)):
            runs[name].append({"gone_s": alone(python, models.a, work / f"{name}-{r}.log", signum)})
            print(name, runs[name][-1], flush=True)
    summary = {name: statistics.median(x["gone_s"] for x in rs) for name, rs in runs.items()}
    print("\nmedian seconds from the stop until every process of the engine is gone:")
    for name, secs in summary.items():
        print(f"  {name:16s} {secs:6.2f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "engine_stop.json"
    out.write_text(json.dumps({"runs": runs, "median_gone_s": summary, "rounds": args.rounds}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
