"""Running generations move between engines (issue 31): a scale-in moves a draining engine's
requests to the engines that stay and cuts nothing; a stream whose engine dies continues on
another; at the end of a batch, requests on a busy engine move to an idle one (the tail). The
client sees one answer: every token once, the original prompt's count, spans of every part, and
where it ran (``meta_info.moves``, ``meta_info.engines``).

Real manager, real sglang-sim engines (time scale 1, 40 tokens/s) through the router. Tail
moves and preemption are opt-in (``--move-tail true``); the tests of other moves leave them off,
so that each sees only the moves it is about. Requests are greedy: the simulator's next token
is a function of the whole context, as a model's is, so a correct move gives exactly the answer
the request gets unmoved (:func:`unmoved_answer`), which the tests assert.
"""

from __future__ import annotations

import concurrent.futures
import http.client as httpclient
import itertools
import json
import os
import signal
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _checkpoints import write_checkpoint
from _support import ManagerHandle, StartManager, http, metric_total, wait_until
from test_drain import in_flight

BUDGET = 120
SLOW = (
    "--engine-arg=--time-scale=1",
    "--engine-arg=--decode-tokens-per-sec=40",
    "--scale-in-drain-timeout-secs",
    "300",
)
TAIL = (*SLOW, "--move-tail", "true")


def post(
    fleet: ManagerHandle, prompt: list[int], stream: bool, budget: int = BUDGET, headers: dict[str, str] | None = None
) -> tuple[httpclient.HTTPConnection, Any]:
    parsed = urllib.parse.urlsplit(fleet.router_url)
    conn = httpclient.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 80, timeout=120)
    body = {"input_ids": prompt, "stream": stream, "sampling_params": greedy(budget)}
    sent = {"Content-Type": "application/json", **(headers or {})}
    conn.request("POST", "/generate", body=json.dumps(body), headers=sent)
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:300]
    return conn, resp


def greedy(budget: int = BUDGET) -> dict[str, Any]:
    return {"max_new_tokens": budget, "ignore_eos": True, "temperature": 0}


def unmoved_answer(fleet: ManagerHandle, engine_id: str, prompt: list[int], budget: int = BUDGET) -> list[int]:
    """The answer `prompt` gets from one engine, asked directly (so never moved)."""
    body = {"input_ids": prompt, "sampling_params": greedy(budget)}
    answer = http("POST", f"{engine_of(fleet, engine_id).url}/generate", body, timeout=120).json()
    return [int(i) for i in answer["output_ids"]]


def events(resp: Any, on_event: Callable[[int], None] = lambda n: None) -> list[dict[str, Any]]:
    """A stream's events up to ``[DONE]``; ``on_event`` is told how many came so far."""
    out: list[dict[str, Any]] = []
    for line in resp:
        text = line.decode().strip()
        if text == "data: [DONE]":
            break
        if text.startswith("data:"):
            out.append(json.loads(text[len("data:") :]))
            on_event(len(out))
    assert out, "no event"
    return out


def generate(
    fleet: ManagerHandle,
    prompt: list[int],
    stream: bool,
    headers: dict[str, str] | None = None,
    budget: int = BUDGET,
) -> dict[str, Any]:
    """One `/generate` of `prompt` through the router: the final answer, and for a stream every
    event (each one's cumulative output ids, to check that none repeats or goes missing)."""
    conn, resp = post(fleet, prompt, stream, budget=budget, headers=headers)
    try:
        if not stream:
            return {"answer": json.loads(resp.read()), "events": []}
        got = events(resp)
        return {"answer": got[-1], "events": got}
    finally:
        conn.close()


def send(fleet: ManagerHandle, body: dict[str, Any]) -> dict[str, Any]:
    """One `/generate` of ``body`` through the router: the final answer, and for a stream every
    event."""
    parsed = urllib.parse.urlsplit(fleet.router_url)
    conn = httpclient.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 80, timeout=120)
    try:
        conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()[:300]
        if not body.get("stream"):
            return {"answer": json.loads(resp.read()), "events": []}
        got = events(resp)
        return {"answer": got[-1], "events": got}
    finally:
        conn.close()


