#!/usr/bin/env python3
"""Benchmark 2 of issue 5: a GRPO-like rollout batch with a heavy-tailed output length, sent
through each router to the same simulated engines with finite KV pools.

    .venv/bin/python benches/router_longtail.py [--groups 64 --samples 8 --seed 0 ...]

What one invocation does (everything on loopback; every process it starts is in its own process
group and is killed at the end):

1. Builds the request set from the seed: `groups` prompts x `samples` samples (siblings share the
   prompt text, so the prefix cache matters; all prompts share a system prefix), plus `sessions`
   multi-turn conversations of `turns` turns (turn k+1's prompt is turn k's prompt + its output +
   a follow-up, sent with `x-session-id`). Output lengths are lognormal with a per-group and a
   per-sample factor, clipped, and are forced exactly: `max_new_tokens: L, ignore_eos: true`
   (`--length-hint exact`, the default: the router can see L) or `max_new_tokens: <cap>,
   min_new_tokens: L-1` on engines with `--eos-prob 1` (`--length-hint hidden`: every request
   announces the same cap, as in real RL rollouts, and still generates exactly L tokens).
2. Calibration, on 3 fresh engines with the same flags (not part of any fleet), concurrently:
   the longest single request alone on an idle engine (T_solo), the longest session chain alone
   on another (T_chain), and 1/N of the batch (every N-th group and session) on a third, whose
   `gen_throughput` sampled while it has waiting requests gives R_sat, the generation rate of one
   saturated engine on this workload mix.
3. Lower bound LB = max(T_solo, T_chain, W / (N x R_sat)) with W the batch's output tokens.
4. `--repeats` rounds of one run per router/policy, each on a fresh `sglang-sim --instances N`
   process: our manager (engines attached with `POST /rollout/scale_out {"engine_urls"}`) with
   its default flags (late binding with each engine's automatic cap, `longest_first` with learned
   lengths) and `capacity` or `round_robin`; `ours_lf:capacity`, the same with a fixed cap
   (`--max-inflight-per-engine` = `--late-binding-cap`); `ours_old:capacity`, the defaults before
   issue 17 (`--max-inflight-per-engine 0 --queue-order fifo`: no late binding);
   `ours_fifo:capacity`, the defaults with `--queue-order fifo` (the switch for interactive
   traffic: late binding in arrival order); `ours_tail:capacity`, the defaults with
   `--move-tail true` (running requests move for the tail, and short ones give their slot to
   much longer waiting ones); `ours_chunk:capacity`, the defaults with `--chunk-tokens`
   (`--chunk-tokens` here, 512 by default: every request runs one chunk at a time and goes back
   to the router's queue between chunks); `ours_base:<policy>`, the defaults of another build
   (`--baseline-binary`, to measure a change in the same invocation); and `smg`
   with `cache_aware`, `power_of_two`, `least_load`,
   `round_robin`. Two reference rows use no router: `oracle:lpt_arrival` sends each request
   straight to the engine an offline longest-processing-time-first partition of the exact output
   lengths chose (perfect balance, knowledge no router has), `oracle:lpt_longest_first` does the
   same but submits the longest requests first. All requests are submitted at once (concurrency
   cap = batch size); every engine's `/v1/loads` is sampled every 0.25 s.
5. Prints a markdown table (median and range over the repeats), writes
   benches/results/router_longtail.{json,md} and a PNG of load across engines over time
   (ours capacity, vs `ours_chunk:capacity` or `ours_tail:capacity` when in the run, else vs
   the best smg policy by median makespan).
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from statistics import median

AUTO_CAP = r"^rollout_engine_auto_inflight_cap\{[^}]*\} (\S+)$"
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results"
SIM = ROOT / "target" / "release" / "sglang-sim"
MANAGER = ROOT / "target" / "release" / "rollout-manager"
SMG = ROOT / ".venv" / "bin" / "smg"
MODEL = "sim-model"  # the manager's default --model-path; attached engines must serve it

ALL_ROUTERS = [
    "oracle:lpt_arrival",
    "oracle:lpt_longest_first",
    "ours:capacity",
    "ours_lf:capacity",
    "ours_old:capacity",
    "ours_fifo:capacity",
    "ours_tail:capacity",
    "ours_chunk:capacity",
    "ours:round_robin",
    "smg:cache_aware",
    "smg:power_of_two",
    "smg:least_load",
    "smg:round_robin",
]

# ----------------------------------------------------------------------------------------------
# Workload


@dataclass
class Req:
    idx: int
    kind: str  # "grpo" or "session"
    group: int  # group index, or session index for sessions
    sample: int  # sample index, or turn index for sessions
    prompt: str  # for sessions: the turn's own follow-up text (the prompt is built at run time)
    out_len: int


@dataclass
class Workload:
    grpo: list[Req]
    sessions: list[list[Req]]  # per session, its turns in order
    session_base: list[str]
    cap: int
    hint: str  # "exact" or "hidden"

    def all_reqs(self) -> list[Req]:
        return self.grpo + [r for s in self.sessions for r in s]

    def total_out(self) -> int:
        return sum(r.out_len for r in self.all_reqs())


def _word(rng: random.Random) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return "".join(rng.choice(letters) for _ in range(rng.randint(3, 5)))


def _words(rng: random.Random, n: int) -> str:
    return " ".join(_word(rng) for _ in range(n))


def lognormal_len(rng: random.Random, median: float, z: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(z))))


def build_workload(a: argparse.Namespace) -> Workload:
    rng = random.Random(a.seed)
    system = _words(rng, 64)  # shared by every prompt: a fleet-wide cached prefix
    grpo: list[Req] = []
    for g in range(a.groups):
        question = _words(rng, rng.randint(a.prompt_min, a.prompt_max))
        prompt = f"{system} {question}"
        zg = rng.gauss(0.0, a.sigma_group)  # prompt difficulty: siblings' lengths correlate
        for s in range(a.samples):
            z = zg + rng.gauss(0.0, a.sigma_sample)
            grpo.append(Req(len(grpo), "grpo", g, s, prompt, lognormal_len(rng, a.median, z, 8, a.cap)))
    sessions: list[list[Req]] = []
    session_base: list[str] = []
    idx = len(grpo)
    for s in range(a.sessions):
        session_base.append(f"{system} {_words(rng, rng.randint(a.prompt_min, a.prompt_max))}")
        turns = []
        for t in range(a.turns):
            follow = _words(rng, 32)
            z = rng.gauss(0.0, math.hypot(a.sigma_group, a.sigma_sample))
            turns.append(Req(idx, "session", s, t, follow, lognormal_len(rng, a.session_median, z, 8, a.session_cap)))
            idx += 1
        sessions.append(turns)
    return Workload(grpo, sessions, session_base, a.cap, a.length_hint)


def body_for(w: Workload, r: Req, prompt: str) -> dict:
    if w.hint == "exact":
        sp = {"max_new_tokens": r.out_len, "ignore_eos": True}
    else:  # hidden: every request announces the cap; --eos-prob 1 ends it after exactly out_len
        sp = {"max_new_tokens": w.cap, "min_new_tokens": r.out_len - 1, "ignore_eos": False}
    sp["sampling_seed"] = r.sample  # siblings differ in their outputs
    return {"text": prompt, "sampling_params": sp, "rid": f"r{r.idx}"}


# ----------------------------------------------------------------------------------------------
# Processes and HTTP


class Procs:
    """Every child process, each in its own process group; killed (group-wise) on close."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.logs: list = []

    def start(self, name: str, cmd: list[str], env: dict | None = None, stdout_pipe: bool = False) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        self.logs.append(log)
        p = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE if stdout_pipe else log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=self.tmp,
            start_new_session=True,
        )
        self.procs.append((name, p))
        return p

    def stop(self, p: subprocess.Popen, grace: float = 5.0) -> None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            if p.poll() is not None:
                break
            try:
                os.killpg(p.pid, sig)  # the group this script created for p
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        # Children of p that outlived it (smg's router process) are still in p's group.
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.procs = [(n, q) for n, q in self.procs if q is not p]

    def close(self) -> None:
        for _, p in list(self.procs):
            self.stop(p, grace=3.0)
        for log in self.logs:
            log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int, rng: random.Random) -> int:
    for _ in range(200):
        base = rng.randint(20000, 60000 - n)
        socks = []
        try:
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 10.0, headers: dict | None = None):
    m = re.match(r"http://([^/:]+):(\d+)(/.*)?$", url)
    assert m, url
    conn = http.client.HTTPConnection(m.group(1), int(m.group(2)), timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        h = {"Content-Type": "application/json"} if data is not None else {}
        h.update(headers or {})
        conn.request(method, m.group(3) or "/", body=data, headers=h)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors="replace")
        return resp.status, parsed, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def http_text(url: str, timeout: float = 10.0) -> str:
    m = re.match(r"http://([^/:]+):(\d+)(/.*)?$", url)
    assert m, url
    conn = http.client.HTTPConnection(m.group(1), int(m.group(2)), timeout=timeout)
    try:
        conn.request("GET", m.group(3) or "/")
        return conn.getresponse().read().decode(errors="replace")
    finally:
        conn.close()


