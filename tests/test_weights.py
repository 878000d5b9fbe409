"""Weight versions: publish, fleet-wide updates, fresh weights for new engines, restarts.

Real manager, real ``sglang-sim`` engines on loopback, checkpoints written as tiny safetensors
files; every engine's loaded checksum is read back from the engine itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from _checkpoints import corrupt, write_checkpoint
from _support import (
    INITIAL_ENGINES,
    STARTUP_TIMEOUT,
    ManagerHandle,
    ProcessIdentity,
    StartManager,
    http,
    start_manager,
    stop_manager,
    wait_until,
)
from test_external import StartEngine, external_engine  # noqa: F401 - the fixture

from elastic_rollout import RolloutApiError

UPDATE_TIMEOUT = 60.0


def check_schema(fleet: ManagerHandle, name: str, value: Any) -> None:
    """``value`` matches the served OpenAPI document's schema ``name``."""
    spec = http("GET", f"{fleet.control_url}/openapi.json").json()
    schema = {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(value)


def model_info(engine_url: str) -> dict[str, Any]:
    result = http("GET", f"{engine_url}/model_info", timeout=10)
    assert result.status == 200, result.body[:300]
    info: dict[str, Any] = result.json()
    return info


def publish(fleet: ManagerHandle, version: str, path: Path, **kwargs: Any) -> dict[str, Any]:
    answer = fleet.client.publish_weights(version, str(path), **kwargs)
    assert answer["version"] == version, answer
    return answer


def assert_fleet_on(fleet: ManagerHandle, version: str, checksum: str, engines: int) -> None:
    """The fleet's version, every ACTIVE engine's record, and each engine's own report agree."""
    weights = fleet.client.weights()
    assert weights["version"] == version, weights
    assert weights["checksum"] == checksum, weights
    assert weights["update"] is None, weights
    view = fleet.wait_engines(engines)
    assert view.raw["models"]["default"]["weight_version"] == version
    for engine in view.with_status("ACTIVE"):
        assert engine.weight_version == version, engine
        assert engine.weights_checksum == checksum, engine
        info = model_info(engine.url)
        assert info["weight_version"] == version, (engine.engine_id, info)
        assert info["weights_checksum"] == checksum, (engine.engine_id, info)


def run_update(fleet: ManagerHandle, version: str, path: Path, **kwargs: Any) -> dict[str, Any]:
    answer = publish(fleet, version, path, **kwargs)
    # Answered before the files are hashed: the checksum is not known yet.
    assert answer["status"] == "CHECKSUMMING" and answer["checksum"] is None, answer
    update = fleet.client.wait_for_weight_update(answer["update_id"], UPDATE_TIMEOUT)
    assert update["status"] == "COMPLETED", json.dumps(update, indent=1)
    assert update["hashed_bytes"] == update["total_bytes"] > 0, update
    return update


def test_publish_v1_to_v3_rolling_and_all_at_once(fleet: ManagerHandle, tmp_path: Path) -> None:
    sums = {v: write_checkpoint(tmp_path / v, seed) for seed, v in enumerate(["v1", "v2", "v3"], start=1)}
    assert fleet.client.weights()["version"] == "default"

    update = run_update(fleet, "v1", tmp_path / "v1", strategy="rolling", max_unavailable=1)
    assert update["checksum"] == sums["v1"] and update["previous_version"] == "default"
    assert {e["status"] for e in update["engines"].values()} == {"VERIFIED"}, update["engines"]
    assert len(update["engines"]) == INITIAL_ENGINES
    assert [h["status"] for h in update["history"]] == ["CHECKSUMMING", "PENDING", "UPDATING", "COMPLETED"]
    assert_fleet_on(fleet, "v1", sums["v1"], INITIAL_ENGINES)
    check_schema(fleet, "WeightUpdate", update)
    check_schema(fleet, "Weights", fleet.client.weights())
    check_schema(fleet, "EnginesView", http("GET", f"{fleet.control_url}/rollout/engines").json())
    check_schema(fleet, "WeightUpdateList", http("GET", f"{fleet.control_url}/rollout/weights/updates").json())
    with pytest.raises(jsonschema.ValidationError):
        check_schema(fleet, "PublishRequest", {"version": "v2", "path": "/x", "strategy": "sideways"})

    run_update(fleet, "v2", tmp_path / "v2", strategy="all_at_once")
    assert_fleet_on(fleet, "v2", sums["v2"], INITIAL_ENGINES)

    v3 = run_update(fleet, "v3", tmp_path / "v3", strategy="rolling", max_unavailable=2, checksum=sums["v3"])
    assert_fleet_on(fleet, "v3", sums["v3"], INITIAL_ENGINES)

    # The same version, path and checksum again: nothing to do, the existing update answers.
    again = fleet.client.publish_weights("v3", str(tmp_path / "v3"))
    assert again["update_id"] == v3["update_id"] and again["status"] == "COMPLETED", again
    check_schema(fleet, "PublishAccepted", again)
    # A version name never changes its bytes.
    write_checkpoint(tmp_path / "v3-other", 99)
    with pytest.raises(RolloutApiError) as err:
        fleet.client.publish_weights("v3", str(tmp_path / "v3-other"))
    assert err.value.status == 409 and err.value.code == "version_conflict", err.value

    weights = fleet.client.weights()
    assert [h["version"] for h in weights["history"]] == ["v3", "v2", "v1"]
    assert [h["strategy"] for h in weights["history"]] == ["rolling", "all_at_once", "rolling"]
    assert weights["source"] == "publish" and weights["path"] == str(tmp_path / "v3")
    assert {e["weight_version"] for e in weights["engines"]} == {"v3"}


def test_bad_publishes_are_refused_and_change_nothing(fleet: ManagerHandle, tmp_path: Path) -> None:
    good = tmp_path / "good"
    checksum = write_checkpoint(good, 1)
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = tmp_path / "bad"
    write_checkpoint(bad, 2)
    corrupt(bad)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"version": "v1", "path": str(tmp_path / "missing")}, "invalid_checkpoint"),
        ({"version": "v1", "path": str(empty)}, "invalid_checkpoint"),
        ({"version": "v1", "path": str(bad)}, "invalid_checkpoint"),
        ({"version": "v1", "path": "relative/dir"}, "invalid_path"),
        ({"version": "v1", "path": str(good), "checksum": "not-hex"}, "invalid_checksum"),
        ({"version": "v 1", "path": str(good)}, "invalid_version"),
        ({"version": "v1", "path": str(good), "strategy": "sideways"}, "invalid_body"),
        ({"version": "v1", "path": str(good), "max_unavailable": 0}, "invalid_max_unavailable"),
        ({"version": "v1", "path": str(good), "pause_mode": "nap"}, "invalid_pause_mode"),
        ({"version": "v1", "path": str(good), "colour": "red"}, "invalid_body"),
        ({"path": str(good)}, "invalid_body"),
        ({"version": "default", "path": str(good)}, "version_conflict"),
    ]
    for body, code in cases:
        result = http("POST", f"{fleet.control_url}/rollout/weights/publish", body)
        expected = 409 if code == "version_conflict" else 400
        assert result.status == expected, (body, result.status, result.body[:400])
        error = result.json()["error"]
        assert error["code"] == code and error["message"], (body, error)
    weights = fleet.client.weights()
    assert weights["version"] == "default" and weights["update"] is None and weights["history"] == []
    missing = http("GET", f"{fleet.control_url}/rollout/weights/updates/nope")
    assert missing.status == 404 and missing.json()["error"]["code"] == "unknown_request"
    bad_filter = http("GET", f"{fleet.control_url}/rollout/weights/updates?status=sleeping")
    assert bad_filter.status == 400 and bad_filter.json()["error"]["code"] == "invalid_status_filter"
    for engine in fleet.wait_engines(INITIAL_ENGINES).engines:
        assert model_info(engine.url)["weight_version"] == "default"
    # The good checkpoint still publishes afterwards.
    accepted = publish(fleet, "v1", good)
    check_schema(fleet, "PublishAccepted", accepted)
    assert fleet.client.wait_for_weight_update(accepted["update_id"], UPDATE_TIMEOUT)["status"] == "COMPLETED"
    assert_fleet_on(fleet, "v1", checksum, INITIAL_ENGINES)


