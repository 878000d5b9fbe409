"""Ray mode on several nodes: a head without GPUs and three GPU nodes (``Cluster.add_node``).

The fleet is started as users start it, with ``ray job submit -- python -m
elastic_rollout_ray.launch``, and without a ``--state-dir`` (each job keeps its own). In file
order: engines spread over the GPU nodes; a node killed (its raylet and everything on it) under
load heals on the other nodes, on the fleet's current weights, without a failed request; a node
killed while a scale-out starts an engine on it: the engine is placed again on another node and
the operation ends ACTIVE; the head killed with the GPU nodes up leaves nothing of the fleet on
them; on a new cluster a new job starts fresh, ``ray job stop`` with Ray's default stop wait
leaves nothing, and ``--resume`` takes the old job's fleet up explicitly; a killed driver takes
the whole fleet with it.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _checkpoints import write_checkpoint
from _ray_support import RayCluster, free_port, local_cluster, serve_actors
from _support import ProcessIdentity, http, wait_until

from elastic_rollout import RolloutApiError, RolloutClient

NAMESPACE = "er-nodes"
STARTUP = 180.0
GPU_NODES = 3
GPUS_PER_NODE = 2
HEAD = {"num_cpus": 8, "num_gpus": 0}
WORKER = {"num_cpus": 4, "num_gpus": GPUS_PER_NODE}


@dataclass
class Job:
    ray: RayCluster
    job_id: str
    control_url: str = ""
    router_url: str = ""
    state_dir: str = ""
    client: RolloutClient = field(default_factory=lambda: RolloutClient("http://127.0.0.1:1"))
    #: every manager, agent and engine process seen, for the leak checks
    seen: dict[int, ProcessIdentity] = field(default_factory=dict)

    def logs(self) -> str:
        done = subprocess.run([*self.ray.ray_cli(), "job", "logs", self.job_id], capture_output=True, text=True,
                              env=self.ray.env, timeout=60, check=False)  # fmt: skip
        return done.stdout[-6000:] + done.stderr[-2000:]

    def status(self) -> str:
        from ray.job_submission import JobSubmissionClient

        return str(JobSubmissionClient(self.ray.dashboard_url).get_job_status(self.job_id).value)

    def placements(self) -> list[dict[str, Any]]:
        resp = http("GET", self.control_url + "/rollout/placements")
        if resp.status != 200:
            raise RolloutApiError.from_body(resp.status, resp.body)
        found: list[dict[str, Any]] = resp.json()["placements"]
        return found

    def engines(self) -> list[dict[str, Any]]:
        engines = [e.raw for e in self.client.engines().engines]
        for e in engines:
            for pid in (e["pid"], agent_pid(e["pid"]) if e["pid"] else None):
                if pid and pid > 1 and (ident := ProcessIdentity.of(pid)) is not None:
                    self.seen.setdefault(pid, ident)
        return engines

    def wait_active(self, count: int, timeout: float = STARTUP) -> list[dict[str, Any]]:
        def check() -> list[dict[str, Any]] | None:
            engines = self.engines()
            active = [e for e in engines if e["status"] == "ACTIVE"]
            return active if len(active) == count == len(engines) else None

        return wait_until(check, timeout, lambda: f"{count} ACTIVE engines; {self.engines()}\n{self.logs()}")


def agent_pid(pid: int) -> int | None:
    """The node agent that runs engine ``pid`` (its parent), if it still does."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        cmdline = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    return parent if b"agent" in cmdline[1:2] else None


def lineage(pid: int) -> list[str]:
    """``pid`` and its ancestors, as ``pid state argv``, for a failure message."""
    out = []
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120].decode(errors="replace")
        except OSError:
            out.append(f"{pid} gone")
            break
        fields = stat[stat.rindex(")") + 2 :].split()
        out.append(f"{pid} {fields[0]} {argv}")
        pid = int(fields[1])
    return out


