#!/usr/bin/env python3
"""Ray mode on several nodes against local mode: scale-out, a lost node, and `ray job stop`.

One run, simulated engines (`sglang-sim --time-scale 0.01`), 1 GPU per engine:

- local mode: `rollout-manager serve --gpus <total>` on this machine, 2 initial engines; then for
  each N in `--sizes`, scale out to 2+N, time until the operation is ACTIVE, scale back in to 2;
- Ray mode: a local `ray.cluster_utils.Cluster` (a head without GPUs, `--nodes` GPU nodes of
  `--gpus-per-node` logical GPUs), the fleet started with `ray job submit -- python -m
  elastic_rollout_ray.launch`, the same scale-outs (with how many node agents each started);
  at 2 + max(sizes) engines, per GPU node: its engines, the fleet's Ray actors and their resident
  memory, Ray's other worker processes (the raylet's children); then at 4 engines the GPU node hosting the most
  of them is killed hard (`Cluster.remove_node(..., allow_graceful=False)`: raylet and every
  process on it), timed until 4 engines are ACTIVE again with none on it; then `ray job stop`
  (Ray's default stop wait), timed until no placement group, actor, Serve app, agent or engine
  process of the fleet is left.

The goals (issues 15 and 33): Ray mode adds at most 2 s to a 16-engine scale-out beyond local
mode; one agent per node whatever the engine count; a lost node's engines are ACTIVE elsewhere
within 10 s plus the engines' own startup; nothing is left 30 s after `ray job stop`. Timeline
plot (`pip install -e 'python[bench]'`): each engine's steps through the reconciler during the
largest scale-out and the node loss.

    cargo build --release --workspace --bins
    .venv/bin/python benches/ray_fleet.py                       # ~3 min
    .venv/bin/python benches/ray_fleet.py --sizes 1 4 16 --nodes 4 --gpus-per-node 5
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"
NAMESPACE = "er-bench"
SIM = "--engine-arg=--time-scale=0.01"


def binary() -> Path:
    for profile in ("release", "debug"):
        p = ROOT / "target" / profile / "rollout-manager"
        if p.exists():
            return p
    sys.exit("build first: cargo build --release --workspace --bins")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def call(method: str, url: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait(cond: Any, timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = cond()
        except OSError:  # the API restarting, a proxy not up yet
            v = None
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(what)


def engines(control: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = call("GET", f"{control}/rollout/engines")["models"]["default"]["engines"]
    return found


class ActiveClock:
    """Records when each engine is first seen ACTIVE (polled every 20 ms in a thread)."""

    def __init__(self, control: str) -> None:
        self.control = control
        self.first_active: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                for e in engines(self.control):
                    if e["status"] == "ACTIVE":
                        self.first_active.setdefault(e["engine_id"], time.time())
                    else:
                        self.first_active.pop(e["engine_id"], None)
            except OSError:
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class LatencyProbe:
    """Calls ``GET url`` every 0.1 s in a thread (one call at a time, 30 s timeout) and records
    each call's start, duration and status (0 for no answer)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.calls: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            t0 = time.time()
            try:
                with urllib.request.urlopen(self.url, timeout=30) as resp:
                    resp.read()
                    status = resp.status
            except urllib.error.HTTPError as err:
                status = err.code
            except OSError:
                status = 0
            self.calls.append((t0, time.time() - t0, status))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        took = sorted(d for _, d, _ in self.calls)
        return {
            "calls": len(took),
            "not_200": sum(1 for _, _, st in self.calls if st != 200),
            "median_s": took[len(took) // 2] if took else None,
            "max_s": took[-1] if took else None,
            "raw": self.calls,
        }


def scale_series(control: str, sizes: list[int], base: int) -> list[dict[str, Any]]:
    """For each N: scale out to base+N, until the operation is ACTIVE; then back in to base."""
    out = []
    for n in sizes:
        t0 = time.time()
        accepted = call("POST", f"{control}/rollout/scale_out", {"num_replicas": base + n})
        rid = accepted["request_id"]

        def ended(rid: str = rid) -> dict[str, Any] | None:
            op: dict[str, Any] = call("GET", f"{control}/rollout/scale_out/{rid}")
            return op if op["status"] in ("ACTIVE", "FAILED") else None

        op = wait(ended, 600, f"scale-out to {base + n}")
        t1 = time.time()
        if op["status"] != "ACTIVE":
            raise RuntimeError(f"scale-out to {base + n} ended {op['status']}: {op}")
        out.append({"engines": n, "seconds": t1 - t0, "t0": t0, "t1": t1})
        print(f"  scale-out +{n}: {t1 - t0:.2f}s", flush=True)
        inn = call("POST", f"{control}/rollout/scale_in", {"num_replicas": base})["request_id"]
        wait(
            lambda inn=inn: call("GET", f"{control}/rollout/scale_in/{inn}")["status"] in ("COMPLETED", "FAILED"),
            600,
            "scale-in",
        )
        wait(lambda: len(engines(control)) == base, 120, "scale-in done")
        time.sleep(1.0)  # let released GPUs and placement groups settle before the next size
    return out


# -- local mode ---------------------------------------------------------------------------------


def run_local(work: Path, gpus: int, sizes: list[int]) -> list[dict[str, Any]]:
    argv = [
        str(binary()), "serve", "--port", "0", "--router-port", "0", "--state-dir", str(work / "local"),
        "--gpus", str(gpus), "--max-engines", str(gpus), "--rollout-num-gpus", "2",
        "--rollout-num-gpus-per-engine", "1", SIM, "--health-check-interval-secs", "1",
    ]  # fmt: skip
    out = work / "local.out"
    proc = subprocess.Popen(argv, stdout=out.open("wb"), stderr=(work / "local.err").open("wb"))
    try:
        m = wait(lambda: re.search(r"listening control=(\S+)", out.read_text()), 30, "local manager to listen")
        control = m.group(1)
        wait(lambda: sum(e["status"] == "ACTIVE" for e in engines(control)) == 2, 60, "2 local engines")
        return scale_series(control, sizes, 2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


# -- Ray mode -----------------------------------------------------------------------------------


def er_groups() -> list[str]:
    from ray.util.placement_group import placement_group_table

    return [
        i["name"]
        for i in placement_group_table().values()
        if (i.get("name") or "").startswith("er-") and i.get("state") != "REMOVED"
    ]


def fleet_processes(manager_bin: Path) -> list[int]:
    """Our manager, agent and engine processes still running on this machine."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        exe = Path(argv[0].decode(errors="replace")).name if argv and argv[0] else ""
        if exe in ("rollout-manager", "sglang-sim") and str(manager_bin.parent).encode() in argv[0]:
            pids.append(int(proc.name))
    return pids


def reconciler_status() -> dict[str, Any]:
    import ray

    status: dict[str, Any] = ray.get(ray.get_actor("er-reconciler", namespace=NAMESPACE).status.remote(), timeout=30)
    return status


def reconciler_events() -> list[tuple[float, str, str]]:
    return [(float(t), str(e), str(w)) for t, e, w in reconciler_status()["events"]]


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def ray_workers_of(raylet_pid: int) -> list[int]:
    """The Ray worker processes a raylet started (its children titled ``ray::...``)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            title = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == raylet_pid and title.startswith(b"ray::"):
            pids.append(int(proc.name))
    return pids


def processes_at(control: str, size: int, raylets: dict[str, int]) -> list[dict[str, Any]]:
    """At ``size`` engines: per GPU node, its engines, the fleet's Ray actors there (agents) with
    their resident memory, and the node's other Ray worker processes (Ray's pool: idle workers,
    which also ran the GPU-id tasks), found as the children of the node's raylet (``raylets``:
    node id -> raylet pid). Scales back in to 2 afterwards."""
    from ray.util.state import list_actors

    rid = call("POST", f"{control}/rollout/scale_out", {"num_replicas": size})["request_id"]
    wait(lambda: call("GET", f"{control}/rollout/scale_out/{rid}")["status"] == "ACTIVE", 600, f"{size} engines")
    placements = call("GET", f"{control}/rollout/placements")["placements"]
    per_node = collections.Counter(p["agent"]["node_id"] for p in placements)
    actors = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000) if a.ray_namespace == NAMESPACE]
    out = []
    for node, count in sorted(per_node.items()):
        fleet = [a for a in actors if a.node_id == node]
        pids = {a.pid for a in fleet}
        out.append({
            "node_id": node, "engines": count, "fleet_actors": [a.class_name for a in fleet],
            "fleet_actor_rss_mb": sum(rss_mb(pid) for pid in pids),
            "other_ray_workers": len([p for p in ray_workers_of(raylets[node]) if p not in pids]),
        })  # fmt: skip
        n = out[-1]
        print(f"  node {node[:8]}: {count} engines, fleet actors {n['fleet_actors']} "
              f"({n['fleet_actor_rss_mb']:.0f} MB), {n['other_ray_workers']} other Ray workers")  # fmt: skip
    inn = call("POST", f"{control}/rollout/scale_in", {"num_replicas": 2})["request_id"]
    wait(lambda: call("GET", f"{control}/rollout/scale_in/{inn}")["status"] in ("COMPLETED", "FAILED"), 600, "in")
    wait(lambda: len(engines(control)) == 2, 120, "scale-in done")
    return out