def test_a_checksum_the_files_do_not_have_fails_the_update_with_nothing_loaded(
    fleet: ManagerHandle, tmp_path: Path
) -> None:
    good = tmp_path / "v1"
    checksum = write_checkpoint(good, 1)
    answer = publish(fleet, "v1", good, checksum="0" * 64)
    assert answer["status"] == "CHECKSUMMING", answer
    update = fleet.client.wait_for_weight_update(answer["update_id"], UPDATE_TIMEOUT)
    assert update["status"] == "FAILED", json.dumps(update, indent=1)
    assert update.statuses == ["CHECKSUMMING", "FAILED"], update.statuses
    message = update["error_message"] or ""
    assert "0" * 64 in message and checksum in message and "nothing was loaded" in message, message
    assert update["engines"] == {} and update["checksum"] is None, update
    weights = fleet.client.weights()
    assert weights["version"] == "default" and weights["update"] is None, weights
    for engine in fleet.wait_engines(INITIAL_ENGINES).engines:
        assert model_info(engine.url)["weight_version"] == "default"
    # A failed version's name is free again: the right checksum publishes it.
    run_update(fleet, "v1", good, checksum=checksum.upper())
    assert_fleet_on(fleet, "v1", checksum, INITIAL_ENGINES)


def test_second_publish_while_one_runs_is_409(start_fleet: StartManager, tmp_path: Path) -> None:
    fleet = start_fleet("--engine-arg=--weight-load-delay=1")
    write_checkpoint(tmp_path / "v1", 1)
    write_checkpoint(tmp_path / "v2", 2)
    first = publish(fleet, "v1", tmp_path / "v1")
    with pytest.raises(RolloutApiError) as err:
        fleet.client.publish_weights("v2", str(tmp_path / "v2"))
    assert err.value.status == 409 and err.value.code == "update_in_progress", err.value
    assert first["update_id"] in err.value.message
    # Publishing the running version from the same path again joins it.
    again = fleet.client.publish_weights("v1", str(tmp_path / "v1"))
    assert again["update_id"] == first["update_id"] and "joins" in again["message"], again
    # ... unless it expects other bytes.
    with pytest.raises(RolloutApiError) as conflict:
        fleet.client.publish_weights("v1", str(tmp_path / "v1"), checksum="1" * 64)
    # (version_conflict once its checksum is known; update_in_progress while it is still hashing)
    assert conflict.value.status == 409 and conflict.value.code in ("version_conflict", "update_in_progress")
    assert fleet.client.wait_for_weight_update(first["update_id"], UPDATE_TIMEOUT)["status"] == "COMPLETED"


