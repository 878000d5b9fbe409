"""SGLang's distributed weight path driven by the trainer helper against real sim engines that
the manager started: group layout from the manager's ACTIVE engines, SGLang's call order, the
group rebuilt when engines join or leave, and failures that leave no engine paused or in a
session. The trainer's NCCL side is a stand-in rank 0 that accepts the engines' rendezvous."""

from __future__ import annotations

import pytest
from _support import STARTUP_TIMEOUT, ManagerHandle, StartManager, http
from _trainer import SPECS, StandInRank0

from elastic_rollout.trainer import DistributedWeightSync, TensorSpec, WeightSyncError, plan_layout


def engine_state(url: str) -> tuple[str, dict]:
    # The version is /model_info's: /server_info's top level is the startup configuration
    # (SGLang 0.5.23, http_server.py:863-891).
    version = http("GET", url + "/model_info").json()["weight_version"]
    return version, http("GET", url + "/server_info").json()["weight_sync"]


def make_sync(fleet: ManagerHandle, rank0: StandInRank0) -> DistributedWeightSync:
    return DistributedWeightSync(fleet.client, join_group=rank0.join_group, broadcast=rank0.broadcast, timeout=30)


def test_plan_layout_follows_sglangs_rank_rule() -> None:
    layout = plan_layout(
        [("e0", "u0", 2), ("e1", "u1", 1), ("e2", "u2", 4)], group_name="g", master_address="a", master_port=1
    )
    assert [m.rank_offset for m in layout.members] == [1, 3, 4]
    assert layout.world_size == 8
    with pytest.raises(ValueError):
        plan_layout([("e0", "u0", 0)], group_name="g", master_address="a", master_port=1)


def test_broadcast_reaches_every_active_engine_in_order(fleet: ManagerHandle) -> None:
    rank0 = StandInRank0()
    sync = make_sync(fleet, rank0)
    first = sync.update("step-1", SPECS)
    assert first.rebuilt and first.layout.world_size == 3
    assert rank0.broadcasts == [(first.layout.group_name, [s.name for s in SPECS])]
    for member in first.layout.members:
        version, ws = engine_state(member.url)
        assert version == "step-1"
        assert list(ws["weight_update_groups"]) == [first.layout.group_name]
        assert ws["weight_update_session"] is None, "the session was ended"
        assert http("GET", member.url + "/ready").status == 200, "generation was continued"
    out = http("POST", fleet.router_url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["weight_version"] == "step-1"

    # Same engines: the group is reused, nobody joins again.
    second = sync.update("step-2", SPECS)
    assert not second.rebuilt and second.layout == first.layout
    assert len(rank0.joined) == 1
    assert {engine_state(m.url)[0] for m in second.layout.members} == {"step-2"}
    sync.close()
    assert all(engine_state(m.url)[1]["weight_update_groups"] == {} for m in second.layout.members)


def test_group_is_rebuilt_when_engines_join_and_leave(fleet: ManagerHandle) -> None:
    rank0 = StandInRank0()
    sync = make_sync(fleet, rank0)
    before = sync.update("v1", SPECS).layout
    op = fleet.client.scale_out(num_replicas=4)
    assert fleet.client.wait_for_operation("scale_out", op.request_id, STARTUP_TIMEOUT).status == "ACTIVE"
    fleet.track_children()
    grown = sync.update("v2", SPECS)
    assert grown.rebuilt and grown.layout.group_name != before.group_name
    assert grown.layout.world_size == 5 and len(rank0.joined) == 2
    for m in grown.layout.members:
        version, ws = engine_state(m.url)
        assert version == "v2"
        assert list(ws["weight_update_groups"]) == [grown.layout.group_name], "the old group was destroyed"

    op = fleet.client.scale_in(num_replicas=2, force=True)
    assert fleet.client.wait_for_operation("scale_in", op.request_id, STARTUP_TIMEOUT).status == "COMPLETED"
    shrunk = sync.update("v3", SPECS)
    assert shrunk.rebuilt and shrunk.layout.world_size == 3 and len(rank0.joined) == 3
    assert [m.rank_offset for m in shrunk.layout.members] == [1, 2]
    assert {engine_state(m.url)[0] for m in shrunk.layout.members} == {"v3"}


def test_a_refused_update_touches_no_engine(fleet: ManagerHandle) -> None:
    rank0 = StandInRank0()
    sync = make_sync(fleet, rank0)
    with pytest.raises(WeightSyncError) as err:
        sync.update("bad", [TensorSpec("w", "complex128", (2,))])
    assert err.value.step == "open"
    assert err.value.failures[0].status == 400 and "dtype" in err.value.failures[0].message
    assert sync.layout is None and rank0.joined == []
    for e in fleet.engines().with_status("ACTIVE"):
        version, ws = engine_state(e.url)
        assert version == "default"
        assert ws["weight_update_groups"] == {} and ws["weight_update_session"] is None
        assert http("GET", e.url + "/ready").status == 200
    # Nothing is left half-done: the next update goes through.
    assert sync.update("good", SPECS).update is not None
    assert fleet.client.weights().version == "good"


def test_engines_with_tensor_parallelism_get_rank_ranges(start_fleet: StartManager) -> None:
    fleet = start_fleet("--gpus", "4", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2")
    rank0 = StandInRank0()
    sync = make_sync(fleet, rank0)
    layout = sync.update("tp", SPECS).layout
    assert [(m.tp_size, m.rank_offset) for m in layout.members] == [(2, 1), (2, 3)]
    assert layout.world_size == 5
    got = sorted((line["rank_offset"], line["tp_size"]) for line in rank0.joined[0])
    assert got == [(1, 2), (3, 2)]