def check_whole(result: dict[str, Any], prompt: list[int] | int, budget: int = BUDGET) -> None:
    """A complete answer of `budget` tokens to `prompt` (its ids, or its token count)."""
    answer = result["answer"]
    assert "error" not in answer, answer
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": budget}, meta
    assert len(answer["output_ids"]) == meta["completion_tokens"] == budget, meta
    assert meta["prompt_tokens"] == (prompt if isinstance(prompt, int) else len(prompt)), meta
    # Releases before 0.5.23 report spans only when the version changed; a moved answer always
    # has them (one per part).
    if "weight_versions" in meta or "moves" in meta:
        spans = meta["weight_versions"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == budget, spans
        assert all(a["end"] == b["start"] for a, b in itertools.pairwise(spans)), spans
    # A stream's events: each one's ids extend the previous one's, so no token repeats or is missing.
    previous: list[int] = []
    for event in result["events"]:
        ids = event["output_ids"]
        assert ids[: len(previous)] == previous, "an event rewrote earlier output"
        previous = ids


def engine_of(fleet: ManagerHandle, engine_id: str) -> Any:
    engine = fleet.engines().by_id(engine_id)
    assert engine is not None
    return engine


def test_a_scale_in_moves_running_requests_and_cuts_nothing(start_fleet: StartManager) -> None:
    fleet = start_fleet(*SLOW)
    op = fleet.client.scale_out(num_replicas=3)
    assert op.request_id is not None
    assert fleet.client.wait_for_operation("scale_out", op.request_id, 60).status == "ACTIVE"
    victim = "engine_2"
    prompts = [[100 + i, 7, 8, 9] for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(generate, fleet, p, i % 2 == 0) for i, p in enumerate(prompts)]
        wait_until(lambda: engine_of(fleet, victim).raw.get("in_flight", 0) >= 2, 30, "requests on the engine to go")
        op = fleet.client.scale_in(num_replicas=2)
        assert op.request_id is not None
        done = fleet.client.wait_for_operation("scale_in", op.request_id, 120)
        assert done.status == "COMPLETED", done
        results = [f.result(timeout=120) for f in futures]
    assert fleet.engines().by_id(victim) is None
    moved = [r for r in results if r["answer"]["meta_info"].get("moves")]
    assert len(moved) >= 2, [r["answer"]["meta_info"].get("engines") for r in results]
    for result, prompt in zip(results, prompts, strict=True):
        check_whole(result, prompt)
    for result in moved:
        meta = result["answer"]["meta_info"]
        assert [m["reason"] for m in meta["moves"]] == ["drain"], meta["moves"]
        assert meta["engines"][0] == victim and victim not in meta["engines"][1:], meta["engines"]
        assert 0 <= meta["moves"][0]["at_token"] < BUDGET
    # Moved or not, each answer is the one its request gets unmoved: every token once, in order.
    assert [r["answer"]["output_ids"] for r in results] == [unmoved_answer(fleet, "engine_0", p) for p in prompts]
    assert any(r["answer"]["meta_info"]["moves"][0]["at_token"] > 0 for r in moved), "a move mid-answer"
    unmoved = next(r for r in results if not r["answer"]["meta_info"].get("moves"))
    extra = set(moved[0]["answer"]["meta_info"]) - set(unmoved["answer"]["meta_info"])
    assert extra == {"moves", "engines"}, extra
    metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
    assert metric_total(metrics, 'rollout_router_moves_total{reason="drain"}') >= len(moved)


def test_the_tail_moves_requests_from_a_busy_engine_to_an_idle_one(start_fleet: StartManager) -> None:
    """Eight long requests run on two engines and none waits in the router; a third engine joins
    idle. The tail planner moves requests to it until no engine runs two more than another: each
    moved answer is whole and token-exact, says ``reason: tail`` and ran last on the new engine
    or where the plan left room, and the metric counts the moves."""
    fleet = start_fleet(*TAIL)
    budget = 480  # 12 s at 40 tokens/s: still running when the third engine is up
    prompts = [[300 + i, 5, 6, 7] for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(generate, fleet, p, i % 2 == 0, None, budget) for i, p in enumerate(prompts)]
        wait_until(
            lambda: sum(e.raw.get("in_flight", 0) for e in fleet.engines().engines) == len(prompts),
            30,
            "every request to run on an engine",
        )
        op = fleet.client.scale_out(num_replicas=3)
        assert op.request_id is not None
        assert fleet.client.wait_for_operation("scale_out", op.request_id, 60).status == "ACTIVE"
        results = [f.result(timeout=120) for f in futures]
    for result, prompt in zip(results, prompts, strict=True):
        check_whole(result, prompt, budget)
    moved = [r for r in results if r["answer"]["meta_info"].get("moves")]
    assert len(moved) >= 2, [r["answer"]["meta_info"].get("engines") for r in results]
    for result in moved:
        meta = result["answer"]["meta_info"]
        assert {m["reason"] for m in meta["moves"]} == {"tail"}, meta["moves"]
        assert len(meta["engines"]) == len(meta["moves"]) + 1, meta
        assert all(0 < m["at_token"] < budget for m in meta["moves"]), meta["moves"]
    assert any("engine_2" in r["answer"]["meta_info"]["engines"] for r in moved), [
        r["answer"]["meta_info"]["engines"] for r in moved
    ]
    metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
    assert metric_total(metrics, 'rollout_router_moves_total{reason="tail"}') >= len(moved)


def test_a_request_expected_much_longer_takes_the_slot_of_a_short_one(start_fleet: StartManager) -> None:
    """Every request asks for the same budget and stops at its own length (as in RL rollouts).
    The router learned that one prompt answers short and another long. Two requests of the short
    prompt (which run long this time) hold both slots (one per engine) when a request of the long
    prompt arrives: the planner preempts one of them, the long one takes its slot, and the
    preempted one continues from its output once a slot frees. Every answer is whole."""
    fleet = start_fleet(
        "--engine-arg=--time-scale=1",
        "--engine-arg=--decode-tokens-per-sec=200",
        "--engine-arg=--eos-prob=1",
        "--max-inflight-per-engine",
        "1",
        "--move-tail",
        "true",
    )
    short, long_ = [11, 12, 13], [21, 22, 23]

    def gen(prompt: list[int], length: int, stream: bool = False) -> dict[str, Any]:
        parsed = urllib.parse.urlsplit(fleet.router_url)
        conn = httpclient.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 80, timeout=120)
        body = {
            "input_ids": prompt, "stream": stream,
            "sampling_params": {"max_new_tokens": 4000, "min_new_tokens": length - 1},
        }  # fmt: skip
        try:
            conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()[:300]
            answer = events(resp)[-1] if stream else json.loads(resp.read())
        finally:
            conn.close()
        assert "error" not in answer, answer
        assert len(answer["output_ids"]) == answer["meta_info"]["completion_tokens"] == length, answer["meta_info"]
        return dict(answer["meta_info"])

    for prompt, length in ((short, 20), (short, 20), (long_, 1000)):
        gen(prompt, length)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        victims = [pool.submit(gen, short, 2000, stream) for stream in (False, True)]
        wait_until(
            lambda: sum(e.raw.get("in_flight", 0) for e in fleet.engines().engines) == 2,
            30,
            "both slots to be taken",
        )
        waiting = pool.submit(gen, long_, 400)
        long_meta = waiting.result(timeout=120)
        metas = [v.result(timeout=120) for v in victims]
    assert not long_meta.get("moves"), long_meta
    preempted = [m for m in metas if m.get("moves")]
    assert len(preempted) == 1, metas
    assert [m["reason"] for m in preempted[0]["moves"]] == ["preempt"], preempted[0]["moves"]
    assert 0 < preempted[0]["moves"][0]["at_token"] < 2000, preempted[0]["moves"]
    metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
    assert metric_total(metrics, 'rollout_router_moves_total{reason="preempt"}') == 1


