"""The whole Ray mode end to end, on a real local Ray cluster with logical GPUs.

``ray job submit -- python -m elastic_rollout_ray.launch --fully-async ...`` starts the manager
(real ``rollout-manager serve --placement ray``), the reconciler and the Serve ingress; engines are
``sglang-sim`` processes hosted by real ``rollout-manager agent`` processes in Ray placement groups.
The tests share one fleet and run in file order: start (2 engines), scale-out to 4, /generate,
engine crash, manager crash, scale-in to 2, a scale-out beyond the cluster's GPUs that waits in
PENDING_RESOURCES until a node joins, and finally ``ray job stop`` leaving nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# ray_cluster is a fixture: imported here, taken by name as an argument below (hence F811 there).
from _ray_support import HEAD_GPUS, RayCluster, free_port, ray_cluster, serve_actors  # noqa: F401
from _support import ProcessIdentity, http, wait_until

from elastic_rollout import RolloutApiError, RolloutClient

NAMESPACE = "er-test"
STARTUP = 180.0


@dataclass
class RayFleet:
    job_id: str
    control_url: str
    router_url: str
    client: RolloutClient
    ray: RayCluster
    seen: dict[int, ProcessIdentity]

    def job_logs(self) -> str:
        done = subprocess.run(
            [*self.ray.ray_cli(), "job", "logs", self.job_id], capture_output=True, text=True, env=self.ray.env,
            timeout=60, check=False,
        )  # fmt: skip
        return done.stdout[-6000:] + done.stderr[-2000:]

    def engines(self) -> list[dict[str, Any]]:
        view = self.client.engines()
        for e in view.engines:
            if e.pid:
                ident = ProcessIdentity.of(e.pid)
                if ident is not None:
                    self.seen.setdefault(e.pid, ident)
        return [e.raw for e in view.engines]

    def active(self) -> list[dict[str, Any]]:
        return [e for e in self.engines() if e["status"] == "ACTIVE"]


def er_placement_groups() -> dict[str, dict[str, Any]]:
    """Our placement groups that Ray has not removed, by name."""
    from ray.util.placement_group import placement_group_table

    return {
        info["name"]: info
        for info in placement_group_table().values()
        if (info.get("name") or "").startswith("er-") and info.get("state") != "REMOVED"
    }


def er_actors() -> list[str]:
    """The names of the fleet's named actors."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE)


def ray_status() -> dict[str, Any]:
    """The reconciler's status()."""
    import ray

    status: dict[str, Any] = ray.get(ray.get_actor("er-reconciler", namespace=NAMESPACE).status.remote(), timeout=30)
    return status


def gpus_taken() -> float:
    import ray

    return ray.cluster_resources().get("GPU", 0.0) - ray.available_resources().get("GPU", 0.0)


def manager_info() -> dict[str, Any]:
    import ray

    info: dict[str, Any] = ray.get(ray.get_actor("er-manager", namespace=NAMESPACE).info.remote(), timeout=30)
    return info


#: The fleet runs with an API token: the reconciler must send it, and Serve must pass it through.
TOKEN = "ray-test-token-0123456789"