def wait_until(pred, timeout: float, what: str, period: float = 0.1):
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except (OSError, http.client.HTTPException) as e:
            last_exc = e
        time.sleep(period)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc})")


def engine_flags(a: argparse.Namespace) -> list[str]:
    f = [
        "--model-path",
        MODEL,
        "--enable-metrics",
        "--skip-server-warmup",
        "--max-total-tokens",
        str(a.max_total_tokens),
        "--time-scale",
        str(a.time_scale),
    ]
    if a.length_hint == "hidden":
        f += ["--eos-prob", "1"]
    return f


def start_engines(
    procs: Procs, a: argparse.Namespace, n: int, name: str, rng: random.Random
) -> tuple[subprocess.Popen, list[str]]:
    for _ in range(3):
        base = free_port_range(n, rng)
        p = procs.start(name, [str(SIM), *engine_flags(a), "--port", str(base), "--instances", str(n)])
        urls = [f"http://127.0.0.1:{base + k}" for k in range(n)]

        def up(u: str, p: subprocess.Popen = p) -> bool:
            if p.poll() is not None:
                raise RuntimeError(f"sglang-sim exited with {p.returncode}")
            return http_json("GET", u + "/health", timeout=2)[0] == 200

        try:
            for u in urls:
                wait_until(lambda u=u: up(u), 15, f"{u}/health")
            return p, urls
        except RuntimeError:
            procs.stop(p)
    raise RuntimeError("could not start sglang-sim (see its log)")


# ----------------------------------------------------------------------------------------------
# Load sampling