def test_a_stream_whose_engine_dies_continues_on_another(start_fleet: StartManager) -> None:
    fleet = start_fleet(*SLOW)
    prompt = [5, 6, 7]
    conn, resp = post(fleet, prompt, stream=True)
    try:
        engine = engine_of(fleet, resp.getheader("x-rollout-engine-id") or "")

        def kill_after_five(n: int) -> None:
            if n == 5:
                os.kill(engine.pid, signal.SIGKILL)

        got = events(resp, kill_after_five)
    finally:
        conn.close()
    check_whole({"answer": got[-1], "events": got}, prompt)
    meta = got[-1]["meta_info"]
    assert [m["reason"] for m in meta["moves"]] == ["lost"], meta
    assert meta["engines"][0] == engine.engine_id and len(meta["engines"]) == 2, meta
    assert got[-1]["output_ids"] == unmoved_answer(fleet, meta["engines"][1], prompt)


def test_a_request_never_continues_on_another_weight_version(start_fleet: StartManager, tmp_path: Path) -> None:
    """During a rolling update one engine serves v1 while the other still runs a stream on the
    startup version. When that engine dies, the stream may not continue on v1 (one answer, one
    policy): with no engine on its version within --version-wait-secs, it ends with an error
    event the client can read, and no token of it came from v1."""
    # The kill fails the update (engine_1 dies in its turn), which restarts engine_0 on the
    # startup version: engines that take 4 s to start keep that restart well past the stream's
    # 1 s wait, so the stream finds no engine on its version.
    fleet = start_fleet(
        *SLOW,
        "--engine-arg=--startup-delay=4",
        "--version-wait-secs",
        "1",
        "--health-check-interval-secs",
        "0.5",
    )
    startup = fleet.client.weights()["version"]
    # The rolling update's first wave is engine_0 (engines in id order): the stream must run on
    # engine_1, so the update reaches it last.
    for attempt in range(8):
        conn, resp = post(fleet, [9, 8, 7, attempt], stream=True, budget=2000)
        if resp.getheader("x-rollout-engine-id") == "engine_1":
            break
        conn.close()
    else:
        raise AssertionError("no stream landed on engine_1")
    try:
        victim = engine_of(fleet, "engine_1")
        write_checkpoint(tmp_path / "v1", 1)
        update = fleet.client.publish_weights("v1", str(tmp_path / "v1"), strategy="rolling", max_unavailable=1)

        def other_on_v1() -> bool:
            other = engine_of(fleet, "engine_0")
            return other.status == "ACTIVE" and other.weight_version == "v1"

        def kill_when_other_on_v1(n: int) -> None:
            if n == 3:
                wait_until(other_on_v1, 60, "engine_0 to serve v1")
                os.kill(victim.pid, signal.SIGKILL)

        got = events(resp, kill_when_other_on_v1)
    finally:
        conn.close()
    last = got[-1]
    assert "error" in last, last
    assert "weight version" in last["error"]["message"] and startup in last["error"]["message"], last
    # Every event came from engine_1 on the startup version (a continuation's events would
    # carry `moves`).
    assert {e["meta_info"]["weight_version"] for e in got[:-1]} == {startup}, got[-2]["meta_info"]
    assert not any("moves" in e["meta_info"] for e in got[:-1]), got[-2]["meta_info"]
    ended = fleet.client.wait_for_weight_update(update["update_id"], 120)
    assert ended.status == "FAILED" and "engine_1" in (ended.error_message or ""), ended


