"""One contract, two engines: every test here runs against ``sglang-sim`` and against SGLang 0.5.23
itself (on this machine's CPU, ``tests/_sglang.py``), with the same body.

SGLang is the contract: a test that passes on the real engine and fails on the simulator is a
simulator bug. Where the simulator knowingly differs, the test checks SGLang's fact on the real
engine and the simulator's entry in ``KNOWN_GAPS`` (of ``tests/test_sglang_contract.py``) on the
simulator, so a gap that gets fixed fails until its entry goes. The facts are cited as
``sglang==0.5.23: <path inside the wheel>:<line>``.

One engine of each kind serves the whole module (SGLang takes 30-40 s to start on 2 cores):
``--enable-metrics`` (the manager always passes it) and the flags of ``tests/_sglang.py``; the
simulator gets the same limits and ``--time-scale 0.1`` (fast, but with steps long enough that
requests are seen running). Tests wait on events (chunks arriving, loads changing) with
timeouts; where a test checks that something does *not* happen (a paused request does not
answer), it waits a bounded time longer than one health look of either engine (1 s on SGLang).
The tiny model's tokens do not matter here; what is compared is what SGLang makes exact.
"""

from __future__ import annotations

import http.client as http_client
import json
import math
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _sglang import make_models, sglang_python, start_sglang
from _support import ANSI_ESCAPE, file_tail, http, wait_until
from test_sglang_contract import (
    ENGINE_TYPE,
    GENERATE_FIELDS,
    KNOWN_GAPS,
    LOAD_CORE_KEYS,
    LOAD_FIELDS_READ,
    LOAD_SECTIONS,
    LOADS_TOP_KEYS,
    METRICS,
    MODEL_INFO_KEYS,
    NEWEST,
    SAMPLING_PARAMS,
    SCHEMA_ONLY,
    SERVER_INFO_0_5_23,
    SERVER_INFO_READ,
    SERVER_INFO_STATUS,
    SIM_MODEL_INFO_EXTENSIONS,
    UNKNOWN_FIELD_MESSAGE,
)

from elastic_rollout._find import find_binary

BACKENDS = ("sim", "sglang")
SIM_TIME_SCALE = "0.1"
#: The tiny model's context is 4096 tokens (tests/sglang_cpu/make_model.py); a budget that no
#: test lets run to its end.
LONG = 3000
WAIT = 120.0
#: Longer than one health look on either engine (SGLang looks once a second).
QUIET = 2.5

# -- facts --------------------------------------------------------------------------------------
#: sglang==0.5.23: sglang/srt/managers/schedule_batch.py:332-345 (FINISH_ABORT(), a running request).
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
#: .../managers/tokenizer_manager.py:3596-3600 (the front end's answer for a waiting request).
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}
#: ... whose meta_info is only these (:3601-3618).
WAITING_ABORT_META = {"id", "finish_reason", "weight_version", "e2e_latency", "weight_versions", "completion_tokens"}
#: .../managers/scheduler_components/output_streamer.py:49 (SGLANG_FORCE_STREAM_INTERVAL's default).
FORCE_STREAM_INTERVAL = 50
#: .../entrypoints/http_server.py:1025-1040; .../managers/scheduler_components/flush_wrapper.py:59-64.
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_FAILED = "Flush cache failed.\n"
FLUSH_TIMED_OUT = "Timed out waiting for idle state."
#: .../managers/scheduler_components/weight_updater.py:192-197.
OUTSIDE_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
#: Response keys: tokenizer_manager.py:2665-2674.
RESPONSE_KEYS = {"text", "output_ids", "meta_info"}
#: meta_info keys the manager and router read (rust/rollout-core/src/moves.rs,
#: rust/rollout-manager/src/adapters/router/moving.rs, ops/weight_update.rs): tokenizer_manager.py:2507-2568.
META_READ = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
             "weight_versions", "num_retractions", "e2e_latency"}  # fmt: skip