def launch_args(state_dir: Path, serve_port: int) -> list[str]:
    token_file = state_dir / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    return [
        "--api-token-file", str(token_file), "--agent-dir", str(state_dir / "agents"),
        "--fully-async", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "1",
        "--namespace", NAMESPACE, "--serve-port", str(serve_port), "--router-port", "0",
        "--state-dir", str(state_dir), "--api-socket", str(state_dir / "api.sock"),
        "--engine-arg=--time-scale=0.01", "--health-check-interval-secs", "1",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def fleet(ray_cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayFleet]:  # noqa: F811
    state_dir = tmp_path_factory.mktemp("er-state")
    serve_port = free_port()
    job_id = f"er-test-{os.getpid()}"
    entrypoint = [sys.executable, "-m", "elastic_rollout_ray.launch", *launch_args(state_dir, serve_port)]
    submit = subprocess.run(
        [*ray_cluster.ray_cli(), "job", "submit", "--no-wait", "--submission-id", job_id, "--", *entrypoint],
        capture_output=True, text=True, env=ray_cluster.env, timeout=120, check=False,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout + submit.stderr
    fleet = RayFleet(job_id, "", "", RolloutClient("http://127.0.0.1:1"), ray_cluster, {})

    def ready() -> dict[str, Any] | None:
        for line in fleet.job_logs().splitlines():
            if line.startswith("ELASTIC_ROLLOUT_READY "):
                found: dict[str, Any] = json.loads(line.split(" ", 1)[1])
                return found
        status = job_status(ray_cluster, job_id)
        assert status in ("PENDING", "RUNNING"), f"job {status}:\n{fleet.job_logs()}"
        return None

    where = wait_until(ready, STARTUP, lambda: f"the launcher's ready line; logs:\n{fleet.job_logs()}", interval=1)
    fleet.control_url, fleet.router_url = where["control_url"], where["router_url"]
    fleet.client = RolloutClient(fleet.control_url, token=TOKEN)
    try:
        yield fleet
    finally:
        if job_status(ray_cluster, job_id) in ("PENDING", "RUNNING"):
            subprocess.run(
                [*ray_cluster.ray_cli(), "job", "stop", job_id], env=ray_cluster.env, timeout=300, check=False
            )


def job_status(cluster: RayCluster, job_id: str) -> str:
    from ray.job_submission import JobSubmissionClient

    return str(JobSubmissionClient(cluster.dashboard_url).get_job_status(job_id).value)


def wait_engines(fleet: RayFleet, count: int, timeout: float = STARTUP) -> list[dict[str, Any]]:
    def check() -> list[dict[str, Any]] | None:
        engines = fleet.engines()
        active = [e for e in engines if e["status"] == "ACTIVE"]
        return active if len(active) == count and len(engines) == count else None

    return wait_until(check, timeout, lambda: f"{count} ACTIVE engines; engines: {fleet.engines()}\n{fleet.job_logs()}")


# -- before anything runs ----------------------------------------------------------------------


def test_launch_validates_before_touching_the_cluster(ray_cluster: RayCluster, manager_bin: Path) -> None:  # noqa: F811
    launch = [sys.executable, "-m", "elastic_rollout_ray.launch"]
    bad = subprocess.run([*launch, "--fully-async", "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
                         capture_output=True, text=True, env=ray_cluster.env, timeout=60, check=False)  # fmt: skip
    assert bad.returncode == 2
    # The manager's own message for the same flags.
    serve = [str(manager_bin), "serve", "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"]
    direct = subprocess.run(serve, capture_output=True, text=True, timeout=60, check=False)
    assert direct.stderr.strip() and direct.stderr.strip() in bad.stderr
    not_async = subprocess.run([*launch, "--rollout-num-gpus", "2"], capture_output=True, text=True,
                               env=ray_cluster.env, timeout=60, check=False)  # fmt: skip
    assert (
        not_async.returncode == 2 and "--fully-async" in not_async.stderr and "fully-async pipeline" in not_async.stderr
    )
    local = subprocess.run([*launch, "--fully-async", "--placement", "local"], capture_output=True, text=True,
                           env=ray_cluster.env, timeout=60, check=False)  # fmt: skip
    assert local.returncode == 2 and "--placement" in local.stderr
    assert er_placement_groups() == {}
    assert gpus_taken() == 0


# -- the fleet ----------------------------------------------------------------------------------


def test_job_starts_the_initial_engines_in_placement_groups(fleet: RayFleet) -> None:
    engines = wait_engines(fleet, 2)
    pgs = wait_until(lambda: (p := er_placement_groups()) and len(p) == 2 and p, 60, "2 placement groups")
    assert set(pgs) == {f"er-{e['engine_id']}" for e in engines}
    assert all(p["strategy"] == "STRICT_PACK" and p["state"] == "CREATED" for p in pgs.values())
    assert gpus_taken() == 2
    placements = http("GET", fleet.control_url + "/rollout/placements").json()["placements"]
    assert sorted(p["status"] for p in placements) == ["BOUND", "BOUND"]
    assert all(p["initial"] and p["agent"]["url"].startswith("http://") for p in placements)


def test_serve_forwards_answers_as_the_manager_gives_them(fleet: RayFleet) -> None:
    import httpx

    socket_path = manager_info()["api_socket"]
    direct = httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), base_url="http://manager")
    cases = [
        ("POST", "/rollout/scale_out", {"num_replicas": "four"}),
        ("POST", "/rollout/scale_in", {"num_replicas": 0, "engine_urls": ["ftp://x"]}),
        ("GET", "/rollout/scale_out/no-such-request", None),
        ("GET", "/rollout/placements?after=0", None),
        ("GET", "/openapi.json", None),
        ("GET", "/health", None),
    ]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for method, path, body in cases:
        raw = None if body is None else json.dumps(body).encode()
        via_serve = http(method, fleet.control_url + path, raw_body=raw, headers=auth)
        via_socket = direct.request(method, path, content=raw, headers={"Content-Type": "application/json", **auth})
        assert via_serve.status == via_socket.status_code, (path, via_serve.body)
        assert via_serve.headers["content-type"] == via_socket.headers["content-type"]
        if via_serve.status >= 400:
            assert via_serve.json() == via_socket.json() and via_serve.json()["error"]["message"]
    direct.close()
    # Without the token a mutating request is refused by the manager, through Serve too.
    refused = http("POST", fleet.control_url + "/rollout/scale_out", {"num_replicas": 2})
    assert refused.status == 401 and "Bearer" in refused.json()["error"]["message"]
    assert fleet.client.scale_out(num_replicas=2).status  # with it, accepted (a no-op at 2 engines)


def test_scale_out_to_4_through_serve_takes_4_gpus(fleet: RayFleet) -> None:
    accepted = fleet.client.scale_out(num_replicas=4)
    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, timeout=STARTUP)
    assert op.status == "ACTIVE", op
    wait_engines(fleet, 4)
    assert len(wait_until(lambda: len(er_placement_groups()) == 4 and er_placement_groups(), 60, "4 PGs")) == 4
    assert gpus_taken() == 4
    # One agent for the node's four engines, each on the GPU its own bundle was given.
    placements = http("GET", fleet.control_url + "/rollout/placements").json()["placements"]
    assert len({p["agent"]["url"] for p in placements}) == 1, placements
    gpus = [g for p in placements for g in p["agent"]["gpu_ids"]]
    assert len(gpus) == 4 and len(set(gpus)) == 4, gpus
    assert [a for a in er_actors() if a.startswith("er-agent-")] == [f"er-agent-{placements[0]['agent']['node_id']}"]
    status = ray_status()
    assert {e: (b["agent_url"], b["gpu_ids"]) for e, b in status["bindings"].items()} == {
        p["engine_id"]: (p["agent"]["url"], p["agent"]["gpu_ids"]) for p in placements
    }