def test_a_whole_answer_whose_version_is_gone_starts_over(start_fleet: StartManager, tmp_path: Path) -> None:
    """A non-streamed request ran on through an update (`in_place`), so it began on the startup
    version, which no engine serves after it. When its engine dies it cannot continue (one answer,
    one policy), but nothing of it reached the client: it starts over on the fleet's version,
    where it waited for a startup-version engine and failed with a 502 before."""
    fleet = start_fleet(*SLOW, "--restart-failed-engines", "false", "--version-wait-secs", "1")
    startup = fleet.client.weights()["version"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        body = {"input_ids": [5, 4, 3], "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
        answer = pool.submit(http, "POST", f"{fleet.router_url}/generate", body, timeout=120)
        wait_until(lambda: running_on(fleet) is not None, 30, "the request to run")
        victim = engine_of(fleet, running_on(fleet) or "")
        write_checkpoint(tmp_path / "v1", 1)
        update = fleet.client.publish_weights("v1", str(tmp_path / "v1"), strategy="all_at_once", pause_mode="in_place")
        ended = fleet.client.wait_for_weight_update(update["update_id"], 60)
        assert ended.status == "COMPLETED", ended
        assert in_flight(fleet, victim.engine_id) == 1 and not answer.done()
        os.kill(victim.pid, signal.SIGKILL)
        resp = answer.result(timeout=120)
    assert resp.status == 200, resp.body[:300]
    meta = resp.json()["meta_info"]
    # All of it from the second engine, on v1 only: the startup version's tokens were dropped.
    assert meta["completion_tokens"] == 600 == len(resp.json()["output_ids"])
    assert meta["weight_versions"] == [{"version": "v1", "start": 0, "end": 600}], meta
    assert meta["weight_version"] == "v1" != startup
    (move,) = meta["moves"]
    assert move["reason"] == "lost" and move["from"] == victim.engine_id and move["at_token"] == 0, move
    assert meta["engines"][-1] != victim.engine_id


def running_on(fleet: ManagerHandle) -> str | None:
    """The engine a request runs on, once one does."""
    return next((e.engine_id for e in fleet.engines().engines if int(e.raw.get("in_flight", 0)) > 0), None)


def test_partial_rollout_continues_across_an_all_at_once_update(start_fleet: StartManager, tmp_path: Path) -> None:
    """An `all_at_once` update aborts running requests (`pause_mode` abort). Those that ask for
    partial rollout continue on the new version from their output so far (one answer, spans of
    both versions); the others end with finish reason `abort`, as SGLang answers them."""
    fleet = start_fleet(*SLOW, "--engine-arg=--weight-load-delay=1")
    startup = fleet.client.weights()["version"]
    write_checkpoint(tmp_path / "v1", 1)
    partial = {"x-partial-rollout": "true"}
    cases = [(True, partial), (False, partial), (True, None), (False, None)]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        futures = [
            pool.submit(generate, fleet, [40 + i, 3, 2], stream, headers) for i, (stream, headers) in enumerate(cases)
        ]
        wait_until(
            lambda: sum(e.raw.get("in_flight", 0) for e in fleet.engines().engines) >= len(cases),
            30,
            "every request to run",
        )
        update = fleet.client.publish_weights("v1", str(tmp_path / "v1"), strategy="all_at_once")
        done = fleet.client.wait_for_weight_update(update["update_id"], 120)
        assert done["status"] == "COMPLETED", done
        results = [f.result(timeout=120) for f in futures]
    for i, ((_, headers), result) in enumerate(zip(cases, results, strict=True)):
        meta = result["answer"]["meta_info"]
        if headers is None:
            assert meta["finish_reason"]["type"] == "abort", meta
            assert result["answer"]["meta_info"]["completion_tokens"] < BUDGET, meta
            assert "moves" not in meta, meta
            continue
        check_whole(result, [40 + i, 3, 2])
        assert [m["reason"] for m in meta["moves"]] == ["weight_update"], meta
        versions = [span["version"] for span in meta["weight_versions"]]
        assert versions[0] == startup and versions[-1] == "v1", meta["weight_versions"]
    metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
    assert metric_total(metrics, 'rollout_router_moves_total{reason="weight_update"}') >= 2

    # A header that is neither true nor false is refused.
    bad = http("POST", f"{fleet.router_url}/generate", {"input_ids": [1]}, headers={"x-partial-rollout": "yes"})
    assert bad.status == 400 and bad.json()["error"]["code"] == "invalid_partial_rollout", bad.body[:200]


def test_moved_requests_keep_their_logprobs(start_fleet: StartManager) -> None:
    """RL trains on the rollout's logprobs: a moved answer has one output logprob per token, for
    the tokens it returns, and the prompt's logprobs of the original prompt."""
    fleet = start_fleet(*SLOW)
    op = fleet.client.scale_out(num_replicas=3)
    assert op.request_id is not None
    assert fleet.client.wait_for_operation("scale_out", op.request_id, 60).status == "ACTIVE"
    victim = "engine_2"
    prompts = [[200 + i, 5, 6, 7] for i in range(9)]

    def one(prompt: list[int], stream: bool) -> dict[str, Any]:
        body = {
            "input_ids": prompt, "stream": stream, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": BUDGET, "ignore_eos": True},
        }  # fmt: skip
        return send(fleet, body)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, p, i % 2 == 0) for i, p in enumerate(prompts)]
        wait_until(lambda: engine_of(fleet, victim).raw.get("in_flight", 0) >= 2, 30, "requests on the engine to go")
        op = fleet.client.scale_in(num_replicas=2)
        assert op.request_id is not None
        assert fleet.client.wait_for_operation("scale_in", op.request_id, 120).status == "COMPLETED"
        results = [f.result(timeout=120) for f in futures]
    moved = [r for r in results if r["answer"]["meta_info"].get("moves")]
    assert len(moved) >= 2, [r["answer"]["meta_info"].get("engines") for r in results]
    for result, prompt in zip(results, prompts, strict=True):
        check_whole(result, prompt)
        answer = result["answer"]
        meta = answer["meta_info"]
        output = meta["output_token_logprobs"]
        assert [entry[1] for entry in output] == answer["output_ids"], meta.get("moves")
        assert all(isinstance(entry[0], float) for entry in output)
        assert [entry[1] for entry in meta["input_token_logprobs"]] == prompt, meta.get("moves")