def wait_first_loading(fleet: ManagerHandle, update_id: str) -> str:
    """Waits for the first engine of the update to start loading; returns its id."""

    def first_loading() -> str | None:
        engines = fleet.client.weight_update(update_id)["engines"]
        started = [eid for eid, e in engines.items() if e["status"] == "UPDATING"]
        return started[0] if started else None

    found: str = wait_until(first_loading, 30, f"the first engine of update {update_id} to start loading")
    return found


def test_engine_that_cannot_load_is_taken_out_and_recovered(start_fleet: StartManager, tmp_path: Path) -> None:
    # Each load takes 3 s after the files are read, so the second engine reads the files well
    # after the first one did: corrupting them in between makes exactly the second engine fail.
    fleet = start_fleet("--engine-arg=--weight-load-delay=3")
    good = write_checkpoint(tmp_path / "v1", 1)
    run_update(fleet, "v1", tmp_path / "v1")
    write_checkpoint(tmp_path / "v2", 2)
    answer = publish(fleet, "v2", tmp_path / "v2", strategy="rolling", max_unavailable=1)
    update_id = answer["update_id"]
    first = wait_first_loading(fleet, update_id)
    time.sleep(1.0)
    corrupt(tmp_path / "v2")
    update = fleet.client.wait_for_weight_update(update_id, UPDATE_TIMEOUT)
    assert update["status"] == "FAILED", json.dumps(update, indent=1)
    failed = [eid for eid, e in update["engines"].items() if e["status"] == "FAILED"]
    assert len(failed) == 1 and failed[0] != first, update["engines"]
    assert "safetensors" in (update["engines"][failed[0]]["error"] or ""), update["engines"]
    assert "stays on v1" in update["error_message"], update

    # The failed engine never served v2; the one that did is restarted; both come back on v1.
    def recovered() -> bool:
        view = fleet.engines()
        active = view.with_status("ACTIVE")
        return len(active) == INITIAL_ENGINES and all(
            e.weight_version == "v1" and e.weights_checksum == good for e in active
        )

    wait_until(recovered, STARTUP_TIMEOUT, lambda: f"both engines back on v1: {fleet.engines().engines}")
    assert_fleet_on(fleet, "v1", good, INITIAL_ENGINES)
    for engine in fleet.engines().engines:
        assert engine.restarts == 1, engine
    weights = fleet.client.weights()
    assert [h["status"] for h in weights["history"]] == ["FAILED", "COMPLETED"]
    # The failed version may be published again once fixed.
    fixed = write_checkpoint(tmp_path / "v2-fixed", 3)
    run_update(fleet, "v2", tmp_path / "v2-fixed")
    assert_fleet_on(fleet, "v2", fixed, INITIAL_ENGINES)


