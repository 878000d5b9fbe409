#!/usr/bin/env python3
"""Scale of the control plane (issue 8, part 5): one manager with 1,000 simulated engines.

    .venv/bin/python benches/control_plane_scale.py [--engines 1000 --scale 100 --window 60]

What one invocation does (everything on loopback; every process it starts is killed at the end):

1. Starts one `sglang-sim --zero-cost --instances N+S` process (N engines for the fleet, S spare
   ones for the scale test) on consecutive free ports, and a `rollout-manager serve` with no local
   engines (`--gpus 1 --rollout-num-gpus 0`), its production defaults for every interval
   (health probes every 5 s, router load polling every 1 s, autoscaler metrics every 10 s) and
   its store in a fresh --state-dir.
2. Attaches the N engines as external engines, `--attach-batch` URLs per
   `POST /rollout/scale_out {"engine_urls"}` (one operation at a time), and waits until all are
   ACTIVE (reported: the time of each batch).
3. Idle window (`--window` seconds, no API calls except one `/health` per second to confirm it
   lives): the manager's CPU share (utime+stime of all its threads from /proc/<pid>/stat, over
   the window, as a share of one core) and its resident memory (VmRSS, sampled every second,
   maximum reported).
4. API latency, one request at a time over a kept-alive connection: `GET /health` (the floor: an
   axum route that touches nothing), `GET /rollout/engines` (N engines as JSON),
   `GET /rollout/engines?...` is not filtered so it is the heavy read, `GET /rollout/scale_out/{id}`
   of the attach operation (a record with N engines), `GET /metrics`, `GET /autoscaler/status`;
   p50/p99/max over `--api-samples` each.
5. Scale test: attach the S spare engines (`scale_out` with their URLs), wait for all ACTIVE;
   detach them (`scale_in` with their URLs), wait for COMPLETED. Reported: each POST's own
   latency and each operation's time from POST to its terminal state. The engines are external,
   so this is the control plane's cost (registry, store, probes, routing table), not process
   start-up.
6. Prints a markdown table with the goals (< 25% of one core, < 200 MB, API p99 < 20 ms) and the
   load average before and after; writes benches/results/control_plane_scale.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
from elastic_rollout._find import find_binary  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
GOALS = {"cpu_share": 0.25, "rss_mb": 200.0, "api_p99_ms": 20.0}


def consecutive_free_ports(count: int, start: int = 20000, stop: int = 60000) -> int:
    """First port p such that p..p+count-1 can all be bound on loopback now."""
    base = start
    while base + count < stop:
        socks = []
        try:
            for i in range(count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            base += len(socks) + 1
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports between {start} and {stop}")


class Api:
    """Kept-alive HTTP/1.1 connection to the control port."""

    def __init__(self, base: str) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes, float]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        started = time.perf_counter()
        try:
            self.conn.request(method, path, body=data, headers=headers)
            resp = self.conn.getresponse()
            payload = resp.read()
        except (http.client.HTTPException, OSError):
            self.conn.close()
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            self.conn.request(method, path, body=data, headers=headers)
            resp = self.conn.getresponse()
            payload = resp.read()
        return resp.status, payload, time.perf_counter() - started

    def json(self, method: str, path: str, body: Any = None) -> Any:
        status, payload, _ = self.call(method, path, body)
        if status != 200:
            raise RuntimeError(f"{method} {path}: {status} {payload[:500]!r}")
        return json.loads(payload)


def cpu_ticks(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, all threads


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_op(api: Api, kind: str, request_id: str, timeout: float) -> tuple[str, float]:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        op = api.json("GET", f"/rollout/{kind}/{request_id}")
        if op["status"] in ("ACTIVE", "FAILED", "CANCELLED", "COMPLETED", "NOOP"):
            return op["status"], time.monotonic() - started
        time.sleep(0.05)
    raise RuntimeError(f"{kind} {request_id} not finished after {timeout}s")


def percentiles(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50_ms": round(q[49], 3), "p99_ms": round(q[98], 3), "max_ms": round(ms[-1], 3), "n": len(ms)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=1000)
    parser.add_argument("--scale", type=int, default=100, help="engines attached and detached in the scale test")
    parser.add_argument("--window", type=float, default=60.0, help="seconds of the idle CPU/memory window")
    parser.add_argument("--api-samples", type=int, default=300)
    parser.add_argument("--attach-batch", type=int, default=1000, help="engines attached per scale-out")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds after attach before measuring")
    parser.add_argument("--out", type=Path, default=ROOT / "benches" / "results")
    args = parser.parse_args()

    manager_bin = os.environ.get("ELASTIC_ROLLOUT_MANAGER_BIN") or str(find_binary("rollout-manager"))
    sim_bin = os.environ.get("SGLANG_SIM_BIN") or str(find_binary("sglang-sim"))
    total = args.engines + args.scale
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="cp-scale-"))
    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "manager_binary": manager_bin,
        "engines": args.engines,
        "scale_n": args.scale,
        "loadavg_before": [round(x, 2) for x in load_before],
    }
    try:
        base = consecutive_free_ports(total)
        sim_log = open(work / "sim.log", "wb")
        sim = subprocess.Popen(
            [sim_bin, "--model-path", "sim-model", "--port", str(base), "--instances", str(total),
             "--zero-cost", "--enable-metrics", "--log-level", "warning"],
            stdout=sim_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        procs.append(sim)
        mgr_out = open(work / "manager.stdout", "wb")
        mgr_err = open(work / "manager.stderr", "wb")
        manager = subprocess.Popen(
            [manager_bin, "serve", "--host", "127.0.0.1", "--port", "0", "--router-port", "0",
             "--state-dir", str(work / "state"), "--gpus", "1", "--rollout-num-gpus", "0",
             "--max-engines", str(total + 10)],
            stdout=mgr_out, stderr=mgr_err, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "NO_COLOR": "1"},
        )  # fmt: skip
        procs.append(manager)
        control = None
        deadline = time.monotonic() + 30
        while control is None and time.monotonic() < deadline:
            for line in (work / "manager.stdout").read_text(errors="replace").splitlines():
                if line.startswith("rollout-manager listening control="):
                    control = line.split("control=")[1].split()[0]
            if manager.poll() is not None:
                raise RuntimeError(f"manager exited: {(work / 'manager.stderr').read_text()[-2000:]}")
            time.sleep(0.1)
        if control is None:
            raise RuntimeError("manager did not print its listening line")
        api = Api(control)
        urls = [f"http://127.0.0.1:{base + i}" for i in range(total)]
        # Wait until the last instance answers (the sim binds them one after another).
        deadline = time.monotonic() + 120
        while True:
            try:
                probe = http.client.HTTPConnection("127.0.0.1", base + total - 1, timeout=2)
                probe.request("GET", "/health")
                if probe.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or sim.poll() is not None:
                raise RuntimeError(f"sglang-sim not up: {(work / 'sim.log').read_text()[-2000:]}")
            time.sleep(0.2)
        results["sim_rss_mb"] = round(rss_mb(sim.pid), 1)

        # Attach N engines, `--attach-batch` per scale-out (one operation at a time).
        started = time.monotonic()
        batches = []
        for first in range(0, args.engines, args.attach_batch):
            batch = urls[first : min(args.engines, first + args.attach_batch)]
            attach = api.json("POST", "/rollout/scale_out", {"engine_urls": batch, "timeout_secs": 600})
            status, took = wait_op(api, "scale_out", attach["request_id"], 900)
            batches.append(round(took, 2))
            print(f"attached {first + len(batch)}: {status}, this batch of {len(batch)} in {took:.2f} s", flush=True)
            if status != "ACTIVE":
                op = api.json("GET", f"/rollout/scale_out/{attach['request_id']}")
                raise RuntimeError(
                    f"attach ended {status}: {op.get('error_message')}; failed (first 3): {op['failed_engines'][:3]}"
                )
        results["attach_n"] = {"status": status, "secs": round(time.monotonic() - started, 2), "batches_s": batches}

        # Idle window: CPU share and memory under probes, load polling and metrics collection.
        time.sleep(args.settle)
        ticks0, t0 = cpu_ticks(manager.pid), time.monotonic()
        rss: list[float] = []
        while time.monotonic() - t0 < args.window:
            rss.append(rss_mb(manager.pid))
            api.call("GET", "/health")
            time.sleep(1.0)
        ticks1, t1 = cpu_ticks(manager.pid), time.monotonic()
        results["cpu_share"] = round((ticks1 - ticks0) / CLK_TCK / (t1 - t0), 4)
        results["rss_mb_max"] = round(max(rss), 1)
        results["rss_mb_end"] = round(rss[-1], 1)
        engines_doc = api.json("GET", "/rollout/engines")
        results["active_engines"] = sum(
            1 for m in engines_doc["models"].values() for e in m["engines"] if e["status"] == "ACTIVE"
        )
        print(f"idle: cpu {results['cpu_share']:.1%} of a core, rss max {results['rss_mb_max']} MB, "
              f"{results['active_engines']} ACTIVE", flush=True)  # fmt: skip

        # API latency.
        latency: dict[str, dict[str, float]] = {}
        routes = {
            "GET /health": "/health",
            "GET /rollout/engines": "/rollout/engines",
            "GET /rollout/scale_out/{id}": f"/rollout/scale_out/{attach['request_id']}",
            "GET /metrics": "/metrics",
            "GET /autoscaler/status": "/autoscaler/status",
        }
        sizes: dict[str, int] = {}
        for name, path in routes.items():
            samples = []
            for _ in range(args.api_samples):
                status_code, payload, secs = api.call("GET", path)
                if status_code != 200:
                    raise RuntimeError(f"{name}: {status_code} {payload[:300]!r}")
                samples.append(secs)
                sizes[name] = len(payload)
            latency[name] = {**percentiles(samples), "bytes": sizes[name]}
            print(f"{name}: {latency[name]}", flush=True)

        # Scale S out and back.
        spare = urls[args.engines :]
        status_code, payload, post_out = api.call("POST", "/rollout/scale_out", {"engine_urls": spare})
        out_id = json.loads(payload)["request_id"]
        out_status, out_secs = wait_op(api, "scale_out", out_id, 600)
        status_code, payload, post_in = api.call("POST", "/rollout/scale_in", {"engine_urls": spare})
        if status_code != 200:
            raise RuntimeError(f"scale_in: {status_code} {payload[:300]!r}")
        in_id = json.loads(payload)["request_id"]
        in_status, in_secs = wait_op(api, "scale_in", in_id, 600)
        latency["POST /rollout/scale_out (S urls)"] = {"p50_ms": round(post_out * 1000, 3), "n": 1}
        latency["POST /rollout/scale_in (S urls)"] = {"p50_ms": round(post_in * 1000, 3), "n": 1}
        results["scale"] = {
            "out": {"status": out_status, "secs": round(out_secs, 3)},
            "in": {"status": in_status, "secs": round(in_secs, 3)},
        }
        results["latency"] = latency
        results["rss_mb_after_scale"] = round(rss_mb(manager.pid), 1)
        print(f"scale {args.scale} out: {out_status} {out_secs:.2f} s; back: {in_status} {in_secs:.2f} s", flush=True)
        results["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()

    heavy = [v["p99_ms"] for k, v in results["latency"].items() if k.startswith("GET") and "p99_ms" in v]
    results["api_p99_ms_worst"] = max(heavy)
    results["goals"] = {
        "cpu_share": results["cpu_share"] < GOALS["cpu_share"],
        "rss_mb": results["rss_mb_max"] < GOALS["rss_mb"],
        "api_p99_ms": results["api_p99_ms_worst"] < GOALS["api_p99_ms"],
    }
    md = render(results)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "control_plane_scale.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "control_plane_scale.md").write_text(md)
    return 0 if all(results["goals"].values()) else 1


def render(r: dict[str, Any]) -> str:
    ok = {True: "yes", False: "NO"}
    lines = [
        f"Results, {r['date']}, {r['machine']}",
        f"`{r['command']}`; load average before {r['loadavg_before']}, after {r.get('loadavg_after')}",
        "",
        "| measure | value | goal | met |",
        "|---|---|---|---|",
        f"| manager CPU, idle with {r['engines']} engines | {r['cpu_share']:.1%} of one core | < 25% "
        f"| {ok[r['goals']['cpu_share']]} |",
        f"| manager resident memory (max over the window) | {r['rss_mb_max']} MB | < 200 MB "
        f"| {ok[r['goals']['rss_mb']]} |",
        f"| worst control-API GET p99 | {r['api_p99_ms_worst']} ms | < 20 ms | {ok[r['goals']['api_p99_ms']]} |",
        f"| attach {r['engines']} external engines, {len(r['attach_n']['batches_s'])} scale-outs in a row "
        f"| {r['attach_n']['secs']} s (per batch: {', '.join(map(str, r['attach_n']['batches_s']))}) | | |",
        f"| scale out by {r['scale_n']} (POST to ACTIVE) "
        f"| {r['scale']['out']['secs']} s ({r['scale']['out']['status']}) | | |",
        f"| scale back in by {r['scale_n']} (POST to COMPLETED) "
        f"| {r['scale']['in']['secs']} s ({r['scale']['in']['status']}) | | |",
        f"| manager memory after the scale test | {r['rss_mb_after_scale']} MB | | |",
        "",
        "| request | p50 ms | p99 ms | max ms | n | body bytes |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in r["latency"].items():
        lines.append(
            f"| {name} | {v.get('p50_ms', '')} | {v.get('p99_ms', '')} | {v.get('max_ms', '')} "
            f"| {v.get('n', '')} | {v.get('bytes', '')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
