"""The trainer port (``--trainer-port``): the fleet as one SGLang engine, driven as slime drives
an engine it did not launch, with its default NCCL weight sync.

The calls are slime's, in slime's order (read at THUDM/slime 624b824a):
``backends/sglang_utils/external.py`` (discovery: ``/server_info``, ``num_gpus``),
``sglang_engine.py`` (``_register_to_router``: ``POST /workers`` on the router, failing on an
error; ``flush_cache`` by GET; every other call a POST with a JSON body) and
``megatron_utils/update_weight/update_weight_from_distributed.py`` (``world_size = GPUs + 1``,
engine ``i`` at ``rank_offset = 1 +`` the GPUs before it; each sync: pause, flush, one
``/update_weights_from_distributed`` per bucket while rank 0 broadcasts, continue).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _checkpoints import write_checkpoint
from _support import (
    STARTUP_TIMEOUT,
    HttpResult,
    ManagerHandle,
    ProcessIdentity,
    StartManager,
    http,
    load_example,
    start_manager,
    wait_until,
)
from _trainer import SPECS, StandInRank0
from test_external import StartEngine, external_engine  # noqa: F401 (a fixture)
from test_weights_resume import engine_identities, free_port, stop_both

from elastic_rollout.trainer import GroupLayout, TensorSpec


class SlimeOnExternalEngines:
    """slime's weight sync against engines given by ``--rollout-external-engine-addrs``, as
    HTTP calls (rank 0's NCCL side is the stand-in)."""

    def __init__(self, addrs: Sequence[str], router_url: str, rank0: StandInRank0, manager: ManagerHandle) -> None:
        self.urls = [f"http://{a}" for a in addrs]
        self.router_url = router_url
        self.rank0 = rank0
        self.manager = manager
        self.pool = ThreadPoolExecutor(4)
        self.gpus: list[int] = []
        self.group_name = "slime-pp_0"
        self.weight_version = 0

    def discover_and_register(self) -> None:
        for url in self.urls:
            info = http("GET", url + "/server_info").json()
            self.gpus.append(int(info.get("num_gpus") or info.get("num_gpus_per_engine") or info["tp_size"]))
            resp = http("POST", self.router_url + "/workers", {"url": url, "worker_type": "regular"})
            assert resp.status == 200, resp.body[:300]  # slime: response.raise_for_status()

    def connect(self) -> list[HttpResult]:
        port = free_port()
        world_size = sum(self.gpus) + 1
        offsets = [1 + sum(self.gpus[:i]) for i in range(len(self.gpus))]
        futures: list[Future[HttpResult]] = [
            self.pool.submit(http, "POST", url + "/init_weights_update_group",
                             {"master_address": "127.0.0.1", "master_port": port, "rank_offset": off,
                              "world_size": world_size, "group_name": self.group_name, "backend": "nccl"}, timeout=120)
            for url, off in zip(self.urls, offsets, strict=True)
        ]  # fmt: skip
        # Rank 0's init_process_group: the stand-in needs the members to check their ranks.
        self.rank0.join_group(self.layout(port, futures))
        return [f.result(timeout=120) for f in futures]

    def layout(self, port: int | None = None, inits: Sequence[Future[HttpResult]] = ()) -> GroupLayout:
        """The group as the manager built it (the one at rank 0's ``port``, when given); fails at
        once when an init in ``inits`` was refused."""

        def built() -> dict[str, Any] | None:
            refused = [f.result() for f in inits if f.done() and f.result().status != 200]
            assert not refused, [(r.status, r.body[:300]) for r in refused]
            resp = http("GET", self.manager.control_url + "/rollout/weights/trainer_group")
            if resp.status != 200 or resp.json()["group_name"] != self.group_name:
                return None
            return resp.json() if port is None or resp.json()["master_port"] == port else None

        return GroupLayout.from_json(wait_until(built, 60, "the trainer's group built"))

    def sync(self, buckets: Sequence[Sequence[TensorSpec]]) -> list[HttpResult]:
        self.weight_version += 1
        answers = [http("POST", u + "/pause_generation", {}) for u in self.urls]
        answers += [http("GET", u + "/flush_cache") for u in self.urls]
        layout = self.layout()
        for bucket in buckets:
            body = {"names": [s.name for s in bucket], "dtypes": [s.dtype for s in bucket],
                    "shapes": [list(s.shape) for s in bucket], "group_name": self.group_name,
                    "flush_cache": False, "weight_version": str(self.weight_version)}  # fmt: skip
            futures = [self.pool.submit(http, "POST", u + "/update_weights_from_distributed", body, timeout=120)
                       for u in self.urls]  # fmt: skip
            self.rank0.broadcast(layout, bucket)
            answers += [f.result(timeout=120) for f in futures]
        answers += [http("POST", u + "/continue_generation", {}, timeout=120) for u in self.urls]
        return answers

    def sync_from_disk(self, version_dir: Path) -> list[HttpResult]:
        """One sync of slime's disk transport, after the trainer wrote ``version_dir``
        (``ray/actor_group.py::_reload_rollout_weights_from_disk``): pause, flush, load from disk
        with the sync's number as ``weight_version``, read the version back (slime's ``--ci-test``
        check), continue."""
        self.weight_version += 1
        answers = [http("POST", u + "/pause_generation", {}) for u in self.urls]
        answers += [http("GET", u + "/flush_cache") for u in self.urls]
        body = {"model_path": str(version_dir), "weight_version": str(self.weight_version)}
        answers += [http("POST", u + "/update_weights_from_disk", body, timeout=120) for u in self.urls]
        for u in self.urls:
            read = http("GET", u + "/get_weight_version")
            assert read.status == 200 and read.json()["weight_version"] == str(self.weight_version), read.body[:300]
        answers += [http("POST", u + "/continue_generation", {}, timeout=120) for u in self.urls]
        return answers


def ok(answers: Sequence[HttpResult]) -> None:
    bad = [(a.status, a.body[:300]) for a in answers if a.status != 200]
    assert not bad, bad


def versions_answered(router_url: str, n: int) -> set[str]:
    body = {"text": "count the sheep", "sampling_params": {"max_new_tokens": 2}}
    out = set()
    for _ in range(n):
        resp = http("POST", router_url + "/generate", body, timeout=60)
        assert resp.status == 200, resp.body[:200]
        out.add(str(resp.json()["meta_info"]["weight_version"]))
    return out


@pytest.fixture
def trainer_fleet(start_fleet: StartManager) -> tuple[ManagerHandle, str]:
    port = free_port()
    return start_fleet("--trainer-port", str(port)), f"127.0.0.1:{port}"


#: slime's pinned SGLang (0.5.15.post1: no weight-update session yet) and the newest.
@pytest.mark.parametrize("release", ["0.5.15.post1", "0.5.23"])
def test_slime_syncs_weights_through_the_trainer_port_and_the_fleet_serves_each_version(
    start_fleet: StartManager, release: str
) -> None:
    port = free_port()
    fleet, addr = start_fleet("--trainer-port", str(port), f"--engine-arg=--sglang-api={release}"), f"127.0.0.1:{port}"
    slime = SlimeOnExternalEngines([addr], fleet.router_url, StandInRank0(), fleet)
    slime.discover_and_register()
    assert slime.gpus == [2]  # two engines of one GPU each, seen as one engine of two
    ok(slime.connect())
    group = fleet.client.trainer_group()
    assert group["world_size"] == 3 and group["fixed"] == {"state": "joined"}
    assert [m["rank_offset"] for m in group["members"]] == [1, 2]

    ok(slime.sync([SPECS[:2], SPECS[2:]]))
    weights = fleet.client.weights()
    assert (weights.version, weights.raw["source"]) == ("1", "trainer")
    assert {e.weight_version for e in fleet.engines().engines} == {"1"}
    for e in fleet.engines().engines:
        assert http("GET", e.url + "/model_info").json()["weight_version"] == "1"
    assert versions_answered(fleet.router_url, 8) == {"1"}
    update = fleet.client.weight_update(weights.raw["update_id"])
    assert update.raw["trainer"]["buckets_received"] == 2
    assert update.raw["pause_mode"] == "abort"  # slime's pause sends {}: SGLang's default mode

    # A scale-out after the group was built: slime's group keeps its two ranks, the new engine
    # copies version 1 from a member, and the next sync reaches it too (it copies version 2).
    op = fleet.client.scale_out(num_replicas=3)
    assert fleet.client.wait_for_operation("scale_out", op.request_id, STARTUP_TIMEOUT).status == "ACTIVE"
    assert {e.weight_version for e in fleet.engines().engines} == {"1"}
    ok(slime.sync([SPECS]))
    assert fleet.client.weights().version == "2"

    def all_on_2() -> bool:
        view = fleet.engines().engines
        return len(view) == 3 and all(e.status == "ACTIVE" and e.weight_version == "2" for e in view)

    wait_until(all_on_2, STARTUP_TIMEOUT, "the engine beyond the group copying version 2")
    assert versions_answered(fleet.router_url, 12) == {"2"}
    assert len(slime.rank0.joined) == 1 and len(slime.rank0.broadcasts) == 3

    # slime's disconnect destroys the group.
    resp = http("POST", f"http://{addr}/destroy_weights_update_group", {"group_name": slime.group_name})
    assert resp.status == 200 and resp.json()["success"] is True
    assert http("GET", fleet.control_url + "/rollout/weights/trainer_group").status == 404


def test_the_trainer_port_refuses_what_it_cannot_do_and_says_why(trainer_fleet: tuple[ManagerHandle, str]) -> None:
    fleet, addr = trainer_fleet
    url = f"http://{addr}"

    def refused(resp: HttpResult, status: int, code: str) -> None:
        assert resp.status == status, (resp.status, resp.body[:300])
        body = resp.json()
        assert body["success"] is False and body["error"]["code"] == code, body

    # The fleet as one engine holds ranks from 1: a second engine's offset cannot be it.
    init = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 2, "world_size": 3}
    refused(http("POST", url + "/init_weights_update_group", init), 400, "invalid_rank_offset")
    # A world the fleet's ranks cannot fill: the message says which would.
    resp = http("POST", url + "/init_weights_update_group", {**init, "rank_offset": 1, "world_size": 5})
    refused(resp, 409, "group_does_not_fit")
    assert "world_size 3" in resp.json()["message"]
    bucket = {"names": [SPECS[0].name], "dtypes": [SPECS[0].dtype], "shapes": [list(SPECS[0].shape)]}
    refused(http("POST", url + "/update_weights_from_distributed", bucket), 400, "weight_version_required")
    refused(http("POST", url + "/update_weights_from_distributed", {**bucket, "weight_version": "1"}), 409,
            "unknown_group")  # fmt: skip
    refused(http("POST", url + "/pause_generation", {"mode": "sideways"}), 400, "invalid_pause_mode")
    refused(http("POST", url + "/generate", {"text": "hi"}), 404, "not_a_trainer_route")
    # slime's calls the fleet cannot answer as one engine, each refused with what to do instead.
    quantized = {"restore_weights_before_load": True, "post_process_quantization": False}
    refused(http("POST", url + "/post_process_weights", quantized), 400, "quantized_sync_unsupported")
    refused(http("POST", url + "/weights_checker", {"action": "snapshot"}), 400, "weights_checker_unsupported")
    # Nothing was opened or built; a continue with nothing open is SGLang's plain answer.
    assert http("POST", url + "/continue_generation", {}).status == 200
    assert fleet.client.weights().version == "default"
    assert http("GET", fleet.control_url + "/rollout/weights/trainer_group").status == 404

    # The router takes the trainer port's own registration (slime's) and still refuses others.
    host, port = addr.split(":")
    assert http("POST", fleet.router_url + "/workers", {"url": f"http://localhost:{port}"}).status == 200
    other = http("POST", fleet.router_url + "/workers", {"url": f"http://{host}:{free_port()}"})
    assert other.status == 403 and other.json()["error"]["code"] == "workers_managed"
    assert http("GET", fleet.router_url + "/workers").json()["total"] == 2