def submit(cluster: RayCluster, job_id: str, serve_port: int, *extra: str) -> Job:
    args = [
        "--fully-async", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "1",
        "--namespace", NAMESPACE, "--serve-port", str(serve_port), "--router-port", "0",
        "--engine-arg=--time-scale=0.01", "--health-check-interval-secs", "1", *extra,
    ]  # fmt: skip
    entry = [sys.executable, "-m", "elastic_rollout_ray.launch", *args]
    done = subprocess.run([*cluster.ray_cli(), "job", "submit", "--no-wait", "--submission-id", job_id, "--", *entry],
                          capture_output=True, text=True, env=cluster.env, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    job = Job(cluster, job_id)

    def ready() -> dict[str, Any] | None:
        for line in job.logs().splitlines():
            if line.startswith("ELASTIC_ROLLOUT_READY "):
                where: dict[str, Any] = json.loads(line.split(" ", 1)[1])
                return where
        assert job.status() in ("PENDING", "RUNNING"), job.logs()
        return None

    where = wait_until(ready, STARTUP, lambda: f"the launcher's ready line; {job.logs()}", interval=0.5)
    job.control_url, job.router_url, job.state_dir = where["control_url"], where["router_url"], where["state_dir"]
    if (manager := ProcessIdentity.of(int(where["manager_pid"]))) is not None:
        job.seen[manager.pid] = manager
    job.client = RolloutClient(job.control_url)
    return job


def er_placement_groups() -> dict[str, dict[str, Any]]:
    from ray.util.placement_group import placement_group_table

    return {
        info["name"]: info
        for info in placement_group_table().values()
        if (info.get("name") or "").startswith("er-") and info.get("state") != "REMOVED"
    }


def fleet_actors() -> list[dict[str, str]]:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]


def nothing_left(job: Job) -> str | None:
    """What of the fleet is still there (None when nothing is)."""
    from ray import serve

    left = []
    if pgs := er_placement_groups():
        left.append(f"placement groups {sorted(pgs)}")
    if actors := fleet_actors():
        left.append(f"actors {actors}")
    if alive := [i.pid for i in job.seen.values() if i.alive()]:
        left.append(f"processes {alive}")
    try:
        if "elastic-rollout" in serve.status().applications:
            left.append("the Serve app")
    except Exception:
        pass
    return "; ".join(left) or None


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, manager_bin: Path, home: Path) -> Iterator[RayCluster]:
    temp_dir = Path(tmp_path_factory.mktemp("rayn", numbered=True))
    with local_cluster(temp_dir, manager_bin, HEAD, [WORKER] * GPU_NODES, home=home) as c:
        yield c


def hold_file(home: Path) -> Path:
    """While this file exists, the job's engines stay in their weight load (sglang-sim's
    ``--hold-startup-while``): a start as slow as a test needs."""
    return home / "hold-engine-startup"


@pytest.fixture(scope="module")
def job(cluster: RayCluster, home: Path) -> Iterator[Job]:
    hold = f"--engine-arg=--hold-startup-while={hold_file(home)}"
    job = submit(cluster, f"er-nodes-{os.getpid()}", free_port(), hold)
    try:
        yield job
    finally:
        try:
            running = job.status() in ("PENDING", "RUNNING")
        except Exception:
            running = False
        if running:
            subprocess.run([*cluster.ray_cli(), "job", "stop", job.job_id], env=cluster.env, timeout=120, check=False)


