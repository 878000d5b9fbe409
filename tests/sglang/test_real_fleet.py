"""The manager driving real SGLang 0.5.23 engines on CPU: what only the engine itself can show.

One fleet for the module (real engines take 30-40 s to start and 3-4 GB each), so the tests run
in order and each leaves it as the next expects: one initial engine of checkpoint ``a``, scaled
out to two; the fleet serving through the router (a client's rid is its own in the answer),
aborts by rid, disk publishes and pauses under load, a hung scheduler, a drain that moves
greedy requests, and the clean stop. SGLang aborts every request whose rid *starts with* the rid
an abort names, and its answers are exact: a correct continuation of a greedy request equals
what the engine generates from the prompt and the output so far.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _sglang import (
    MANAGER_ENGINE_ARGS,
    Call,
    Models,
    Rank0,
    alive,
    children,
    generate,
    greedy,
    process_name,
    request,
)
from _support import ManagerHandle, metric_total, start_manager, stop_manager, wait_until
from test_weights_resume import free_port

from elastic_rollout.trainer import DistributedWeightSync, TensorSpec

#: Two real engines start in 30-40 s alone; on 2 busy cores, allow much more.
START = 300.0
MODEL_NAME = "tiny"
ROUND_ROBIN = {"x-routing-policy": "round_robin"}


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    for child in children(pid):
        out += [child, *descendants(child)]
    return out


@pytest.fixture(scope="module")
def fleet(
    manager_bin: Path, sglang_py: Path, models: Models, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagerHandle]:
    args = (
        "--engine", "sglang", "--engine-program", str(sglang_py),
        "--model-path", str(models.a), "--model-name", MODEL_NAME,
        "--gpus", "2", "--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine", "1",
        *MANAGER_ENGINE_ARGS,
        "--engine-startup-timeout-secs", str(START),
        "--health-check-interval-secs", "1", "--health-check-timeout-secs", "5",
        "--health-failure-threshold", "2",
        "--scale-in-drain-timeout-secs", "120",
        "--weight-update-timeout-secs", "240",
    )  # fmt: skip
    trainer_port = free_port()
    handle = start_manager(
        manager_bin, tmp_path_factory.mktemp("real_fleet"), (*args, "--trainer-port", str(trainer_port)), base_args=()
    )
    handle.trainer_port = trainer_port
    seen: set[int] = set()
    try:
        handle.wait_engines(1, "ACTIVE", START, fail_on_failed=True)
        yield handle
    finally:
        seen.update(descendants(handle.process.pid))
        stop_manager(handle)
        left = [p for p in seen if alive(p)]
        assert not left, f"processes of the fleet outlived the manager: {[(p, process_name(p)) for p in left]}"


def active(fleet: ManagerHandle) -> list[Any]:
    return fleet.engines().with_status("ACTIVE")


def ids(i: int) -> list[int]:
    """A prompt of token ids of its own."""
    return [7 + i, 101 + 3 * i, 250 + i, 33, 500 + i]


def test_a_scale_out_starts_a_second_real_engine(fleet: ManagerHandle) -> None:
    accepted = fleet.client.scale_out(num_replicas=2, model_name=MODEL_NAME)
    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, START)
    assert op.status == "ACTIVE", op.raw
    engines = fleet.wait_engines(2, "ACTIVE", START)
    assert {e.engine_id for e in engines.engines} == {"engine_0", "engine_1"}


def test_generate_and_chat_through_the_router(fleet: ManagerHandle) -> None:
    engines = active(fleet)
    body = {"input_ids": ids(0), "sampling_params": greedy(16)}
    direct = [generate(e.url, body)["output_ids"] for e in engines]
    assert direct[0] == direct[1], "two engines of one checkpoint answer a greedy request alike"
    via = generate(fleet.router_url, body)
    assert via["output_ids"] == direct[0] and via["meta_info"]["completion_tokens"] == 16
    # A text prompt, whole and streamed.
    text = generate(fleet.router_url, {"text": "The fleet serves", "sampling_params": greedy(8)})
    assert len(text["output_ids"]) == 8 and text["text"]
    # The client's own rid is the answer's, in a whole answer and in every event of a stream.
    mine = generate(fleet.router_url, {**body, "rid": "client-7"})
    assert mine["meta_info"]["id"] == "client-7" and mine["output_ids"] == direct[0]
    stream = Call(f"{fleet.router_url}/generate", {**body, "rid": "client-8", "stream": True})
    stream.result()
    assert len(stream.events) >= 2 and {e["meta_info"]["id"] for e in stream.events} == {"client-8"}
    # OpenAI chat under the fleet's name; its id is the client's rid.
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
            "temperature": 0, "rid": "chat-1"}  # fmt: skip
    status, answer = request("POST", f"{fleet.router_url}/v1/chat/completions", chat)
    assert status == 200, answer
    assert answer["id"] == "chat-1" and answer["model"] == MODEL_NAME
    assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["message"]["content"]
    # The manager's metrics count the router's requests; each engine's own are scraped where the
    # service discovery says.
    _, metrics = request("GET", f"{fleet.control_url}/metrics")
    assert metric_total(metrics, "rollout_router_requests_total") >= 4
    assert metric_total(metrics, "rollout_engines") >= 2
    _, targets = request("GET", f"{fleet.control_url}/rollout/prometheus/targets")
    engine_metrics = [request("GET", f"http://{t}/metrics")[1] for group in targets for t in group["targets"]]
    assert len(engine_metrics) == 2
    assert all(metric_total(m, "sglang:prompt_tokens_total") > 0 for m in engine_metrics)


def test_an_abort_by_rid_ends_exactly_that_request(fleet: ManagerHandle) -> None:
    """rs-1 is a prefix of rs-10 and rs-100; SGLang would end all three for an abort of rs-1."""
    session = {"x-routing-policy": "session", "x-session-id": "abort-by-rid"}
    calls = {
        rid: Call(f"{fleet.router_url}/generate",
                  {"input_ids": ids(i), "sampling_params": greedy(300), "stream": True, "rid": rid}, session)
        for i, rid in enumerate(["rs-1", "rs-10", "rs-100"])
    }  # fmt: skip
    # And requests without a rid, one of which is aborted by the id its first event shows.
    anonymous = [
        Call(f"{fleet.router_url}/generate", {"input_ids": ids(10 + i), "sampling_params": greedy(300), "stream": True},
             session)
        for i in range(4)
    ]  # fmt: skip
    for call in [*calls.values(), *anonymous]:
        assert call.first.wait(120) and call.events, (call.status, call.answer, call.error)
    victim = anonymous[1].events[0]["meta_info"]["id"]
    assert len({c.events[0]["meta_info"]["id"] for c in anonymous}) == 4
    for rid in ("rs-1", victim):
        status, _ = request("POST", f"{fleet.router_url}/abort_request", {"rid": rid})
        assert status == 200
    for name, call in [*calls.items(), *((c.events[0]["meta_info"]["id"], c) for c in anonymous)]:
        end = call.result()
        finish = end["meta_info"]["finish_reason"]
        if name in ("rs-1", victim):
            assert finish["type"] == "abort", (name, finish)
            assert end["meta_info"]["completion_tokens"] < 300
        else:
            assert finish == {"type": "length", "length": 300}, (name, finish)
        assert end["meta_info"]["id"] == name


def publish(fleet: ManagerHandle, checkpoint: Path, version: str, **options: Any) -> None:
    accepted = fleet.client.publish_weights(version, str(checkpoint), **options)
    update = fleet.client.wait_for_weight_update(accepted.update_id, 240)
    assert update.status == "COMPLETED", update.raw


def answers(fleet: ManagerHandle, body: dict[str, Any]) -> list[list[int]]:
    return [generate(e.url, body)["output_ids"] for e in active(fleet)]


def test_a_disk_publish_switches_every_engine_to_the_checkpoint(fleet: ManagerHandle, models: Models) -> None:
    body = {"input_ids": ids(1), "sampling_params": greedy(24)}
    (of_a,) = {tuple(a) for a in answers(fleet, body)}
    publish(fleet, models.b, "b-1")
    for engine in active(fleet):
        assert request("GET", f"{engine.url}/model_info")[1]["weight_version"] == "b-1"
    (of_b,) = {tuple(a) for a in answers(fleet, body)}
    assert of_b != of_a, "checkpoint b answers otherwise than a"
    via = generate(fleet.router_url, body)
    assert tuple(via["output_ids"]) == of_b and via["meta_info"]["weight_version"] == "b-1"
    # SGLang now serves the model under the checkpoint's path; OpenAI requests under the fleet's
    # name still reach it (its /v1/responses refuses an unknown name with 404).
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, answer = request("POST", f"{fleet.router_url}/v1/chat/completions", chat)
    assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer
    status, answer = request(
        "POST", f"{fleet.router_url}/v1/responses", {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 4}
    )
    assert status == 200, answer
    publish(fleet, models.a, "a-2")
    assert {tuple(a) for a in answers(fleet, body)} == {of_a}


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes_under_load_during_an_update(fleet: ManagerHandle, models: Models, mode: str) -> None:
    before = fleet.client.weights().raw["version"]
    calls = [
        Call(f"{fleet.router_url}/generate",
             {"input_ids": ids(20 + i), "sampling_params": greedy(400), "stream": i % 2 == 0}, ROUND_ROBIN)
        for i in range(6)
    ]  # fmt: skip
    wait_until(lambda: sum(int(e.raw.get("in_flight", 0)) for e in active(fleet)) >= 6, 60, "6 requests running")
    # b, then a twice: the fleet ends on checkpoint a, which the trainer tests then change.
    checkpoint = models.b if mode == "abort" else models.a
    publish(fleet, checkpoint, f"{mode}-1", strategy="all_at_once", pause_mode=mode)
    ends = [c.result() for c in calls]
    for end in ends:
        meta = end["meta_info"]
        spans = [s["version"] for s in meta["weight_versions"]]
        if mode == "abort":
            # Ended by the update's abort with its output so far, or done before it.
            assert meta["finish_reason"]["type"] in ("abort", "length"), meta["finish_reason"]
            assert spans == [before], spans
        else:
            # Kept through the pause (or started after it): finished, on the new version after it.
            assert meta["finish_reason"] == {"type": "length", "length": 400}, meta["finish_reason"]
            assert spans[-1] == f"{mode}-1" and set(spans) <= {before, f"{mode}-1"}, spans
    if mode == "abort":
        assert any(e["meta_info"]["finish_reason"]["type"] == "abort" for e in ends)
    else:
        assert any(len(e["meta_info"]["weight_versions"]) == 2 for e in ends)


def test_a_hung_scheduler_leaves_routing_and_is_restarted(fleet: ManagerHandle) -> None:
    """SGLang's health check is a one-token generation of at least a second; a scheduler that
    hangs (SIGSTOP) fails it and the control request that tells a hang from a pause, so the
    engine leaves routing after --health-failure-threshold probes, the other engine serves,
    and after three times the threshold it is stopped (its processes reaped, the stopped one
    too) and started again."""
    victim = fleet.engines().by_id("engine_1")
    assert victim is not None and victim.pid is not None
    scheduler = next(p for p in children(victim.pid) if process_name(p).startswith("sglang::scheduler"))
    old = [victim.pid, *descendants(victim.pid)]
    os.kill(scheduler, signal.SIGSTOP)
    try:
        wait_until(
            lambda: fleet.engines().by_id("engine_1").status != "ACTIVE",  # type: ignore[union-attr]
            60,
            "the hung engine to leave routing",
        )
        # The other engine serves meanwhile.
        for i in range(3):
            assert generate(fleet.router_url, {"input_ids": ids(30 + i), "sampling_params": greedy(8)})
        restarted = wait_until(
            lambda: (e := fleet.engines().by_id("engine_1")) and e.status == "ACTIVE" and e.pid not in old and e,
            START,
            "the hung engine restarted and ACTIVE",
        )
    finally:
        if alive(scheduler):
            os.kill(scheduler, signal.SIGCONT)
    assert restarted.raw["restarts"] >= 1
    assert not [p for p in old if alive(p)], "the hung engine's processes were all stopped"


@pytest.fixture(scope="module")
def rank0(sglang_py: Path) -> Iterator[Rank0]:
    trainer = Rank0(sglang_py)
    try:
        yield trainer
    finally:
        trainer.close()


def gloo_sync(fleet: ManagerHandle, rank0: Rank0, checkpoint: Path) -> DistributedWeightSync:
    """Trainer updates through the manager from `rank0`, broadcasting `checkpoint`'s tensors."""
    return DistributedWeightSync(
        fleet.client,
        join_group=lambda layout: rank0.join(layout.master_address, layout.master_port, layout.world_size,
                                             layout.group_name),
        broadcast=lambda _layout, bucket: rank0.send(checkpoint, [s.name for s in bucket]),
        backend="gloo",
        timeout=240,
    )  # fmt: skip