def test_a_failed_join_answers_slime_with_an_error_and_builds_again(trainer_fleet: tuple[ManagerHandle, str]) -> None:
    """A rank 0 that never joins: the members cannot form the group, the port answers the init
    with the error (slime's ray.get raises), and the next init builds the group again."""
    fleet, addr = trainer_fleet
    slime = SlimeOnExternalEngines([addr], fleet.router_url, StandInRank0(timeout=60), fleet)
    slime.discover_and_register()
    # A port nobody listens on: the members' rendezvous fails.
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 3,
            "group_name": "slime-pp_0"}  # fmt: skip
    resp = http("POST", f"http://{addr}/init_weights_update_group", body, timeout=120)
    assert resp.status == 409 and resp.json()["error"]["code"] == "group_failed", resp.body[:300]
    assert "did not accept" in resp.json()["message"]
    ok(slime.connect())
    ok(slime.sync([SPECS]))
    assert fleet.client.weights().version == "1"


def test_the_trainer_port_takes_the_managers_token(start_fleet: StartManager, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    port = free_port()
    start_fleet("--api-token-file", str(token), "--trainer-port", str(port))
    url = f"http://127.0.0.1:{port}"
    # Reads stay open, as on the router; every call that acts on the fleet needs the token.
    assert http("GET", url + "/server_info").json()["num_gpus"] == 2
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 2, "world_size": 3}
    for path in ("/init_weights_update_group", "/pause_generation", "/continue_generation", "/flush_cache"):
        resp = http("POST", url + path, body)
        assert resp.status == 401 and resp.json()["error"]["code"] == "unauthorized", path
    assert http("GET", url + "/flush_cache").status == 401
    authed = http("POST", url + "/init_weights_update_group", body, headers={"Authorization": "Bearer s3cret-token"})
    assert authed.status == 400 and authed.json()["error"]["code"] == "invalid_rank_offset"


