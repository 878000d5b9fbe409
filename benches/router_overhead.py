#!/usr/bin/env python3
"""Router overhead: our router vs smg 1.13.0, sglang-router 0.3.2 and nginx (the floor).

Every proxy sits in front of the same two simulated engines (one `sglang-sim --zero-cost
--instances 2` process, which answers a tiny /generate at once), and `wrk` drives the same
POST /generate at each concurrency. For each run we report requests/s, p50/p99 latency, and
the proxy's own CPU time per request, read from /proc (utime + stime of every process of the
proxy, divided by the requests wrk completed in the window).

Run from the repository root (installs wrk and nginx with apt, and sglang-router 0.3.2 into
.bench/ when missing; smg comes with `pip install -e 'python[test]'`):

    .venv/bin/python benches/router_overhead.py            # 3 interleaved rounds, 5 s per run
    .venv/bin/python benches/router_overhead.py --seconds 10 --concurrency 1 16 64

To compare two builds of ours (a change against its base), build the base's binary elsewhere
and add it as the proxy `ours_baseline`, interleaved with the others:

    .venv/bin/python benches/router_overhead.py --proxies nginx ours ours_baseline \
        --baseline-binary /tmp/rollout-manager-base
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"
BODY = '{"text": "hi", "sampling_params": {"max_new_tokens": 1}}'
TICK = os.sysconf("SC_CLK_TCK")
DEAD_HF = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
# --baseline-binary: the rollout-manager that the proxy `ours_baseline` runs.
BASELINE: list[Path | None] = [None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> int:
    """A base port with n consecutive free ports."""
    for _ in range(100):
        base = free_port()
        try:
            socks = []
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            for s in socks:
                s.close()
            return base
        except OSError:
            for s in socks:
                s.close()
    raise RuntimeError("no consecutive free ports")


def wait_http(url: str, timeout: float = 30.0, ok: tuple[int, ...] = (200,)) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status in ok:
                    return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout}s")


def post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def ensure_tools() -> Path:
    """wrk and nginx from Debian; sglang-router 0.3.2 in its own venv (its `smg` script would
    clash with smg 1.13.0's). Returns that venv's python."""
    missing = [t for t in ("wrk", "nginx") if shutil.which(t) is None and not Path("/usr/sbin/nginx").exists()]
    if missing:
        sudo = [] if os.geteuid() == 0 else ["sudo"]
        subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True)
        subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", "wrk", "nginx-light"], check=True)
    venv = ROOT / ".bench" / "sglang-router-0.3.2"
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "sglang-router==0.3.2"], check=True)
    return py


def cpu_split(pids: list[int]) -> tuple[float, float]:
    """User and system CPU seconds of the processes (utime, stime from /proc)."""
    user = system = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            user += int(fields[11])
            system += int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return user / TICK, system / TICK


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (nginx workers, python children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                todo.extend(int(c) for c in children)
        except OSError:
            pass
    return sorted(set(out))


@dataclass
class Run:
    proxy: str
    concurrency: int
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_req: float
    errors: int
    round: int = 0
    # The CPU split: user space (the proxy's own code and libraries) and the kernel (mostly
    # loopback TCP, which every proxy pays alike for the same syscalls).
    user_us_per_req: float = 0.0
    sys_us_per_req: float = 0.0


def parse_latency(text: str, label: str) -> float:
    m = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
    if not m:
        return float("nan")
    v, unit = float(m.group(1)), m.group(2)
    return v / 1000 if unit == "us" else v * 1000 if unit == "s" else v


def drive(name: str, url: str, pids: list[int], conc: int, secs: float, lua: Path) -> Run:
    user0, sys0 = cpu_split(pids)
    out = subprocess.run(
        ["wrk", "-t1", f"-c{conc}", f"-d{max(1, round(secs))}s", "--latency", "-s", str(lua), f"{url}/generate"],
        capture_output=True,
        text=True,
        timeout=secs + 60,
        check=True,
    ).stdout
    user1, sys1 = cpu_split(pids)
    used = (user1 - user0) + (sys1 - sys0)
    n = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    errs = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(errs.group(1)) if errs else 0) + (sum(int(x) for x in sock.groups()) if sock else 0)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    per_req = 1e6 / max(n, 1)
    return Run(
        name,
        conc,
        n,
        rps,
        parse_latency(out, "50"),
        parse_latency(out, "99"),
        used * per_req,
        errors,
        user_us_per_req=(user1 - user0) * per_req,
        sys_us_per_req=(sys1 - sys0) * per_req,
    )


class Stack:
    """Processes started for one measurement, stopped in reverse order."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")
        p = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; cells are medians over them")
    ap.add_argument(
        "--proxies", nargs="+", default=["direct", "nginx", "ours", "ours_round_robin", "smg", "sglang_router"]
    )
    ap.add_argument(
        "--baseline-binary",
        type=Path,
        default=None,
        help="a rollout-manager binary of another build, run as the proxy `ours_baseline`",
    )
    ap.add_argument("--name", default=None, help="results file name under benches/results (default by proxies)")
    args = ap.parse_args()
    if "ours_baseline" in args.proxies and args.baseline_binary is None:
        ap.error("--proxies ours_baseline needs --baseline-binary PATH")
    BASELINE[0] = args.baseline_binary
    sgr_python = ensure_tools()
    release = ROOT / "target" / "release"
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "rollout-manager", "-p", "sglang-sim"], cwd=ROOT, check=True
    )
    tmp = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    lua = tmp / "post.lua"
    lua.write_text(f"wrk.method = 'POST'\nwrk.body = '{BODY}'\nwrk.headers['Content-Type'] = 'application/json'\n")
    runs: list[Run] = []
    engines = Stack(tmp)
    base = free_ports(2)
    engines.start(
        "engines",
        [
            str(release / "sglang-sim"),
            "--model-path",
            "sim-model",
            "--port",
            str(base),
            "--instances",
            "2",
            "--zero-cost",
            "--log-level",
            "warn",
        ],
    )
    urls = [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
    for u in urls:
        wait_http(f"{u}/health")
    stacks: list[Stack] = []
    try:
        # Every proxy is started once and stays up (idle ones cost next to nothing); the rounds
        # then interleave them at each concurrency, so a burst of other work on the machine hits
        # every proxy alike instead of whichever one was being measured.
        targets = {}
        for proxy in args.proxies:
            stack = Stack(tmp)
            stacks.append(stack)
            url, pid = start_proxy(proxy, stack, urls, tmp, release, sgr_python)
            targets[proxy] = (url, process_tree(pid))
        order = list(targets.items())
        for rnd in range(args.rounds):
            for conc in args.concurrency:
                # Each round starts at the next proxy: the one measured right after another
                # was seen to run ~3% slower at c=64 (a change against its base read 1.04 with
                # one order, 0.97 with the other), so a fixed order would favour the first.
                turn = rnd % len(order)
                for proxy, (url, pids) in order[turn:] + order[:turn]:
                    drive(proxy, url, pids, conc, 1.0, lua)  # warm the pools
                    run = drive(proxy, url, pids, conc, args.seconds, lua)
                    run.round = rnd
                    print(
                        f"round {rnd + 1} {proxy:>16} c={conc:<3} {run.rps:>9.0f} req/s  p50 {run.p50_ms:6.2f} ms  "
                        f"p99 {run.p99_ms:6.2f} ms  cpu {run.cpu_us_per_req:6.1f} us/req  errors {run.errors}",
                        flush=True,
                    )
                    runs.append(run)
    finally:
        for stack in reversed(stacks):
            stack.stop()
        engines.stop()
    report(runs, args)


def start_proxy(
    proxy: str, stack: Stack, urls: list[str], tmp: Path, release: Path, sgr_python: Path
) -> tuple[str, int]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if proxy == "direct":
        # No proxy: wrk talks to one engine. The engines' CPU is not counted (pid 0).
        return urls[0], 0
    if proxy.startswith("ours"):
        policy = "round_robin" if proxy == "ours_round_robin" else "capacity"
        # ours_threads<N>: the default policy on N data-plane threads.
        threads = proxy.removeprefix("ours_threads") if proxy.startswith("ours_threads") else "0"
        binary = BASELINE[0] if proxy == "ours_baseline" and BASELINE[0] else release / "rollout-manager"
        p = stack.start(
            proxy,
            [
                str(binary),
                "serve",
                "--port",
                "0",
                "--router-port",
                str(port),
                "--rollout-num-gpus",
                "0",
                "--state-dir",
                str(tmp / f"state-{proxy}"),
                "--routing-policy",
                policy,
                "--router-threads",
                threads,
            ],
            env={"RUST_LOG": "warn"},
        )
        control = None
        deadline = time.monotonic() + 30
        while control is None and time.monotonic() < deadline:
            m = re.search(r"control=(http://\S+)", (tmp / f"{proxy}.log").read_text())
            control = m.group(1) if m else None
            time.sleep(0.1)
        if control is None:
            raise RuntimeError("rollout-manager did not start")
        op = post_json(f"{control}/rollout/scale_out", {"engine_urls": urls})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{control}/rollout/scale_out/{op['request_id']}") as r:
                if json.loads(r.read())["status"] == "ACTIVE":
                    break
            time.sleep(0.1)
        return url, p.pid
    if proxy in ("smg", "sglang_router"):
        metrics = free_port()
        common = [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *urls,
            "--policy",
            "round_robin",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics),
            "--log-level",
            "warn",
        ]
        if proxy == "smg":
            smg = shutil.which("smg", path=str(Path(sys.executable).parent)) or "smg"
            p = stack.start(proxy, [smg, "launch", *common, "--disable-tokenizer-autoload"], env=DEAD_HF)
        else:
            p = stack.start(proxy, [str(sgr_python), "-m", "sglang_router.launch_router", *common], env=DEAD_HF)
        wait_http(f"{url}/readiness", 60)
        return url, p.pid
    if proxy == "nginx":
        conf = tmp / "nginx.conf"
        conf.write_text(f"""
worker_processes auto;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
daemon off;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/nginx-body;
  proxy_temp_path {tmp}/nginx-proxy;
  upstream engines {{ server {urls[0][7:]}; server {urls[1][7:]}; keepalive 256; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://engines; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off;
    }}
  }}
}}
""")
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        p = stack.start(proxy, [nginx, "-c", str(conf), "-p", str(tmp)])
        wait_http(f"{url}/health")
        return url, p.pid
    raise SystemExit(f"unknown proxy {proxy}")


