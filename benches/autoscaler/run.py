#!/usr/bin/env python3
"""Autoscaler benchmark: demand rises 4x and falls back, on simulated engines, time-compressed.

    .venv/bin/python benches/autoscaler/run.py            # ~5 minutes; builds release binaries first

Two workloads, each run against three fleets (the real rollout-manager with sglang-sim engines,
everything on loopback):

* serving: open-loop requests (low rate, 4x rate, low rate);
* rl: a simulated fully-async trainer (consumes a batch per step, batch 4x larger in the middle
  phase) fed by a rollout loop that may run one step ahead (staleness limit); the trainer
  reports every step to POST /rollout/pipeline.

Fleets: static-min (2 engines), static-max (6 engines), autoscaled (2..6, the YAML below; on the
rl workload it follows the pipeline signal). Reported: completed tokens, engine-seconds, p95
queue time (engine-side, from every engine's sglang:queue_time_seconds), p95 latency from
arrival, scale actions and direction changes (oscillation). Writes benches/autoscaler/results.json,
results.png (needs matplotlib: pip install -e 'python[bench]') and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
LISTENING = re.compile(r"rollout-manager listening control=(\S+) router=(\S+)")

#: Engines: 0.5x a modelled GPU's speed, at most 8 running requests in a KV pool of 2048 tokens
#: (a full batch of these requests fills about 70% of it), 1.5 s to "load weights".
MAX_RUNNING = 8
#: The router holds requests beyond MAX_RUNNING per engine (--max-inflight-per-engine), so work
#: waits where any engine, a new one included, can take it.
ENGINE_ARGS = [
    "--engine-arg=--time-scale=0.5",
    f"--engine-arg=--max-running-requests={MAX_RUNNING}",
    "--engine-arg=--max-total-tokens=2048",
    "--engine-arg=--startup-delay=1.5",
]
MAX_NEW_TOKENS = 128
#: One engine serves about 16 requests/s of 128 tokens (measured with the settings above).

#: The autoscaler, with the seed's policy compressed ~30x in time.
YAML = """
min_engines: 2
max_engines: 6
metrics_interval_secs: 0.5
evaluation_interval_secs: 1.0
condition_window_secs: 3.0
scale_out_cooldown_secs: 2.0
scale_in_cooldown_secs: 1.5
scale_out_policy:
  queue_depth_per_engine: 4
  queue_time_p95_threshold: 0.5
  ttft_p95_threshold: 1.0
  condition_duration_secs: 1.0
  max_delta: 4
scale_in_policy:
  token_usage_threshold: 0.3
  queue_depth_threshold: 1
  throughput_variance_threshold: 0.1
  condition_duration_secs: 3.0
pipeline_policy:
  trainer_wait_fraction_threshold: 0.15
  rollout_throttled_fraction_threshold: 0.15
  min_steps: 2
  report_max_age_secs: 5.0
  rate_headroom: 0.1  # the simulated engines' rate does not drift (real runs: keep 0.2)