def test_engine_that_freezes_during_its_load_fails_the_update_and_is_restarted(
    start_fleet: StartManager, tmp_path: Path
) -> None:
    """An engine out of routing for its weight load is not health-probed; one that freezes
    then (SIGSTOP: alive, answering nothing) is caught by the update's own liveness probes,
    long before --weight-update-timeout-secs (600 s): the update FAILS, the fleet stays on
    its version, and the frozen engine is replaced by a fresh process."""
    fleet = start_fleet(
        "--engine-arg=--weight-load-delay=3", "--health-check-interval-secs", "0.5",
        "--health-check-timeout-secs", "1", "--health-failure-threshold", "2",
    )  # fmt: skip
    before = {e.engine_id: e.pid for e in fleet.engines().engines}
    write_checkpoint(tmp_path / "v1", 1)
    answer = publish(fleet, "v1", tmp_path / "v1", strategy="rolling", max_unavailable=1)
    update_id = answer["update_id"]
    frozen_id = wait_first_loading(fleet, update_id)
    frozen = ProcessIdentity.of(before[frozen_id])
    assert frozen is not None
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        update = fleet.client.wait_for_weight_update(update_id, UPDATE_TIMEOUT)
        assert update["status"] == "FAILED", json.dumps(update, indent=1)
        error = update["engines"][frozen_id]["error"] or ""
        assert "stopped answering during its weight update" in error, update["engines"]
        assert "/model_info timed out" in error, update["engines"]

        def replaced() -> bool:
            active = fleet.engines().with_status("ACTIVE")
            return len(active) == INITIAL_ENGINES and any(
                e.engine_id == frozen_id and e.pid != frozen.pid for e in active
            )

        wait_until(replaced, STARTUP_TIMEOUT, lambda: f"the frozen engine to be restarted: {fleet.engines().engines}")
        assert not frozen.alive(), "the frozen process outlived its restart"
        assert_fleet_on(fleet, "default", fleet.client.weights()["checksum"], INITIAL_ENGINES)
        restarted = {e.engine_id: e.restarts for e in fleet.engines().engines}
        assert restarted[frozen_id] == 1, restarted
    finally:
        if frozen.alive():
            os.kill(frozen.pid, signal.SIGCONT)


