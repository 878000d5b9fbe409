"""SMG's RL control plane on our router port, driven by SMG's own Python client (``smg.rl`` from
PyPI's ``smg``): discovery, single-engine and fan-out calls, the ``paused()`` context manager, and
refusals that keep every weight change the manager's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from _checkpoints import write_checkpoint
from _support import ManagerHandle, StartManager, http, wait_until
from _trainer import SPECS, StandInRank0, update_engines_directly
from smg.rl import RL, FanoutError, RlError, paused

from elastic_rollout.trainer import DistributedWeightSync


def probes(fleet: ManagerHandle, result: str) -> float:
    text = http("GET", fleet.control_url + "/metrics").body.decode()
    found = re.search(rf'^rollout_health_probes_total{{result="{result}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def routed(fleet: ManagerHandle) -> set[str]:
    return {w["id"] for w in http("GET", fleet.router_url + "/workers").json()["workers"]}


def test_a_trainer_written_against_smg_finds_and_calls_the_engines(fleet: ManagerHandle) -> None:
    rl = RL(fleet.router_url, timeout=60)
    workers = rl.workers()
    engines = {e.engine_id: e for e in fleet.engines().engines}
    assert {w.id for w in workers} == set(engines)
    for w in workers:
        assert (w.engine, w.health, w.worker_type, w.connection_mode) == ("sglang", "ready", "regular", "http")
        assert w.url == engines[w.id].url and w.weight_version == "default" and w.tp_size == 1
        assert w.labels["status"] == "ACTIVE" and w.labels["paused"] == "false"
    first = workers[0]
    assert rl.worker(first.id) == first

    info = rl.call(first.id, "model_info", method="GET")
    assert info.status == 200 and info.worker_id == first.id and info.body["weight_version"] == "default"
    flushed = rl.fanout("flush_cache", {}, selector="engine=sglang")
    assert (flushed.total, flushed.succeeded, flushed.failed) == (2, 2, [])
    assert set(flushed.results) == set(engines)

    with pytest.raises(RlError) as unknown:
        rl.worker("engine_99")
    assert (unknown.value.status, unknown.value.code) == (404, "worker_not_found")
    with pytest.raises(RlError) as bad:
        rl.fanout("flush_cache", {}, selector="engine")
    assert (bad.value.status, bad.value.code) == (400, "invalid_selector") and "k notin (a,b)" in str(bad.value)
    with pytest.raises(RlError) as none:
        rl.fanout("flush_cache", {}, selector="colour=red")
    assert (none.value.status, none.value.code) == (400, "no_workers_match")
    missing = http("POST", fleet.router_url + "/v1/rl/engine/flush_cache", {})
    assert missing.status == 400 and missing.json()["error"] == "selector_required"
    assert http("GET", fleet.router_url + "/v1/rl/workers").json()["protocol_version"] == 1

    # A weight change on one engine, or over NCCL, would go around the manager's versions.
    with pytest.raises(RlError) as refused:
        rl.call(first.id, "update_weights_from_disk", {"model_path": "/x", "weight_version": "9"})
    assert (refused.value.status, refused.value.code) == (403, "weights_managed")
    assert "selector=all" in str(refused.value)
    with pytest.raises(RlError) as one:
        rl.fanout("init_weights_update_group", {"master_address": "127.0.0.1"}, selector="all")
    assert one.value.code == "weights_managed" and "/rollout/weights/publish" in str(one.value)
    assert {e.weight_version for e in fleet.engines().engines} == {"default"}


def test_smgs_own_weight_update_example_publishes_to_the_fleet(fleet: ManagerHandle, tmp_path: Path) -> None:
    """The example in smg.rl's docstring, unchanged: pause every engine, fan out
    update_weights_from_disk, continue. Here it is the manager's publish of the checkpoint to the
    whole fleet, recorded and versioned."""
    rl = RL(fleet.router_url, timeout=120)
    p = str(tmp_path / "step-42")
    checksum = write_checkpoint(Path(p), seed=42)
    with paused(rl, "engine=sglang"):
        result = rl.fanout(
            "update_weights_from_disk", {"model_path": p, "weight_version": "42"}, selector="engine=sglang"
        )
    assert (result.total, result.succeeded, result.failed) == (2, 2, [])
    assert {r.status for r in result.results.values()} == {200}
    weights = fleet.client.weights()
    assert (weights.version, weights.raw["path"], weights.raw["checksum"]) == ("42", p, checksum)
    update = fleet.client.weight_update(weights.raw["update_id"])
    assert update.status == "COMPLETED" and update.raw["strategy"] == "all_at_once"
    for e in fleet.engines().engines:
        assert (e.status, e.weight_version) == ("ACTIVE", "42")
        assert http("GET", e.url + "/model_info").json()["weight_version"] == "42"
    assert {w.weight_version for w in rl.workers()} == {"42"} and routed(fleet) == {w.id for w in rl.workers()}
    out = http("POST", fleet.router_url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert out.status == 200 and out.json()["meta_info"]["weight_version"] == "42"

    # The same files under the same version again: nothing to load, each worker says so.
    again = rl.fanout("update_weights_from_disk", {"model_path": p, "weight_version": "42"}, selector="all")
    assert again.succeeded == 2 and fleet.client.weights().raw["update_id"] == weights.raw["update_id"]
    # Once the fleet moved on, going back to those files under their old name is refused (the
    # engines would not be on "42" again): they need a new name.
    p43 = str(tmp_path / "step-43")
    write_checkpoint(Path(p43), seed=43)
    assert (
        rl.fanout("update_weights_from_disk", {"model_path": p43, "weight_version": "43"}, selector="all").succeeded
        == 2
    )
    with pytest.raises(RlError) as back:
        rl.fanout("update_weights_from_disk", {"model_path": p, "weight_version": "42"}, selector="all")
    assert (back.value.status, back.value.code) == (409, "version_conflict")

    # What the manager cannot take is refused before anything is published.
    cases = [
        ({"model_path": p, "weight_version": "44"}, "id=" + next(iter(result.results)), 409, "partial_weight_update"),
        ({"model_path": p}, "all", 400, "weight_version_required"),
        ({"model_path": "relative/dir", "weight_version": "44"}, "all", 400, "invalid_path"),
        ({"model_path": str(tmp_path / "missing"), "weight_version": "44"}, "all", 400, "invalid_checkpoint"),
        ({"model_path": p, "weight_version": "44", "load_format": "dummy"}, "all", 400, "invalid_load_format"),
    ]
    for body, selector, status, code in cases:
        with pytest.raises(RlError) as err:
            rl.fanout("update_weights_from_disk", body, selector=selector)
        assert (err.value.status, err.value.code) == (status, code), (body, err.value)
    assert fleet.client.weights().version == "43"


def test_a_pause_through_the_control_plane_is_the_managers(start_fleet: StartManager) -> None:
    """The paused engine leaves routing, and its failing health probes while its scheduler
    answers are not taken for a hang however long the pause lasts (past the pause grace);
    continuing puts it back."""
    fleet = start_fleet(
        "--health-check-interval-secs", "0.3", "--health-check-timeout-secs", "0.5",
        "--health-failure-threshold", "2", "--health-pause-grace-secs", "0.5",
    )  # fmt: skip
    rl = RL(fleet.router_url, timeout=60)
    a, b = sorted(w.id for w in rl.workers())
    with paused(rl, f"id={a}") as result:
        assert (result.total, result.succeeded) == (1, 1)
        assert rl.worker(a).labels["paused"] == "true"
        assert routed(fleet) == {b}
        # Many probe rounds while paused, each failing with an answering scheduler.
        before = probes(fleet, "paused")
        wait_until(lambda: probes(fleet, "paused") >= before + 8, 60, "probes of the paused engine")
        engine = fleet.engines().by_id(a)
        assert engine is not None and engine.status == "ACTIVE", engine
        out = http("POST", fleet.router_url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert out.status == 200
    assert rl.worker(a).labels["paused"] == "false"
    wait_until(lambda: routed(fleet) == {a, b}, 30, "the continued engine back in routing")


def test_a_fan_out_reports_each_engine_and_answers_207_on_a_partial_failure(start_fleet: StartManager) -> None:
    fleet = start_fleet("--restart-failed-engines", "false", "--health-check-interval-secs", "0.3")
    rl = RL(fleet.router_url, timeout=60)
    a, b = sorted(fleet.engines().engines, key=lambda e: e.engine_id)
    assert b.pid is not None
    os.kill(b.pid, signal.SIGKILL)
    with pytest.raises(FanoutError) as partial:
        rl.fanout("server_info", method="GET", selector="all")
    assert partial.value.status == 207
    result = partial.value.result
    assert (result.total, result.succeeded) == (2, 1) and set(result.results) == {a.engine_id}
    assert [(f.worker_id, f.error) for f in result.failed] == [(b.engine_id, "upstream_unreachable")]
    kept = rl.fanout("server_info", method="GET", selector="all", allow_partial=True)
    assert kept.succeeded == 1
    wait_until(lambda: rl.worker(b.engine_id).health != "ready", 30, "the killed engine out")
    only = rl.fanout("server_info", method="GET", selector="health=ready")
    assert (only.total, only.succeeded) == (1, 1)


def generate(fleet: ManagerHandle, policy: str | None) -> tuple[int, dict]:
    # Round robin, so that every engine the policy allows gets requests.
    headers = {"x-routing-policy": "round_robin"}
    if policy is not None:
        headers["x-smg-version-policy"] = policy
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    resp = http("POST", fleet.router_url + "/generate", body, headers=headers)
    stamped.append(resp.headers.get("x-smg-weight-version"))
    return resp.status, resp.json()


#: The `x-smg-weight-version` of every answer `generate` got, in order.
stamped: list[str | None] = []


def test_smg_version_policies_choose_the_engines_a_request_may_use(start_fleet: StartManager) -> None:
    fleet = start_fleet("--health-check-interval-secs", "0.3", "--version-wait-secs", "0.5")
    rank0 = StandInRank0()
    sync = DistributedWeightSync(fleet.client, join_group=rank0.join_group, broadcast=rank0.broadcast, timeout=60)
    sync.update("step-1", SPECS)
    sync.update("step-2", SPECS)
    a, _b = sorted(fleet.engines().engines, key=lambda e: e.engine_id)
    # A trainer moves engine a back to an old version around the manager; the registry follows
    # what a reports, the fleet's version stays step-2.
    update_engines_directly(rank0, [(a.engine_id, a.url)], "step-1")
    wait_until(lambda: fleet.engines().by_id(a.engine_id).weight_version == "step-1", 30, "a on step-1")  # type: ignore[union-attr]

    def served(policy: str | None, n: int = 12) -> set[str]:
        versions = set()
        for _ in range(n):
            status, body = generate(fleet, policy)
            assert status == 200, body
            versions.add(body["meta_info"]["weight_version"])
            # Stamped where SMG stamps it: the answering engine's version.
            assert stamped[-1] == body["meta_info"]["weight_version"], (stamped, body)
        return versions

    assert served("latest-only") == {"step-2"}
    assert served("max-staleness:0") == {"step-2"}
    assert served("max-staleness:1") == {"step-1", "step-2"}
    assert served("min-version:step-2") == {"step-2"}
    assert served("any") == {"step-1", "step-2"}
    status, body = generate(fleet, "min-version:step-3")
    assert status == 503 and body["error"]["code"] == "version_unavailable", body
    status, body = generate(fleet, "latest")
    assert status == 400 and body["error"]["code"] == "invalid_version_policy", body
    assert "max-staleness:<k>" in body["error"]["message"]


def test_the_fleets_default_version_policy_applies_to_requests_that_name_none(start_fleet: StartManager) -> None:
    fleet = start_fleet("--rl-version-policy", "min-version:step-9", "--version-wait-secs", "0.2")
    status, body = generate(fleet, None)
    assert status == 503 and body["error"]["code"] == "version_unavailable", body
    assert generate(fleet, "any")[0] == 200


def test_a_bad_version_policy_flag_names_the_flag_and_the_grammar(manager_bin: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [str(manager_bin), "serve", "--state-dir", str(tmp_path), "--rl-version-policy", "newest"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert "--rl-version-policy" in out.stderr and "max-staleness:<k>" in out.stderr, out.stderr


def test_calls_through_the_control_plane_need_the_token(start_fleet: StartManager, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    fleet = start_fleet("--api-token-file", str(token))
    anonymous = RL(fleet.router_url, timeout=60)
    workers = anonymous.workers()  # discovery stays open
    assert len(workers) == 2 and anonymous.worker(workers[0].id).id == workers[0].id
    for call in (
        lambda: anonymous.call(workers[0].id, "model_info", method="GET"),
        lambda: anonymous.fanout("flush_cache", {}, selector="all"),
        lambda: anonymous.fanout("server_info", method="GET", selector="all"),
    ):
        with pytest.raises(RlError) as refused:
            call()
        assert (refused.value.status, refused.value.code) == (401, "unauthorized")
    # A GET does not flush: request actions are POSTs.
    get_flush = http("GET", fleet.router_url + "/v1/rl/engine/flush_cache?selector=all",
                     headers={"Authorization": "Bearer s3cret-token"})  # fmt: skip
    assert get_flush.status == 403 and get_flush.json()["error"] == "path_not_allowed", get_flush.body
    authed = RL(fleet.router_url, api_key="s3cret-token", timeout=60)
    assert authed.fanout("flush_cache", {}, selector="all").succeeded == 2
    assert authed.call(workers[0].id, "model_info", method="GET").status == 200


def test_smgs_state_and_version_writes_are_the_managers_pause_or_refused(fleet: ManagerHandle) -> None:
    """SMG's control-state and version writes (crates/rl control.rs, read at 4d699e7/6559bee):
    ``paused`` is the manager's pause of the engine, ``active`` resumes it, ``asleep`` is not
    something the manager does, and a version label is refused (the engine's own version is the
    one the manager reports)."""
    rl = RL(fleet.router_url, timeout=60)
    first, second = (w.id for w in rl.workers())
    base = fleet.router_url + "/v1/rl"

    paused = http("POST", f"{base}/workers/{first}/state", {"control": "paused"})
    assert paused.status == 200, paused.body[:300]
    assert (paused.json()["id"], paused.json()["control"], paused.json()["labels"]["routable"]) == (
        first,
        "paused",
        "false",
    )
    assert routed(fleet) == {second}
    active = http("POST", f"{base}/workers/{first}/state", {"control": "active"})
    assert active.status == 200 and active.json()["control"] == "active"
    wait_until(lambda: routed(fleet) == {first, second}, 30, "the resumed engine back in routing")

    both = http("POST", f"{base}/state?selector=all", {"control": "paused"})
    assert both.status == 200 and both.json()["total"] == 2
    assert {w["control"] for w in both.json()["workers"]} == {"paused"} and routed(fleet) == set()
    assert http("POST", f"{base}/state?selector=all", {"control": "active"}).status == 200
    wait_until(lambda: routed(fleet) == {first, second}, 30, "both engines back in routing")

    for path, body, status, code in [
        (f"/workers/{first}/state", {"control": "asleep"}, 409, "not_supported"),
        (f"/workers/{first}/state", {"control": "Paused"}, 400, "invalid_body"),
        ("/workers/engine_99/state", {"control": "paused"}, 404, "worker_not_found"),
        ("/state", {"control": "paused"}, 400, "selector_required"),
        ("/state?selector=colour%3Dred", {"control": "paused"}, 400, "no_workers_match"),
        (f"/workers/{first}/version", {"weight_version": "42"}, 403, "weights_managed"),
        ("/version?selector=all", {"weight_version": "42"}, 403, "weights_managed"),
        ("/version?selector=all", {"weight_version": ""}, 400, "invalid_version"),
    ]:
        resp = http("POST", base + path, body)
        assert (resp.status, resp.json()["error"]) == (status, code), (path, body, resp.body[:300])
    assert {w.weight_version for w in rl.workers()} == {"default"}
    assert {e.status for e in fleet.engines().engines} == {"ACTIVE"}