#: GenerateReqInput fields the real engine is not sent: custom_labels kills SGLang 0.5.23 with
#: --enable-metrics (see GENERATE_FIELDS in tests/test_sglang_contract.py).
FIELDS_NOT_SENT = {"custom_labels"}
#: Values SGLang refuses for reasons of their own: `n: null` is a 500 (a None compared with an
#: int), and the contract file's structural_tag "{}" is not a grammar; both keys are accepted.
SAMPLING_VALUES_REFUSED: list[tuple[str, Any]] = [("n", None), ("structural_tag", "{}")]
#: meta_info keys SGLang sends and the simulator does not (test_sglang_contract.KNOWN_GAPS).
SIM_META_MISSING: set[str] = KNOWN_GAPS["meta_info missing"]


# -- the engines --------------------------------------------------------------------------------


@dataclass
class EngineUnderTest:
    """One running engine of either kind, with the calls the tests make."""

    kind: str
    url: str
    log: Path
    stops: list[Callable[[], None]] = field(default_factory=list)

    def get(self, path: str) -> Any:
        resp = http("GET", self.url + path, timeout=WAIT)
        assert resp.status == 200, (path, resp.status, resp.body[:300])
        return resp.json()

    def post(self, path: str, body: Any, timeout: float = WAIT) -> tuple[int, Any]:
        resp = http("POST", self.url + path, body, timeout=timeout)
        try:
            return resp.status, resp.json()
        except ValueError:
            return resp.status, resp.body.decode()

    def generate(self, body: dict[str, Any]) -> Any:
        status, out = self.post("/generate", body)
        assert status == 200, (body, status, out)
        return out

    def load(self) -> dict[str, Any]:
        loads: dict[str, Any] = self.get("/v1/loads")["loads"][0]
        return loads

    def fact(self, sglang: Any, gap: Any) -> Any:
        """SGLang's fact on the real engine; the simulator's known gap on the simulator."""
        return sglang if self.kind == "sglang" else gap


def _start_sim(log: Path) -> EngineUnderTest:
    binary = find_binary("sglang-sim")
    argv = [str(binary), "--model-path", "contract-model", "--host", "127.0.0.1", "--port", "0",
            "--enable-metrics", "--max-total-tokens", "16384", "--context-length", "4096",
            "--skip-server-warmup", "--time-scale", SIM_TIME_SCALE]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)

    def stop() -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def listening() -> str | None:
        match = re.search(r"sglang-sim listening on (http://127\.0\.0\.1:\d+)", ANSI_ESCAPE.sub("", log.read_text()))
        if process.poll() is not None:
            raise AssertionError(f"sglang-sim exited with {process.returncode}:\n{file_tail(log)}")
        return match[1] if match else None

    try:
        url = wait_until(listening, 20, "sglang-sim to listen")
        wait_until(lambda: http("GET", url + "/health").status == 200, 20, f"{url}/health")
    except BaseException:
        stop()
        raise
    return EngineUnderTest("sim", url, log, [stop])


def _start_real(directory: Path) -> EngineUnderTest:
    python = sglang_python()
    models = make_models(python, directory / "models")
    log = directory / "sglang.log"
    server = start_sglang(python, models.a, log, "--enable-metrics")
    return EngineUnderTest("sglang", server.url, log, [server.stop])


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineUnderTest]:
    directory = tmp_path_factory.mktemp(request.param)
    started = _start_sim(directory / "sim.log") if request.param == "sim" else _start_real(directory)
    try:
        yield started
    finally:
        for stop in started.stops:
            stop()


# -- streams ------------------------------------------------------------------------------------