def run_ray(work: Path, nodes: int, gpus_per_node: int, sizes: list[int]) -> dict[str, Any]:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    (work / "ray").mkdir()
    os.environ["RAY_TMPDIR"] = str(work)
    os.environ["ELASTIC_ROLLOUT_MANAGER_BIN"] = str(binary())
    dashboard = free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 8, "num_gpus": 0, "temp_dir": str(work / "ray"), "include_dashboard": True,
                        "dashboard_port": dashboard},
    )  # fmt: skip
    workers = [cluster.add_node(num_cpus=8, num_gpus=gpus_per_node) for _ in range(nodes)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="er-bench-driver", log_to_driver=False)
    env = {**os.environ, "RAY_ADDRESS": f"http://127.0.0.1:{dashboard}"}
    cli = [sys.executable, "-m", "ray.scripts.scripts"]
    job = f"ray-fleet-bench-{os.getpid()}"
    serve_port = free_port()
    result: dict[str, Any] = {}
    try:
        entry = [
            sys.executable, "-m", "elastic_rollout_ray.launch", "--fully-async", "--rollout-num-gpus", "2",
            "--rollout-num-gpus-per-engine", "1", "--namespace", NAMESPACE, "--serve-port", str(serve_port),
            "--router-port", "0", "--state-dir", str(work / "ray-state"), "--agent-dir", str(work / "agents"), SIM,
            "--health-check-interval-secs", "1", "--max-engines", str(nodes * gpus_per_node),
        ]  # fmt: skip
        subprocess.run([*cli, "job", "submit", "--no-wait", "--submission-id", job, "--", *entry], env=env,
                       check=True, capture_output=True, timeout=120)  # fmt: skip

        def logs() -> str:
            return subprocess.run(
                [*cli, "job", "logs", job], env=env, capture_output=True, text=True, timeout=60
            ).stdout

        line = wait(lambda: re.search(r"^ELASTIC_ROLLOUT_READY (.*)$", logs(), re.M), 180, "the launcher", 0.5)
        serve_url = json.loads(line.group(1))["control_url"]
        call("GET", f"{serve_url}/rollout/engines")  # the front door answers
        # Timed on the manager's own port: Serve's proxy adds a hop of its own (measured below,
        # during the node loss), which is not the fleet's.
        manager = ray.get_actor("er-manager", namespace=NAMESPACE)
        control = ray.get(manager.info.remote(), timeout=60)["control_url"]
        wait(lambda: sum(e["status"] == "ACTIVE" for e in engines(control)) == 2, 120, "2 Ray engines")
        clock = ActiveClock(control)
        result["scale_out"] = scale_series(control, sizes, 2)
        result["events"] = reconciler_events()
        raylets = {n.node_id: n.all_processes["raylet"][0].process.pid for n in workers}
        result["processes"] = processes_at(control, 2 + max(sizes), raylets)

        # A node dies: the one hosting the most of 4 engines.
        call("POST", f"{control}/rollout/scale_out", {"num_replicas": 4})
        wait(lambda: sum(e["status"] == "ACTIVE" for e in engines(control)) == 4 == len(engines(control)), 120, "4")
        placements = call("GET", f"{control}/rollout/placements")["placements"]
        by_node = collections.Counter(p["agent"]["node_id"] for p in placements)
        victim_id, hosted = by_node.most_common(1)[0]
        victim = next(n for n in workers if n.node_id == victim_id)
        # The control API's latency through Serve's proxy and on the manager's own port, side by
        # side, from the kill until 10 s after it or 3 s after the heal, whichever is later.
        probes = {"serve": LatencyProbe(f"{serve_url}/rollout/placements"),
                  "manager": LatencyProbe(f"{control}/rollout/placements")}  # fmt: skip
        t0 = time.time()
        cluster.remove_node(victim, allow_graceful=False)

        def healed() -> bool:
            now = call("GET", f"{control}/rollout/placements", timeout=5)["placements"]
            active = [e for e in engines(control) if e["status"] == "ACTIVE"]
            return len(active) == 4 and all(p["agent"] and p["agent"]["node_id"] != victim_id for p in now)

        wait(healed, 300, "the fleet healed")
        t1 = time.time()
        time.sleep(max(t0 + 10.0, t1 + 3.0) - time.time())
        result["control_latency"] = {name: probe.stop() for name, probe in probes.items()}
        for name, lat in result["control_latency"].items():
            print(f"  GET /rollout/placements via {name} after the kill: {lat['calls']} calls, "
                  f"{lat['not_200']} not 200, median {lat['median_s']:.3f}s, max {lat['max_s']:.3f}s")  # fmt: skip
        moved = [p["engine_id"] for p in placements if p["agent"]["node_id"] == victim_id]
        result["node_loss"] = {"seconds": t1 - t0, "engines_lost": hosted, "t0": t0, "t1": t1, "moved": moved}
        print(f"  node lost ({hosted} engines): whole again after {t1 - t0:.2f}s", flush=True)
        result["node_loss_events"] = [e for e in reconciler_events() if e[0] >= t0 - 0.1]
        result["active"] = dict(clock.first_active)
        result["reconciler_errors"] = reconciler_status()["errors"]
        clock.stop()

        # ray job stop, Ray's default stop wait.
        env.pop("RAY_JOB_STOP_WAIT_TIME_S", None)
        t0 = time.time()
        subprocess.run([*cli, "job", "stop", job], env=env, check=True, capture_output=True, timeout=120)
        t_returned = time.time()

        def left() -> list[str]:
            what = []
            if groups := er_groups():
                what.append(f"{len(groups)} groups")
            if actors := [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]:
                what.append(f"{len(actors)} actors")
            if procs := fleet_processes(binary()):
                what.append(f"{len(procs)} processes")
            try:
                if "elastic-rollout" in serve.status().applications:
                    what.append("Serve app")
            except Exception:  # no Serve at all
                pass
            return what

        wait(lambda: not left(), 120, "nothing left", 0.1)
        t1 = time.time()
        result["job_stop"] = {"seconds": t1 - t0, "stop_command_seconds": t_returned - t0}
        print(f"  ray job stop: nothing left after {t1 - t0:.2f}s (the command returned after {t_returned - t0:.2f}s)")
    finally:
        ray.shutdown()
        cluster.shutdown()
    return result