def parent_cmdline(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_generate_through_the_router_reaches_agent_hosted_engines(fleet: RayFleet) -> None:
    engines = fleet.active()
    assert len(engines) == 4
    agent_dir = manager_info()["state_dir"] + "/agents/"  # the launcher's --agent-dir
    for e in engines:  # every engine is a child of a node agent, not of the manager
        assert " agent " in parent_cmdline(e["pid"]), parent_cmdline(e["pid"])
        assert e["log_path"].startswith(agent_dir), e["log_path"]
        # The agent holds the manager's token (so it refuses other callers), in its environment.
        stat = Path(f"/proc/{e['pid']}/stat").read_text()
        agent_pid = int(stat[stat.rindex(")") + 2 :].split()[1])
        assert f"ROLLOUT_MANAGER_API_TOKEN={TOKEN}".encode() in Path(f"/proc/{agent_pid}/environ").read_bytes().split(
            b"\0"
        )
        assert TOKEN not in Path(f"/proc/{agent_pid}/cmdline").read_text()
        assert TOKEN.encode() not in Path(f"/proc/{e['pid']}/environ").read_bytes()  # engines never get it
    for _ in range(8):
        resp = http("POST", fleet.router_url + "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}})
        assert resp.status == 200, resp.body
        assert resp.json()["text"]


def test_a_killed_engine_is_recovered_by_its_agent(fleet: RayFleet) -> None:
    victim = next(e for e in fleet.active() if e["pid"])
    ident = ProcessIdentity.of(victim["pid"])
    assert ident is not None
    os.kill(victim["pid"], signal.SIGKILL)

    def recovered() -> bool:
        now = next((e for e in fleet.engines() if e["engine_id"] == victim["engine_id"]), None)
        return bool(now and now["status"] == "ACTIVE" and now["pid"] and now["pid"] != victim["pid"])

    wait_until(recovered, STARTUP, lambda: f"{victim['engine_id']} restarted; {fleet.engines()}")
    assert not ident.alive()
    wait_engines(fleet, 4)


def test_a_transient_agent_error_restarts_nothing(fleet: RayFleet) -> None:
    """Ray's ActorUnavailableError on an agent's watch (contact lost for a moment) is not taken
    for death: the agent answers and its node is alive, so nothing is reported lost or restarted,
    and the agent is watched again (a second blip is handled the same way)."""
    import ray

    engines = wait_engines(fleet, 4)
    before = {e["engine_id"]: e["pid"] for e in engines}
    restarts = {e["engine_id"]: e["restarts"] for e in engines}
    placements = http("GET", fleet.control_url + "/rollout/placements").json()["placements"]
    agents = {p["engine_id"]: p["agent"]["url"] for p in placements}
    reconciler = ray.get_actor("er-reconciler", namespace=NAMESPACE)
    victim = sorted(before)[0]
    key = "agent:" + next(p["agent"]["node_id"] for p in placements if p["engine_id"] == victim)
    since = time.time()

    def events(*what: str) -> list[tuple[float, str, str]]:
        status = ray.get(reconciler.status.remote())
        return [(t, k, ev) for t, k, ev in status["events"] if ev in what and t >= since]

    for blip in (1, 2):
        assert ray.get(reconciler.inject_watch_error.remote(victim))
        wait_until(
            lambda n=blip: len([e for e in events("agent_unavailable_transient") if e[1] == key]) >= n,
            60,
            f"blip {blip} seen as transient",
        )
    assert not events("agent_lost", "node_lost"), ray.get(reconciler.status.remote())["errors"]
    assert {e["engine_id"]: e["pid"] for e in fleet.active()} == before
    now = {
        p["engine_id"]: p["agent"]["url"]
        for p in http("GET", fleet.control_url + "/rollout/placements").json()["placements"]
    }
    assert now == agents
    assert {e["engine_id"]: e["restarts"] for e in fleet.active()} == restarts


def active_pids(fleet: RayFleet, count: int) -> dict[str, int] | None:
    """Engine id -> pid of the ACTIVE engines once there are ``count`` (None before, and while
    Serve answers 503 because the manager is (re)starting)."""
    try:
        now = {e["engine_id"]: e["pid"] for e in fleet.active()}
    except RolloutApiError as err:
        assert err.status == 503, err
        return None
    return now if len(now) == count else None


def test_a_killed_manager_is_restarted_and_readopts_every_engine(fleet: RayFleet) -> None:
    before = {e["engine_id"]: e["pid"] for e in wait_engines(fleet, 4)}
    info = manager_info()
    os.kill(info["pid"], signal.SIGKILL)
    wait_until(lambda: manager_info()["pid"] != info["pid"] and manager_info()["running"], 120, "a restarted manager")

    after = wait_until(
        lambda: active_pids(fleet, 4), STARTUP, lambda: f"4 ACTIVE engines after the restart; {fleet.engines()}"
    )
    assert after == before  # the same engines, same processes: re-adopted, not restarted
    assert manager_info()["router_url"] == info["router_url"]
    assert len(er_placement_groups()) == 4


def test_a_killed_manager_actor_is_started_again_and_readopts_every_engine(fleet: RayFleet) -> None:
    import ray
    from ray.exceptions import RayActorError

    before = {e["engine_id"]: e["pid"] for e in wait_engines(fleet, 4)}
    old_info = manager_info()
    old = ray.get_actor("er-manager", namespace=NAMESPACE)
    ray.kill(old, no_restart=True)  # its manager process dies with it (SIGKILL, --parent-pid)

    def new_manager() -> dict[str, Any] | None:
        try:
            actor = ray.get_actor("er-manager", namespace=NAMESPACE)
            if actor._actor_id == old._actor_id:
                return None
            info: dict[str, Any] = ray.get(actor.info.remote(), timeout=30)
        except (ValueError, RayActorError):
            return None
        return info if info["running"] else None

    info = wait_until(new_manager, 120, lambda: f"a new manager actor; {fleet.job_logs()}")
    assert info["pid"] != old_info["pid"]
    assert (info["router_url"], info["state_dir"]) == (old_info["router_url"], old_info["state_dir"])

    after = wait_until(
        lambda: active_pids(fleet, 4), STARTUP, lambda: f"4 ACTIVE engines after the new actor; {fleet.engines()}"
    )
    assert after == before  # the same engine processes, re-adopted through their agents


def test_scale_in_to_2_returns_the_gpus(fleet: RayFleet) -> None:
    accepted = fleet.client.scale_in(num_replicas=2)
    op = fleet.client.wait_for_operation("scale_in", accepted.request_id, timeout=STARTUP)
    assert op.status == "COMPLETED", op
    wait_engines(fleet, 2)
    wait_until(lambda: len(er_placement_groups()) == 2, 120, lambda: f"2 PGs; {er_placement_groups().keys()}")
    wait_until(lambda: gpus_taken() == 2, 60, "2 GPUs back")


def test_a_killed_reconciler_is_replaced_and_the_fleet_rebuilt(fleet: RayFleet) -> None:
    import ray

    before = {
        p["engine_id"]: p["agent"]["url"]
        for p in http("GET", fleet.control_url + "/rollout/placements").json()["placements"]
    }
    assert len(before) == 2
    old = ray.get_actor("er-reconciler", namespace=NAMESPACE)
    ray.kill(old, no_restart=True)  # its agent actors (and their agents and engines) die with it

    def rebuilt() -> dict[str, str] | None:
        placements = http("GET", fleet.control_url + "/rollout/placements").json()["placements"]
        agents = {p["engine_id"]: (p["agent"] or {}).get("url") for p in placements}
        if set(agents) != set(before) or any(agents[e] in (None, before[e]) for e in agents):
            return None
        return agents if len(fleet.active()) == 2 else None

    wait_until(rebuilt, STARTUP, lambda: f"2 engines re-bound to new agents; {fleet.engines()}\n{fleet.job_logs()}")
    assert ray.get_actor("er-reconciler", namespace=NAMESPACE)._actor_id != old._actor_id
    wait_until(lambda: len(er_placement_groups()) == 2, 60, "2 PGs")
    wait_until(lambda: gpus_taken() == 2, 60, "2 GPUs taken")


def requested_bundles() -> list[dict[str, float]] | None:
    """What the autoscaler was asked for (request_resources), as Ray stored it."""
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return None if raw is None else json.loads(raw)


def test_scale_out_beyond_the_cluster_waits_for_a_node(fleet: RayFleet) -> None:
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    assert not is_autoscaler_v2(), "this test reads the v1 resource request channel"
    want = HEAD_GPUS + 1
    accepted = fleet.client.scale_out(num_replicas=want)

    def pending() -> list[dict[str, Any]] | None:
        engines = fleet.engines()
        waiting = [e for e in engines if "PENDING_RESOURCES" in json.dumps(e)]
        # The new ones that got GPUs wait in READY for the rest of their scale-out (rollback_all).
        running = [e for e in engines if e["status"] in ("ACTIVE", "READY") and e["pid"]]
        # The cluster's 4 GPUs are in use and one engine waits for a fifth.
        return waiting if len(running) == HEAD_GPUS and len(waiting) == 1 else None

    waiting = wait_until(pending, STARTUP, lambda: f"4 running and 1 waiting for resources; {fleet.engines()}")
    assert waiting[0]["status"] == "PENDING"
    assert gpus_taken() == HEAD_GPUS
    op = fleet.client.operation("scale_out", accepted.request_id)
    assert not op.is_terminal and "PENDING_RESOURCES" in json.dumps(op.raw)
    request = wait_until(lambda: (r := requested_bundles()) and len(r) == want and r, 60, "a resource request")
    assert all(b.get("GPU") == 1 for b in request)
    fleet.ray.cluster.add_node(num_gpus=1, num_cpus=4)
    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, timeout=STARTUP)
    assert op.status == "ACTIVE", op
    wait_engines(fleet, want)
    assert gpus_taken() == want
    wait_until(lambda: requested_bundles() == [], 60, "the resource request reset")


def test_cancelling_a_scale_out_that_waits_for_resources_releases_its_placement(fleet: RayFleet) -> None:
    have = len(wait_engines(fleet, HEAD_GPUS + 1))
    accepted = fleet.client.scale_out(num_replicas=have + 1)
    waiting = wait_until(
        lambda: [e for e in fleet.engines() if "PENDING_RESOURCES" in json.dumps(e)],
        STARTUP, lambda: f"an engine waiting for resources; {fleet.engines()}",
    )  # fmt: skip
    engine_id = waiting[0]["engine_id"]
    wait_until(lambda: f"er-{engine_id}" in er_placement_groups(), 60, "its placement group (pending)")
    assert er_placement_groups()[f"er-{engine_id}"]["state"] == "PENDING"
    wait_until(lambda: (r := requested_bundles()) is not None and len(r) == have + 1, 60, "a resource request")
    fleet.client.cancel_scale_out(accepted.request_id)
    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, timeout=STARTUP)
    assert op.status == "CANCELLED", op
    wait_until(lambda: f"er-{engine_id}" not in er_placement_groups(), 60, "the pending PG removed")

    def forgotten() -> bool:
        placements = http("GET", fleet.control_url + "/rollout/placements").json()["placements"]
        return engine_id not in {p["engine_id"] for p in placements}

    wait_until(forgotten, 60, "the placement released")
    wait_until(lambda: requested_bundles() == [], 60, "the resource request reset")
    wait_engines(fleet, have)
    assert gpus_taken() == have