def test_a_trainer_update_over_gloo_through_the_trainer_api(fleet: ManagerHandle, models: Models, rank0: Rank0) -> None:
    """The trainer broadcasts checkpoint b's tensors from its rank 0 (two buckets); the fleet then
    answers as checkpoint b does (a disk publish of b afterwards changes no answer)."""
    fleet.wait_engines(2, "ACTIVE", START)
    body = {"input_ids": ids(3), "sampling_params": greedy(24)}
    (before,) = {tuple(a) for a in answers(fleet, body)}
    specs = [TensorSpec(n, d, s) for n, d, s in rank0.tensors(models.b)]
    sync = gloo_sync(fleet, rank0, models.b)
    half = len(specs) // 2
    result = sync.update("trainer-b", buckets=[specs[:half], specs[half:]])
    assert not result.failed, result
    for engine in active(fleet):
        assert request("GET", f"{engine.url}/model_info")[1]["weight_version"] == "trainer-b"
    (after,) = {tuple(a) for a in answers(fleet, body)}
    assert after != before
    assert fleet.client.weights().raw["version"] == "trainer-b"
    publish(fleet, models.b, "b-disk")
    assert {tuple(a) for a in answers(fleet, body)} == {after}, "the trainer's broadcast was checkpoint b"
    sync.manager.destroy_trainer_group()


