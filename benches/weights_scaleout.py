#!/usr/bin/env python3
"""Scale-out to fresh weights: time from POST /rollout/scale_out to ACTIVE, minus the engines'
own startup, for 1, 4 and 16 engines at once.

One manager with 1 initial engine and 32 logical GPUs publishes a checkpoint (`--size-mib`,
safetensors shards) as v1, then repeatedly scales out by N engines and back in. New engines
launch on the published checkpoint (`--model-path <v1 dir> --weight-version v1`); `sglang-sim`
reads and SHA-256-checksums it at startup, like a real weight load, plus `--startup-delay`
seconds of simulated loading. The manager then checks version and checksum (WEIGHT_SYNCING)
before the engines are routable. For each scale-out we report:

- total: request sent -> operation ACTIVE (the manager's own timestamps, same clock);
- engine startup: the slowest new engine's own startup, process start -> ready, as the engine
  reports it (`/server_info` `startup_time`);
- overhead = total - engine startup: what the manager adds (launch, health polling, weight
  check, activation); its ratio to the N=1 overhead is the figure the issue asks to keep flat.

Run from the repository root after `cargo build --release --workspace --bins` (or debug):

    .venv/bin/python benches/weights_scaleout.py
    .venv/bin/python benches/weights_scaleout.py --engines 1 4 16 --repeats 3 --size-mib 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"


def request(method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def write_checkpoint(directory: Path, size_mib: int, shards: int = 4) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    per = size_mib * (1 << 20) // shards // 4 * 4
    for i in range(shards):
        header = json.dumps({f"w{i}": {"dtype": "F32", "shape": [per // 4], "data_offsets": [0, per]}}).encode()
        with open(directory / f"model-{i:05d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            f.write(os.urandom(per))


def binary() -> Path:
    for profile in ("release", "debug"):
        p = ROOT / "target" / profile / "rollout-manager"
        if p.exists():
            return p
    sys.exit("build first: cargo build --release --workspace --bins")


def wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise TimeoutError(what)


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="weights-scaleout-"))
    ckpt = work / "v1"
    write_checkpoint(ckpt, args.size_mib)
    argv = [
        str(binary()), "serve", "--host", "127.0.0.1", "--port", "0", "--router-port", "0",
        "--state-dir", str(work / "state"), "--gpus", "32", "--rollout-num-gpus", "1",
        "--max-engines", "32", "--health-check-interval-secs", "5",
        "--engine-arg=--time-scale=0.01", f"--engine-arg=--startup-delay={args.startup_delay}",
    ]  # fmt: skip
    out = open(work / "manager.out", "wb")
    proc = subprocess.Popen(argv, stdout=out, stderr=open(work / "manager.err", "wb"))
    try:
        line = wait(
            lambda: re.search(r"listening control=(\S+)", (work / "manager.out").read_text()), 30, "manager to listen"
        )
        control = line.group(1)

        def active() -> list[dict[str, Any]]:
            engines = request("GET", f"{control}/rollout/engines")["models"]["default"]["engines"]
            return [e for e in engines if e["status"] == "ACTIVE"]

        wait(lambda: len(active()) == 1, 60, "the initial engine")
        upd = request("POST", f"{control}/rollout/weights/publish", {"version": "v1", "path": str(ckpt)})
        wait(
            lambda: request("GET", f"{control}/rollout/weights/updates/{upd['update_id']}")["status"] == "COMPLETED",
            120,
            "v1 to be published",
        )
        checksum = request("GET", f"{control}/rollout/weights")["checksum"]
        rows = []
        for n in args.engines:
            for rep in range(args.repeats):
                sent = time.time()
                op = request("POST", f"{control}/rollout/scale_out", {"num_replicas": 1 + n})
                rid = op["request_id"]
                record = wait(
                    lambda: (
                        (r := request("GET", f"{control}/rollout/scale_out/{rid}"))["status"]  # noqa: B023
                        in ("ACTIVE", "FAILED")
                        and r
                    ),
                    600,
                    f"scale-out to {1 + n}",
                )
                assert record["status"] == "ACTIVE", record
                activated = next(h["at"] for h in record["history"] if h["status"] == "ACTIVE")
                new = [e for e in active() if e["engine_id"] in record["engine_ids"]]
                assert len(new) == n, (n, new)
                startups = []
                for e in new:
                    info = request("GET", f"{e['url']}/server_info")
                    assert info["weight_version"] == "v1" and info["weights_checksum"] == checksum, info
                    assert e["weights_checksum"] == checksum, e
                    startups.append(float(info["startup_time"]))
                total = activated - sent
                row = {
                    "engines": n,
                    "repeat": rep,
                    "total_s": total,
                    "engine_startup_max_s": max(startups),
                    "engine_startup_mean_s": statistics.mean(startups),
                    "overhead_s": total - max(startups),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                sin = request("POST", f"{control}/rollout/scale_in", {"num_replicas": 1, "force": True})
                wait(
                    lambda: (
                        request("GET", f"{control}/rollout/scale_in/{sin['request_id']}")["status"]  # noqa: B023
                        in ("COMPLETED", "FAILED")
                    ),
                    120,
                    "scale-in",
                )
                wait(lambda: len(request("GET", f"{control}/rollout/engines")["models"]["default"]["engines"]) == 1,
                     60, "engines to leave")  # fmt: skip
        return {"rows": rows, "size_mib": args.size_mib, "startup_delay": args.startup_delay}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)


def summarize(result: dict[str, Any]) -> str:
    by_n: dict[int, list[dict[str, Any]]] = {}
    for r in result["rows"]:
        by_n.setdefault(r["engines"], []).append(r)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k.endswith("_s")} for n, rs in by_n.items()}
    base = med[min(med)]["overhead_s"]
    lines = [
        "| engines | total s | slowest engine's own startup s | overhead s | overhead / 1-engine overhead |",
        "|---|---|---|---|---|",
    ]
    for n, m in sorted(med.items()):
        lines.append(
            f"| {n} | {m['total_s']:.2f} | {m['engine_startup_max_s']:.2f} | {m['overhead_s']:.2f} "
            f"| {m['overhead_s'] / base:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size-mib", type=int, default=64, help="checkpoint size")
    p.add_argument("--startup-delay", type=float, default=2.0, help="simulated load seconds per engine")
    args = p.parse_args()
    result = run(args)
    table = summarize(result)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = (
        f"Results, {stamp}, {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}\n"
        f"`python benches/weights_scaleout.py {' '.join(sys.argv[1:])}` (medians of {args.repeats})\n"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "weights_scaleout.json").write_text(json.dumps({"when": stamp, **result}, indent=1))
    (RESULTS / "weights_scaleout.md").write_text(header + "\n" + table + "\n")
    print(header)
    print(table)


if __name__ == "__main__":
    main()