def test_engines_spread_over_the_gpu_nodes(job: Job, home: Path) -> None:
    import ray

    job.wait_active(2)
    # No --state-dir: the fleet's state is this job's own.
    assert job.state_dir == str(home / ".cache" / "elastic-rollout" / NAMESPACE / job.job_id)
    op = job.client.wait_for_operation("scale_out", job.client.scale_out(num_replicas=4).request_id, STARTUP)
    assert op.status == "ACTIVE", op
    job.wait_active(4)
    head = ray.get_runtime_context().get_node_id()
    nodes = {p["agent"]["node_id"] for p in job.placements()}
    assert head not in nodes and len(nodes) >= 2, nodes
    assert len(er_placement_groups()) == 4
    # The manager, the reconciler and the Serve ingress share the driver's node (the socket and
    # the state dir are node-local), pinned by node id: every node here has the same IP.
    from ray.util.state import list_actors

    alive = list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)
    where = {
        a.name if a.name in ("er-manager", "er-reconciler") else "ingress": a.node_id
        for a in alive
        if a.name in ("er-manager", "er-reconciler") or "RolloutIngress" in (a.class_name or "")
    }
    assert where == {"er-manager": head, "er-reconciler": head, "ingress": head}, where
    # One agent per node, whatever the number of engines there, running on that node.
    placements = job.placements()
    urls = {n: {q["agent"]["url"] for q in placements if q["agent"]["node_id"] == n} for n in nodes}
    assert all(len(u) == 1 for u in urls.values()), urls
    agent_nodes = {a.name.removeprefix("er-agent-"): a.node_id for a in alive if (a.name or "").startswith("er-agent-")}
    assert agent_nodes == {n: n for n in nodes}, agent_nodes


def test_a_lost_node_heals_under_load_on_the_current_weights(job: Job, tmp_path: Path) -> None:
    checksum = write_checkpoint(tmp_path / "v2", seed=2)
    update = job.client.publish_weights("v2", str(tmp_path / "v2"), checksum=checksum)
    assert job.client.wait_for_weight_update(update["update_id"], STARTUP)["status"] == "COMPLETED"
    job.wait_active(4)
    placements = job.placements()
    by_node = collections.Counter(p["agent"]["node_id"] for p in placements)
    victim_id, hosted = by_node.most_common(1)[0]
    moved = {p["engine_id"] for p in placements if p["agent"]["node_id"] == victim_id}
    assert len(moved) == hosted
    victim = next(n for n in job.ray.cluster.worker_nodes if n.node_id == victim_id)

    answers: list[int] = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            body = {"text": f"prompt {i}", "sampling_params": {"max_new_tokens": 4}}
            answers.append(http("POST", job.router_url + "/generate", body, timeout=60).status)
            i += 1

    workers = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for w in workers:
        w.start()
    wait_until(lambda: len(answers) >= 20, 60, "requests flowing")
    # Hard: the raylet and every process of the node are killed, as when a machine dies.
    job.ray.cluster.remove_node(victim, allow_graceful=False)

    def healed() -> list[dict[str, Any]] | None:
        # The control API goes through Serve. The nodes of this test share one IP, so its replica
        # may have run on the killed node; Serve answers 5xx until it is back (on a real cluster
        # it runs on the launcher's node): keep waiting through those.
        try:
            now = job.placements()
            active = [e for e in job.engines() if e["status"] == "ACTIVE"]
        except RolloutApiError as err:
            if err.status >= 500:
                return None
            raise
        elsewhere = all(p["agent"] and p["agent"]["node_id"] != victim_id for p in now)
        return active if len(active) == 4 and len(now) == 4 and elsewhere else None

    active = wait_until(healed, STARTUP, lambda: f"4 ACTIVE engines off the dead node; {job.engines()}\n{job.logs()}")
    seen_after = len(answers)
    wait_until(lambda: len(answers) >= seen_after + 20, 60, "requests served after the heal")
    stop.set()
    for w in workers:
        w.join(timeout=90)
    assert answers and set(answers) == {200}, collections.Counter(answers)
    for e in active:
        assert e["weight_version"] == "v2", e
        if e["engine_id"] in moved:
            assert e["restarts"] >= 1, e
    assert len(er_placement_groups()) == 4