@pytest.mark.parametrize("release", ["0.5.23", "0.5.12"])
def test_text_prompts_move_with_the_ids_their_first_engine_made(start_fleet: StartManager, release: str) -> None:
    """A text prompt is tokenized once: the router asks the engine for the prompt's ids
    (`return_prompt_token_ids`, SGLang 0.5.15 and later) and a move continues from them. On a
    release without them (0.5.12) a streamed text request stays where it is until it ends, and a
    whole one starts again elsewhere: nothing is cut either way."""
    fleet = start_fleet(*SLOW, f"--engine-arg=--sglang-api={release}")
    op = fleet.client.scale_out(num_replicas=3)
    assert op.request_id is not None
    assert fleet.client.wait_for_operation("scale_out", op.request_id, 60).status == "ACTIVE"
    victim = "engine_2"
    texts = [f"question {i}: how many prime numbers are below {100 + i}?" for i in range(10)]
    counted = http(
        "POST",
        f"{engine_of(fleet, 'engine_0').url}/generate",
        {"text": texts[0], "sampling_params": {"max_new_tokens": 1}},
    ).json()["meta_info"]["prompt_tokens"]

    def one(i: int) -> dict[str, Any]:
        parsed = urllib.parse.urlsplit(fleet.router_url)
        conn = httpclient.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 80, timeout=120)
        stream = i % 2 == 0
        body = {"text": texts[i], "stream": stream, "sampling_params": {"max_new_tokens": BUDGET, "ignore_eos": True}}
        if i == 1:
            body["return_prompt_token_ids"] = True
        try:
            conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()[:300]
            # A stream's head names the engine it started on, a whole answer's the one it ended on.
            engine = resp.getheader("x-rollout-engine-id")
            if not stream:
                answer = json.loads(resp.read())
                return {"answer": answer, "events": [], "engine": answer["meta_info"].get("engines", [engine])[0]}
            got = events(resp)
            return {"answer": got[-1], "events": got, "engine": engine}
        finally:
            conn.close()

    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        futures = [pool.submit(one, i) for i in range(len(texts))]
        wait_until(lambda: engine_of(fleet, victim).raw.get("in_flight", 0) >= 3, 30, "requests on the engine to go")
        op = fleet.client.scale_in(num_replicas=2)
        assert op.request_id is not None
        assert fleet.client.wait_for_operation("scale_in", op.request_id, 120).status == "COMPLETED"
        results = [f.result(timeout=120) for f in futures]
    on_victim = [r for r in results if r["engine"] == victim]
    assert on_victim, [r["engine"] for r in results]
    for i, result in enumerate(results):
        answer = result["answer"]
        same_length = len(texts[i]) == len(texts[0])
        check_whole(result, counted if same_length else answer["meta_info"]["prompt_tokens"])
        # The ids the router asked for are shown only to the client that asked.
        if i == 1 and release == "0.5.23":
            assert len(answer["prompt_token_ids"]) == answer["meta_info"]["prompt_tokens"], answer
        else:
            assert "prompt_token_ids" not in answer, (i, sorted(answer))
            assert all("prompt_token_ids" not in e for e in result["events"]), i
    for result in on_victim:
        moves = result["answer"]["meta_info"].get("moves", [])
        if release == "0.5.23":
            assert [m["reason"] for m in moves] == ["drain"], result["answer"]["meta_info"]
        elif result["events"]:
            # No ids: a stream stays where it is until it ends.
            assert not moves, result["answer"]["meta_info"]
        else:
            # No ids: a whole answer starts again from the text elsewhere.
            assert [(m["reason"], m["at_token"]) for m in moves] == [("drain", 0)], result["answer"]["meta_info"]