def test_other_engines_are_still_probed_while_one_loads_weights_to_rejoin(
    start_fleet: StartManager, tmp_path: Path
) -> None:
    """An UNHEALTHY engine that missed an update loads the new version before it rejoins
    (20 s here). The other engines are still health-probed during that load: one frozen then
    is taken out of routing while the first is still loading, not after."""
    fleet = start_fleet(
        "--engine-arg=--weight-load-delay=20", "--engine-arg=--enable-fault-api",
        "--health-check-interval-secs", "0.5", "--health-check-timeout-secs", "1",
        "--health-failure-threshold", "2", "--restart-failed-engines", "false",
        # A slow /health with a scheduler that answers looks like a pause; here it is the fault.
        "--health-pause-grace-secs", "0",
        # Both engines out of routing at once is the point here, beyond the default bound of half.
        "--health-max-unhealthy-fraction", "1",
    )  # fmt: skip
    a, b = sorted(fleet.engines().engines, key=lambda e: e.engine_id)

    def status(engine_id: str) -> str:
        return next(e.status for e in fleet.engines().engines if e.engine_id == engine_id)

    assert http("POST", f"{a.url}/sim/faults", {"slow_health": 3.0}, timeout=5).status == 200
    wait_until(lambda: status(a.engine_id) == "UNHEALTHY", 30, f"{a.engine_id} to be taken out")
    checksum = write_checkpoint(tmp_path / "v1", 1)
    run_update(fleet, "v1", tmp_path / "v1")  # b loads v1; a, out of routing, does not
    assert model_info(a.url)["weight_version"] == "default"
    # a answers its probes again and starts loading v1 to rejoin; b freezes meanwhile.
    assert http("POST", f"{a.url}/sim/faults", {"slow_health": 0}, timeout=5).status == 200
    frozen = ProcessIdentity.of(b.pid)
    assert frozen is not None
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: status(b.engine_id) == "UNHEALTHY", 60, f"{b.engine_id} to be taken out")
        assert status(a.engine_id) == "UNHEALTHY", fleet.engines().engines  # still loading v1
        os.kill(frozen.pid, signal.SIGCONT)
        wait_until(
            lambda: all(e.status == "ACTIVE" for e in fleet.engines().engines), 90,
            lambda: f"both engines back: {fleet.engines().engines}",
        )  # fmt: skip
        assert_fleet_on(fleet, "v1", checksum, INITIAL_ENGINES)
    finally:
        if frozen.alive():
            os.kill(frozen.pid, signal.SIGCONT)


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_scale_out_after_publish_starts_on_the_new_version(fleet: ManagerHandle, tmp_path: Path) -> None:
    checksum = write_checkpoint(tmp_path / "v1", 1)
    run_update(fleet, "v1", tmp_path / "v1")
    op = fleet.client.scale_out(num_replicas=3)
    done = fleet.client.wait_for_operation("scale_out", op.request_id, timeout=STARTUP_TIMEOUT)
    assert done.status == "ACTIVE", done.raw
    assert_fleet_on(fleet, "v1", checksum, 3)
    (new,) = [e for e in fleet.engines().engines if e.origin == "dynamic"]
    assert new.pid is not None
    argv = cmdline(new.pid)
    # Launched on the published checkpoint itself, not loaded after start.
    assert argv[argv.index("--model-path") + 1] == str(tmp_path / "v1"), argv
    assert argv[argv.index("--weight-version") + 1] == "v1", argv