def test_a_trainer_update_reaches_the_agents_engines_and_a_new_engine_copies_it(fleet: RayFleet) -> None:
    """Weights from the trainer in Ray mode: the manager runs the update on the engines the agents
    host, and an engine added afterwards copies the trainer's version from one that serves it
    (remote-instance loading) before it is routable."""
    from _trainer import SPECS, StandInRank0

    from elastic_rollout.trainer import DistributedWeightSync

    have = len(wait_engines(fleet, HEAD_GPUS + 1))
    op = fleet.client.scale_in(num_replicas=have - 1)
    assert fleet.client.wait_for_operation("scale_in", op.request_id, timeout=STARTUP).status == "COMPLETED"
    before = {e["engine_id"] for e in wait_engines(fleet, have - 1)}
    rank0 = StandInRank0()
    sync = DistributedWeightSync(fleet.client, join_group=rank0.join_group, broadcast=rank0.broadcast, timeout=60)
    result = sync.update("step-1", SPECS)
    assert result.update is not None and result.update.status == "COMPLETED", result
    assert set(result.update.engines) == before, result.update.engines
    assert fleet.client.weights().version == "step-1"

    def sends(url: str) -> int:
        groups = http("GET", url + "/server_info").json()["weight_sync"]["weight_send_groups"]
        return sum(int(g["sends"]) for g in groups.values())

    urls = {e["engine_id"]: e["url"] for e in fleet.active()}
    op = fleet.client.scale_out(num_replicas=have)
    assert fleet.client.wait_for_operation("scale_out", op.request_id, timeout=STARTUP).status == "ACTIVE"
    engines = wait_engines(fleet, have)
    (new,) = [e for e in engines if e["engine_id"] not in before]
    assert all(e["weight_version"] == "step-1" for e in engines), engines
    assert http("GET", new["url"] + "/model_info").json()["weight_version"] == "step-1"
    assert sum(sends(url) for url in urls.values()) >= 1, "the new engine copied from a serving one"


