"""The fleet's lifecycle against each SGLang release the simulator imitates (``--sglang-api``).

SGLang renamed and removed routes across 0.5.x: 0.5.2 serves only ``/get_model_info``,
``/get_server_info`` and ``/get_load`` (``{"load": tokens}``); 0.5.6 adds ``/model_info`` and
``/server_info`` and answers ``/get_load`` per DP rank; 0.5.23 has ``/v1/loads`` and no
``/get_load``, and requires ``/begin_weight_update`` around distributed updates. The manager,
the router's load poller, the autoscaler and the trainer helper must work with each: engines
launched and attached by URL come up ACTIVE, a published checkpoint is verified on every
engine, the router learns each engine's KV pool, the autoscaler reads every engine, and the
trainer's distributed update, run by the manager, succeeds and is the fleet's version, and an
engine added after it starts on that version.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _checkpoints import write_checkpoint
from _support import INITIAL_ENGINES, STARTUP_TIMEOUT, ManagerHandle, StartManager, http, metric_total, wait_until
from _trainer import SPECS, StandInRank0
from test_external import StartEngine, external_engine  # noqa: F401 - the fixture

from elastic_rollout.trainer import DistributedWeightSync

# (release, routes it must answer 404 to, routes it must serve)
RELEASES = [
    ("0.5.2", ["/model_info", "/server_info", "/v1/loads", "/begin_weight_update"], ["/get_model_info", "/get_load"]),
    ("0.5.6", ["/v1/loads", "/begin_weight_update"], ["/model_info", "/get_model_info", "/get_load"]),
    ("0.5.10.post1", ["/begin_weight_update"], ["/model_info", "/v1/loads", "/get_load"]),
    # verl's stable image: no /ready, no update session yet, /get_load a shim over /v1/loads.
    ("0.5.12", ["/begin_weight_update", "/ready"], ["/model_info", "/v1/loads", "/get_load"]),
    ("0.5.23", ["/get_load"], ["/model_info", "/v1/loads"]),
]
POOL_TOKENS = 65536  # sglang-sim's --max-total-tokens default


def engine_version(url: str) -> str:
    """The ``version`` the engine reports, from whichever server-info route it serves."""
    for route in ("/server_info", "/get_server_info"):
        resp = http("GET", url + route)
        if resp.status == 200:
            return str(resp.json()["version"])
    raise AssertionError(f"{url} serves no server-info route")


def route_status(url: str, route: str) -> int:
    method = "POST" if route == "/begin_weight_update" else "GET"
    return http(method, url + route, {} if method == "POST" else None).status


@pytest.mark.parametrize(("release", "absent", "served"), RELEASES, ids=[r[0] for r in RELEASES])
def test_lifecycle_on_each_release(
    start_fleet: StartManager,
    external_engine: StartEngine,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    release: str,
    absent: list,
    served: list,
) -> None:
    fleet: ManagerHandle = start_fleet(f"--engine-arg=--sglang-api={release}", "--load-poll-interval-secs", "0.2")

    # Launched engines came up ACTIVE; they really are that release.
    view = fleet.wait_engines(INITIAL_ENGINES)
    urls = [e.url for e in view.with_status("ACTIVE")]
    for url in urls:
        assert engine_version(url) == f"{release}-sim"
        assert {r: route_status(url, r) for r in absent} == dict.fromkeys(absent, 404)
        assert all(route_status(url, r) == 200 for r in served), url

    # An engine of that release attached by URL is verified and routed to.
    attached, _ = external_engine("sim-model", None, "--sglang-api", release)
    fleet.client.scale_out(engine_urls=[attached])
    view = fleet.wait_engines(INITIAL_ENGINES + 1, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
    assert attached in {e.url for e in view.with_status("ACTIVE")}

    # A published checkpoint is loaded and verified (the version read back from the engine).
    checkpoint = tmp_path / "ckpt-v2"
    write_checkpoint(checkpoint, seed=2)
    update = fleet.client.publish_weights("v2", str(checkpoint))
    done = fleet.client.wait_for_weight_update(update["update_id"], timeout=60)
    assert done["status"] == "COMPLETED", done
    view = fleet.wait_engines(INITIAL_ENGINES + 1)
    assert {e.weight_version for e in view.with_status("ACTIVE")} == {"v2"}

    # The router's load poller learned every engine's KV pool (from /v1/loads, or from
    # /get_load plus /get_server_info).
    def pools() -> float | None:
        total = metric_total(
            http("GET", f"{fleet.control_url}/metrics").body.decode(), "rollout_engine_kv_capacity_tokens"
        )
        return total if total == POOL_TOKENS * (INITIAL_ENGINES + 1) else None

    wait_until(pools, 30, "the router to learn every engine's KV pool size")
    resp = http("POST", f"{fleet.router_url}/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    assert resp.status == 200, resp.body[:300]

    # The autoscaler reads every engine (from /v1/loads or, without it, from /metrics).
    def read_all() -> dict | None:
        h = http("GET", f"{fleet.control_url}/autoscaler/health").json()
        return h if h["ticks"] > 0 and h["engines_read"] == INITIAL_ENGINES + 1 and h["engines_missing"] == 0 else None

    wait_until(read_all, 30, "the autoscaler to read every engine")

    # The trainer's distributed update through the manager, with or without
    # begin/end_weight_update; the manager then says the trainer's version.
    rank0 = StandInRank0()
    sync = DistributedWeightSync(fleet.client, join_group=rank0.join_group, broadcast=rank0.broadcast, timeout=30)
    result = sync.update("step-3", SPECS)
    assert result.layout.world_size == 1 + INITIAL_ENGINES + 1
    view = fleet.wait_engines(INITIAL_ENGINES + 1)
    for url in (e.url for e in view.with_status("ACTIVE")):
        info = http("GET", f"{url}/get_model_info").json()
        assert info["weight_version"] == "step-3", (url, info)
    assert fleet.client.weights().version == "step-3"
    assert {e.weight_version for e in view.engines} == {"step-3"}

    # A new engine starts on the trainer's version: copied from a running engine where the
    # release can send weights to a new instance (0.5.3 on); on 0.5.2 it waits out of routing
    # and the trainer's next update includes it.
    op = fleet.client.scale_out(num_replicas=INITIAL_ENGINES + 2)
    if release == "0.5.2":

        def waiting() -> bool:
            new = [e for e in fleet.engines().engines if e.status == "WEIGHT_SYNCING"]
            return bool(new) and "waiting for weight version step-3" in str(new[0].raw.get("detail"))

        wait_until(waiting, 60, "the new engine to wait for the trainer")
        assert fleet.client.operation("scale_out", op.request_id).status not in ("ACTIVE", "FAILED")
        next_update = sync.update("step-4", SPECS)
        assert next_update.layout.world_size == 1 + INITIAL_ENGINES + 2, "the waiting engine took part"
        expected = "step-4"
    else:
        expected = "step-3"
    assert fleet.client.wait_for_operation("scale_out", op.request_id, 60).status == "ACTIVE"
    fleet.track_children()
    view = fleet.wait_engines(INITIAL_ENGINES + 2)
    assert {e.weight_version for e in view.engines} == {expected}
    for url in (e.url for e in view.engines):
        assert http("GET", f"{url}/get_model_info").json()["weight_version"] == expected
    sync.close()