def test_a_sync_cut_between_buckets_never_becomes_a_version(trainer_fleet: tuple[ManagerHandle, str]) -> None:
    """The update behind a sync ends between two buckets (here: given up on the control port, as
    a timeout would end it). The next bucket of that version must not open it again with only
    the buckets left: it is refused until the trainer starts a sync again; the members that held
    part of it were restarted, so the group is gone and the trainer builds another."""
    fleet, addr = trainer_fleet
    url = f"http://{addr}"
    slime = SlimeOnExternalEngines([addr], fleet.router_url, StandInRank0(), fleet)
    slime.discover_and_register()
    ok(slime.connect())
    layout = slime.layout()

    def bucket(specs: Sequence[TensorSpec], version: str) -> dict[str, Any]:
        return {"names": [s.name for s in specs], "dtypes": [s.dtype for s in specs],
                "shapes": [list(s.shape) for s in specs], "group_name": slime.group_name,
                "weight_version": version}  # fmt: skip

    ok([http("POST", url + "/pause_generation", {})])
    first = slime.pool.submit(
        http, "POST", url + "/update_weights_from_distributed", bucket(SPECS[:2], "1"), timeout=120
    )
    slime.rank0.broadcast(layout, SPECS[:2])
    ok([first.result(timeout=120)])
    open_id = fleet.client.weights().raw["update"]["update_id"]
    resp = http("POST", f"{fleet.control_url}/rollout/weights/updates/{open_id}/abort", {"reason": "test: cut"})
    assert resp.status == 200 and resp.json()["status"] == "FAILED", resp.body[:300]

    second = http("POST", url + "/update_weights_from_distributed", bucket(SPECS[2:], "1"))
    assert second.status == 409 and second.json()["error"]["code"] == "sync_not_started", second.body[:300]
    assert fleet.client.weights().version == "default"
    # The continue that ends this sync answers its outcome: the fleet is not on "1".
    ended = http("POST", url + "/continue_generation", {})
    assert ended.status == 502 and ended.json()["error"]["code"] == "update_failed", ended.body[:300]
    assert open_id in ended.json()["message"], ended.body[:300]
    # Starting the sync again does not get past a bucket the manager refuses either: a bucket it
    # cannot take ends the sync, so the bucket after it cannot make a version without it.
    ok([http("POST", url + "/pause_generation", {})])
    bad = http("POST", url + "/update_weights_from_distributed", {**bucket(SPECS[:1], "1"), "dtypes": ["complex64"]})
    assert bad.status == 400 and bad.json()["error"]["code"] == "invalid_dtype", bad.body[:300]
    after = http("POST", url + "/update_weights_from_distributed", bucket(SPECS[1:], "1"))
    assert after.status == 409 and after.json()["error"]["code"] == "sync_not_started", after.body[:300]

    # Its members held bucket 1 of "1": they are restarted, so the trainer's group lost them.
    ok([http("POST", url + "/pause_generation", {})])
    lost = http("POST", url + "/update_weights_from_distributed", bucket(SPECS, "1"))
    assert lost.status == 409 and lost.json()["error"]["code"] == "group_member_lost", lost.body[:300]
    # A restarted slime builds a new group at once: the port waits for the engines coming back
    # to fill it. Then a whole sync: version 1 with every bucket.
    ok(slime.connect())
    assert all(e.status == "ACTIVE" for e in fleet.engines().engines)
    ok(slime.sync([SPECS[:2], SPECS[2:]]))
    assert fleet.client.weights().version == "1"
    for e in fleet.engines().engines:
        assert http("GET", e.url + "/model_info").json()["weight_version"] == "1"
    assert versions_answered(fleet.router_url, 6) == {"1"}