# -- report -------------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: pip install -e 'python[bench]' for the plot")
        return False
    biggest = result["ray"]["scale_out"][-1]
    panels = [
        (f"Ray mode: scale-out of {biggest['engines']} engines", biggest["t0"], result["ray"]["events"]),
        (
            f"Ray mode: a node with {result['ray']['node_loss']['engines_lost']} engines killed",
            result["ray"]["node_loss"]["t0"],
            result["ray"]["node_loss_events"],
        ),
    ]
    colors = {"pg_created": "tab:blue", "pg_ready": "tab:cyan", "gpus_read": "tab:orange", "bound": "tab:green",
              "node_lost": "tab:red", "released": "tab:grey"}  # fmt: skip
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, (title, t0, events) in zip(axes, panels, strict=True):
        # The placements' own events (the agents' are keyed agent:<node>).
        window = [e for e in events if t0 - 0.05 <= e[0] <= t0 + 60 and not e[1].startswith("agent:")]
        ids = sorted({e[1] for e in window}, key=lambda x: int(x.rsplit("_", 1)[1]))
        for row, engine in enumerate(ids):
            for t, eid, what in window:
                if eid == engine:
                    kind = what.split(" ")[0]
                    ax.scatter(t - t0, row, color=colors.get(kind, "black"), s=18, label=kind)
        ax.set_yticks(range(len(ids)), ids)
        ax.set_xlabel("seconds after the request (left) / the node's death (right)")
        ax.set_title(title)
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles, strict=True))
        ax.legend(uniq.values(), uniq.keys(), loc="lower right", fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def summarize(result: dict[str, Any]) -> str:
    lines = [
        "| scale-out of N engines | local mode s | Ray mode s | Ray - local s | node agents started in it |",
        "|---|---|---|---|---|",
    ]
    for loc, ray_ in zip(result["local"], result["ray"]["scale_out"], strict=True):
        started = sum(
            1 for t, _, what in result["ray"]["events"] if what == "agent_started" and ray_["t0"] <= t <= ray_["t1"]
        )
        lines.append(
            f"| {loc['engines']} | {loc['seconds']:.2f} | {ray_['seconds']:.2f} "
            f"| {ray_['seconds'] - loc['seconds']:+.2f} | {started} |"
        )
    lines += [
        "",
        f"At {sum(n['engines'] for n in result['ray']['processes'])} engines, per GPU node:",
        "",
        "| node | engines | the fleet's Ray actors there | their resident MB | Ray's other live workers |",
        "|---|---|---|---|---|",
    ]
    for n in result["ray"]["processes"]:
        actors = collections.Counter(n["fleet_actors"])
        named = ", ".join(f"{c} {k}" for k, c in sorted(actors.items()))
        rss, others = n["fleet_actor_rss_mb"], n["other_ray_workers"]
        lines.append(f"| {n['node_id'][:8]} | {n['engines']} | {named} | {rss:.0f} | {others} |")
    nl, js = result["ray"]["node_loss"], result["ray"]["job_stop"]
    lines += [
        "",
        "| event | seconds | goal |",
        "|---|---|---|",
        f"| node killed ({nl['engines_lost']} of 4 engines on it) -> 4 ACTIVE, none on it | {nl['seconds']:.2f} | "
        "<= 10 + engine startup |",
        f"| `ray job stop` -> nothing of the fleet left | {js['seconds']:.2f} | <= 30 |",
    ]
    if "control_latency" in result["ray"]:
        lines += [
            "",
            "`GET /rollout/placements` every 0.1 s from the node's kill until 10 s after it (or 3 s after the heal):",
            "",
            "| through | calls | not 200 | median s | max s |",
            "|---|---|---|---|---|",
        ]
        for name, lat in result["ray"]["control_latency"].items():
            where = "Serve's proxy" if name == "serve" else "the manager's own port"
            lines.append(
                f"| {where} | {lat['calls']} | {lat['not_200']} | {lat['median_s']:.3f} | {lat['max_s']:.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--nodes", type=int, default=4, help="GPU nodes of the Ray cluster")
    p.add_argument("--gpus-per-node", type=int, default=5)
    args = p.parse_args()
    total = args.nodes * args.gpus_per_node
    if max(args.sizes) + 2 > total:
        sys.exit(f"--sizes up to {max(args.sizes)} needs {max(args.sizes) + 2} GPUs; the cluster has {total}")
    work = Path(tempfile.mkdtemp(prefix="rf-", dir="/tmp"))  # short: Ray's socket paths
    try:
        print("local mode", flush=True)
        local = run_local(work, total, args.sizes)
        print("Ray mode", flush=True)
        ray_result = run_ray(work, args.nodes, args.gpus_per_node, args.sizes)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"local": local, "ray": ray_result}
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = (
        f"Results, {stamp}, {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}\n"
        f"`python benches/ray_fleet.py {' '.join(sys.argv[1:])}`: {args.nodes} GPU nodes x {args.gpus_per_node} "
        "logical GPUs + a head without GPUs (ray.cluster_utils.Cluster, one machine)\n"
    )
    table = summarize(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ray_fleet.json").write_text(json.dumps({"when": stamp, **result}, indent=1))
    (RESULTS / "ray_fleet.md").write_text(header + "\n" + table + "\n")
    plotted = plot(result, RESULTS / "ray_fleet.png")
    print(header)
    print(table)
    if plotted:
        print(f"plot: {RESULTS / 'ray_fleet.png'}")


if __name__ == "__main__":
    main()