class Sampler(threading.Thread):
    """Reads every engine's /v1/loads each `period` seconds until stopped."""

    def __init__(self, urls: list[str], period: float, t0: float):
        super().__init__(daemon=True)
        self.urls, self.period, self.t0 = urls, period, t0
        self.samples: list[dict] = []
        self.stop_ev = threading.Event()

    def run(self) -> None:
        conns: dict[str, http.client.HTTPConnection] = {}
        nxt = time.monotonic()
        while not self.stop_ev.is_set():
            for i, u in enumerate(self.urls):
                m = re.match(r"http://([^/:]+):(\d+)", u)
                try:
                    c = conns.get(u) or http.client.HTTPConnection(m.group(1), int(m.group(2)), timeout=2)
                    conns[u] = c
                    c.request("GET", "/v1/loads?include=core")
                    d = json.loads(c.getresponse().read())
                    ld = d["loads"][0]
                    self.samples.append(
                        {
                            "t": round(time.monotonic() - self.t0, 3),
                            "e": i,
                            "run": ld.get("num_running_reqs", 0),
                            "wait": ld.get("num_waiting_reqs", 0),
                            "usage": ld.get("token_usage", 0.0),
                            "used": ld.get("num_used_tokens", 0),
                            "thr": ld.get("gen_throughput", 0.0),
                        }
                    )
                except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError):
                    conns.pop(u, None)
            nxt += self.period
            self.stop_ev.wait(max(0.0, nxt - time.monotonic()))
        for c in conns.values():
            c.close()

    def stop(self) -> list[dict]:
        self.stop_ev.set()
        self.join(timeout=5)
        return self.samples


# ----------------------------------------------------------------------------------------------
# Client


@dataclass
class Rec:
    idx: int
    kind: str
    out_len: int
    start: float = 0.0
    end: float = 0.0
    status: int = 0
    engine: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    retractions: int = 0
    e2e: float = 0.0  # the engine's e2e_latency: from its receipt of the request to its end
    error: str = ""


def send(router_url: str, body: dict, headers: dict, rec: Rec, t0: float, timeout: float) -> str:
    """One /generate; fills rec; returns the output text ('' on failure)."""
    m = re.match(r"http://([^/:]+):(\d+)", router_url)
    rec.start = time.monotonic() - t0
    text = ""
    conn = http.client.HTTPConnection(m.group(1), int(m.group(2)), timeout=timeout)
    try:
        conn.request(
            "POST", "/generate", body=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
        )
        resp = conn.getresponse()
        raw = resp.read()
        rec.status = resp.status
        # Which engine served it: ours says so, smg too; a direct request went to router_url itself.
        rec.engine = resp.getheader("x-rollout-engine-id") or resp.getheader("x-smg-routed-worker-id") or router_url
        if resp.status == 200:
            d = json.loads(raw)
            mi = d["meta_info"]
            rec.prompt_tokens = mi.get("prompt_tokens", 0)
            rec.cached_tokens = mi.get("cached_tokens", 0)
            rec.completion_tokens = mi.get("completion_tokens", 0)
            rec.retractions = mi.get("num_retractions", 0)
            rec.e2e = mi.get("e2e_latency", 0.0) or 0.0
            text = d.get("text", "")
        else:
            rec.error = raw[:300].decode(errors="replace")
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        rec.end = time.monotonic() - t0
    return text


def run_batch(target, w: Workload, grpo: list[Req], sessions: list[int], t0: float, timeout: float) -> list[Rec]:
    """All GRPO requests at once (in the order of `grpo`) plus the given sessions (each a chain of
    turns), concurrently. `target` is a router URL, or a function of the request giving the URL."""
    recs: dict[int, Rec] = {}
    url_of = target if callable(target) else (lambda _r: target)

    def one(r: Req) -> None:
        rec = recs[r.idx]
        send(url_of(r), body_for(w, r, r.prompt), {}, rec, t0, timeout)

    def chain(s: int) -> None:
        prompt = w.session_base[s]
        for t, r in enumerate(w.sessions[s]):
            prompt = f"{prompt} {r.prompt}"
            out = send(url_of(r), body_for(w, r, prompt), {"x-session-id": f"sess-{s}"}, recs[r.idx], t0, timeout)
            if recs[r.idx].status != 200:
                for later in w.sessions[s][t + 1 :]:
                    recs[later.idx].error = "skipped: an earlier turn failed"
                return
            prompt = f"{prompt}{out}"

    for r in grpo:
        recs[r.idx] = Rec(r.idx, r.kind, r.out_len)
    for s in sessions:
        for r in w.sessions[s]:
            recs[r.idx] = Rec(r.idx, r.kind, r.out_len)
    with ThreadPoolExecutor(max_workers=len(grpo) + len(sessions)) as pool:
        # Sessions' first turns go first (a trainer starts its agents, then the GRPO batch).
        futs = [pool.submit(chain, s) for s in sessions] + [pool.submit(one, r) for r in grpo]
        for f in futs:
            f.result()
    return [recs[k] for k in sorted(recs)]


# ----------------------------------------------------------------------------------------------
# Routers