def test_a_second_slime_run_numbers_its_syncs_after_the_fleets_version(
    trainer_fleet: tuple[ManagerHandle, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """slime numbers syncs from 1 in every run; examples/slime's init hook starts them after the
    fleet's version, so a second run against the same manager is not refused."""
    fleet, addr = trainer_fleet
    first_run = SlimeOnExternalEngines([addr], fleet.router_url, StandInRank0(), fleet)
    first_run.discover_and_register()
    ok(first_run.connect())
    ok(first_run.sync([SPECS]))
    ok(first_run.sync([SPECS]))
    assert fleet.client.weights().version == "2"

    monkeypatch.setenv("ELASTIC_ROLLOUT_MANAGER", fleet.control_url)
    hooks = load_example("examples/slime/elastic_rollout_hooks.py")
    args = SimpleNamespace()
    hooks.continue_fleet_versions(args)
    assert args.update_weight_start_version == 2

    second_run = SlimeOnExternalEngines([addr], fleet.router_url, StandInRank0(), fleet)
    second_run.discover_and_register()
    ok(second_run.connect())
    # Without the hook, the first sync would reuse "1": the manager keeps names unique.
    again = http("POST", f"http://{addr}/pause_generation", {})
    assert again.status == 200
    body = {"names": [SPECS[0].name], "dtypes": [SPECS[0].dtype], "shapes": [list(SPECS[0].shape)],
            "group_name": second_run.group_name, "weight_version": "1"}  # fmt: skip
    reused = http("POST", f"http://{addr}/update_weights_from_distributed", body)
    assert reused.status == 409 and reused.json()["error"]["code"] == "version_conflict", reused.body[:300]
    second_run.weight_version = args.update_weight_start_version
    ok(second_run.sync([SPECS]))
    assert fleet.client.weights().version == "3"


def test_a_continue_after_the_manager_restarted_mid_sync_answers_the_failed_update(
    manager_bin: Path, tmp_path: Path
) -> None:
    """The manager is killed between two buckets and comes back on its state: the update it had
    open cannot resume (its rank 0's broadcast is gone) and ends FAILED. slime's continue must
    say so; a plain 200 would leave slime sure the fleet serves "1" while it serves the old."""
    ports = [str(free_port()) for _ in range(3)]
    extra = ("--rollout-num-gpus", "2", "--reattach-grace-secs", "60",
             "--port", ports[0], "--router-port", ports[1], "--trainer-port", ports[2])  # fmt: skip
    url = f"http://127.0.0.1:{ports[2]}"
    first = start_manager(manager_bin, tmp_path / "state", extra)
    second: ManagerHandle | None = None
    identities: dict[str, ProcessIdentity] = {}
    try:
        first.wait_engines(2, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        slime = SlimeOnExternalEngines([f"127.0.0.1:{ports[2]}"], first.router_url, StandInRank0(), first)
        slime.discover_and_register()
        ok(slime.connect())
        layout = slime.layout()
        ok([http("POST", url + "/pause_generation", {})])
        body = {"names": [s.name for s in SPECS[:2]], "dtypes": [s.dtype for s in SPECS[:2]],
                "shapes": [list(s.shape) for s in SPECS[:2]], "group_name": slime.group_name,
                "weight_version": "1"}  # fmt: skip
        first_bucket = slime.pool.submit(http, "POST", url + "/update_weights_from_distributed", body, timeout=120)
        slime.rank0.broadcast(layout, SPECS[:2])
        ok([first_bucket.result(timeout=120)])
        open_id = first.client.weights().raw["update"]["update_id"]
        identities = engine_identities(first)
        first.process.kill()
        first.process.wait()

        second = start_manager(manager_bin, tmp_path / "state", extra)
        wait_until(lambda: second.client.weight_update(open_id)["status"] == "FAILED", 120, "the open update FAILED")
        ended = http("POST", url + "/continue_generation", {}, timeout=120)
        assert ended.status == 502 and ended.json()["error"]["code"] == "update_failed", ended.body[:300]
        assert open_id in ended.json()["message"], ended.body[:300]
        assert second.client.weights().version == "default"
        # The next sync starts with a pause: its continue answers that sync, not the old one.
        ok([http("POST", url + "/pause_generation", {})])
        ok([http("POST", url + "/continue_generation", {})])
    finally:
        stop_both(first, second, identities)


def test_an_attached_engine_with_two_ranks_counts_two_in_the_trainers_group(
    trainer_fleet: tuple[ManagerHandle, str],
    external_engine: StartEngine,  # noqa: F811 (the fixture imported above)
) -> None:
    """An engine the manager did not launch has no GPU ids: its ranks come from its own
    `/server_info` (`tp_size x pp_size`). Counted as one, slime would size its world one short
    and the engine's second rank would have no place in the group."""
    fleet, addr = trainer_fleet
    url, _ = external_engine("sim-model", None, "--tp-size", "2")
    accepted = fleet.client.scale_out(engine_urls=[url])
    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, timeout=STARTUP_TIMEOUT)
    assert op.status == "ACTIVE", op.raw
    info = http("GET", f"http://{addr}/server_info").json()
    assert info["num_gpus"] == 2 * 1 + 2, info  # two launched engines of one GPU, the attached one's two
    slime = SlimeOnExternalEngines([addr], fleet.router_url, StandInRank0(), fleet)
    slime.discover_and_register()
    ok(slime.connect())
    members = {m.url: (m.rank_offset, m.tp_size) for m in slime.layout().members}
    assert members[url] == (3, 2), members
    ok(slime.sync([SPECS]))
    assert fleet.client.weights().version == "1"
    assert http("GET", url + "/model_info").json()["weight_version"] == "1"


def test_slime_loads_weights_from_disk_through_the_trainer_port_on_every_engine(
    trainer_fleet: tuple[ManagerHandle, str],
    external_engine: StartEngine,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    """slime's disk transport (`--update-weight-transport disk`) with the trainer port as its only
    engine (`--rollout-external-engine-addrs`): each `/update_weights_from_disk` is the manager's
    publish of that checkpoint to the whole fleet, launched and attached (TP 2) engines alike,
    answered once every engine serves it. (With `--rollout-num-gpus 0`, as this example once said,
    slime skips the sync altogether and the fleet never leaves its startup weights.)"""
    fleet, addr = trainer_fleet
    url, _ = external_engine("sim-model", None, "--tp-size", "2")
    op = fleet.client.wait_for_operation("scale_out", fleet.client.scale_out(engine_urls=[url]).request_id, 60)
    assert op.status == "ACTIVE", op.raw
    slime = SlimeOnExternalEngines([addr], fleet.router_url, StandInRank0(), fleet)
    slime.discover_and_register()
    root = tmp_path / "slime-weights"
    for n in (1, 2):
        write_checkpoint(root / f"weight_v{n:06d}", n)
        answers = slime.sync_from_disk(root / f"weight_v{n:06d}")
        ok(answers)
        loaded = answers[2].json()
        assert loaded["success"] is True and loaded["weight_version"] == str(n), loaded
        weights = fleet.client.weights()
        assert weights.version == str(n) and weights.raw["path"] == str(root / f"weight_v{n:06d}"), weights.raw
        engines = fleet.engines().engines
        assert len(engines) == 3 and {e.weight_version for e in engines} == {str(n)}
        assert http("GET", url + "/model_info").json()["weight_version"] == str(n)
        assert versions_answered(fleet.router_url, 8) == {str(n)}
    # slime loaded from the pause's mode, abort (its pause sends {}): every engine at once.
    update = fleet.client.weight_update(fleet.client.weights().raw["update_id"])
    assert (update.raw["strategy"], update.raw["pause_mode"]) == ("all_at_once", "abort"), update.raw

    # The same call again (a retry) is the version already served: nothing is loaded again.
    port = f"http://{addr}/update_weights_from_disk"
    again = http("POST", port, {"model_path": str(root / "weight_v000002"), "weight_version": "2"})
    assert again.status == 200 and again.json()["update_id"] == update.raw["update_id"], again.body[:300]
    # A new run of slime numbers its disk syncs from 1 again: other files under a served name
    # are refused before anything is paused, and the fleet stays where it is.
    write_checkpoint(tmp_path / "run2" / "weight_v000001", 7)
    reused = http("POST", port, {"model_path": str(tmp_path / "run2" / "weight_v000001"), "weight_version": "1"})
    assert reused.status == 409 and reused.json()["error"]["code"] == "version_conflict", reused.body[:300]
    refusals = [
        ({"model_path": str(root / "weight_v000002")}, "weight_version_required"),
        ({"model_path": "weight_v000002", "weight_version": "3"}, "invalid_path"),
        ({"model_path": str(root / "nothing"), "weight_version": "3"}, "invalid_checkpoint"),
    ]
    for body, code in refusals:
        resp = http("POST", port, body)
        assert resp.status == 400 and resp.json()["error"]["code"] == code, resp.body[:300]
    assert fleet.client.weights().version == "2"


def test_the_slime_hooks_refuse_a_setup_whose_syncs_never_reach_the_fleet() -> None:
    """With no engine of its own and none listed, slime skips every weight sync without an error
    (its actors find no updatable engine); the rollout hook refuses that setup at the first
    rollout, naming the flag that fixes it."""
    hooks = load_example("examples/slime/elastic_rollout_hooks.py")
    for args in (SimpleNamespace(rollout_num_gpus=0, update_weight_transport="disk"),
                 SimpleNamespace(rollout_num_gpus=0, update_weight_transport="nccl"),
                 SimpleNamespace(rollout_num_gpus=4, update_weight_transport="disk")):  # fmt: skip
        with pytest.raises(RuntimeError, match="--rollout-external-engine-addrs"):
            hooks.generate_rollout(args, 0, None)
    listed = SimpleNamespace(rollout_num_gpus=0, update_weight_transport="disk", rollout_external_engine_addrs=["m:1"])
    hooks._check_weight_path(listed)  # the trainer port listed: both transports reach the fleet


def test_the_trainer_port_takes_its_own_allow_list_instead_of_the_token(
    start_fleet: StartManager, tmp_path: Path
) -> None:
    """slime sends no credentials, so a manager with a token refused it on the trainer port.
    `--trainer-allow-cidr` is the port's own credential: callers from those networks need no
    token there (the control API and the router still ask for it), callers from elsewhere get a
    403 that names the flag."""
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    port = free_port()
    fleet = start_fleet(
        "--api-token-file", str(token), "--trainer-port", str(port), "--trainer-allow-cidr", "127.0.0.0/8"
    )
    addr = f"127.0.0.1:{port}"
    slime = SlimeOnExternalEngines([addr], fleet.router_url, StandInRank0(), fleet)
    assert http("POST", f"http://{addr}/pause_generation", {}).status == 200
    write_checkpoint(tmp_path / "weight_v000001", 1)
    ok(slime.sync_from_disk(tmp_path / "weight_v000001"))
    assert fleet.client.weights().version == "1"
    assert http("POST", fleet.control_url + "/rollout/scale_out", {"num_replicas": 3}).status == 401
    assert http("POST", fleet.router_url + "/abort_request", {"abort_all": True}).status == 401

    elsewhere = free_port()
    start_fleet(
        "--trainer-port", str(elsewhere), "--trainer-allow-cidr", "10.0.0.0/8", "--trainer-allow-cidr", "fd00::/8"
    )
    for method, path in (("GET", "/server_info"), ("POST", "/update_weights_from_disk")):
        resp = http(method, f"http://127.0.0.1:{elsewhere}{path}", {} if method == "POST" else None)
        assert resp.status == 403 and resp.json()["error"]["code"] == "peer_not_allowed", resp.body[:300]
        assert "127.0.0.1" in resp.json()["message"] and "--trainer-allow-cidr" in resp.json()["message"]