class Stream:
    """A streamed /generate read in a thread of its own: its chunks as they come."""

    def __init__(self, engine: EngineUnderTest, body: dict[str, Any]) -> None:
        host, port = engine.url.removeprefix("http://").split(":")
        self.conn = http_client.HTTPConnection(host, int(port), timeout=WAIT)
        self.conn.request(
            "POST", "/generate", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
        )
        response = self.conn.getresponse()
        assert response.status == 200, response.read()[:300]
        self.chunks: list[dict[str, Any]] = []
        self.done = threading.Event()
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(response,), daemon=True)
        self.thread.start()

    def _read(self, response: http_client.HTTPResponse) -> None:
        try:
            self._read_lines(response)
        except (OSError, ValueError, AttributeError, http_client.HTTPException):
            pass  # the stream was cut (closed by the test)
        finally:
            self.done.set()
            with self.changed:
                self.changed.notify_all()

    def _read_lines(self, response: http_client.HTTPResponse) -> None:
        for line in response:
            text = line.decode().strip()
            if not text.startswith("data:"):
                continue
            payload = text.removeprefix("data:").strip()
            with self.changed:
                if payload == "[DONE]":
                    self.done.set()
                else:
                    self.chunks.append(json.loads(payload))
                self.changed.notify_all()

    def tokens(self) -> int:
        """Output tokens received so far (chunks hold the whole output so far)."""
        with self.changed:
            return len(self.chunks[-1]["output_ids"]) if self.chunks else 0

    def wait_tokens(self, n: int) -> int:
        with self.changed:
            ok = self.changed.wait_for(lambda: self.done.is_set() or self.tokens() >= n, WAIT)
        assert ok and self.tokens() >= n, f"stream reached {self.tokens()} tokens, wanted {n}"
        return self.tokens()

    def finish(self) -> dict[str, Any]:
        """The final chunk, once the stream ended."""
        assert self.done.wait(WAIT), "stream did not end"
        self.thread.join(WAIT)
        final: dict[str, Any] = self.chunks[-1]
        assert final["meta_info"]["finish_reason"] is not None, final
        return final

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def streams() -> Iterator[Callable[[EngineUnderTest, dict[str, Any]], Stream]]:
    """``streams(engine, body)`` starts a stream; every stream is closed at the end of the test."""
    opened: list[Stream] = []

    def start(engine: EngineUnderTest, body: dict[str, Any]) -> Stream:
        opened.append(Stream(engine, body))
        return opened[-1]

    try:
        yield start
    finally:
        for s in opened:
            s.close()


class Call:
    """A blocking call made in a thread, to see whether (and what) it answers."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.answered = threading.Event()
        threading.Thread(target=self._run, args=(fn,), daemon=True).start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as err:
            self.error = err
        finally:
            self.answered.set()

    def value(self) -> Any:
        assert self.answered.wait(WAIT), "no answer"
        if self.error is not None:
            raise self.error
        return self.result


def long_body(rid: str, **extra: Any) -> dict[str, Any]:
    return {"text": f"contract {rid}", "rid": rid, **extra,
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "temperature": 0}}  # fmt: skip


def running(engine: EngineUnderTest, n: int) -> None:
    wait_until(lambda: engine.load()["num_running_reqs"] >= n, WAIT, f"{n} running requests")


def idle(engine: EngineUnderTest) -> None:
    """Ends whatever runs and waits until nothing does (between tests)."""
    engine.post("/abort_request", {"abort_all": True})
    wait_until(lambda: http("POST", engine.url + "/flush_cache", timeout=WAIT).status == 200, WAIT, "an idle engine")


@pytest.fixture(autouse=True)
def leave_idle(engine: EngineUnderTest) -> Iterator[None]:
    yield
    engine.post("/continue_generation", {})
    idle(engine)


# -- 1. what /generate answers ------------------------------------------------------------------


def test_an_answer_has_the_keys_the_manager_reads(engine: EngineUnderTest) -> None:
    body = {"text": "hello world", "return_logprob": True, "return_prompt_token_ids": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    out = engine.generate(body)
    assert set(out) == RESPONSE_KEYS | {"prompt_token_ids"}
    meta = out["meta_info"]
    assert META_READ <= set(meta), META_READ - set(meta)
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["completion_tokens"], len(out["output_ids"])) == (4, 4)
    assert meta["prompt_tokens"] == len(out["prompt_token_ids"])
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 4}]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == out["output_ids"]
    assert SIM_META_MISSING - set(meta) == engine.fact(set(), SIM_META_MISSING)

    chunks: list[dict[str, Any]] = []
    stream = Stream(engine, body)
    try:
        stream.finish()
        chunks = stream.chunks
    finally:
        stream.close()
    assert all(set(c) == RESPONSE_KEYS | {"prompt_token_ids"} for c in chunks)
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["output_ids"] == out["output_ids"], "greedy: the stream makes the same tokens"


def test_parallel_samples_run_under_fresh_rids(engine: EngineUnderTest) -> None:
    """With n > 1 every sample gets a new rid, whatever the client sent (sglang==0.5.23:
    .../managers/tokenizer_manager.py:2160-2180, .../managers/io_struct.py:382-388), so the
    client's rid names none of them."""
    body = {"text": "samples", "rid": "client-rid", "sampling_params": {"max_new_tokens": 2, "n": 2}}
    ids = [out["meta_info"]["id"] for out in engine.generate(body)]
    assert len(set(ids)) == 2 and not any(i.startswith("client-rid") for i in ids), ids