def test_slime_syncs_over_the_trainer_port_in_slimes_order(fleet: ManagerHandle, models: Models, rank0: Rank0) -> None:
    """slime's calls to an engine it did not launch, in slime's order, against the trainer port
    (the fleet as one SGLang engine), with its rank 0 over gloo."""
    port = fleet.trainer_port
    assert port, "the fleet serves a trainer port"
    url = f"http://127.0.0.1:{port}"
    body = {"input_ids": ids(4), "sampling_params": greedy(24)}
    (of_b,) = {tuple(a) for a in answers(fleet, body)}
    gpus = int(request("GET", f"{url}/server_info")[1]["num_gpus"])
    assert gpus == 2
    master = free_port()
    group = "slime-pp_0"
    init = {"master_address": "127.0.0.1", "master_port": master, "rank_offset": 1, "world_size": gpus + 1,
            "group_name": group, "backend": "gloo"}  # fmt: skip
    joining = Call(f"{url}/init_weights_update_group", init)
    rank0.join("127.0.0.1", master, gpus + 1, group)
    assert joining.result()["success"] is True
    specs = rank0.tensors(models.a)
    assert request("POST", f"{url}/pause_generation", {})[0] == 200
    assert request("GET", f"{url}/flush_cache")[0] == 200
    half = len(specs) // 2
    for bucket in (specs[:half], specs[half:]):
        update = {"names": [n for n, _, _ in bucket], "dtypes": [d for _, d, _ in bucket],
                  "shapes": [list(s) for _, _, s in bucket], "group_name": group, "flush_cache": False,
                  "weight_version": "7"}  # fmt: skip
        receiving = Call(f"{url}/update_weights_from_distributed", update)
        rank0.send(models.a, [n for n, _, _ in bucket])
        assert receiving.result()["success"] is True
    assert request("POST", f"{url}/continue_generation", {}, timeout=240)[0] == 200
    for engine in active(fleet):
        assert request("GET", f"{engine.url}/model_info")[1]["weight_version"] == "7"
    of_a = {tuple(a) for a in answers(fleet, body)}
    assert of_a != {of_b} and len(of_a) == 1
    assert request("POST", f"{url}/destroy_weights_update_group", {"group_name": group})[0] == 200