def start_ours(
    procs: Procs,
    a: argparse.Namespace,
    policy: str,
    urls: list[str],
    tmp: Path,
    extra: list[str],
    binary: Path = MANAGER,
) -> tuple[str, dict]:
    state = Path(tempfile.mkdtemp(prefix=f"state-{policy}-", dir=tmp))  # fresh: no fleet to restore
    cmd = [
        str(binary),
        "serve",
        "--rollout-num-gpus",
        "0",
        "--port",
        "0",
        "--router-port",
        "0",
        "--state-dir",
        str(state),
        "--routing-policy",
        policy,
        *extra,
        *a.ours_arg,
    ]
    p = procs.start(f"manager-{policy}", cmd, stdout_pipe=True)
    found: dict[str, str] = {}
    ready = threading.Event()

    def drain() -> None:  # keep reading stdout so the manager never blocks on it
        with open(tmp / f"manager-{policy}.stdout", "ab") as out_log:
            for line in p.stdout:
                out_log.write(line)
                m = re.search(rb"rollout-manager listening control=(\S+) router=(\S+)", line)
                if m and not ready.is_set():
                    found["control"], found["router"] = m.group(1).decode(), m.group(2).decode()
                    ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(20):
        raise RuntimeError(f"rollout-manager did not print its listening line (see {tmp}/manager-{policy}.log)")
    control, router = found["control"], found["router"]
    st, d, _ = http_json("POST", control + "/rollout/scale_out", {"engine_urls": urls})
    if st not in (200, 201, 202):
        raise RuntimeError(f"scale_out answered {st}: {d}")
    op = d["request_id"]

    def settled() -> str | None:
        status = http_json("GET", f"{control}/rollout/scale_out/{op}")[1]["status"]
        return status if status in ("ACTIVE", "FAILED", "CANCELLED", "ROLLED_BACK") else None

    final = wait_until(settled, 30, "scale_out ACTIVE")
    if final != "ACTIVE":
        raise RuntimeError(f"scale_out ended {final}: {http_json('GET', f'{control}/rollout/scale_out/{op}')[1]}")
    _, eng, _ = http_json("GET", control + "/rollout/engines")
    ids = {e["engine_id"]: e["url"] for m in eng["models"].values() for e in m["engines"]}

    # The load poller reads each engine's pool size when the fleet changes; wait for all of them.
    def polled() -> bool:
        text = http_text(control + "/metrics")
        caps = re.findall(r'rollout_engine_kv_capacity_tokens\{engine_id="[^"]+"\} (\S+)', text)
        return len(caps) == len(urls) and all(float(c) > 0 for c in caps)

    wait_until(polled, 15, "the router's first /v1/loads poll")
    return router, {"control": control, "engine_urls": ids, "proc": p}


def start_smg(procs: Procs, a: argparse.Namespace, policy: str, urls: list[str]) -> tuple[str, dict]:
    port, prom = free_port(), free_port()
    cmd = [
        str(SMG),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prom),
        "--disable-tokenizer-autoload",
        "--log-level",
        "warn",
        "--load-monitor-interval",
        str(a.smg_load_monitor_interval),
    ]
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="1")
    p = procs.start(f"smg-{policy}", cmd, env=env)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if p.poll() is not None:
            raise RuntimeError(f"smg exited with {p.returncode}")
        st, d, _ = http_json("GET", base + "/workers", timeout=2)
        return st == 200 and sum(1 for x in d.get("workers", []) if x.get("is_healthy")) == len(urls)

    wait_until(ready, 60, "smg workers healthy", period=0.25)
    time.sleep(max(1.2, a.smg_load_monitor_interval + 0.2))  # let its load monitor read every worker once
    return base, {"proc": p, "prometheus": f"http://127.0.0.1:{prom}"}


def oracle_assignment(w: Workload, urls: list[str]):
    """Longest-processing-time-first over the exact output lengths (a session counts as its whole
    chain): each item goes to the engine with the least output tokens so far. Knows what no router
    knows (every length, offline); a reference for what balance alone can achieve."""
    items = [(r.out_len, "r", r.idx) for r in w.grpo]
    items += [(sum(t.out_len for t in turns), "s", s) for s, turns in enumerate(w.sessions)]
    load = [0] * len(urls)
    where: dict[tuple[str, int], int] = {}
    for size, kind, key in sorted(items, key=lambda x: (-x[0], x[1], x[2])):
        e = min(range(len(urls)), key=lambda i: (load[i], i))
        load[e] += size
        where[(kind, key)] = e
    return lambda r: urls[where[("s", r.group)] if r.kind == "session" else where[("r", r.idx)]]