def test_stream_interval_spaces_the_chunks(engine: EngineUnderTest, streams: Callable[..., Stream]) -> None:
    """A stream sends its first token at once, then whenever `stream_interval` tokens are unsent
    (sglang==0.5.23: .../scheduler_components/output_streamer.py:455-472; sampling_params.py:177);
    the end sends the rest. SGLang's front end may merge chunks that queue up (tokenizer_manager.py
    :1983-1998), so what holds is the lengths a chunk can have, not their number."""
    base = {"text": "spacing", "sampling_params": {"max_new_tokens": 14, "ignore_eos": True, "temperature": 0}}
    for interval, lengths in ((4, {1, 5, 9, 13}), (1000, {1})):
        params = {**base["sampling_params"], "stream_interval": interval}
        s = streams(engine, {**base, "sampling_params": params})
        s.finish()
        counts = [len(c["output_ids"]) for c in s.chunks]
        assert counts[-1] == 14 and counts[0] == 1, counts
        assert set(counts[:-1]) <= lengths and counts == sorted(set(counts)), (interval, counts)
    s = streams(engine, base)
    s.finish()
    assert len(s.chunks) > 2, "the default interval (1) sends more than the first and last"


def test_a_continuation_produces_what_the_original_produced(engine: EngineUnderTest) -> None:
    """Greedy decoding of prompt + the first k output tokens gives the original's tokens after k,
    exactly; its logprobs (and the prompt logprobs of those k tokens) match the original's at the
    same positions: exactly on the simulator, up to float noise between a prefill and a decode
    step on SGLang's CPU kernels."""
    params = {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0}
    first = engine.generate({"text": "The quick brown fox", "return_prompt_token_ids": True,
                             "return_logprob": True, "sampling_params": params})  # fmt: skip
    prompt, whole = first["prompt_token_ids"], first["output_ids"]
    lps = [e[0] for e in first["meta_info"]["output_token_logprobs"]]
    tolerance = engine.fact(1e-2, 0.0)
    for k in (1, 8, 16):
        body = {"input_ids": prompt + whole[:k], "return_logprob": True, "logprob_start_len": len(prompt),
                "sampling_params": {**params, "max_new_tokens": 24 - k}}  # fmt: skip
        rest = engine.generate(body)
        assert rest["output_ids"] == whole[k:], k
        meta = rest["meta_info"]
        assert all(
            math.isclose(e[0], lp, abs_tol=tolerance)
            for e, lp in zip(meta["output_token_logprobs"], lps[k:], strict=True)
        )
        # From logprob_start_len on; the first one returned is always None
        # (managers/scheduler_components/logprob_result_processor.py:26-39).
        moved = meta["input_token_logprobs"]
        assert [e[1] for e in moved] == whole[:k] and moved[0][0] is None
        assert all(math.isclose(e[0], lp, abs_tol=tolerance) for e, lp in zip(moved[1:], lps[1:k], strict=True))