def test_publish_while_scale_out_runs(start_fleet: StartManager, tmp_path: Path) -> None:
    # Engines take 1 s to start, so the publish lands while the new ones are still starting.
    fleet = start_fleet("--engine-arg=--startup-delay=1")
    checksum = write_checkpoint(tmp_path / "v1", 1)
    op = fleet.client.scale_out(num_replicas=4)
    answer = publish(fleet, "v1", tmp_path / "v1")
    status = fleet.client.scale_out_status(op.request_id).status
    assert status in ("PENDING", "CREATING", "HEALTH_CHECKING"), status
    update = fleet.client.wait_for_weight_update(answer["update_id"], UPDATE_TIMEOUT)
    assert update["status"] == "COMPLETED", update
    done = fleet.client.wait_for_operation("scale_out", op.request_id, timeout=STARTUP_TIMEOUT)
    assert done.status == "ACTIVE", (status, done.raw)
    assert_fleet_on(fleet, "v1", checksum, 4)


def test_manager_restart_keeps_the_version(manager_bin: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    checksum = write_checkpoint(tmp_path / "v1", 1)
    first = start_manager(manager_bin, state)
    try:
        first.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        run_update(first, "v1", tmp_path / "v1")
    finally:
        stop_manager(first)
    second = start_manager(manager_bin, state)
    try:
        second.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT)
        weights = second.client.weights()
        assert weights["version"] == "v1" and weights["path"] == str(tmp_path / "v1"), weights
        assert_fleet_on(second, "v1", checksum, INITIAL_ENGINES)
        for engine in second.engines().engines:
            assert engine.pid is not None
            argv = cmdline(engine.pid)
            assert argv[argv.index("--model-path") + 1] == str(tmp_path / "v1"), argv
    finally:
        stop_manager(second)


def test_relay_transport_stages_on_node_local_storage(start_fleet: StartManager, tmp_path: Path) -> None:
    relay_dir = tmp_path / "shm"
    fleet = start_fleet("--weight-transport", "relay", "--relay-dir", str(relay_dir))
    sums = {v: write_checkpoint(tmp_path / v, seed) for seed, v in enumerate(["v1", "v2"], start=1)}
    for version in ("v1", "v2"):
        update = run_update(fleet, version, tmp_path / version)
        assert update["transport"] == "relay", update
        staged = Path(update["engine_path"])
        assert staged.parent == relay_dir and staged.name == f"{version}-{sums[version][:16]}", staged
        assert fleet.client.weights()["transport"] == "relay"
        assert_fleet_on(fleet, version, sums[version], INITIAL_ENGINES)
        for engine in fleet.engines().engines:
            # The engine loaded the node-local copy, not the published directory.
            loaded = http("GET", f"{engine.url}/server_info").json()["weights"]
            assert loaded["path"] == str(staged) and loaded["checksum"] == sums[version], loaded
    # Only the version in use stays staged.
    assert sorted(p.name for p in relay_dir.iterdir()) == [f"v2-{sums['v2'][:16]}"]


