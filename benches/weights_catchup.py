#!/usr/bin/env python3
"""Weights from the trainer: how fast new engines catch up, and what the manager adds to a
trainer's update.

The fleet is `sglang-sim` engines with the simulator's transfer model: `--weight-bytes` of
weights over links of `--transfer-gbps`. A seed engine sends its weights to one new instance at a
time (SGLang's remote-instance loading builds a 2-rank group per new instance, so one seed is a
queue); every rank of the trainer's NCCL broadcast receives a bucket in the time its bytes take
on one link. The trainer sends `--weight-bytes` in buckets of `--bucket-mb` (slime's default
`--update-weight-buffer-size`, 512 MiB), one `/update_weights_from_distributed` each, as slime,
AReaL and verl do.

Part 1, catch-up. For each number of seeds S (`--seeds`, the initial engines), a fresh manager
brings up S engines, the trainer (a stand-in rank 0 through `DistributedWeightSync`) broadcasts
`step-1`, then the fleet scales out by N engines (`--new`) and back in, `--repeats` times each.
New engines copy step-1 from the seeds (the manager spreads them, fewest copies first). Reported:
request sent -> operation ACTIVE (the manager's timestamps), the bound "startup + copies per seed x
one transfer", and the ratio to N=1 with the same seeds. Every new engine is checked to report
step-1 in `/model_info`.

Part 2, a trainer update through the manager against the trainer driving the engines itself (the
pre-manager `DistributedWeightSync`, reproduced here as `direct_update`: init group, pause,
begin, each bucket's update while rank 0 broadcasts it, end, continue), alternated on the same engines,
`--update-repeats` times each. The ratio manager / direct is the figure the issue bounds (<= 1.05).

Run from the repository root after `cargo build --release --workspace --bins` (or debug):

    .venv/bin/python benches/weights_catchup.py
    .venv/bin/python benches/weights_catchup.py --seeds 1 4 --new 1 4 16 --repeats 2 \
        --weight-bytes 16e9 --transfer-gbps 100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from elastic_rollout import RolloutClient
from elastic_rollout.sim import SimRank0
from elastic_rollout.trainer import DistributedWeightSync, GroupLayout, TensorSpec, plan_layout

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"


def buckets_of(weight_bytes: float, bucket_mb: float) -> list[list[TensorSpec]]:
    """The trainer's buckets: ``weight_bytes`` of bf16 tensors, one tensor of ``bucket_mb`` MiB
    (rows of 8192 values) per bucket, the last one smaller."""
    per_bucket = int(bucket_mb * 2**20)
    left, out = int(weight_bytes), []
    while left > 0:
        size = min(left, per_bucket)
        rows = max(1, size // (2 * 8192))
        out.append([TensorSpec(f"model.bucket{len(out)}.weight", "bfloat16", (rows, 8192))])
        left -= size
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def binary() -> Path:
    found = [ROOT / "target" / p / "rollout-manager" for p in ("release", "debug")]
    found = [p for p in found if p.exists()]
    if not found:
        sys.exit("build first: cargo build --release --workspace --bins")
    return max(found, key=lambda p: p.stat().st_mtime)


class Fleet:
    """One `rollout-manager serve --engine sim` with the transfer model."""

    def __init__(self, seeds: int, gpus: int, args: argparse.Namespace, state: Path) -> None:
        self.port, self.router_port = free_port(), free_port()
        engine_args = [
            f"--weight-bytes={int(args.weight_bytes)}",
            f"--transfer-gbps={args.transfer_gbps}",
            f"--startup-delay={args.startup_delay}",
        ]
        cmd = [
            str(binary()), "serve", "--engine", "sim", "--gpus", str(gpus),
            "--rollout-num-gpus", str(seeds), "--rollout-num-gpus-per-engine", "1",
            "--port", str(self.port), "--router-port", str(self.router_port), "--state-dir", str(state),
            *[f"--engine-arg={a}" for a in engine_args],
        ]  # fmt: skip
        self.log = open(state.parent / f"manager-{seeds}.log", "wb")
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = RolloutClient(f"http://127.0.0.1:{self.port}", timeout=120)
        self.wait_active(seeds, 120)

    def wait_active(self, n: int, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                view = self.client.engines()
                active = view.with_status("ACTIVE")
                if len(active) == n and len(view.engines) == n:
                    return active
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{n} engines not ACTIVE within {timeout}s")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def model_version(url: str) -> str:
    return str(httpx.get(url + "/model_info", timeout=10).json()["weight_version"])


def catch_up(args: argparse.Namespace, seeds: int, work: Path) -> list[dict[str, Any]]:
    transfer = args.weight_bytes * 8 / (args.transfer_gbps * 1e9) if args.transfer_gbps > 0 else 0.0
    fleet = Fleet(seeds, seeds + max(args.new), args, work / f"state-{seeds}")
    rows = []
    try:
        sync = DistributedWeightSync(fleet.client, join_group=SimRank0().join_group,
                                     broadcast=SimRank0().broadcast, timeout=600)  # fmt: skip
        sync.update("step-1", buckets=args.buckets)
        for n in args.new:
            for r in range(args.repeats):
                op = fleet.client.scale_out(num_replicas=seeds + n)
                done = fleet.client.wait_for_operation("scale_out", op.request_id, 600)
                assert done.status == "ACTIVE", done
                total = float(done.raw["updated_at"]) - float(done.raw["created_at"])
                engines = fleet.wait_active(seeds + n, 60)
                versions = {model_version(e.url) for e in engines}
                assert versions == {"step-1"}, versions
                per_seed = -(-n // seeds)
                rows.append({
                    "seeds": seeds, "new": n, "repeat": r, "total_s": round(total, 3),
                    "copies_per_seed": per_seed, "transfer_s": round(transfer, 3),
                    "bound_s": round(args.startup_delay + per_seed * transfer, 3),
                })  # fmt: skip
                print(f"seeds={seeds} new={n} repeat={r}: {total:.2f} s to ACTIVE on step-1", flush=True)
                out = fleet.client.scale_in(num_replicas=seeds)
                fleet.client.wait_for_operation("scale_in", out.request_id, 120)
                fleet.wait_active(seeds, 60)
        rows.extend(update_cost(args, fleet, sync))
    finally:
        fleet.stop()
    return rows


def direct_update(
    engines: list[tuple[str, str, int]], version: str, layout: GroupLayout | None, buckets: list[list[TensorSpec]]
) -> GroupLayout:
    """What DistributedWeightSync did before the manager ran updates: the trainer calls every
    engine itself. Builds its own group on first use (a name of its own beside the manager's)."""
    rank0 = SimRank0()
    http = httpx.Client(timeout=600)

    def on_all(route: str, body: dict[str, Any]) -> None:
        with ThreadPoolExecutor(len(engines)) as pool:
            for resp in pool.map(lambda e: http.post(e[1] + route, json=body), engines):
                if resp.status_code not in (200, 404):
                    raise RuntimeError(f"{route}: {resp.status_code} {resp.text[:200]}")

    if layout is None:
        layout = plan_layout(engines, group_name="direct_group", master_address="127.0.0.1", master_port=free_port())
        with ThreadPoolExecutor(len(engines) + 1) as pool:
            joined = pool.submit(rank0.join_group, layout)
            bodies = [
                {"master_address": layout.master_address, "master_port": layout.master_port,
                 "rank_offset": m.rank_offset, "world_size": layout.world_size,
                 "group_name": layout.group_name, "backend": "nccl"}
                for m in layout.members
            ]  # fmt: skip
            for resp in pool.map(lambda mb: http.post(mb[0].url + "/init_weights_update_group", json=mb[1]),
                                 zip(layout.members, bodies, strict=True)):  # fmt: skip
                resp.raise_for_status()
            joined.result()
    on_all("/pause_generation", {"mode": "retract"})
    on_all("/begin_weight_update", {})
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        body: dict[str, Any] = {"names": [s.name for s in bucket], "dtypes": [s.dtype for s in bucket],
                                "shapes": [list(s.shape) for s in bucket], "group_name": layout.group_name,
                                "flush_cache": last}  # fmt: skip
        if last:
            body["weight_version"] = version
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(rank0.broadcast, layout, bucket)
            on_all("/update_weights_from_distributed", body)
            sent.result()
    on_all("/end_weight_update", {})
    on_all("/continue_generation", {})
    return layout


def update_cost(args: argparse.Namespace, fleet: Fleet, sync: DistributedWeightSync) -> list[dict[str, Any]]:
    engines = [(e.engine_id, e.url, 1) for e in sorted(fleet.wait_active(len(fleet.client.engines().engines), 60),
                                                        key=lambda e: e.engine_id)]  # fmt: skip
    rows = []
    direct_layout = direct_update(engines, "warm-direct", None, args.buckets)  # builds its group once
    sync.update("warm-manager", buckets=args.buckets)
    for r in range(args.update_repeats):
        t0 = time.perf_counter()
        direct_update(engines, f"direct-{r}", direct_layout, args.buckets)
        direct = time.perf_counter() - t0
        t0 = time.perf_counter()
        sync.update(f"manager-{r}", buckets=args.buckets)
        managed = time.perf_counter() - t0
        assert fleet.client.weights().version == f"manager-{r}"
        rows.append({"seeds": len(engines), "update_repeat": r, "direct_s": round(direct, 4),
                     "manager_s": round(managed, 4), "ratio": round(managed / direct, 4)})  # fmt: skip
        print(
            f"update on {len(engines)} engines: direct {direct:.3f} s, through the manager {managed:.3f} s", flush=True
        )
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for seeds in sorted({r["seeds"] for r in rows if "new" in r}):
        pts = sorted({r["new"] for r in rows if r.get("seeds") == seeds and "new" in r})
        med = [
            statistics.median(r["total_s"] for r in rows if r.get("seeds") == seeds and r.get("new") == n) for n in pts
        ]
        bound = [next(r["bound_s"] for r in rows if r.get("seeds") == seeds and r.get("new") == n) for n in pts]
        line = ax.plot(pts, med, marker="o", label=f"{seeds} seed(s): measured")[0]
        ax.plot(pts, bound, linestyle="--", color=line.get_color(), label=f"{seeds} seed(s): startup + queue bound")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("new engines in one scale-out")
    ax.set_ylabel("seconds to ACTIVE on the trainer's version")
    ax.set_title("Catch-up by remote-instance copies (sglang-sim transfer model)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 4])
    p.add_argument("--new", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--update-repeats", type=int, default=5)
    p.add_argument("--weight-bytes", type=float, default=16e9, help="16 GB: an 8B model in bf16")
    p.add_argument("--transfer-gbps", type=float, default=100.0)
    p.add_argument("--startup-delay", type=float, default=0.5, help="each sim engine's simulated startup")
    p.add_argument("--bucket-mb", type=float, default=512.0, help="the trainer's bucket size (slime's default)")
    args = p.parse_args()
    args.buckets = buckets_of(args.weight_bytes, args.bucket_mb)
    work = Path(tempfile.mkdtemp(prefix="weights-catchup-"))
    rows: list[dict[str, Any]] = []
    for seeds in args.seeds:
        try:
            rows.extend(catch_up(args, seeds, work))
        except BaseException:
            print(f"failed; the manager's and engines' logs are under {work}", file=sys.stderr)
            raise
    shutil.rmtree(work, ignore_errors=True)
    print("\n| seeds | new engines | copies per seed | to ACTIVE s (median) | bound s | / N=1 |")
    print("|---|---|---|---|---|---|")
    for seeds in args.seeds:
        base = None
        for n in args.new:
            got = [r for r in rows if r.get("seeds") == seeds and r.get("new") == n]
            if not got:
                continue
            med = statistics.median(r["total_s"] for r in got)
            base = base or med
            per_seed, bound = got[0]["copies_per_seed"], got[0]["bound_s"]
            print(f"| {seeds} | {n} | {per_seed} | {med:.2f} | {bound:.2f} | {med / base:.2f} |")
    ups = [r for r in rows if "ratio" in r]
    if ups:
        print("\n| engines | direct s (median) | through the manager s (median) | ratio |")
        print("|---|---|---|---|")
        for seeds in sorted({r["seeds"] for r in ups}):
            got = [r for r in ups if r["seeds"] == seeds]
            d = statistics.median(r["direct_s"] for r in got)
            m = statistics.median(r["manager_s"] for r in got)
            print(f"| {seeds} | {d:.3f} | {m:.3f} | {m / d:.3f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "weights_catchup.json"
    meta = {
        "args": {k: v for k, v in vars(args).items() if k != "buckets"},
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "binary": str(binary()),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    png = RESULTS / "weights_catchup.png"
    plot(rows, png)
    print(f"\nwrote {out} and {png}")


if __name__ == "__main__":
    main()