def test_a_node_lost_while_a_scale_out_starts_an_engine_places_it_again(job: Job, home: Path) -> None:
    # After the test above: the fleet is on v2 and its 4 engines fill the 2 GPU nodes left. Two
    # empty GPU nodes join; the fifth engine is placed on one of them and held in its weight
    # load, its process started there.
    fresh = [job.ray.cluster.add_node(**WORKER) for _ in range(2)]
    fresh_ids = {n.node_id for n in fresh}
    before = {e["engine_id"] for e in job.engines()}
    hold = hold_file(home)
    hold.touch()
    try:
        request_id = job.client.scale_out(num_replicas=len(before) + 1).request_id

        def started() -> tuple[str, str] | None:
            new = [e for e in job.engines() if e["engine_id"] not in before]
            if len(new) != 1 or new[0]["status"] != "HEALTH_CHECKING":
                return None
            placement = next(p for p in job.placements() if p["engine_id"] == new[0]["engine_id"])
            return (new[0]["engine_id"], placement["agent"]["node_id"]) if placement["agent"] else None

        engine_id, victim_id = wait_until(started, STARTUP, lambda: f"the new engine starting; {job.engines()}")
        assert victim_id in fresh_ids, (victim_id, fresh_ids)
        assert job.client.scale_out_status(request_id).status not in ("ACTIVE", "FAILED")
        victim = next(n for n in fresh if n.node_id == victim_id)
        job.ray.cluster.remove_node(victim, allow_graceful=False)

        def unbound() -> bool:
            # As on a real cluster, the engine on the dead node never comes up: the load stays
            # held until the manager saw the node go (this test's nodes share one machine, so a
            # process of the killed node could otherwise still finish its start).
            try:
                placement = next(p for p in job.placements() if p["engine_id"] == engine_id)
            except RolloutApiError as err:
                if err.status >= 500:
                    return False
                raise
            return placement["agent"] is None or placement["agent"]["node_id"] != victim_id

        wait_until(unbound, 60, lambda: f"the placement off the dead node; {job.placements()}")
    finally:
        hold.unlink(missing_ok=True)

    def ended() -> Any:
        # The nodes of this test share one IP; see the test above for Serve's 5xx meanwhile.
        try:
            op = job.client.scale_out_status(request_id)
        except RolloutApiError as err:
            if err.status >= 500:
                return None
            raise
        return op if op.is_terminal else None

    op = wait_until(ended, STARTUP, lambda: f"the scale-out to end; {job.engines()}\n{job.logs()}")
    assert op.status == "ACTIVE" and not op.failed_engines, op
    engine = next(e for e in job.engines() if e["engine_id"] == engine_id)
    assert engine["status"] == "ACTIVE" and engine["weight_version"] == "v2", engine
    placement = next(p for p in job.placements() if p["engine_id"] == engine_id)
    assert placement["agent"]["node_id"] in fresh_ids - {victim_id}, (placement, victim_id)
    assert len(job.wait_active(len(before) + 1)) == len(before) + 1
    # Back to the fleet the tests after this one expect.
    removal = job.client.scale_in(num_replicas=len(before))
    assert job.client.wait_for_operation("scale_in", removal.request_id, STARTUP).status == "COMPLETED"
    wait_until(lambda: len(er_placement_groups()) == len(before), 60, lambda: f"{er_placement_groups()}")