def test_job_stop_leaves_nothing(fleet: RayFleet) -> None:
    import ray

    engines = fleet.engines()
    manager = manager_info()
    pids = [ProcessIdentity.of(manager["pid"]), *(ProcessIdentity.of(e["pid"]) for e in engines if e["pid"])]
    agents = [p["agent"]["url"] for p in http("GET", fleet.control_url + "/rollout/placements").json()["placements"]]
    assert len(agents) == len(engines) > 0 and any(a.startswith("er-agent-") for a in er_actors())

    def app_actors() -> list[dict[str, str]]:
        return [
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and "elastic-rollout" in a["name"]
        ]

    assert app_actors(), "the Serve app's replica runs before the stop"
    stop = subprocess.run([*fleet.ray.ray_cli(), "job", "stop", fleet.job_id], capture_output=True, text=True,
                          env=fleet.ray.env, timeout=300, check=False)  # fmt: skip
    assert stop.returncode == 0, stop.stdout + stop.stderr
    wait_until(lambda: job_status(fleet.ray, fleet.job_id) == "STOPPED", 120, "the job stopped")
    # Ray's default stop wait (3 s) may SIGKILL the launcher mid-teardown: what it did not finish,
    # Ray does (the actors die with the driver, the groups with the job).
    wait_until(lambda: er_placement_groups() == {}, 60, lambda: f"no PG left; {er_placement_groups()}")
    wait_until(lambda: gpus_taken() == 0, 60, "every GPU free")

    def named() -> list[dict[str, str]]:
        return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]

    wait_until(lambda: named() == [], 60, lambda: f"no actor of the fleet left; {named()}")
    for ident in pids:
        if ident is not None:
            wait_until(lambda i=ident: not i.alive(), 60, f"pid {ident.pid} gone")  # type: ignore[misc]
    for ident in fleet.seen.values():
        wait_until(lambda i=ident: not i.alive(), 60, f"engine pid {ident.pid} gone")  # type: ignore[misc]

    # The app's replica is gone (deleted by the launcher, or by itself once the job was dead),
    # and with it Serve's controller and proxies: the fleet had Serve to itself.
    wait_until(lambda: app_actors() == [], 60, lambda: f"the Serve app's actors gone; {app_actors()}")
    wait_until(lambda: serve_actors() == [], 60, lambda: f"Serve's controller and proxies gone; {serve_actors()}")