def test_generation_in_chunks_joins_every_chunk_into_one_answer(start_fleet: StartManager) -> None:
    """With ``--chunk-tokens 32`` a request of 120 tokens runs as four parts (32, 32, 32 and the
    last 24), each after the one before it went back to the router's queue; with nothing else
    waiting each continues on the engine it ran on (its prefix cache holds the tokens), so no
    prefill is counted. The client sees one answer, whole and token-exact, for prompts of ids and
    of text, streamed or not; requests a continuation could change (stop strings) and requests
    of one chunk or less run in one part."""
    fleet = start_fleet(*SLOW, "--chunk-tokens", "32")
    texts = [f"chunked question {i}: what is {i} squared?" for i in range(2)]
    engine_url = engine_of(fleet, "engine_0").url
    one_token = [{"text": t, "sampling_params": {"max_new_tokens": 1}} for t in texts]
    counted = [http("POST", f"{engine_url}/generate", b).json()["meta_info"]["prompt_tokens"] for b in one_token]

    def text_request(i: int) -> dict[str, Any]:
        params = {"max_new_tokens": BUDGET, "ignore_eos": True}
        return send(fleet, {"text": texts[i], "stream": i == 0, "sampling_params": params})

    prompts = [[700 + i, 5, 6] for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        by_ids = [pool.submit(generate, fleet, p, i % 2 == 0) for i, p in enumerate(prompts)]
        by_text = [pool.submit(text_request, i) for i in range(len(texts))]
        short = pool.submit(generate, fleet, [800, 1], False, None, 32)
        results = [f.result(timeout=120) for f in by_ids]
        text_results = [f.result(timeout=120) for f in by_text]
        short_result = short.result(timeout=120)
    chunked = [*zip(results, prompts, strict=True), *zip(text_results, counted, strict=True)]
    for result, prompt in chunked:
        check_whole(result, prompt)
        meta = result["answer"]["meta_info"]
        assert [(m["reason"], m["at_token"]) for m in meta["moves"]] == [("chunk", 32), ("chunk", 64), ("chunk", 96)]
        assert len(meta["engines"]) == 4 and len(set(meta["engines"])) == 1, meta["engines"]
        assert len(meta["weight_versions"]) == 4, meta["weight_versions"]
        assert "prompt_token_ids" not in result["answer"], sorted(result["answer"])
        # A stream's events never end before the last chunk: one finish, at the end.
        finishes = [e["meta_info"]["finish_reason"] for e in result["events"] if e["meta_info"].get("finish_reason")]
        assert finishes in ([], [{"type": "length", "length": BUDGET}]), finishes
    check_whole(short_result, 2, 32)
    assert "moves" not in short_result["answer"]["meta_info"], short_result["answer"]["meta_info"]
    # Stop strings: a continuation would not see one that started in the chunk before.
    body = {"input_ids": [900, 1], "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "stop": ["@@@"]}}
    answer = http("POST", f"{fleet.router_url}/generate", body).json()
    assert answer["meta_info"]["completion_tokens"] == 64 and "moves" not in answer["meta_info"], answer["meta_info"]
    metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
    assert metric_total(metrics, 'rollout_router_moves_total{reason="chunk"}') == 3 * len(chunked)
    assert metric_total(metrics, "rollout_router_move_prefill_tokens_total") == 0


def test_a_chunk_goes_on_where_it_ran_unless_another_engine_is_idle(start_fleet: StartManager) -> None:
    """Two long requests generated in chunks share the one engine; a second engine joins, idle.
    At a chunk's end a request keeps its slot and engine, unless another engine is idle while its
    own runs another request: then one of the two continues there (and, alone there, stays)."""
    fleet = start_fleet(*SLOW, "--chunk-tokens", "32", "--rollout-num-gpus", "1", wait=False)
    fleet.wait_engines(1, "ACTIVE", 120, fail_on_failed=True)
    budget = 360  # 9 s at 40 tokens/s: still running when the second engine is up
    prompts = [[960 + i, 1, 2] for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(generate, fleet, p, i == 0, None, budget) for i, p in enumerate(prompts)]
        wait_until(lambda: engine_of(fleet, "engine_0").raw.get("in_flight", 0) == 2, 30, "both requests to run")
        op = fleet.client.scale_out(num_replicas=2)
        assert op.request_id is not None
        assert fleet.client.wait_for_operation("scale_out", op.request_id, 60).status == "ACTIVE"
        results = [f.result(timeout=120) for f in futures]
    engines = []
    for result, prompt in zip(results, prompts, strict=True):
        check_whole(result, prompt, budget)
        meta = result["answer"]["meta_info"]
        assert {m["reason"] for m in meta["moves"]} == {"chunk"}, meta["moves"]
        assert [m["at_token"] for m in meta["moves"]] == list(range(32, budget, 32)), meta["moves"]
        engines.append(meta["engines"])
    moved = [e for e in engines if "engine_1" in e]
    assert len(moved) == 1, engines
    # It went over once and stayed there; the other never left the first engine.
    went = moved[0]
    assert went[went.index("engine_1") :] == ["engine_1"] * (len(went) - went.index("engine_1")), went
    assert set(next(e for e in engines if e is not went)) == {"engine_0"}, engines
    metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
    assert metric_total(metrics, "rollout_router_move_prefill_tokens_total") > 0


def test_chunks_of_an_incremental_stream_carry_each_token_once(start_fleet: StartManager) -> None:
    """Engines that stream incrementally (`--incremental-streaming-output`: each event only the
    new tokens): a request generated in chunks of 32 streams 120 tokens in all, each once, the
    counts rising to 120 and one finish at the end; its whole twin answers 120 tokens joined."""
    fleet = start_fleet(*SLOW, "--engine-arg=--incremental-streaming-output", "--chunk-tokens", "32")
    # Both at once: once answers come back at their budget, the router takes budgets for the
    # lengths and stops cutting requests into chunks.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        twin = pool.submit(generate, fleet, [991, 4, 5], False)
        conn, resp = post(fleet, [990, 4, 5], True)
        try:
            got = events(resp)
        finally:
            conn.close()
        whole = twin.result(timeout=120)
    ids = [i for e in got for i in e["output_ids"]]
    assert len(ids) == BUDGET, (len(ids), [len(e["output_ids"]) for e in got])
    counts = [e["meta_info"]["completion_tokens"] for e in got]
    assert counts == sorted(counts) and counts[-1] == BUDGET, counts
    finishes = [e["meta_info"]["finish_reason"] for e in got if e["meta_info"].get("finish_reason")]
    assert finishes == [{"type": "length", "length": BUDGET}], finishes
    last = got[-1]["meta_info"]
    assert [m["reason"] for m in last["moves"]] == ["chunk"] * 3, last["moves"]
    assert last["prompt_tokens"] == 3 and last["weight_versions"][-1]["end"] == BUDGET, last
    check_whole(whole, [991, 4, 5])
    assert [m["at_token"] for m in whole["answer"]["meta_info"]["moves"]] == [32, 64, 96]


def test_a_client_abort_ends_a_request_between_or_within_chunks(start_fleet: StartManager) -> None:
    """After its first chunk a request's parts run under the router's own rids, and between two
    chunks it is on no engine: a client's `/abort_request` through the router (by its `rid`, or
    `abort_all` as slime sends at the end of a rollout) still ends it, with the output so far
    and finish reason `abort`, as SGLang ends an aborted request."""
    fleet = start_fleet(*SLOW, "--chunk-tokens", "32")
    budget = 2000  # 50 s at 40 tokens/s: far from done when it is aborted

    def one(rid: str, stream: bool) -> dict[str, Any]:
        params = {"max_new_tokens": budget, "ignore_eos": True}
        answer: dict[str, Any] = send(
            fleet, {"input_ids": [980, 1, 2], "rid": rid, "stream": stream, "sampling_params": params}
        )["answer"]
        return answer

    def chunk_moves() -> float:
        return metric_total(http("GET", f"{fleet.control_url}/metrics").body.decode(), "rollout_router_moves_total")

    for abort_body, stream in (({"rid": "rollout-7"}, False), ({"abort_all": True}, True)):
        before = chunk_moves()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(one, "rollout-7", stream)
            wait_until(lambda b=before: chunk_moves() >= b + 1, 30, "the request to pass its first chunk")
            assert http("POST", f"{fleet.router_url}/abort_request", abort_body).status == 200
            answer = future.result(timeout=30)
        meta = answer["meta_info"]
        assert meta["finish_reason"]["type"] == "abort", meta
        assert 32 <= meta["completion_tokens"] < budget, meta
        assert len(answer["output_ids"]) == meta["completion_tokens"], meta
        assert {m["reason"] for m in meta["moves"]} == {"chunk"}, meta["moves"]


def test_a_clients_abort_by_its_rid_reaches_a_request_that_moved(start_fleet: StartManager) -> None:
    """A moved request runs under a rid of the router's on its new engine; a client's abort by
    its own rid still ends it there, with the output so far, and ends nothing else (the
    simulator, as SGLang, aborts every rid that starts with the one named: rs-1 would end
    rs-10)."""
    fleet = start_fleet(*SLOW)
    op = fleet.client.scale_out(num_replicas=3)
    assert fleet.client.wait_for_operation("scale_out", op.request_id, 60).status == "ACTIVE"
    budget = 2000  # 50 s at 40 tokens/s: far from done when it is aborted
    rids = [f"rs-1{'0' * i}" for i in range(6)]  # rs-1, rs-10, rs-100, ...

    def one(i: int, rid: str) -> dict[str, Any]:
        body = {"input_ids": [700 + i, 1, 2], "rid": rid, "stream": i % 2 == 0, "sampling_params": greedy(budget)}
        return send(fleet, body)["answer"]

    with concurrent.futures.ThreadPoolExecutor(len(rids)) as pool:
        futures = {rid: pool.submit(one, i, rid) for i, rid in enumerate(rids)}
        wait_until(lambda: engine_of(fleet, "engine_2").raw.get("in_flight", 0) >= 2, 30, "requests on engine_2")
        done = fleet.client.wait_for_operation("scale_in", fleet.client.scale_in(num_replicas=2).request_id, 60)
        assert done.status == "COMPLETED", done
        for rid in rids[::2]:  # rs-1, rs-100, rs-10000
            assert http("POST", f"{fleet.router_url}/abort_request", {"rid": rid}).status == 200
        aborted = {rid: futures[rid].result(timeout=30) for rid in rids[::2]}
        # The others (rs-10, rs-1000, rs-100000) still generate: an abort of a prefix of their
        # rid did not end them.
        held = kv_held(fleet)
        wait_until(lambda: kv_held(fleet) >= held + 150, 30, "the other requests to go on generating")
        for rid in rids[1::2]:
            assert http("POST", f"{fleet.router_url}/abort_request", {"rid": rid}).status == 200
        answers = {**aborted, **{rid: futures[rid].result(timeout=30) for rid in rids[1::2]}}
    for rid, answer in answers.items():
        meta = answer["meta_info"]
        assert meta["id"] == rid, meta
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < budget, (rid, meta)
        assert len(answer["output_ids"]) == meta["completion_tokens"]
    moved = [rid for rid, a in answers.items() if a["meta_info"].get("moves")]
    assert moved, "a request was on the engine that left"


def kv_held(fleet: ManagerHandle) -> int:
    """KV tokens the fleet's engines hold now (prompts and output of what they run)."""
    total = 0
    for engine in fleet.engines().with_status("ACTIVE"):
        total += sum(int(x["num_used_tokens"]) for x in http("GET", f"{engine.url}/v1/loads").json()["loads"])
    return total


def test_a_request_a_continuation_would_change_never_moves(start_fleet: StartManager) -> None:
    """Stop strings (checked on the output ids only), grammars and output penalties would not
    survive a continuation: such a request stays on its draining engine until it ends (the
    drain waits for it), and one whose engine is lost ends with the output it had, finish
    abort saying why, instead of going on elsewhere."""
    fleet = start_fleet(*SLOW, "--restart-failed-engines", "false", "--routing-policy", "round_robin")
    op = fleet.client.scale_out(num_replicas=3)
    assert fleet.client.wait_for_operation("scale_out", op.request_id, 60).status == "ACTIVE"
    stop = {**greedy(200), "stop": "never-generated-words"}
    bodies = [{"input_ids": [600 + i, 1, 2], "stream": i % 2 == 0, "sampling_params": stop} for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(send, fleet, b) for b in bodies]
        wait_until(lambda: engine_of(fleet, "engine_2").raw.get("in_flight", 0) >= 2, 30, "requests on engine_2")
        done = fleet.client.wait_for_operation("scale_in", fleet.client.scale_in(num_replicas=2).request_id, 60)
        assert done.status == "COMPLETED", done
        answers = [f.result(timeout=60)["answer"] for f in futures]
    for answer in answers:
        assert "moves" not in answer["meta_info"], answer["meta_info"]
        assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    # A lost engine: the stop-string request ends with what it had; an ordinary one goes on.
    victim = engine_of(fleet, "engine_1")
    long = {**greedy(2000), "stop": "never-generated-words"}
    in_flight = lambda: sum(int(e.raw.get("in_flight", 0)) for e in fleet.engines().engines)  # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = []
        for i in range(4):
            # One at a time, so that round robin puts one of each kind on each engine.
            body = {"input_ids": [650 + i, 3], "stream": i % 2 == 0, "sampling_params": long if i < 2 else greedy(400)}
            futures.append(pool.submit(send, fleet, body))
            wait_until(lambda n=i + 1: in_flight() == n, 30, f"{i + 1} requests in flight")
        wait_until(lambda: sum(int(x["num_used_tokens"]) for x in http("GET", f"{victim.url}/v1/loads").json()["loads"])
                   > 400, 30, "output on engine_1")  # fmt: skip
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        answers = [f.result(timeout=60)["answer"] for f in futures]
    metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
    ended = 0
    for i, answer in enumerate(answers):
        meta = answer["meta_info"]
        on_victim = meta.get("engines", [None])[0] == "engine_1" or meta["finish_reason"]["type"] == "abort"
        if i < 2 and on_victim:
            ended += 1
            assert meta["finish_reason"]["type"] == "abort", meta
            assert "engine_1 was lost" in meta["finish_reason"]["message"], meta
            assert 0 < meta["completion_tokens"] == len(answer["output_ids"]) < 2000, meta
            assert not meta.get("moves") and meta["engines"] == ["engine_1"], meta
        elif i >= 2:
            assert meta["finish_reason"] == {"type": "length", "length": 400}, meta
    assert ended >= 1, [a["meta_info"].get("engines") for a in answers]
    assert metric_total(metrics, "rollout_router_ended_on_engine_loss_total") == ended
