"""Ray mode without Ray: ``rollout-manager serve --placement ray`` with real node agents.

The test plays the Ray shim (docs/ray.md) with a small loop: it long-polls
``GET /rollout/placements``, starts one ``rollout-manager agent`` process per wanted placement
(as the engine-host actor would), binds it, and for unwanted placements kills the agent and
posts ``released``. Everything runs on loopback with sglang-sim engines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from _checkpoints import write_checkpoint
from _support import ManagerHandle, ProcessIdentity, StartManager, http, metric_total, wait_until
from test_weights import assert_fleet_on, cmdline, run_update

from elastic_rollout import EnginesView, RolloutClient

RAY_ARGS = ("--placement", "ray", "--health-check-interval-secs", "0.5")


def _ppid(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2 :].split()[1])


@dataclass
class AgentProc:
    process: subprocess.Popen[bytes]
    url: str
    identity: ProcessIdentity
    stderr_path: Path
    #: its --relay-dir: each agent plays a node of its own, with its own node-local storage.
    relay_dir: Path


@dataclass
class Shim:
    """What the Ray shim does, by hand: one agent process per wanted placement."""

    manager_bin: Path
    workdir: Path
    control_url: str
    agents: dict[str, AgentProc] = field(default_factory=dict)
    #: every agent ever started (engine id, identity), for the leak check.
    started: list[tuple[str, ProcessIdentity]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    paused: bool = False
    #: the manager's API token file: agents get it, and bind/released carry the token.
    token_file: Path | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def start_agent(self, engine_id: str) -> AgentProc:
        n = len(self.started)
        ready = self.workdir / f"agent{n}.json"
        stderr_path = self.workdir / f"agent{n}.stderr"
        relay_dir = self.workdir / f"agent{n}-shm"
        argv = [
            str(self.manager_bin), "agent", "--listen", "127.0.0.1:0", "--ready-file", str(ready),
            "--state-dir", str(self.workdir / f"agent{n}"), "--relay-dir", str(relay_dir),
            *(["--api-token-file", str(self.token_file)] if self.token_file else []),
        ]  # fmt: skip
        with open(stderr_path, "wb") as err:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        identity = ProcessIdentity.of(process.pid)
        assert identity is not None
        self.started.append((engine_id, identity))

        def url() -> str | None:
            if process.poll() is not None:
                raise AssertionError(f"agent exited with {process.returncode}: {stderr_path.read_text()}")
            return json.loads(ready.read_text())["url"] if ready.exists() else None

        agent = AgentProc(process, wait_until(url, 20.0, f"agent ready file {ready}"), identity, stderr_path, relay_dir)
        return agent

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"} if self.token_file else {}

    def reconcile(self) -> None:
        resp = http("GET", f"{self.control_url}/rollout/placements", timeout=5.0)
        assert resp.status == 200, resp.body
        for p in resp.json()["placements"]:
            engine_id = p["engine_id"]
            if p["desired"] == "present" and not self.paused:
                agent = self.agents.get(engine_id)
                if agent is None or agent.process.poll() is not None:
                    agent = self.start_agent(engine_id)
                    self.agents[engine_id] = agent
                if (p["agent"] or {}).get("url") != agent.url:
                    gpu = str(int(engine_id.rsplit("_", 1)[1]) % 8)
                    body = {"agent_url": agent.url, "node_id": "node-1", "gpu_ids": [gpu]}
                    bound = http(
                        "POST", f"{self.control_url}/rollout/placements/{engine_id}/bind", body, headers=self.auth()
                    )
                    assert bound.status == 200, bound.body
            elif p["desired"] == "absent":
                agent = self.agents.pop(engine_id, None)
                if agent is not None:
                    agent.process.send_signal(signal.SIGTERM)
                    agent.process.wait(timeout=30)
                done = http("POST", f"{self.control_url}/rollout/placements/{engine_id}/released", headers=self.auth())
                assert done.status == 200, done.body
                self.released.append(engine_id)

    def _loop(self) -> None:
        revision = None
        while not self._stop.is_set():
            try:
                query = "" if revision is None else f"?after={revision}&wait_secs=1"
                resp = http("GET", f"{self.control_url}/rollout/placements{query}", timeout=5.0)
                revision = resp.json()["revision"] if resp.status == 200 else None
                with self._lock:
                    self.reconcile()
            except Exception as err:
                # The manager may be down (a restart test); try again.
                self.errors.append(repr(err))
                revision = None
                time.sleep(0.2)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for agent in self.agents.values():
            if agent.process.poll() is None:
                agent.process.send_signal(signal.SIGTERM)
        for agent in self.agents.values():
            try:
                agent.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.process.kill()
                agent.process.wait()


@pytest.fixture
def shim(manager_bin: Path, tmp_path: Path) -> Iterator[Shim]:
    s = Shim(manager_bin, tmp_path / "shim", "")
    s.workdir.mkdir()
    yield s
    s.stop()
    leaked = [f"agent of {e} pid {i.pid}" for e, i in s.started if i.alive()]
    assert not leaked, leaked


def placements(handle: ManagerHandle) -> dict[str, Any]:
    resp = http("GET", f"{handle.control_url}/rollout/placements")
    assert resp.status == 200
    body: dict[str, Any] = resp.json()
    return {p["engine_id"]: p for p in body["placements"]}


def wait_no_operation(handle: ManagerHandle) -> None:
    """Engines turn ACTIVE a moment before their operation records its end."""
    terminal = {"ACTIVE", "FAILED", "CANCELLED", "NOOP", "COMPLETED"}

    def idle() -> bool:
        ops: list[dict[str, Any]] = []
        for kind in ("scale_out", "scale_in"):
            ops += http("GET", f"{handle.control_url}/rollout/{kind}").json()["requests"]
        return all(op["status"] in terminal for op in ops)

    wait_until(idle, 30, "no scale operation running")


def engine_pids(handle: ManagerHandle) -> dict[str, int]:
    return {e.engine_id: e.pid for e in handle.engines().engines if e.pid is not None}


def test_ray_mode_scales_routes_recovers_and_releases(start_fleet: StartManager, shim: Shim) -> None:
    fleet = start_fleet(*RAY_ARGS, wait=False)

    # Before the shim runs, the initial engines wait for resources, visibly.
    def listed() -> EnginesView | None:
        v = fleet.engines()
        return v if len(v.engines) == 2 else None

    view = wait_until(listed, 20, "2 engines listed")
    assert [e.status for e in view.engines] == ["PENDING", "PENDING"]
    raw = http("GET", f"{fleet.control_url}/rollout/engines").json()["models"]["default"]["engines"]
    assert all(e["detail"].startswith("PENDING_RESOURCES") for e in raw)
    pending = placements(fleet)
    assert sorted(pending) == ["engine_0", "engine_1"]
    for p in pending.values():
        assert p["status"] == "PENDING_RESOURCES" and p["desired"] == "present" and p["agent"] is None
        assert p["initial"] is True and p["strategy"] == "STRICT_PACK" and p["bundles"] == [{"GPU": 1, "CPU": 1}]

    shim.control_url = fleet.control_url
    shim.start()
    fleet.wait_engines(2, "ACTIVE", 60)
    # Each engine is a child of the agent bound to its placement, not of the manager.
    bound = placements(fleet)
    for engine_id, pid in engine_pids(fleet).items():
        assert bound[engine_id]["status"] == "BOUND"
        assert bound[engine_id]["agent"]["url"] == shim.agents[engine_id].url
        assert _ppid(pid) == shim.agents[engine_id].process.pid

    # Scale out 2 -> 4: two more placements, two more agents.
    wait_no_operation(fleet)
    accepted = fleet.client.scale_out(num_replicas=4)
    fleet.wait_engines(4, "ACTIVE", 60)
    op = http("GET", f"{fleet.control_url}/rollout/scale_out/{accepted.request_id}").json()
    assert op["status"] == "ACTIVE", op
    assert "PENDING" in [h["status"] for h in op["history"]]
    four = placements(fleet)
    assert len(four) == 4 and {p["status"] for p in four.values()} == {"BOUND"}
    assert len({p["agent"]["url"] for p in four.values()}) == 4
    assert [p["initial"] for _, p in sorted(four.items())] == [True, True, False, False]

    # /generate through the router reaches agent-hosted engines (each one, by round robin).
    for i in range(8):
        resp = http(
            "POST",
            f"{fleet.router_url}/generate",
            {"text": f"prompt {i}", "sampling_params": {"max_new_tokens": 4}},
            headers={"x-routing-policy": "round_robin"},
        )
        assert resp.status == 200, resp.body
        assert isinstance(resp.json()["text"], str)
    metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
    for engine_id in four:
        served = metric_total(
            "\n".join(line for line in metrics.splitlines() if f'engine_id="{engine_id}"' in line),
            "rollout_engine_served_total",
        )
        assert served >= 1, (engine_id, metrics)

    # kill -9 an engine: its agent reports EXITED, the manager restarts it through that agent.
    victim = "engine_3"
    old_pid = engine_pids(fleet)[victim]
    agent_pid = shim.agents[victim].process.pid
    os.kill(old_pid, signal.SIGKILL)

    def recovered() -> bool:
        e = next(e for e in fleet.engines().engines if e.engine_id == victim)
        return e.status == "ACTIVE" and e.pid not in (None, old_pid) and e.restarts == 1

    wait_until(recovered, 60, f"{victim} recovered after kill -9")
    wait_no_operation(fleet)
    assert _ppid(engine_pids(fleet)[victim]) == agent_pid
    assert placements(fleet)[victim]["agent"]["url"] == shim.agents[victim].url

    # Scale in 4 -> 2: the dynamic engines stop, their placements become desired absent, the
    # shim kills their agents and says released; the manager forgets them.
    doomed_agents = [shim.agents[e].identity for e in ("engine_2", "engine_3")]
    doomed_pids = [ProcessIdentity.of(p) for e, p in engine_pids(fleet).items() if e in ("engine_2", "engine_3")]
    fleet.client.scale_in(num_replicas=2)
    fleet.wait_engines(2, "ACTIVE", 60)
    wait_until(lambda: sorted(placements(fleet)) == ["engine_0", "engine_1"], 30, "placements released")
    assert sorted(shim.released) == ["engine_2", "engine_3"]
    wait_until(lambda: not any(i is not None and i.alive() for i in doomed_agents + doomed_pids), 30, "agents gone")
    assert len(fleet.engines().engines) == 2


def test_bad_placement_requests_are_refused(start_fleet: StartManager, shim: Shim) -> None:
    fleet = start_fleet(*RAY_ARGS, wait=False)
    url = f"{fleet.control_url}/rollout/placements"
    # The listening line comes before the initial engines are reserved.
    wait_until(lambda: len(placements(fleet)) == 2, 20, "the initial placements")
    agent = shim.start_agent("engine_0")
    shim.agents["engine_0"] = agent
    cases = [
        ("engine_9/bind", {"agent_url": agent.url}, 404, "unknown_placement"),
        ("engine_0/bind", {"agent_url": "not a url"}, 400, "invalid_agent_url"),
        ("engine_0/bind", {"agent_url": agent.url, "gpu_ids": ["0", "1"]}, 400, "invalid_gpu_ids"),
        ("engine_0/bind", {"agent_url": agent.url, "extra": 1}, 400, "invalid_body"),
        ("engine_0/released", None, 409, "placement_still_wanted"),
        ("engine_9/released", None, 404, "unknown_placement"),
    ]
    for path, body, status, code in cases:
        resp = http("POST", f"{url}/{path}", body)
        assert (resp.status, resp.json()["error"]["code"]) == (status, code), (path, resp.body)
    bad_wait = http("GET", f"{url}?after=0&wait_secs=100")
    assert bad_wait.status == 400 and "wait_secs" in bad_wait.json()["error"]["message"]
    assert http("GET", f"{url}?after=x").status == 400
    # Answers match the served OpenAPI document.
    spec = http("GET", f"{fleet.control_url}/openapi.json").json()

    def check(name: str, value: Any) -> None:
        jsonschema.Draft202012Validator(
            {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
        ).validate(value)

    check("PlacementList", http("GET", url).json())
    check("EnginesView", http("GET", f"{fleet.control_url}/rollout/engines").json())
    # Bind is idempotent for the same agent; another live agent is refused.
    for _ in range(2):
        resp = http("POST", f"{url}/engine_0/bind", {"agent_url": agent.url, "node_id": "n", "gpu_ids": ["0"]})
        assert resp.status == 200 and resp.json()["agent"]["url"] == agent.url
        check("Placement", resp.json())
    check("PlacementList", http("GET", url).json())
    other = shim.start_agent("engine_0-other")
    try:
        resp = http("POST", f"{url}/engine_0/bind", {"agent_url": other.url})
        assert resp.status == 409 and resp.json()["error"]["code"] == "placement_bound_elsewhere"
        assert agent.url in resp.json()["error"]["message"]
    finally:
        other.process.send_signal(signal.SIGTERM)
        other.process.wait(timeout=30)
    # A long poll at the current revision returns when it passes, with the same revision.
    revision = http("GET", url).json()["revision"]
    assert http("GET", f"{url}?after={revision}&wait_secs=0.2").json()["revision"] == revision
    assert http("GET", f"{url}?after={revision - 1}&wait_secs=30").json()["revision"] == revision
    # Local mode has no placements.
    local = start_fleet()
    assert http("GET", f"{local.control_url}/rollout/placements").json()["placements"] == []
    resp = http("POST", f"{local.control_url}/rollout/placements/engine_0/bind", {"agent_url": agent.url})
    assert resp.status == 409 and resp.json()["error"]["code"] == "not_ray_placement"


def test_pending_scale_out_is_cancellable(start_fleet: StartManager, shim: Shim) -> None:
    fleet = start_fleet(*RAY_ARGS, wait=False)
    shim.control_url = fleet.control_url
    shim.start()
    fleet.wait_engines(2, "ACTIVE", 60)
    shim.paused = True  # Ray has no resources for more.
    wait_no_operation(fleet)
    accepted = fleet.client.scale_out(num_replicas=3)
    op_url = f"{fleet.control_url}/rollout/scale_out/{accepted.request_id}"

    # The operation reports PENDING_RESOURCES once its placement is planned, just after it is accepted.
    def planned() -> dict[str, Any] | None:
        o: dict[str, Any] = http("GET", op_url).json()
        return o if "PENDING_RESOURCES" in o["message"] else None

    op = wait_until(planned, 30, "the scale-out to report PENDING_RESOURCES")
    assert op["status"] == "PENDING" and "PENDING_RESOURCES" in op["message"]
    assert op["engines"][0]["status"] == "PENDING" and op["engines"][0]["detail"].startswith("PENDING_RESOURCES")
    assert placements(fleet)["engine_2"]["status"] == "PENDING_RESOURCES"
    assert http("POST", f"{op_url}/cancel").status == 200
    wait_until(lambda: http("GET", op_url).json()["status"] == "CANCELLED", 30, "scale-out cancelled")
    # The placement is no longer wanted; the shim releases it.
    wait_until(lambda: "engine_2" in shim.released, 30, "engine_2 released")
    assert sorted(placements(fleet)) == ["engine_0", "engine_1"]
    assert len(fleet.engines().engines) == 2


def test_restarted_manager_re_adopts_agent_engines(manager_bin: Path, tmp_path: Path, shim: Shim) -> None:
    from _support import start_manager, stop_manager

    state = tmp_path / "state"
    first = start_manager(manager_bin, state, RAY_ARGS)
    second: ManagerHandle | None = None
    try:
        shim.control_url = first.control_url
        shim.start()
        first.wait_engines(2, "ACTIVE", 60)
        before = engine_pids(first)
        # What the first manager counted (an engine it failed and relaunched under load counts
        # one, with its agent keeping the same process); the second must add none.
        restarts_before = {e.engine_id: e.restarts for e in first.engines().engines}
        agents_before = {e: a.url for e, a in shim.agents.items()}
        identities = {e: ProcessIdentity.of(p) for e, p in before.items()}
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=10)
        # The engines live on: their agents own them, not the manager.
        time.sleep(0.5)
        assert all(i is not None and i.alive() for i in identities.values())

        second = start_manager(manager_bin, state, RAY_ARGS)
        shim.control_url = second.control_url
        second.wait_engines(2, "ACTIVE", 60)
        after = second.engines().engines
        assert {e.engine_id: e.pid for e in after} == before
        assert {e.engine_id: e.restarts for e in after} == restarts_before
        kept = placements(second)
        assert {e: p["agent"]["url"] for e, p in kept.items()} == agents_before
        assert len(shim.started) == 2, "no agent was started again"
        # A re-adopted engine is watched again: kill -9 recovers it through its agent.
        os.kill(before["engine_1"], signal.SIGKILL)
        wait_until(
            lambda: (
                next(e for e in second.engines().engines if e.engine_id == "engine_1").pid
                not in (None, before["engine_1"])
                and len(second.engines().with_status("ACTIVE")) == 2
            ),
            60,
            "engine_1 recovered after the restart",
        )
        assert _ppid(engine_pids(second)["engine_1"]) == shim.agents["engine_1"].process.pid
        assert RolloutClient(second.control_url).engines().engines
    finally:
        if second is not None:
            stop_manager(second)
        if first.process.poll() is None:
            first.process.kill()
            first.process.wait()
    shim.stop()
    assert all(not i.alive() for i in identities.values() if i is not None)
    assert all(not i.alive() for _, i in shim.started)


def test_agents_and_placements_need_the_managers_token(start_fleet: StartManager, shim: Shim, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("ray-s3cret\n")
    token.chmod(0o600)
    fleet = start_fleet(*RAY_ARGS, "--api-token-file", str(token), wait=False)
    # Without the token the shim cannot bind.
    stranger = shim.start_agent("engine_0")
    try:
        resp = http("POST", f"{fleet.control_url}/rollout/placements/engine_0/bind", {"agent_url": stranger.url})
        assert resp.status == 401
    finally:
        stranger.process.send_signal(signal.SIGTERM)
        stranger.process.wait(timeout=30)
    shim.token_file = token
    shim.control_url = fleet.control_url
    shim.start()
    # Agents started with the token serve the manager, which sends it on every call.
    fleet.wait_engines(2, "ACTIVE", 60)
    for engine in fleet.engines().engines:
        assert engine.pid is not None
        assert b"ray-s3cret" not in Path(f"/proc/{engine.pid}/environ").read_bytes()
    assert "ray-s3cret" not in fleet.stderr_tail(1_000_000)


def test_restart_keeps_placements_still_waiting_for_resources(manager_bin: Path, tmp_path: Path, shim: Shim) -> None:
    from _support import start_manager, stop_manager

    state = tmp_path / "state"
    first = start_manager(manager_bin, state, RAY_ARGS)
    second: ManagerHandle | None = None
    try:
        wait_until(lambda: len(placements(first)) == 2, 20, "two pending placements")
        revision = http("GET", f"{first.control_url}/rollout/placements").json()["revision"]
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=10)

        second = start_manager(manager_bin, state, RAY_ARGS)
        kept = http("GET", f"{second.control_url}/rollout/placements").json()
        assert kept["revision"] > revision
        assert sorted(p["engine_id"] for p in kept["placements"]) == ["engine_0", "engine_1"]
        assert {p["status"] for p in kept["placements"]} == {"PENDING_RESOURCES"}

        def waiting() -> bool:
            raw = http("GET", f"{second.control_url}/rollout/engines").json()["models"]["default"]["engines"]
            return len(raw) == 2 and all((e.get("detail") or "").startswith("PENDING_RESOURCES") for e in raw)

        wait_until(waiting, 20, "restored engines waiting for their placements")
        shim.control_url = second.control_url
        shim.start()
        second.wait_engines(2, "ACTIVE", 60)
        assert {p["status"] for p in placements(second).values()} == {"BOUND"}
    finally:
        if second is not None:
            stop_manager(second)
        if first.process.poll() is None:
            first.process.kill()
            first.process.wait()


def test_agent_refuses_a_bad_listen_address(manager_bin: Path, tmp_path: Path) -> None:
    for listen, why in [("0.0.0.0:0", "node's own IP"), ("nonsense", "HOST:PORT"), ("256.1.1.1:0", "cannot bind")]:
        argv = [str(manager_bin), "agent", "--listen", listen, "--ready-file", str(tmp_path / "ready.json")]
        result = subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL, check=False)
        stderr = result.stderr.decode()
        assert result.returncode != 0 and "--listen" in stderr and why in stderr, (listen, stderr)
        assert not (tmp_path / "ready.json").exists()


def test_relay_stages_versions_on_every_agent_node(start_fleet: StartManager, shim: Shim, tmp_path: Path) -> None:
    """Two agents play two nodes, each with its own relay directory: a publish lands on both,
    each engine loads its own node's copy, a node that joins later gets the current version
    before its engine starts on it, and old versions are removed on every node."""
    token = tmp_path / "token"
    token.write_text("relay-s3cret\n")
    token.chmod(0o600)
    manager_shm = tmp_path / "manager-shm"
    fleet = start_fleet(*RAY_ARGS, "--api-token-file", str(token), "--weight-transport", "relay",
                        "--relay-dir", str(manager_shm), wait=False)  # fmt: skip
    fleet.client = RolloutClient(fleet.control_url, token="relay-s3cret")
    shim.token_file = token
    shim.control_url = fleet.control_url
    shim.start()
    fleet.wait_engines(2, "ACTIVE", 60)
    sums = {v: write_checkpoint(tmp_path / v, seed) for seed, v in enumerate(["v1", "v2"], start=1)}
    staged = {v: f"{v}-{sums[v][:16]}" for v in sums}

    def node_copies(engine_id: str) -> list[str]:
        root = shim.agents[engine_id].relay_dir
        return sorted(p.name for p in root.iterdir()) if root.is_dir() else []

    def loaded_from(url: str) -> tuple[str, str]:
        weights = http("GET", f"{url}/server_info").json()["weights"]
        return weights["path"], weights["checksum"]

    update = run_update(fleet, "v1", tmp_path / "v1")
    assert update["transport"] == "relay" and Path(update["engine_path"]).name == staged["v1"], update
    assert_fleet_on(fleet, "v1", sums["v1"], 2)
    engines = fleet.engines().engines
    assert len({shim.agents[e.engine_id].relay_dir for e in engines}) == 2
    for engine in engines:
        assert node_copies(engine.engine_id) == [staged["v1"]], engine.engine_id
        own = shim.agents[engine.engine_id].relay_dir / staged["v1"]
        assert loaded_from(engine.url) == (str(own), sums["v1"]), engine.engine_id
    # In Ray mode without external engines the manager's node hosts no engine: no copy there.
    assert not manager_shm.exists() or not list(manager_shm.iterdir())

    # Scale out onto a third node: the version is staged there before the engine launches on it.
    wait_no_operation(fleet)
    fleet.client.scale_out(num_replicas=3)
    fleet.wait_engines(3, "ACTIVE", 60)
    wait_no_operation(fleet)
    new = next(e for e in fleet.engines().engines if e.engine_id == "engine_2")
    own = shim.agents["engine_2"].relay_dir / staged["v1"]
    assert node_copies("engine_2") == [staged["v1"]]
    assert new.pid is not None
    argv = cmdline(new.pid)
    assert argv[argv.index("--model-path") + 1] == str(own), argv
    assert loaded_from(new.url) == (str(own), sums["v1"])
    assert_fleet_on(fleet, "v1", sums["v1"], 3)

    # v2 reaches all three nodes; v1 is then removed on each of them (in the background).
    run_update(fleet, "v2", tmp_path / "v2", strategy="all_at_once")
    assert_fleet_on(fleet, "v2", sums["v2"], 3)
    for engine in fleet.engines().engines:
        own = shim.agents[engine.engine_id].relay_dir / staged["v2"]
        assert loaded_from(engine.url) == (str(own), sums["v2"]), engine.engine_id
    wait_until(
        lambda: all(node_copies(e) == [staged["v2"]] for e in ("engine_0", "engine_1", "engine_2")),
        30,
        "v1 removed from every node",
    )


def test_a_lost_agent_sends_its_placement_back_and_the_engine_comes_back_elsewhere(
    start_fleet: StartManager, shim: Shim
) -> None:
    fleet = start_fleet(*RAY_ARGS, wait=False)
    shim.control_url = fleet.control_url
    shim.start()
    fleet.wait_engines(2, "ACTIVE", 60)
    wait_no_operation(fleet)
    lost = f"{fleet.control_url}/rollout/placements"
    agent0 = shim.agents["engine_0"]
    # Bad reports are refused; a report about an agent the placement is not bound to is stale.
    cases = [
        ("engine_9/lost", {"agent_url": agent0.url}, 404, "unknown_placement"),
        ("engine_0/lost", {"agent_url": agent0.url, "extra": 1}, 400, "invalid_body"),
        ("engine_0/lost", {}, 400, "invalid_body"),
    ]
    for path, body, status, code in cases:
        resp = http("POST", f"{lost}/{path}", body)
        assert (resp.status, resp.json()["error"]["code"]) == (status, code), (path, resp.body)
    stale = http("POST", f"{lost}/engine_0/lost", {"agent_url": "http://127.0.0.1:9", "reason": "not this one"})
    assert stale.status == 200 and stale.json()["unbound"] is False, stale.body
    assert stale.json()["status"] == "BOUND" and stale.json()["agent"]["url"] == agent0.url
    assert fleet.engines().engines[0].status == "ACTIVE"

    # The agent of engine_1 dies (as when its node goes): the manager finds it refusing
    # connections and sends the placement back to PENDING_RESOURCES, without waiting for the
    # unreachable-agent timeout and without relaunching through the dead agent.
    before = {e.engine_id: e.pid for e in fleet.engines().engines}
    with shim._lock:
        shim.paused = True
    dead = shim.agents["engine_1"]
    dead.process.kill()
    dead.process.wait(timeout=30)

    def sent_back() -> dict[str, Any] | None:
        p = placements(fleet)["engine_1"]
        return p if p["status"] == "PENDING_RESOURCES" and p["agent"] is None else None

    wait_until(sent_back, 60, lambda: f"engine_1's placement back to PENDING_RESOURCES; {placements(fleet)}")
    raw = {
        e["engine_id"]: e
        for e in http("GET", f"{fleet.control_url}/rollout/engines").json()["models"]["default"]["engines"]
    }
    assert "refuses connections" in (raw["engine_1"]["last_error"] or ""), raw["engine_1"]
    assert raw["engine_0"]["status"] == "ACTIVE"

    def engine_1() -> dict[str, Any]:
        engines = http("GET", f"{fleet.control_url}/rollout/engines").json()["models"]["default"]["engines"]
        return next(x for x in engines if x["engine_id"] == "engine_1")

    # No engine is launched while no agent is bound: it waits, visibly, for resources.
    wait_until(
        lambda: (e := engine_1())
        and e["status"] == "CREATING" and (e.get("detail") or "").startswith("PENDING_RESOURCES") and e,
        60, "engine_1 waiting for an agent",
    )  # fmt: skip
    # Requests keep being served by the engine left.
    for i in range(4):
        resp = http("POST", f"{fleet.router_url}/generate", {"text": f"p{i}", "sampling_params": {"max_new_tokens": 2}})
        assert resp.status == 200, resp.body
    with shim._lock:
        shim.paused = False
        shim.agents.pop("engine_1")
    fleet.wait_engines(2, "ACTIVE", 60)
    wait_until(lambda: placements(fleet)["engine_1"]["status"] == "BOUND", 30, "engine_1 bound again")
    assert placements(fleet)["engine_1"]["agent"]["url"] == shim.agents["engine_1"].url != dead.url
    after = {e.engine_id: e for e in fleet.engines().engines}
    assert after["engine_1"].pid not in (None, before["engine_1"]) and after["engine_1"].restarts == 1
    assert _ppid(after["engine_1"].pid) == shim.agents["engine_1"].process.pid  # type: ignore[arg-type]
    assert after["engine_0"].pid == before["engine_0"]

    # The shim reports engine_0's agent lost (its host actor died; the agent itself is killed
    # with it here): the placement is unbound at once, and the engine comes back on a new agent.
    with shim._lock:
        shim.paused = True
        old0 = shim.agents.pop("engine_0")
        old0.process.kill()
        old0.process.wait(timeout=30)
        reported = http("POST", f"{lost}/engine_0/lost", {"agent_url": old0.url, "reason": "host actor died"})
        assert reported.status == 200 and reported.json()["unbound"] is True, reported.body
        assert reported.json()["status"] == "PENDING_RESOURCES" and reported.json()["agent"] is None
        again = http("POST", f"{lost}/engine_0/lost", {"agent_url": old0.url})
        assert again.status == 200 and again.json()["unbound"] is False
        shim.paused = False
    fleet.wait_engines(2, "ACTIVE", 60)
    wait_until(lambda: placements(fleet)["engine_0"]["status"] == "BOUND", 30, "engine_0 bound again")
    e0 = next(e for e in fleet.engines().engines if e.engine_id == "engine_0")
    assert e0.pid != before["engine_0"] and e0.restarts == 1
    assert not any(i.alive() for _, i in shim.started if i.pid in (dead.process.pid, old0.process.pid))