def report(runs: list[Run], args: argparse.Namespace) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "command": "python " + " ".join(sys.argv),
        "seconds": args.seconds,
        "rounds": args.rounds,
        "load_average": os.getloadavg(),
    }
    # A comparison with another build goes to its own files, beside the peers' results.
    name = args.name or ("router_overhead_vs_baseline" if "ours_baseline" in args.proxies else "router_overhead")
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]}, indent=1))
    cells: dict[tuple[str, int], list[Run]] = {}
    for r in runs:
        cells.setdefault((r.proxy, r.concurrency), []).append(r)

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    lines = [
        f"Router overhead, {meta['date']}, {meta['machine']}",
        f"`{meta['command']}`",
        f"{args.rounds} interleaved rounds of {args.seconds:g} s per cell; medians over the rounds",
        "",
        "| proxy | conc | req/s | p50 ms | p99 ms | proxy CPU us/req | user / system us/req | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (proxy, conc), rs in cells.items():
        cpu = "-" if proxy == "direct" else f"{med([r.cpu_us_per_req for r in rs]):.1f}"
        split = (
            "-"
            if proxy == "direct"
            else f"{med([r.user_us_per_req for r in rs]):.1f} / {med([r.sys_us_per_req for r in rs]):.1f}"
        )
        lines.append(
            f"| {proxy} | {conc} | {med([r.rps for r in rs]):.0f} | {med([r.p50_ms for r in rs]):.2f} | "
            f"{med([r.p99_ms for r in rs]):.2f} | {cpu} | {split} | {sum(r.errors for r in rs)} |"
        )

    def ratio(a: str, b: str, conc: int, attr: str) -> str:
        """Median [min-max] over rounds of a/b, each from the same round."""
        by_round = {r.round: r for r in cells.get((b, conc), [])}
        xs = [
            getattr(r, attr) / getattr(by_round[r.round], attr)
            for r in cells.get((a, conc), [])
            if r.round in by_round and getattr(by_round[r.round], attr)
        ]
        return f"{med(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]" if xs else "-"

    lines += [
        "",
        "Ratios from the same round, median [min-max] over rounds:",
        "",
        "| conc | ours CPU / nginx CPU | ours req/s / sglang-router req/s | ours req/s / smg req/s |",
        "|---|---|---|---|",
    ]
    for c in args.concurrency:
        lines.append(
            f"| {c} | {ratio('ours', 'nginx', c, 'cpu_us_per_req')} | {ratio('ours', 'sglang_router', c, 'rps')} | "
            f"{ratio('ours', 'smg', c, 'rps')} |"
        )
    if "ours_baseline" in args.proxies:
        lines += [
            "",
            f"This build against `{args.baseline_binary}`, same rounds, median [min-max]:",
            "",
            "| conc | ours CPU / baseline CPU | ours req/s / baseline req/s |",
            "|---|---|---|",
        ]
        for c in args.concurrency:
            lines.append(
                f"| {c} | {ratio('ours', 'ours_baseline', c, 'cpu_us_per_req')} | "
                f"{ratio('ours', 'ours_baseline', c, 'rps')} |"
            )
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{name}.md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