"""

#: (seconds, requests per second) for the serving workload.
SERVING_PHASES = [(8.0, 18.0), (22.0, 72.0), (14.0, 18.0)]
#: (seconds, batch per trainer step) for the rl workload; a step trains for TRAIN_SECS.
RL_PHASES = [(8.0, 16), (22.0, 64), (14.0, 16)]
TRAIN_SECS = 1.0
GRACE = 6.0  # seconds after the last phase during which completions still count


def http_json(method: str, url: str, body: Any = None, timeout: float = 30.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def http_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


class Manager:
    """rollout-manager serve on free loopback ports; stopped with SIGTERM."""

    def __init__(self, binary: Path, state: Path, args: list[str]) -> None:
        state.mkdir(parents=True, exist_ok=True)
        self.out = state / "manager.stdout"
        argv = [str(binary), "serve", "--host", "127.0.0.1", "--port", "0", "--router-port", "0",
                "--state-dir", str(state), "--gpus", "6", "--rollout-num-gpus-per-engine", "1",
                "--routing-policy", "least_requests", "--max-inflight-per-engine", str(MAX_RUNNING),
                *ENGINE_ARGS, *args]  # fmt: skip
        with open(self.out, "wb") as out, open(state / "manager.stderr", "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            m = LISTENING.search(self.out.read_text())
            if m:
                self.control, self.router = m.group(1), m.group(2)
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"manager did not start: {(state / 'manager.stderr').read_text()[-2000:]}")
            time.sleep(0.05)

    def engines(self) -> list[dict[str, Any]]:
        view = http_json("GET", f"{self.control}/rollout/engines")
        return [e for m in view["models"].values() for e in m["engines"]]

    def wait_active(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while sum(e["status"] == "ACTIVE" for e in self.engines()) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} engines not ACTIVE within {timeout}s")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def queue_histogram(text: str) -> dict[float, float]:
    """Cumulative sglang:queue_time_seconds buckets of one engine, summed over label sets."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("sglang:queue_time_seconds_bucket"):
            le = re.search(r'le="([^"]+)"', line)
            if le:
                bound = float("inf") if le.group(1) == "+Inf" else float(le.group(1))
                out[bound] = out.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def p95(hist: dict[float, float]) -> float | None:
    """histogram_quantile(0.95) over cumulative buckets."""
    bounds = sorted(hist)
    total = hist.get(float("inf"), 0.0)
    if not total:
        return None
    rank, lower, below = 0.95 * total, 0.0, 0.0
    for b in bounds:
        if hist[b] >= rank:
            if b == float("inf"):
                return lower
            return lower + (b - lower) * (rank - below) / max(hist[b] - below, 1e-9)
        lower, below = b, hist[b]
    return lower


class Sampler(threading.Thread):
    """Engine count every 0.25 s; every engine's queue-time histogram every second."""

    def __init__(self, manager: Manager, t0: float, horizon: float) -> None:
        super().__init__(daemon=True)
        self.m, self.t0, self.horizon = manager, t0, horizon
        self.timeline: list[tuple[float, int, int]] = []  # (t, engines holding GPUs, active)
        self.hists: dict[str, dict[float, float]] = {}

    def run(self) -> None:
        last_scrape = 0.0
        while (t := time.monotonic() - self.t0) < self.horizon:
            try:
                engines = self.m.engines()
            except OSError:
                time.sleep(0.25)
                continue
            live = [e for e in engines if e["status"] not in ("REMOVED", "FAILED")]
            self.timeline.append((t, len(live), sum(e["status"] == "ACTIVE" for e in engines)))
            if t - last_scrape >= 1.0:
                last_scrape = t
                for e in live:
                    if e["status"] in ("ACTIVE", "DRAINING"):
                        try:
                            self.hists[e["engine_id"]] = queue_histogram(http_text(f"{e['url']}/metrics"))
                        except OSError:
                            pass
            time.sleep(0.25)

    def engine_seconds(self) -> float:
        total = 0.0
        for (t0, n, _), (t1, _, _) in itertools.pairwise(self.timeline):
            total += n * (t1 - t0)
        return total

    def queue_p95(self) -> float | None:
        merged: dict[float, float] = {}
        for h in self.hists.values():
            for b, v in h.items():
                merged[b] = merged.get(b, 0.0) + v
        return p95(merged)


def direction_changes(timeline: list[tuple[float, int, int]]) -> int:
    """How often the engine count turned from growing to shrinking or back."""
    changes, last_dir, last_n = 0, 0, None
    for _, n, _ in timeline:
        if last_n is not None and n != last_n:
            d = 1 if n > last_n else -1
            if last_dir and d != last_dir:
                changes += 1
            last_dir = d
        last_n = n
    return changes


def generate(router: str, i: int) -> int:
    body = {"text": f"rollout sample {i} " + "tok " * 40,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}}  # fmt: skip
    answer = http_json("POST", f"{router}/generate", body, timeout=120)
    return int(answer["meta_info"]["completion_tokens"])