def test_publish_needs_the_token(start_fleet: StartManager, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("w-token\n")
    token.chmod(0o600)
    fleet = start_fleet("--api-token-file", str(token))
    checksum = write_checkpoint(tmp_path / "v1", 1)
    body = {"version": "v1", "path": str(tmp_path / "v1")}
    for headers in (None, {"Authorization": "Bearer wrong"}):
        resp = http("POST", f"{fleet.control_url}/rollout/weights/publish", body, headers=headers)
        assert resp.status == 401 and resp.json()["error"]["code"] == "unauthorized", resp.body
    assert fleet.client.weights()["version"] == "default"  # reads stay open; nothing was published
    authed = http("POST", f"{fleet.control_url}/rollout/weights/publish", body,
                  headers={"Authorization": "Bearer w-token"})  # fmt: skip
    assert authed.status == 202, authed.body
    assert fleet.client.wait_for_weight_update(authed.json()["update_id"], UPDATE_TIMEOUT)["status"] == "COMPLETED"
    assert_fleet_on(fleet, "v1", checksum, INITIAL_ENGINES)


def test_external_engines_are_updated_too(
    start_fleet: StartManager,
    external_engine: StartEngine,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    fleet = start_fleet()
    url, _ = external_engine()
    op = fleet.client.scale_out(engine_urls=[url])
    assert fleet.client.wait_for_operation("scale_out", op.request_id, timeout=STARTUP_TIMEOUT).status == "ACTIVE"
    checksum = write_checkpoint(tmp_path / "v1", 1)
    update = run_update(fleet, "v1", tmp_path / "v1", strategy="all_at_once")
    assert len(update["engines"]) == INITIAL_ENGINES + 1
    assert_fleet_on(fleet, "v1", checksum, INITIAL_ENGINES + 1)
    assert model_info(url)["weights_checksum"] == checksum


def test_relay_copy_lost_across_a_restart_is_staged_again(manager_bin: Path, tmp_path: Path) -> None:
    state, relay_dir = tmp_path / "state", tmp_path / "shm"
    args = ("--weight-transport", "relay", "--relay-dir", str(relay_dir))
    checksum = write_checkpoint(tmp_path / "v1", 1)
    first = start_manager(manager_bin, state, args)
    try:
        first.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        staged = Path(run_update(first, "v1", tmp_path / "v1")["engine_path"])
    finally:
        stop_manager(first)
    shutil.rmtree(relay_dir)  # what a reboot does to /dev/shm
    second = start_manager(manager_bin, state, args)
    try:
        second.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT)
        assert_fleet_on(second, "v1", checksum, INITIAL_ENGINES)
        assert sorted(relay_dir.iterdir()) == [staged]
        for engine in second.engines().engines:
            assert http("GET", f"{engine.url}/server_info").json()["weights"]["path"] == str(staged)
    finally:
        stop_manager(second)


def test_an_interrupted_update_whose_checkpoint_vanished_ends_failed_after_the_restart(
    manager_bin: Path, tmp_path: Path
) -> None:
    """kill -9 of the manager while a rolling update loads, then the checkpoint directory goes
    away: the restarted manager cannot resume the update (see test_weights_resume.py for the
    resume itself), so it ends FAILED saying why, the fleet keeps its version, and every engine
    is brought back to it; no engine process outlives the second manager."""
    state = tmp_path / "state"
    v1 = write_checkpoint(tmp_path / "v1", 1)
    write_checkpoint(tmp_path / "v2", 2)
    extra = ("--reattach-grace-secs", "30", "--engine-arg=--weight-load-delay=2")
    first = start_manager(manager_bin, state, extra)
    engines: list[ProcessIdentity] = []
    try:
        first.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        run_update(first, "v1", tmp_path / "v1")
        update_id = publish(first, "v2", tmp_path / "v2")["update_id"]

        def loading() -> bool:
            engines = first.client.weight_update(update_id)["engines"]
            return any(e["status"] == "UPDATING" for e in engines.values())

        wait_until(loading, UPDATE_TIMEOUT, "an engine loading v2")
        engines = [i for e in first.engines().engines if e.pid and (i := ProcessIdentity.of(e.pid))]
        assert len(engines) == INITIAL_ENGINES, engines
        first.process.kill()
        first.process.wait()
    finally:
        if first.process.poll() is None:
            stop_manager(first)
    shutil.rmtree(tmp_path / "v2")
    second = start_manager(manager_bin, state, extra)
    try:
        update = wait_until(
            lambda: (u := second.client.weight_update(update_id))["status"] == "FAILED" and u,
            UPDATE_TIMEOUT,
            "the interrupted update to end FAILED",
        )
        assert update["resumed"] == 1, update
        message = update["error_message"] or ""
        assert "cannot resume after a manager restart" in message and str(tmp_path / "v2") in message, message
        assert message.endswith("the fleet stays on v1"), message
        assert_fleet_on(second, "v1", v1, INITIAL_ENGINES)
    finally:
        stop_manager(second)
    assert not [i.pid for i in engines if i.alive()], "engine processes outlived the second manager"