def test_sampling_seed_counts_only_with_deterministic_inference(engine: EngineUnderTest) -> None:
    """Without --enable-deterministic-inference sampled tokens are random, sampling_seed or not
    (sglang==0.5.23: sampling/sampling_batch_info.py:157-170)."""
    sampled = {"text": "seeded", "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 7}}
    a, b = engine.generate(sampled)["output_ids"], engine.generate(sampled)["output_ids"]
    assert a != b
    greedy = {"text": "seeded", "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0}}
    assert engine.generate(greedy)["output_ids"] == engine.generate(greedy)["output_ids"]


# -- 2. aborts ----------------------------------------------------------------------------------


def test_an_abort_reaches_every_rid_with_that_prefix_if_its_rid_is_open(
    engine: EngineUnderTest, streams: Callable[..., Stream]
) -> None:
    """The front end forwards {"rid": X} only when X is an open request's rid (tokenizer_manager.py
    :2241-2265); the scheduler aborts every request whose rid starts with X (scheduler.py:5675-5815).
    A running request ends after one more step with FINISH_ABORT (schedule_batch.py:332-345)."""
    s = {rid: streams(engine, long_body(rid)) for rid in ("abc-1", "abc-10", "xyz-1")}
    seen = {rid: st.wait_tokens(1) for rid, st in s.items()}
    assert engine.post("/abort_request", {"rid": "abc"}) == (200, "")
    for rid, st in s.items():
        st.wait_tokens(seen[rid] + 3)  # nothing was aborted: all go on
    assert engine.post("/abort_request", {"rid": "abc-1"}) == (200, "")
    for rid in ("abc-1", "abc-10"):
        assert s[rid].finish()["meta_info"]["finish_reason"] == ABORTED, rid
    ended = s["xyz-1"].tokens()
    s["xyz-1"].wait_tokens(ended + 3)
    assert not s["xyz-1"].done.is_set()
    assert engine.post("/abort_request", {"rid": "xyz-1"}) == (200, "")
    assert s["xyz-1"].finish()["meta_info"]["finish_reason"] == ABORTED


def test_an_aborted_running_request_gets_one_more_token(
    engine: EngineUnderTest, streams: Callable[..., Stream]
) -> None:
    """Paused in place, a request makes no step; aborted then, it ends only after
    continue_generation, with one token more than it had (scheduler.py:5803-5815, :5817-5832;
    schedule_batch.py:2007-2013)."""
    s = streams(engine, long_body("one-more"))
    s.wait_tokens(2)
    assert engine.post("/pause_generation", {"mode": "in_place"})[0] == 200
    assert engine.post("/abort_request", {"rid": "one-more"}) == (200, "")
    assert not s.done.wait(QUIET), "ended while paused in place"
    before = s.tokens()
    assert engine.post("/continue_generation", {})[0] == 200
    final = s.finish()
    assert final["meta_info"]["finish_reason"] == ABORTED
    assert len(final["output_ids"]) == final["meta_info"]["completion_tokens"] == before + 1


# -- 3. pauses seen by a running request --------------------------------------------------------


def test_pause_abort_ends_running_requests_and_holds_new_ones(engine: EngineUnderTest) -> None:
    running_call = Call(lambda: engine.post("/generate", long_body("paused-abort")))
    running(engine, 1)
    assert engine.post("/pause_generation", {"mode": "abort"}) == (
        200,
        {"message": "Generation paused successfully.", "status": "ok"},
    )
    status, out = running_call.value()
    assert status == 200 and out["meta_info"]["finish_reason"] == ABORTED
    held = Call(lambda: engine.generate({"text": "held", "sampling_params": {"max_new_tokens": 2}}))
    assert not held.answered.wait(QUIET), "a new request ran while paused"
    assert http("GET", engine.url + "/ready").status == 503
    assert http("GET", engine.url + "/ping").status == 200, "paused is still healthy"
    assert engine.post("/continue_generation", {})[0] == 200
    assert held.value()["meta_info"]["finish_reason"]["type"] in ("length", "stop")


def test_pause_in_place_holds_the_answer_until_continue(engine: EngineUnderTest) -> None:
    call = Call(lambda: engine.post("/generate", long_body("paused-in-place")))
    running(engine, 1)
    assert engine.post("/pause_generation", {"mode": "in_place"})[0] == 200
    assert engine.post("/abort_request", {"rid": "paused-in-place"}) == (200, "")
    assert not call.answered.wait(QUIET), "answered while paused in place"
    assert engine.post("/continue_generation", {})[0] == 200
    status, out = call.value()
    assert status == 200 and out["meta_info"]["finish_reason"] == ABORTED


def test_pause_retract_sends_a_retracted_request_back_to_the_queue(
    engine: EngineUnderTest, streams: Callable[..., Stream]
) -> None:
    """Retracted requests wait in the queue without KV (scheduler.py:5834-5900). Aborted there, a
    request is answered by the front end from what it had received (tokenizer_manager.py:3577-3640):
    a non-streamed one its output up to the last multiple of 50 tokens (output_streamer.py:474-476),
    a stream what it streamed; continued, a stream goes on with num_retractions 1."""
    plain = Call(lambda: engine.post("/generate", long_body("retract-plain")))
    kept = streams(engine, long_body("retract-stream"))
    dropped = streams(engine, long_body("retract-dropped"))
    for s in (kept, dropped):
        s.wait_tokens(2 * FORCE_STREAM_INTERVAL + 5)
    assert engine.post("/pause_generation", {"mode": "retract"})[0] == 200
    assert engine.post("/abort_request", {"rid": "retract-plain"}) == (200, "")
    status, out = plain.value()
    assert status == 200
    meta = out["meta_info"]
    assert meta["finish_reason"] == ABORTED_WAITING
    assert set(meta) - {"response_sent_to_client_ts"} == WAITING_ABORT_META
    n = meta["completion_tokens"]
    assert n >= FORCE_STREAM_INTERVAL and n % FORCE_STREAM_INTERVAL == 0 and len(out["output_ids"]) == n
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": n}]

    # A token sent just before the pause may still be on its way to the reader: the answer repeats
    # what the stream carried up to it, at least what had arrived when the abort was sent.
    streamed = dropped.tokens()
    assert engine.post("/abort_request", {"rid": "retract-dropped"}) == (200, "")
    final = dropped.finish()
    assert final["meta_info"]["finish_reason"] == ABORTED_WAITING
    carried = len(dropped.chunks[-2]["output_ids"])
    assert len(final["output_ids"]) == final["meta_info"]["completion_tokens"] == carried >= streamed

    at_pause = kept.tokens()
    assert not kept.done.is_set()
    assert engine.post("/continue_generation", {})[0] == 200
    kept.wait_tokens(at_pause + 3)
    assert engine.post("/abort_request", {"rid": "retract-stream"}) == (200, "")
    final = kept.finish()
    assert final["meta_info"]["finish_reason"] == ABORTED
    assert final["meta_info"]["num_retractions"] == 1


# -- 4. flush_cache, health, weights ------------------------------------------------------------


def test_flush_cache_is_refused_as_sglang_refuses_it(engine: EngineUnderTest, streams: Callable[..., Stream]) -> None:
    """is_fully_idle(ignore_waiting=<scheduler paused>) (scheduler.py:5337-5380, :5518-5548): a
    running request refuses the flush, in every mode; waiting ones only while not paused."""

    def flush(query: str = "") -> tuple[int, str, str | None]:
        resp = http("POST", engine.url + "/flush_cache" + query, timeout=WAIT)
        return resp.status, resp.body.decode(), resp.headers.get("content-type")

    assert flush() == (200, FLUSHED, None)
    s = streams(engine, long_body("flush"))
    s.wait_tokens(1)
    assert flush() == (400, FLUSH_FAILED, None)
    assert flush("?timeout=0.3") == (400, FLUSH_TIMED_OUT, None)
    assert engine.post("/pause_generation", {"mode": "in_place"})[0] == 200
    assert flush() == (400, FLUSH_FAILED, None), "paused in place, the request still holds its KV"
    assert engine.post("/continue_generation", {})[0] == 200
    assert engine.post("/pause_generation", {"mode": "retract"})[0] == 200
    assert flush() == (200, FLUSHED, None), "retracted, it waits without KV"
    assert engine.post("/continue_generation", {})[0] == 200
    at = s.tokens()
    s.wait_tokens(at + 2)


def test_health_waits_for_a_scheduler_message(engine: EngineUnderTest) -> None:
    """The health check sends a 1-token request and looks once a second for any scheduler message
    (http_server.py:721-800, tokenizer_manager.py:2465-2478). Paused, its request waits: no
    message comes, so it does not answer, until a control call's reply comes."""
    assert http("GET", engine.url + "/health").status == 200
    assert http("GET", engine.url + "/health_generate").status == 200
    assert engine.post("/pause_generation", {"mode": "in_place"})[0] == 200
    check = Call(lambda: http("GET", engine.url + "/health", timeout=WAIT).status)
    assert not check.answered.wait(QUIET), "the check passed with nothing from the scheduler"
    engine.get("/server_info")  # the scheduler answers for its internal state
    assert check.value() == 200
    assert engine.post("/continue_generation", {})[0] == 200


def test_a_distributed_update_outside_a_session_is_refused(engine: EngineUnderTest) -> None:
    body = {"names": ["model.embed_tokens.weight"], "dtypes": ["bfloat16"], "shapes": [[1024, 64]]}
    assert engine.post("/update_weights_from_distributed", body) == (
        400,
        {"success": False, "message": OUTSIDE_SESSION},
    )


# -- 5. identity, loads and metrics -------------------------------------------------------------


def test_identity_and_load_routes(engine: EngineUnderTest) -> None:
    info = engine.get("/model_info")
    missing = engine.fact(set(), KNOWN_GAPS["model_info keys missing"])
    assert set(info) == MODEL_INFO_KEYS[NEWEST] - missing | engine.fact(set(), SIM_MODEL_INFO_EXTENSIONS)
    assert (info["weight_version"], info["is_generation"]) == ("default", True)
    server = engine.get("/server_info")
    assert SERVER_INFO_READ | SERVER_INFO_0_5_23 <= set(server)
    assert isinstance(server["launch_command"], str)
    assert server["status"] == engine.fact(SERVER_INFO_STATUS, KNOWN_GAPS["server_info status"])
    assert (server["tp_size"], server["dp_size"], len(server["internal_states"])) == (1, 1, 1)
    assert (server["max_total_num_tokens"], server["weight_version"]) == (16384, "default")
    assert http("GET", engine.url + "/get_load").status == 404, "gone in 0.5.21"


def test_v1_loads_fields(engine: EngineUnderTest) -> None:
    """sglang==0.5.23: .../entrypoints/v1_loads.py:96-150, .../managers/load_snapshot.py:142-258."""
    body = engine.get("/v1/loads")
    assert set(body) == LOADS_TOP_KEYS
    (load,) = body["loads"]
    assert LOAD_FIELDS_READ <= set(load)
    core = {k for k in load if k not in LOAD_SECTIONS and k not in ("speculative", "lora")}
    assert LOAD_CORE_KEYS - core == engine.fact(set(), KNOWN_GAPS["loads core keys missing"])
    assert core - LOAD_CORE_KEYS == set()
    sections: dict[str, Any] = {}
    for name in ("speculative", "lora"):  # SGLang leaves these out when not enabled
        if name in load:
            sections[name] = "null" if load[name] is None else "present"
    for name, fields in LOAD_SECTIONS.items():
        added, lacking = set(load[name]) - fields, fields - set(load[name])
        if added or lacking:
            sections[name] = (added, lacking)
    assert sections == engine.fact({}, KNOWN_GAPS["loads sections"])
    assert set(engine.get("/v1/loads?include=core")["loads"][0]) == core
    status = http("GET", engine.url + "/v1/loads?dp_rank=7").status
    assert status == engine.fact(200, KNOWN_GAPS["loads dp_rank out of range status"])


def test_metric_names_and_labels(engine: EngineUnderTest) -> None:
    """sglang==0.5.23: .../observability/metrics_collector.py (scheduler labels :1382-1392, tokenizer
    labels :1804-1811); the names the autoscaler reads (rust/rollout-core/src/autoscaler/prom.rs)."""
    engine.generate({"text": "metrics", "sampling_params": {"max_new_tokens": 2}})
    series: dict[str, list[dict[str, str]]] = {}
    for line in http("GET", engine.url + "/metrics").body.decode().splitlines():
        match = re.match(r"^([\w:]+)\{(.*)\}\s", line)
        if match:
            series.setdefault(match[1], []).append(dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match[2])))
    for name, (kind, labels) in METRICS.items():
        if name == "sglang:queue_time_seconds":
            missing = labels - set(series[name + "_count"][0])
            assert missing == engine.fact(set(), KNOWN_GAPS["queue_time_seconds labels missing"])
            labels = labels - missing
        names = [name] if kind == "gauge" else [name + "_sum", name + "_count", name + "_bucket"]
        for sample_name in names:
            assert sample_name in series, sample_name
            want = labels | ({"le"} if sample_name.endswith("_bucket") else set())
            assert all(set(s) == want for s in series[sample_name]), (sample_name, series[sample_name][0])
            assert all(s["engine_type"] == ENGINE_TYPE for s in series[sample_name])