def scrape_engine(url: str) -> dict:
    text = http_text(url + "/metrics")
    out: dict[str, float] = {}
    for key in (
        "num_requests_total",
        "generation_tokens_total",
        "prompt_tokens_total",
        "cached_tokens_total",
        "queue_time_seconds_sum",
        "queue_time_seconds_count",
    ):
        vals = re.findall(rf"^sglang:{key}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        out[key] = sum(float(v) for v in vals)
    return out


def scrape_ours(control: str) -> dict:
    text = http_text(control + "/metrics")

    def g(pat: str) -> float:
        return sum(float(v) for v in re.findall(pat, text, re.MULTILINE))

    return {
        "affinity_kept": g(r'^rollout_router_affinity_total\{outcome="kept"\} (\S+)$'),
        "affinity_moved": g(r'^rollout_router_affinity_total\{outcome="moved"\} (\S+)$'),
        "retries": g(r"^rollout_router_retries_total (\S+)$"),
        "errors": g(r"^rollout_router_errors_total\{[^}]*\} (\S+)$"),
        "auto_caps": [int(float(v)) for v in re.findall(AUTO_CAP, text, re.MULTILINE)],
        "moves": {
            reason: g(rf'^rollout_router_moves_total\{{reason="{reason}"\}} (\S+)$')
            for reason in ("tail", "preempt", "chunk", "drain", "lost", "weight_update")
        },
        "move_prefill_tokens": g(r"^rollout_router_move_prefill_tokens_total (\S+)$"),
    }


# ----------------------------------------------------------------------------------------------
# Calibration (lower bound)


def longest_chain(w: Workload) -> int:
    return max(range(len(w.sessions)), key=lambda s: sum(r.out_len for r in w.sessions[s])) if w.sessions else -1


def calibrate(procs: Procs, a: argparse.Namespace, w: Workload, rng: random.Random) -> dict:
    p, urls = start_engines(procs, a, 3, "sim-calibration", rng)
    t0 = time.monotonic()
    longest = max(w.grpo, key=lambda r: (r.out_len, -r.idx))
    chain = longest_chain(w)
    result: dict = {}

    def solo() -> None:
        rec = Rec(longest.idx, "grpo", longest.out_len)
        send(urls[0], body_for(w, longest, longest.prompt), {}, rec, t0, a.run_timeout)
        result["solo"] = rec

    def solo_chain() -> None:
        if chain >= 0:
            result["chain"] = run_batch(urls[1], w, [], [chain], time.monotonic(), a.run_timeout)

    n = a.engines
    sub_grpo = [r for r in w.grpo if r.group % n == 0]
    sub_sessions = [s for s in range(len(w.sessions)) if s % n == 0]
    sampler = Sampler([urls[2]], 0.1, t0)
    sampler.start()
    th = [threading.Thread(target=solo), threading.Thread(target=solo_chain)]
    for t in th:
        t.start()
    t_sub = time.monotonic()
    sub = run_batch(urls[2], w, sub_grpo, sub_sessions, t_sub, a.run_timeout)
    for t in th:
        t.join(timeout=a.run_timeout)
    samples = sampler.stop()
    procs.stop(p)

    solo_rec: Rec = result["solo"]
    if solo_rec.status != 200 or any(r.status != 200 for r in sub):
        raise RuntimeError(f"calibration requests failed: {solo_rec.error or [r.error for r in sub if r.error][:3]}")
    sat = [s["thr"] for s in samples if s["wait"] > 0 and s["run"] > 0 and s["thr"] > 0]
    if not sat:
        raise RuntimeError("the calibration engine never saturated: raise --groups or lower --max-total-tokens")
    r_sat = sum(sat) / len(sat)
    t_chain = 0.0
    if chain >= 0:
        recs = result["chain"]
        t_chain = max(r.end for r in recs) - min(r.start for r in recs)
    sub_out = sum(r.out_len for r in sub_grpo) + sum(r.out_len for s in sub_sessions for r in w.sessions[s])
    # What the timing model predicts for the solo request (a sanity check only; LB uses the measurement).
    prompt_tokens = solo_rec.prompt_tokens
    steps_ms = sum(8 + 0.05 + 0.002 * (prompt_tokens + k) / 1000 for k in range(1, longest.out_len))
    model_solo = a.time_scale * (5 + 60 * prompt_tokens / 1000 + steps_ms) / 1000
    return {
        "longest_request": {"idx": longest.idx, "out_len": longest.out_len, "prompt_tokens": prompt_tokens},
        "t_solo_s": solo_rec.end - solo_rec.start,
        "t_solo_model_s": model_solo,
        "longest_chain": {"session": chain, "out_len": sum(r.out_len for r in w.sessions[chain]) if chain >= 0 else 0},
        "t_chain_s": t_chain,
        "r_sat_tokens_per_s": r_sat,
        "r_sat_max": max(sat),
        "r_sat_samples": len(sat),
        "subset": {
            "requests": len(sub),
            "out_tokens": sub_out,
            "makespan_s": max(r.end for r in sub) - min(r.start for r in sub),
            "cache_hit": sum(r.cached_tokens for r in sub) / max(1, sum(r.prompt_tokens for r in sub)),
        },
    }


# ----------------------------------------------------------------------------------------------
# One router run


def busy_and_finish(samples: list[dict], n: int, period: float) -> tuple[list[float], list[float]]:
    busy = [0.0] * n
    last = [0.0] * n
    for s in samples:
        if s["run"] + s["wait"] > 0:
            busy[s["e"]] += period
            last[s["e"]] = max(last[s["e"]], s["t"])
    return busy, last


def one_run(procs: Procs, a: argparse.Namespace, w: Workload, name: str, tmp: Path, rng: random.Random) -> dict:
    kind, policy = name.split(":")
    sim, urls = start_engines(procs, a, a.engines, f"sim-{kind}-{policy}", rng)
    router = None
    try:
        grpo = w.grpo
        if kind in ("ours", "ours_lf", "ours_old", "ours_fifo", "ours_tail", "ours_chunk", "ours_base"):
            # ours: the defaults. ours_lf: a fixed cap of --late-binding-cap requests per engine
            # instead of each engine's automatic one. ours_old: no late binding, arrival order.
            # ours_base: the defaults of another build (--baseline-binary).
            extra = {
                "ours": [],
                "ours_base": [],
                "ours_lf": ["--max-inflight-per-engine", str(a.late_binding_cap), "--queue-order", "longest_first"],
                "ours_old": ["--max-inflight-per-engine", "0", "--queue-order", "fifo"],
                "ours_fifo": ["--queue-order", "fifo"],
                "ours_tail": ["--move-tail", "true"],
                "ours_chunk": ["--chunk-tokens", str(a.chunk_tokens)],
            }[kind]
            binary = Path(a.baseline_binary) if kind == "ours_base" else MANAGER
            target, info = start_ours(procs, a, policy, urls, tmp, extra, binary)
            engine_index = {eid: urls.index(u) for eid, u in info["engine_urls"].items()}
        elif kind == "smg":
            target, info = start_smg(procs, a, policy, urls)
            engine_index = {u: i for i, u in enumerate(urls)}
        else:  # oracle: no router; the client sends each request to the engine an offline LPT chose
            target, info = oracle_assignment(w, urls), {"proc": None}
            engine_index = {u: i for i, u in enumerate(urls)}
            if policy == "lpt_longest_first":
                grpo = sorted(grpo, key=lambda r: -r.out_len)
        router = info["proc"]
        t0 = time.monotonic()
        sampler = Sampler(urls, a.sample_period, t0)
        sampler.start()
        recs = run_batch(target, w, grpo, list(range(len(w.sessions))), t0, a.run_timeout)
        samples = sampler.stop()
        engines = [scrape_engine(u) for u in urls]
        extra = scrape_ours(info["control"]) if kind.startswith("ours") else {}
    finally:
        if router is not None:
            procs.stop(router)
        procs.stop(sim)
    ok = [r for r in recs if r.status == 200]
    n = a.engines
    per_req = [0] * n
    per_tok = [0] * n
    per_last = [0.0] * n
    unknown = 0
    for r in ok:
        e = engine_index.get(r.engine)
        if e is None:
            unknown += 1
            continue
        per_req[e] += 1
        per_tok[e] += r.completion_tokens
        per_last[e] = max(per_last[e], r.end)
    busy, last_busy = busy_and_finish(samples, n, a.sample_period)  # from the engines' own loads
    longest = max(w.grpo, key=lambda r: (r.out_len, -r.idx))
    lrec = next(r for r in recs if r.idx == longest.idx)
    return {
        "name": name,
        "makespan_s": max(r.end for r in recs) - min(r.start for r in recs),
        "grpo_makespan_s": max((r.end for r in recs if r.kind == "grpo"), default=0.0),
        "sessions_makespan_s": max((r.end for r in recs if r.kind == "session"), default=0.0),
        "ok": len(ok),
        "errors": len(recs) - len(ok),
        "error_samples": sorted({r.error for r in recs if r.error})[:5],
        "cache_hit": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "retractions": sum(r.retractions for r in ok),
        "engine_of_unknown": unknown,
        "per_engine_requests": per_req if unknown < len(ok) else [int(e["num_requests_total"]) for e in engines],
        "per_engine_out_tokens": [int(e["generation_tokens_total"]) for e in engines],
        "per_engine_requests_metrics": [int(e["num_requests_total"]) for e in engines],
        "per_engine_cache_hit": [e["cached_tokens_total"] / max(1.0, e["prompt_tokens_total"]) for e in engines],
        "per_engine_last_finish_s": per_last,
        "per_engine_mean_queue_s": [
            e["queue_time_seconds_sum"] / max(1.0, e["queue_time_seconds_count"]) for e in engines
        ],
        "per_engine_busy_s": busy,
        "per_engine_last_busy_sample_s": last_busy,
        "longest_request": {
            "engine": engine_index.get(lrec.engine),
            "start_s": lrec.start,
            "end_s": lrec.end,
            "retractions": lrec.retractions,
        },
        "router_metrics": extra,
        "samples": samples,
        "requests": [
            [
                r.idx,
                engine_index.get(r.engine),
                round(r.start, 3),
                round(r.end, 3),
                r.out_len,
                r.prompt_tokens,
                r.cached_tokens,
                r.retractions,
                round(r.end - r.e2e, 3),  # when the engine got it (approximately)
            ]
            for r in recs
        ],
    }


# ----------------------------------------------------------------------------------------------
# Report


def plot(results: list[dict], lb: float, path: Path, n: int, period: float) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e 'python[bench]'); no plot"
    groups = by_name(results)
    mine = next((n for n in ("ours:capacity", "ours_lf:capacity") if n in groups), None)
    ours = representative(groups[mine]) if mine else None
    smg = [n for n in groups if n.startswith("smg:") and all(r["errors"] == 0 for r in groups[n])]
    best = None
    for other in ("ours_chunk:capacity", "ours_tail:capacity"):
        if best is None and other in groups:
            # The same defaults with chunks, or with moves for the tail, before any smg row.
            best = representative(groups[other])
    if best is None and smg:
        best = representative(groups[min(smg, key=lambda n: median([r["makespan_s"] for r in groups[n]]))])
    rows = [r for r in (ours, best) if r]
    if not rows:
        return "nothing to plot"
    tmax = max(r["makespan_s"] for r in rows) * 1.03
    fig, axes = plt.subplots(len(rows), 2, figsize=(13, 3.6 * len(rows)), squeeze=False, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, r in zip(axes, rows, strict=True):
        for e in range(n):
            ss = [s for s in r["samples"] if s["e"] == e]
            t = [s["t"] for s in ss]
            c = colors[e % len(colors)]
            row[0].plot(t, [s["run"] for s in ss], color=c, lw=1.4, label=f"engine {e} running")
            row[0].plot(t, [s["wait"] for s in ss], color=c, lw=1.0, ls=":", label=f"engine {e} waiting")
            row[1].plot(t, [100 * s["usage"] for s in ss], color=c, lw=1.4, label=f"engine {e}")
        title = (
            f"{r['name']} (run {r['repeat'] + 1}): makespan {r['makespan_s']:.1f} s = {r['makespan_s'] / lb:.2f} x LB"
        )
        row[0].set_title(title + " - requests per engine", fontsize=10)
        row[1].set_title(title + " - KV pool used", fontsize=10)
        row[0].set_ylabel("requests (solid running, dotted waiting)")
        row[1].set_ylabel("KV tokens used (%)")
        for ax in row:
            ax.axvline(lb, color="k", ls="--", lw=1)
            ax.text(lb, ax.get_ylim()[1] * 0.02, " lower bound", va="bottom", fontsize=8)
            ax.set_xlim(0, tmax)
            ax.grid(alpha=0.3)
        row[1].set_ylim(0, 105)
    axes[0][0].legend(fontsize=7, ncol=2, loc="upper right")
    axes[0][1].legend(fontsize=7, loc="lower left")
    for ax in axes[-1]:
        ax.set_xlabel(f"seconds since the batch was submitted (engines' /v1/loads every {period} s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def by_name(results: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in results:
        out.setdefault(r["name"], []).append(r)
    return out


def representative(runs: list[dict]) -> dict:
    """The run whose makespan is closest to the median of its repeats."""
    m = median([r["makespan_s"] for r in runs])
    return min(runs, key=lambda r: (abs(r["makespan_s"] - m), r["repeat"]))


def moves_cell(runs: list[dict]) -> str:
    """Tail moves / preemptions per run (median), where the router counts them."""
    moves = [r["router_metrics"]["moves"] for r in runs if r.get("router_metrics", {}).get("moves")]
    if not moves:
        return "-"
    return "/".join(f"{median(m.get(k, 0) for m in moves):.0f}" for k in ("tail", "preempt", "chunk"))


def prefill_cell(runs: list[dict]) -> str:
    """Tokens prefilled again by moves, as a share of the output tokens (median)."""
    shares = [
        r["router_metrics"]["move_prefill_tokens"] / max(1, sum(r["per_engine_out_tokens"]))
        for r in runs
        if r.get("router_metrics", {}).get("moves")
    ]
    return f"{100 * median(shares):.1f}%" if shares else "-"


def table(results: list[dict], lb: float) -> str:
    lines = [
        (
            "| router | policy | makespan (s), median [min-max] | / LB, median [min-max] | GRPO done (s) | "
            "sessions done (s) | engine last finish (s) | requests per engine | output tokens per engine (k) | "
            "mean queue wait per engine (s) | prefix-cache hit | retractions | moves: tail/preempt/chunk | "
            "move prefill / output tokens | errors |"
        ),
        "|---|---|---|---|---:|---:|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    label = {
        "ours": "ours (defaults)",
        "ours_lf": "ours, fixed cap (--late-binding-cap)",
        "ours_old": "ours, old defaults (no cap, fifo)",
        "ours_fifo": "ours, --queue-order fifo",
        "ours_tail": "ours, --move-tail true",
        "ours_chunk": "ours, --chunk-tokens",
        "ours_base": "ours (defaults), --baseline-binary",
        "smg": "smg 1.13.0",
        "oracle": "oracle (no router)",
    }
    for name, runs in by_name(results).items():
        kind, policy = name.split(":")
        ms = [r["makespan_s"] for r in runs]
        r = representative(runs)
        fin = [f for f in r["per_engine_last_finish_s"] if f > 0]
        fin_s = f"{min(fin):.1f}-{max(fin):.1f}" if fin else "n/a"
        lines.append(
            f"| {label[kind]} | {policy} | {median(ms):.2f} [{min(ms):.2f}-{max(ms):.2f}] | "
            f"**{median(ms) / lb:.2f}** [{min(ms) / lb:.2f}-{max(ms) / lb:.2f}] | "
            f"{r['grpo_makespan_s']:.1f} | {r['sessions_makespan_s']:.1f} | {fin_s} | "
            f"{'/'.join(map(str, r['per_engine_requests']))} | "
            f"{'/'.join(f'{t / 1000:.0f}' for t in r['per_engine_out_tokens'])} | "
            f"{'/'.join(f'{q:.1f}' for q in r['per_engine_mean_queue_s'])} | "
            f"{100 * median([x['cache_hit'] for x in runs]):.1f}% | "
            f"{r['retractions']} | {moves_cell(runs)} | {prefill_cell(runs)} | {sum(x['errors'] for x in runs)} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--groups", type=int, default=64, help="prompts in the batch")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (GRPO group size)")
    ap.add_argument("--sessions", type=int, default=16, help="multi-turn sessions sent alongside the batch")
    ap.add_argument("--turns", type=int, default=3, help="turns per session")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--median", type=float, default=256, help="median output length (tokens)")
    ap.add_argument("--sigma-group", type=float, default=0.8, help="lognormal sigma shared by a group")
    ap.add_argument("--sigma-sample", type=float, default=0.6, help="lognormal sigma per sample")
    ap.add_argument("--cap", type=int, default=4096, help="largest output length (the rollout's max response length)")
    ap.add_argument("--session-median", type=float, default=150)
    ap.add_argument("--session-cap", type=int, default=768)
    ap.add_argument(
        "--prompt-min", type=int, default=64, help="question words (tokens) after the shared 64-token system prefix"
    )
    ap.add_argument("--prompt-max", type=int, default=448)
    ap.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool per engine")
    ap.add_argument("--time-scale", type=float, default=0.4, help="sglang-sim --time-scale")
    ap.add_argument(
        "--length-hint",
        choices=["exact", "hidden"],
        default="exact",
        help=(
            "exact: max_new_tokens=L (the router sees L); hidden: max_new_tokens=cap, min_new_tokens=L-1, --eos-prob 1"
        ),
    )
    ap.add_argument("--routers", default=",".join(ALL_ROUTERS), help="comma-separated kind:policy list")
    ap.add_argument(
        "--ours-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra rollout-manager flag for our router, e.g. --ours-arg=--max-inflight-per-engine=32",
    )
    ap.add_argument(
        "--late-binding-cap",
        type=int,
        default=32,
        help="--max-inflight-per-engine of the ours_lf row (near the engines' full batch)",
    )
    ap.add_argument(
        "--chunk-tokens",
        type=int,
        default=512,
        help="--chunk-tokens of the ours_chunk row (output tokens per part of a request)",
    )
    ap.add_argument(
        "--baseline-binary",
        help="a rollout-manager of another build, for the ours_base:<policy> rows (its defaults)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="runs of each router (the table shows median and range)")
    ap.add_argument("--sample-period", type=float, default=0.25)
    ap.add_argument(
        "--smg-load-monitor-interval",
        type=int,
        default=1,
        help="smg --load-monitor-interval (ours polls /v1/loads every 1 s by default)",
    )
    ap.add_argument("--run-timeout", type=float, default=240, help="per-request timeout (s)")
    ap.add_argument("--out", default=str(RESULTS / "router_longtail.json"))
    ap.add_argument("--plot", default=str(RESULTS / "router_longtail.png"))
    a = ap.parse_args()
    routers = [r.strip() for r in a.routers.split(",") if r.strip()]
    for r in routers:
        if r.startswith("ours_base:"):
            if r.split(":")[1] not in ("capacity", "round_robin"):
                ap.error(f"--routers {r!r}: ours_base takes capacity or round_robin")
            if not a.baseline_binary or not Path(a.baseline_binary).is_file():
                ap.error(f"--routers {r!r} needs --baseline-binary pointing at a rollout-manager binary")
        elif r not in ALL_ROUTERS:
            ap.error(f"unknown router {r!r}; choose from {ALL_ROUTERS} (or ours_base:<policy> with --baseline-binary)")
    for b in (SIM, MANAGER):
        if not b.exists():
            ap.error(f"{b} is missing: cargo build --release --workspace --bins")
    if any(r.startswith("smg:") for r in routers) and not SMG.exists():
        ap.error(f"{SMG} is missing: .venv/bin/pip install -e 'python[test]'")

    w = build_workload(a)
    lens = sorted(r.out_len for r in w.all_reqs())
    W = w.total_out()
    print(
        f"workload: {len(w.grpo)} GRPO requests ({a.groups} x {a.samples}) + {a.sessions} sessions x {a.turns} turns; "
        f"output tokens {W} (median {lens[len(lens) // 2]}, p99 {lens[int(0.99 * (len(lens) - 1))]}, max {lens[-1]}); "
        f"length hint {a.length_hint}",
        flush=True,
    )
    port_rng = random.Random()
    tmp = Path(tempfile.mkdtemp(prefix="router-longtail-"))
    procs = Procs(tmp)
    started = time.monotonic()
    results: list[dict] = []
    try:
        cal = calibrate(procs, a, w, port_rng)
        lb_work = W / (a.engines * cal["r_sat_tokens_per_s"])
        lb = max(cal["t_solo_s"], cal["t_chain_s"], lb_work)
        print(
            f"calibration: T_solo {cal['t_solo_s']:.2f} s (model {cal['t_solo_model_s']:.2f}), T_chain "
            f"{cal['t_chain_s']:.2f} s, R_sat {cal['r_sat_tokens_per_s']:.0f} tok/s/engine -> W/(N R) {lb_work:.2f} s; "
            f"LB {lb:.2f} s; 1/N of the batch on one engine took {cal['subset']['makespan_s']:.2f} s",
            flush=True,
        )
        for rep in range(a.repeats):
            for name in routers:
                t = time.monotonic()
                res = one_run(procs, a, w, name, tmp, port_rng)
                res["repeat"] = rep
                results.append(res)
                print(
                    f"  {name:26s} makespan {res['makespan_s']:6.2f} s = {res['makespan_s'] / lb:.2f} x LB, "
                    f"errors {res['errors']}, cache hit {100 * res['cache_hit']:.1f}%, "
                    f"requests/engine {res['per_engine_requests']}"
                    f" ({time.monotonic() - t:.0f} s with setup)",
                    flush=True,
                )
    finally:
        procs.close()
    elapsed = time.monotonic() - started
    machine = f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()})"
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print()
    print(f"Machine: {machine}; date: {date}; total {elapsed:.0f} s")
    print(
        f"LB = max(T_solo {cal['t_solo_s']:.2f} s, T_chain {cal['t_chain_s']:.2f} s, "
        f"W/(N*R_sat) = {W}/({a.engines}*{cal['r_sat_tokens_per_s']:.0f}) = {lb_work:.2f} s) = {lb:.2f} s"
    )
    print()
    md = table(results, lb)
    print(md)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    note = plot(results, lb, Path(a.plot), a.engines, a.sample_period)
    if note:
        print(note)
    doc = {
        "command": " ".join([".venv/bin/python", "benches/router_longtail.py", *sys.argv[1:]]),
        "machine": machine,
        "date": date,
        "elapsed_s": elapsed,
        "config": vars(a),
        "engine_flags": engine_flags(a),
        "workload": {
            "grpo_requests": len(w.grpo),
            "sessions": a.sessions,
            "turns": a.turns,
            "output_tokens": W,
            "median_out": lens[len(lens) // 2],
            "max_out": lens[-1],
        },
        "calibration": cal,
        "lower_bound": {"lb_s": lb, "t_solo_s": cal["t_solo_s"], "t_chain_s": cal["t_chain_s"], "work_s": lb_work},
        "results": results,
        "table": md,
    }
    out.write_text(json.dumps(doc, separators=(",", ":")))
    out.with_suffix(".md").write_text(
        f"Command: `{doc['command']}`\n\nMachine: {machine}; date: {date}; total {elapsed:.0f} s\n\n"
        f"Engines: {a.engines} x `sglang-sim {' '.join(engine_flags(a))}`\n\n"
        f"Workload: {doc['workload']}\n\n"
        f"LB = max(T_solo {cal['t_solo_s']:.2f} s, T_chain {cal['t_chain_s']:.2f} s, W/(N*R_sat) = "
        f"{W}/({a.engines}*{cal['r_sat_tokens_per_s']:.0f}) = {lb_work:.2f} s) = {lb:.2f} s\n\n{md}\n"
    )
    print(f"\nwrote {out}, {out.with_suffix('.md')}" + ("" if note else f" and {a.plot}"))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