def serving_load(m: Manager, t0: float, horizon: float) -> dict[str, Any]:
    """Open loop: arrivals on schedule; 160 sender threads; latency counted from the arrival."""
    arrivals: queue.Queue[float | None] = queue.Queue()
    tokens, latencies, lock = [0], [], threading.Lock()
    end = sum(d for d, _ in SERVING_PHASES)

    def dispatcher() -> None:
        start = 0.0
        for duration, rate in SERVING_PHASES:
            n = int(duration * rate)
            for k in range(n):
                at = start + k / rate
                time.sleep(max(0.0, t0 + at - time.monotonic()))
                arrivals.put(t0 + at)
            start += duration
        for _ in range(160):
            arrivals.put(None)

    def sender() -> None:
        i = 0
        while (at := arrivals.get()) is not None:
            i += 1
            try:
                n = generate(m.router, i)
            except OSError:
                continue
            done = time.monotonic()
            if done - t0 <= horizon:
                with lock:
                    tokens[0] += n
                    latencies.append(done - at)

    threads = [threading.Thread(target=dispatcher, daemon=True)]
    threads += [threading.Thread(target=sender, daemon=True) for _ in range(160)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, t0 + horizon - time.monotonic()))
    latencies.sort()
    demand = [(0.0, SERVING_PHASES[0][1])]
    start = 0.0
    for duration, rate in SERVING_PHASES:
        demand += [(start, rate), (start + duration, rate)]
        start += duration
    return {"tokens": tokens[0], "requests": len(latencies), "demand": demand, "end": end,
            "p95_latency": latencies[int(0.95 * (len(latencies) - 1))] if latencies else None}  # fmt: skip


def rl_load(m: Manager, t0: float, horizon: float, report: bool, rates: bool = False) -> dict[str, Any]:
    """A trainer consuming a batch per step, fed by rollout that may run one step ahead."""
    cv = threading.Condition()
    state = {"buffered": 0, "in_flight": 0, "consumed": 0, "batch": RL_PHASES[0][1], "throttled": 0.0,
             "stop": False, "tokens": 0, "produced": 0}  # fmt: skip
    end = sum(d for d, _ in RL_PHASES)
    waits: list[float] = []

    def gate_open() -> bool:
        return state["buffered"] + state["in_flight"] < 2 * state["batch"]

    def rollout_worker(w: int) -> None:
        i = 0
        while True:
            with cv:
                while not state["stop"] and not gate_open():
                    cv.wait(0.1)
                if state["stop"]:
                    return
                state["in_flight"] += 1
            i += 1
            try:
                generate(m.router, w * 100000 + i)
                ok = True
            except OSError:
                ok = False
            with cv:
                state["in_flight"] -= 1
                state["buffered"] += int(ok)
                state["produced"] += int(ok)
                cv.notify_all()

    def throttle_meter() -> None:
        """Rollout is throttled while the staleness limit holds it back with nothing in flight."""
        last = time.monotonic()
        while not state["stop"]:
            time.sleep(0.02)
            now = time.monotonic()
            with cv:
                if not gate_open() and state["in_flight"] == 0:
                    state["throttled"] += now - last
            last = now

    def throttled_now() -> float:
        return float(state["throttled"])

    def batch_at(t: float) -> int:
        """The batch the schedule asks for at t seconds (the trainer knows its own schedule)."""
        edge = 0.0
        for duration, batch in RL_PHASES:
            edge += duration
            if t < edge:
                return batch
        return RL_PHASES[-1][1]

    def trainer() -> None:
        step, start = 0, 0.0
        for duration, batch in RL_PHASES:
            with cv:
                state["batch"] = batch
                cv.notify_all()
            while time.monotonic() - t0 < start + duration:
                step += 1
                began = time.monotonic()
                with cv:
                    throttled_before = throttled_now()
                    produced_before = state["produced"]
                    while state["buffered"] < batch and time.monotonic() - t0 < horizon:
                        cv.wait(0.1)
                    if state["buffered"] < batch:
                        return
                    state["buffered"] -= batch
                    state["consumed"] += batch
                    if time.monotonic() - t0 <= horizon:
                        state["tokens"] += batch * MAX_NEW_TOKENS
                    cv.notify_all()
                wait = time.monotonic() - began
                waits.append(wait)
                time.sleep(TRAIN_SECS)
                step_secs = time.monotonic() - began
                with cv:
                    throttled = min(throttled_now() - throttled_before, step_secs)
                    produced = state["produced"] - produced_before
                if report:
                    body = {"step": step, "trainer_wait_secs": min(wait, step_secs),
                            "rollout_throttled_secs": throttled, "step_secs": step_secs}  # fmt: skip
                    if rates:
                        body["rollout_samples"] = produced
                        body["next_step_samples"] = batch_at(time.monotonic() - t0)
                    try:
                        http_json("POST", f"{m.control}/rollout/pipeline", body)
                    except OSError:
                        pass
            start += duration

    workers = [threading.Thread(target=rollout_worker, args=(w,), daemon=True) for w in range(128)]
    workers.append(threading.Thread(target=throttle_meter, daemon=True))
    for t in workers:
        t.start()
    trainer_thread = threading.Thread(target=trainer, daemon=True)
    trainer_thread.start()
    time.sleep(max(0.0, t0 + horizon - time.monotonic()))
    with cv:
        state["stop"] = True
        cv.notify_all()
    demand = []
    start = 0.0
    for duration, batch in RL_PHASES:
        demand += [(start, batch / TRAIN_SECS), (start + duration, batch / TRAIN_SECS)]
        start += duration
    return {"tokens": state["tokens"], "requests": state["consumed"], "demand": demand, "end": end,
            "p95_latency": None, "trainer_wait_total": sum(waits)}  # fmt: skip