def test_sampling_params_and_an_unknown_key(engine: EngineUnderTest) -> None:
    """Every SamplingParams key is accepted (sampling_params.py:149-181); an unknown one is a 400
    naming the known ones (http_server.py:937-939, api_types.py:1256)."""
    refused = set()
    for name, (_default, value) in SAMPLING_PARAMS.items():
        for sent in (value, None):
            if any(name == n and sent == v for n, v in SAMPLING_VALUES_REFUSED):
                continue
            params = {"max_new_tokens": 2, name: sent} if name != "max_new_tokens" else {name: sent or 2}
            status, out = engine.post("/generate", {"text": "hi", "sampling_params": params})
            if status != 200:
                assert status == 400, (name, sent, status, out)
                refused.add(name)
    assert refused == engine.fact(set(), KNOWN_GAPS["sampling_params refused"])
    status, body = engine.post("/generate", {"text": "hi", "sampling_params": {"bogus_param": 1}})
    assert status == 400
    message = body["error"] if isinstance(body.get("error"), str) else body["message"]
    assert UNKNOWN_FIELD_MESSAGE.match(message), message
    listed = set(re.findall(r"`(\w+)`", message.split("expected one of", 1)[1]))
    missing = (set(SAMPLING_PARAMS) | set(SCHEMA_ONLY)) - listed
    assert missing == engine.fact(set(), KNOWN_GAPS["sampling_params missing from the unknown-field message"])
    assert listed <= set(SAMPLING_PARAMS) | set(SCHEMA_ONLY)
    assert set(body) == engine.fact({"error"}, KNOWN_GAPS["unknown sampling_params key body"])


def test_every_generate_field_is_accepted(engine: EngineUnderTest) -> None:
    """GenerateReqInput's fields (managers/io_struct.py); SGLang refuses max_thinking_tokens
    without --enable-strict-thinking (tokenizer_manager.py:906-913)."""
    refused = set()
    for name, value in GENERATE_FIELDS.items():
        if name in FIELDS_NOT_SENT:
            continue
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 1}}
        if name == "input_ids":
            del body["text"]
        status, out = engine.post("/generate", {**body, name: value})
        if status != 200:
            assert status == 400, (name, status, out)
            refused.add(name)
    assert refused == engine.fact(KNOWN_GAPS["generate fields refused by SGLang"], set())