def test_a_dead_head_leaves_nothing_and_a_new_cluster_starts_fresh_with_explicit_resume(
    job: Job, cluster: RayCluster, home: Path, tmp_path_factory: pytest.TempPathFactory, manager_bin: Path
) -> None:
    import ray

    old = Path(job.state_dir)
    assert (old / "manager.log").exists()
    # The head dies as `ray stop` on it ends it (GCS, raylet, the job's driver, the manager
    # actor), while the GPU nodes stay up with the fleet's agents and engines on them. Without
    # GCS fault tolerance (Ray's default) their raylets give up on the GCS after Ray's default
    # reconnect timeout (60 s), their workers with them, and every agent and engine follows its
    # parent: nothing of the fleet is left on them.
    job.engines()  # every engine, agent and the manager recorded in job.seen
    assert {i.pid for i in job.seen.values() if i.alive()} and any(agent_pid(p) for p in job.seen), job.seen
    ray.shutdown()
    cluster.cluster.remove_node(cluster.cluster.head_node, allow_graceful=False)
    alive = {pid: i for pid, i in job.seen.items() if i.alive()}

    def raylets() -> list[int | None]:
        # Reaped as init reaps them on a real node: here they are this process's children, and
        # Ray's workers take a raylet that is a zombie for alive (kill(pid, 0) succeeds).
        return [n.all_processes["raylet"][0].process.poll() for n in cluster.cluster.worker_nodes]

    def gone() -> bool:
        raylets()
        return not [p for p, i in alive.items() if i.alive()]

    def left() -> str:
        return f"{[lineage(p) for p, i in alive.items() if i.alive()]}; the raylets' exit codes {raylets()}"

    wait_until(gone, 180, lambda: f"the fleet gone: {left()}", interval=0.5)
    # A new cluster comes up, with the same home directory.
    cluster.cluster.shutdown()
    temp_dir = Path(tmp_path_factory.mktemp("rayn", numbered=True))
    with local_cluster(temp_dir, manager_bin, HEAD, [WORKER] * 2, home=home) as fresh:
        again = submit(fresh, f"er-nodes-again-{os.getpid()}", free_port())
        engines = again.wait_active(2)
        assert sorted(e["engine_id"] for e in engines) == ["engine_0", "engine_1"]
        assert all(e["restarts"] == 0 and e["weight_version"] != "v2" for e in engines), engines
        assert Path(again.state_dir) != old
        # `ray job stop` with Ray's default stop wait leaves nothing of the fleet, and frees every GPU.
        assert "RAY_JOB_STOP_WAIT_TIME_S" not in fresh.env
        stop = subprocess.run([*fresh.ray_cli(), "job", "stop", again.job_id], capture_output=True, text=True,
                              env=fresh.env, timeout=120, check=False)  # fmt: skip
        assert stop.returncode == 0, stop.stdout + stop.stderr
        wait_until(lambda: again.status() == "STOPPED", 60, "the job stopped")
        wait_until(lambda: nothing_left(again) is None, 30, lambda: f"nothing left: {nothing_left(again)}")
        free = 2 * GPUS_PER_NODE
        wait_until(
            lambda: ray.cluster_resources().get("GPU") == ray.available_resources().get("GPU") == free,
            60, lambda: f"{free} GPUs, all free: {ray.cluster_resources()} {ray.available_resources()}",
        )  # fmt: skip

        # Resuming is a choice: the old fleet (4 engines on v2) comes back, its placements
        # re-placed on this cluster since the old agents are gone.
        resumed = submit(fresh, f"er-nodes-resumed-{os.getpid()}", free_port(), "--resume", job.job_id)
        assert Path(resumed.state_dir) == old
        engines = resumed.wait_active(4)
        assert all(e["weight_version"] == "v2" for e in engines), engines
        agents = {p["agent"]["node_id"] for p in resumed.placements()}
        assert agents <= {n["NodeID"] for n in ray.nodes() if n["Alive"]}

        # A driver killed outright takes the fleet with it: its actors die with it, Ray removes
        # the job's placement groups, agents and engines die with their actors, and the Serve
        # app's replica, seeing the job dead, shuts Serve down (nothing else uses it here).
        from ray.job_submission import JobSubmissionClient

        info = JobSubmissionClient(fresh.dashboard_url).get_job_info(resumed.job_id)
        assert info.driver_info is not None
        os.kill(int(info.driver_info.pid), signal.SIGKILL)
        wait_until(lambda: nothing_left(resumed) is None, 60, lambda: f"nothing left: {nothing_left(resumed)}")
        assert ray.cluster_resources().get("GPU") == ray.available_resources().get("GPU")
        wait_until(lambda: serve_actors() == [], 60, lambda: f"Serve's controller and proxies gone; {serve_actors()}")