def scheduled_scaling(m: Manager, t0: float, phases: list[tuple[float, float]]) -> threading.Thread:
    """The `scheduled` peer: told the demand schedule in advance, it asks for the static-max
    size the instant demand rises and for the minimum the instant it falls. No autoscaler can
    react sooner, so this is the bound set by engine startup alone."""
    low = phases[0][1]

    def go() -> None:
        edge = 0.0
        for duration, level in phases:
            time.sleep(max(0.0, t0 + edge - time.monotonic()))
            path, size = ("scale_out", 6) if level > low else ("scale_in", 2)
            if edge > 0.0:
                try:
                    http_json("POST", f"{m.control}/rollout/{path}", {"num_replicas": size})
                except OSError as e:
                    print(f"scheduled {path} failed: {e}", file=sys.stderr)
            edge += duration

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def run(binary: Path, workload: str, fleet: str, workdir: Path) -> dict[str, Any]:
    args = {"static-min": ["--rollout-num-gpus", "2"], "static-max": ["--rollout-num-gpus", "6"],
            "scheduled": ["--rollout-num-gpus", "2"]}.get(fleet)  # fmt: skip
    if args is None:
        yaml = workdir / "autoscaler.yaml"
        # Every metrics tick is recorded, for `rollout-manager autoscaler-replay`.
        trace = HERE / f"trace-{workload}{'-rates' if fleet == 'autoscaled+rates' else ''}.jsonl"
        trace.unlink(missing_ok=True)
        yaml.write_text(YAML + f"trace_file: {json.dumps(str(trace))}\n")
        args = ["--rollout-num-gpus", "2", "--autoscaler-config", str(yaml)]
    m = Manager(binary, workdir / f"{workload}-{fleet}", args)
    try:
        m.wait_active(6 if fleet == "static-max" else 2)
        horizon = sum(d for d, _ in (SERVING_PHASES if workload == "serving" else RL_PHASES)) + GRACE
        t0 = time.monotonic()
        sampler = Sampler(m, t0, horizon)
        sampler.start()
        if fleet == "scheduled":
            scheduled_scaling(m, t0, SERVING_PHASES if workload == "serving" else RL_PHASES)
        if workload == "serving":
            load = serving_load(m, t0, horizon)
        else:
            load = rl_load(m, t0, horizon, report=fleet.startswith("autoscaled"), rates=fleet == "autoscaled+rates")
        sampler.join(timeout=10)
        history = http_json("GET", f"{m.control}/autoscaler/scale_history")
        actions = [h for h in history["history"] if h["status"] not in ("REJECTED", "NOOP")]
        return {
            "workload": workload, "fleet": fleet, "tokens": load["tokens"], "requests": load["requests"],
            "engine_seconds": sampler.engine_seconds(), "p95_queue_time": sampler.queue_p95(),
            "p95_latency": load["p95_latency"], "scale_actions": len(actions),
            "direction_changes": direction_changes(sampler.timeline), "timeline": sampler.timeline,
            "demand": load["demand"], "trainer_wait_total": load.get("trainer_wait_total"),
        }  # fmt: skip
    finally:
        m.stop()


