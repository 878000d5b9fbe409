"""The OpenAI routes (``/v1/chat/completions``, ``/v1/completions``) through the router, with
the official ``openai`` client: shapes, streaming, ``n``, output budgets, session and prompt
affinity, version pins, and a retry on another engine. Real manager, real sglang-sim engines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from _support import STARTUP_TIMEOUT, ManagerHandle, StartManager, http, metric_total, start_manager, stop_manager

ENGINES = 2
MODEL = "default"


@pytest.fixture(scope="module")
def fleet(manager_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagerHandle]:
    """One manager for the module's tests that leave the fleet as it is: 2 engines at v3."""
    handle = start_manager(
        manager_bin, tmp_path_factory.mktemp("openai_fleet"), ("--weight-version", "v3", "--version-wait-secs", "1")
    )
    try:
        handle.wait_engines(ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        yield handle
    finally:
        stop_manager(handle)


def client_for(fleet: ManagerHandle) -> openai.OpenAI:
    # No client-side retries: the router's own retries are under test.
    return openai.OpenAI(base_url=f"{fleet.router_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def client(fleet: ManagerHandle) -> openai.OpenAI:
    return client_for(fleet)


def router_metric(fleet: ManagerHandle, name: str) -> float:
    return metric_total(http("GET", f"{fleet.control_url}/metrics").body.decode(), name)


def served_version(response: Any) -> str:
    """The weight version SGLang reports in a response's ``metadata``."""
    return str(response.model_dump()["metadata"]["weight_version"])


def chat_on(client: openai.OpenAI, content: str, **kwargs: Any) -> tuple[str, Any]:
    """A chat completion and the id of the engine that answered it."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kwargs
    )
    return raw.headers["x-rollout-engine-id"], raw.parse()


def test_chat_and_completions_honour_their_budgets(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "count to ten"}],
        max_completion_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert chat.object == "chat.completion" and chat.model == MODEL
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 6
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 6
    # SGLang reports the weight version that served the request in `metadata`.
    assert served_version(chat) == "v3"
    # max_completion_tokens wins over the older max_tokens.
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "again"}],
        max_tokens=9,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    # Without ignore_eos the answer may end early, never late.
    done = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=5, temperature=0)
    assert done.object == "text_completion"
    assert done.usage is not None and done.usage.completion_tokens <= 5
    assert done.choices[0].finish_reason in ("stop", "length")
    assert served_version(done) == "v3"
    batch = client.completions.create(
        model=MODEL, prompt=["a b", "c d e"], max_tokens=4, extra_body={"ignore_eos": True}, logprobs=1
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in batch.choices)
    assert all(c.logprobs is not None and len(c.logprobs.tokens or []) == 4 for c in batch.choices)
    assert batch.usage is not None and (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (5, 8)


def test_streaming_chat_and_completions(client: openai.OpenAI) -> None:
    # Greedy, so the stream makes the plain answer's tokens: sampled ones are random, whatever the
    # seed, unless the engines run with --enable-deterministic-inference (as in SGLang).
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream"}], max_tokens=5, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    roles, parts, finishes, usage = [], [], [], None
    for chunk in stream:  # ends at `data: [DONE]`
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            parts += [c.delta.content] if c.delta.content else []
            finishes += [c.finish_reason] if c.finish_reason else []
        usage = chunk.usage or usage
    assert roles == ["assistant"]
    assert "".join(parts) == plain.choices[0].message.content
    assert finishes == [plain.choices[0].finish_reason]
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens  # type: ignore[union-attr]

    texts: dict[int, str] = {0: "", 1: ""}
    finished: dict[int, str] = {}
    for chunk in client.completions.create(
        model=MODEL, prompt="go", max_tokens=4, n=2, stream=True, extra_body={"ignore_eos": True}
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert finished == {0: "length", 1: "length"}
    assert all(len(t.split()) == 4 for t in texts.values()) and texts[0] != texts[1]


def test_n_samples_and_grpo_siblings_share_an_engine(fleet: ManagerHandle, client: openai.OpenAI) -> None:
    engine, chat = chat_on(client, "solve: 2+2", n=4, max_tokens=3, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in chat.choices}) == 4
    assert chat.usage is not None and chat.usage.completion_tokens == 12
    # Separate requests for one prompt (GRPO siblings, other seeds) follow the first one.
    kept = router_metric(fleet, 'rollout_router_affinity_total{outcome="kept"}')
    siblings = {chat_on(client, "solve: 2+2", seed=s, max_tokens=2)[0] for s in range(4)}
    assert siblings == {engine}
    assert router_metric(fleet, 'rollout_router_affinity_total{outcome="kept"}') >= kept + 4


def test_session_requests_stay_on_one_engine(client: openai.OpenAI) -> None:
    for session in ("alice", "bob", "carol"):
        engines = {
            chat_on(client, f"turn {turn} of {session}", max_tokens=2, extra_body={"session_params": {"id": session}})[
                0
            ]
            for turn in range(5)
        }
        assert len(engines) == 1, (session, engines)


def test_version_pins(client: openai.OpenAI) -> None:
    for pin in ("v3", {"exact_version": "v3"}, {"min_version": "v2"}):
        _, chat = chat_on(client, "pinned", max_tokens=1, extra_body={"weight_version": pin})
        assert served_version(chat) == "v3"
    # No engine serves v10: after --version-wait-secs the router answers 503 version_unavailable.
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, extra_body={"weight_version": {"min_version": "v10"}}
        )
    assert err.value.status_code == 503
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "version_unavailable", err.value.body


def test_errors_keep_sglangs_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[])
    assert isinstance(err.value.body, dict)
    assert err.value.body["object"] == "error" and err.value.body["message"] == "Messages cannot be empty."
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)


def test_a_request_on_a_hung_engine_is_answered_by_another(start_fleet: StartManager) -> None:
    fleet = start_fleet(
        "--engine-arg=--enable-fault-api",
        "--health-check-interval-secs", "0.5",
        "--health-check-timeout-secs", "1",
        "--health-failure-threshold", "2",
        "--restart-failed-engines", "false",
    )  # fmt: skip
    client = client_for(fleet)
    session = {"session_params": {"id": "retry-me"}}
    victim, _ = chat_on(client, "first", max_tokens=1, extra_body=session)
    engine = fleet.engines().by_id(victim)
    assert engine is not None
    assert http("POST", f"{engine.url}/sim/faults", {"hang": True}, timeout=5).status == 200
    retries = router_metric(fleet, "rollout_router_retries_total")
    # The session's engine no longer answers; once the manager takes it out of routing the
    # request goes to the other engine, and the client sees one normal answer.
    survivor, chat = chat_on(client, "second", max_tokens=3, extra_body={**session, "ignore_eos": True})
    assert survivor != victim
    assert chat.choices[0].finish_reason == "length"
    assert router_metric(fleet, "rollout_router_retries_total") == retries + 1