def test_a_drain_moves_greedy_requests_exactly_and_a_client_abort_reaches_them(fleet: ManagerHandle) -> None:
    """A scale-in moves the victim's running requests to the engine that stays. A greedy answer
    that moved keeps the unmoved answer up to the move, then equals what the remaining engine
    generates from the prompt and the output so far; no request is cut; and a client's abort by
    its own rid reaches a request after it moved (it runs under a rid of the router's there)."""
    fleet.wait_engines(2, "ACTIVE", START)
    victim, survivor = fleet.engines().by_id("engine_1"), fleet.engines().by_id("engine_0")
    assert victim is not None and survivor is not None
    n = 300
    bodies = [{"input_ids": ids(40 + i), "sampling_params": greedy(n), "stream": i % 2 == 1} for i in range(6)]
    # The unmoved answers, from the engine that is to go.
    unmoved = [generate(victim.url, {**b, "stream": False})["output_ids"] for b in bodies]
    calls = [Call(f"{fleet.router_url}/generate", b, ROUND_ROBIN) for b in bodies]
    # Long ones with rids of their clients', aborted once the drain is over.
    long = {
        f"mv-{i}": Call(f"{fleet.router_url}/generate",
                        {"input_ids": ids(60 + i), "sampling_params": greedy(2000), "stream": True, "rid": f"mv-{i}"},
                        ROUND_ROBIN)
        for i in range(4)
    }  # fmt: skip
    on_victim = lambda: int(fleet.engines().by_id("engine_1").raw.get("in_flight", 0))  # type: ignore[union-attr]  # noqa: E731
    wait_until(lambda: on_victim() >= 4, 60, "work on the victim")
    accepted = fleet.client.scale_in(num_replicas=1, model_name=MODEL_NAME)
    op = fleet.client.wait_for_operation("scale_in", accepted.request_id, 180)
    assert op.status == "COMPLETED", op.raw
    assert victim.pid is not None
    moved = moved_mid_answer = 0
    for body, call, reference in zip(bodies, calls, unmoved, strict=True):
        end = call.result()
        meta = end["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": n}, meta["finish_reason"]
        out = end["output_ids"]
        assert len(out) == n and meta["completion_tokens"] == n
        if not meta.get("moves"):
            continue
        moved += 1
        (move,) = meta["moves"]
        assert (move["reason"], move["from"], move["to"]) == ("drain", "engine_1", "engine_0"), move
        k = move["at_token"]
        assert 0 <= k < n, move
        moved_mid_answer += k > 0
        assert out[:k] == reference[:k], f"moved at {k}: the part before the move is the unmoved answer's"
        own = generate(survivor.url, {"input_ids": body["input_ids"] + out[:k], "sampling_params": greedy(n - k)})
        assert out[k:] == own["output_ids"], f"moved at {k}: the rest is the engine's own continuation"
    assert moved >= 1 and moved_mid_answer >= 1, "some request was running on the victim, with output"
    # Moved or not, every long one is ended by its client's abort, well before its budget.
    assert any(c.first.is_set() and c.events for c in long.values())
    for rid in long:
        assert request("POST", f"{fleet.router_url}/abort_request", {"rid": rid})[0] == 200
    ends = {rid: c.result(120) for rid, c in long.items()}
    for rid, end in ends.items():
        meta = end["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 2000, (rid, meta)
        assert meta["id"] == rid
    assert any(e["meta_info"].get("moves") for e in ends.values()), "an aborted request had moved"


def test_a_new_engine_waits_out_of_routing_until_a_trainer_update_reaches_it(
    fleet: ManagerHandle, models: Models, rank0: Rank0
) -> None:
    """The fleet serves a version the trainer broadcast. An engine a scale-out starts cannot copy
    it from a running engine on CPU (SGLang's remote-instance sender needs CUDA), so it waits out
    of routing, and the trainer's next update includes it; only then is it routable."""
    version = fleet.client.weights().raw["version"]
    assert version == "7", "the fleet serves the trainer port's version"
    accepted = fleet.client.scale_out(num_replicas=2, model_name=MODEL_NAME)

    def waiting() -> Any:
        new = [e for e in fleet.engines().engines if e.engine_id not in ("engine_0", "engine_1")]
        return new and new[0].status == "WEIGHT_SYNCING" and "waiting for weight version" in str(new[0].raw) and new[0]

    new = wait_until(waiting, START, "the new engine waiting for the trainer's version")
    for i in range(4):
        answered = Call(f"{fleet.router_url}/generate", {"input_ids": ids(70 + i), "sampling_params": greedy(4)})
        answered.result()
        assert answered.headers["x-rollout-engine-id"] == "engine_0", "the waiting engine is not routable"
    specs = [TensorSpec(n, d, s) for n, d, s in rank0.tensors(models.b)]
    sync = gloo_sync(fleet, rank0, models.b)
    result = sync.update("trainer-b-2", specs)
    assert not result.failed, result
    assert {m.engine_id for m in result.layout.members} == {"engine_0", new.engine_id}
    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, START)
    assert op.status == "ACTIVE", op.raw
    body = {"input_ids": ids(5), "sampling_params": greedy(24)}
    assert len({tuple(a) for a in answers(fleet, body)}) == 1
    for engine in active(fleet):
        assert request("GET", f"{engine.url}/model_info")[1]["weight_version"] == "trainer-b-2"