def table(results: list[dict[str, Any]]) -> str:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    rows = [
        "| workload | fleet | completed tokens | vs static-max | engine-seconds | vs static-max "
        "| p95 engine queue time (s) | p95 latency (s) | trainer waited (s) | scale actions | direction changes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ref = next((x for x in results if x["workload"] == r["workload"] and x["fleet"] == "static-max"), r)
        rows.append(
            f"| {r['workload']} | {r['fleet']} | {r['tokens']:,} | {r['tokens'] / max(ref['tokens'], 1):.0%} "
            f"| {r['engine_seconds']:.0f} | {r['engine_seconds'] / max(ref['engine_seconds'], 1e-9):.0%} "
            f"| {fmt(r['p95_queue_time'])} | {fmt(r['p95_latency'])} | {fmt(r.get('trainer_wait_total'))} "
            f"| {r['scale_actions']} | {r['direction_changes']} |"
        )
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install -e 'python[bench]'); no plot", file=sys.stderr)
        return False
    workloads = sorted({r["workload"] for r in results}, reverse=True)
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 6), squeeze=False, sharex="col")
    for col, w in enumerate(workloads):
        rs = [r for r in results if r["workload"] == w]
        xs, ys = zip(*rs[0]["demand"], strict=True)
        axes[0][col].plot(xs, ys, color="black")
        axes[0][col].set_title(f"{w}: demand")
        axes[0][col].set_ylabel("requests/s" if w == "serving" else "samples/s the trainer wants")
        for r in rs:
            t, n, _ = zip(*r["timeline"], strict=True) if r["timeline"] else ((), (), ())
            axes[1][col].step(t, n, where="post", label=r["fleet"])
        axes[1][col].set_ylabel("engines (holding GPUs)")
        axes[1][col].set_xlabel("seconds")
        axes[1][col].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="serving,rl")
    parser.add_argument("--fleets", default="static-min,static-max,scheduled,autoscaled,autoscaled+rates",
                        help="autoscaled+rates runs for the rl workload only")  # fmt: skip
    parser.add_argument("--no-build", action="store_true", help="use the existing target/release binaries")
    opts = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so every manager started is stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if not opts.no_build:
        subprocess.run(["cargo", "build", "--release", "--bins", "-p", "rollout-manager", "-p", "sglang-sim"],
                       cwd=ROOT, check=True)  # fmt: skip
    binary = ROOT / "target" / "release" / "rollout-manager"
    started = time.time()
    results = []
    with tempfile.TemporaryDirectory(prefix="autoscaler-bench-") as tmp:
        for workload in opts.workloads.split(","):
            for fleet in opts.fleets.split(","):
                if fleet == "autoscaled+rates" and workload != "rl":
                    continue
                print(f"running {workload} / {fleet} ...", file=sys.stderr, flush=True)
                results.append(run(binary, workload, fleet, Path(tmp)))
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)), "cpus": os.cpu_count(),
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
            "seconds": round(time.time() - started)}  # fmt: skip
    (HERE / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, HERE / "results.png")
    print(f"\n{meta['date']}, {meta['machine']}, {meta['seconds']} s\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
