"""Engines that lie are contained: garbage, huge bodies, bodies that trickle forever, answers
that never come, and wrong weight versions. The lying engine is a real HTTP server on loopback
(``tests/_hostile.py``) attached as an external engine next to two simulated ones. The manager
must bound every read in size and time, mark the engine with a clear reason, and keep serving
through the others, without its memory following the lies."""

from __future__ import annotations

import http.client as http_client
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from _hostile import HUGE_BYTES, HostileEngine
from _support import STARTUP_TIMEOUT, ManagerHandle, StartManager, http, wait_until

#: The manager's peak resident memory must stay far below one lying body (100 MB).
MEMORY_CEILING_KB = 80 * 1024


def peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


@pytest.fixture
def hostile() -> Iterator[HostileEngine]:
    engine = HostileEngine()
    yield engine
    engine.close()


def engine_at(fleet: ManagerHandle, url: str) -> dict | None:
    for engine in fleet.engines().engines:
        if engine.url == url:
            return engine.raw
    return None


def generate(
    fleet: ManagerHandle, policy: str = "round_robin", timeout: float = 30.0, batch: bool = False
) -> tuple[int, dict]:
    """One /generate through the router; a `batch` of two prompts is one the router cannot move."""
    body = {"text": ["hello", "there"] if batch else "hello", "sampling_params": {"max_new_tokens": 2}}
    resp = http("POST", f"{fleet.router_url}/generate", body, headers={"x-routing-policy": policy}, timeout=timeout)
    try:
        payload = resp.json()
    except ValueError:
        payload = {"raw": resp.body[:200].decode(errors="replace")}
    if isinstance(payload, list):  # a batch's answers
        payload = {"answers": payload}
    return resp.status, {**payload, "engine": resp.headers.get("x-rollout-engine-id")}


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("garbage", "unusable answer to /model_info: invalid answer: not JSON"),
        ("huge", "unusable answer to /model_info: answer larger than the 1048576-byte limit"),
        ("trickle", "did not answer /model_info: timed out"),
        ("hang", "did not answer /model_info: timed out"),
        ("error", "unusable answer to /model_info: answered HTTP 500"),
        ("wrong_version", 'weight version "v-from-elsewhere"'),
    ],
)
def test_lying_engine_is_refused_at_attach(
    start_fleet: StartManager, hostile: HostileEngine, mode: str, reason: str
) -> None:
    fleet = start_fleet()
    hostile.set(mode, "/model_info")
    accepted = fleet.client.scale_out(engine_urls=[hostile.url])
    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, timeout=STARTUP_TIMEOUT)
    assert op.status == "FAILED", op.raw
    assert reason in str(op.raw["failed_engines"]), op.raw
    assert engine_at(fleet, hostile.url) is None
    # The manager read at most its cap of the lie, and serves on through its own engines.
    assert peak_rss_kb(fleet.process.pid) < MEMORY_CEILING_KB, (mode, peak_rss_kb(fleet.process.pid))
    for _ in range(4):
        status, answer = generate(fleet)
        assert status == 200, answer


def test_engine_that_turns_hostile_is_contained(
    start_fleet: StartManager, hostile: HostileEngine, tmp_path: Path
) -> None:
    autoscaler = tmp_path / "autoscaler.yaml"
    autoscaler.write_text(
        "enabled: false\nmetrics_interval_secs: 0.5\nevaluation_interval_secs: 1\ncondition_window_secs: 5\n"
    )
    fleet = start_fleet(
        "--autoscaler-config", str(autoscaler),
        "--health-check-interval-secs", "0.3",
        "--health-check-timeout-secs", "1",
        "--health-failure-threshold", "2",
        "--load-poll-interval-secs", "0.3",
        "--request-timeout-secs", "2",
        "--routing-policy", "round_robin",
    )  # fmt: skip
    op = fleet.client.wait_for_operation(
        "scale_out", fleet.client.scale_out(engine_urls=[hostile.url]).request_id, timeout=STARTUP_TIMEOUT
    )
    assert op.status == "ACTIVE", op.raw
    hostile_id = engine_at(fleet, hostile.url)["engine_id"]

    # 1. Load reports that lie: read with a cap and a deadline, then ignored (the router keeps
    # its own count; the autoscaler's health lists the engine's metrics as missing, with the reason); the
    # engine still serves.
    def autoscaler_says(text: str) -> bool:
        errors = http("GET", f"{fleet.control_url}/autoscaler/health").json()["errors"]
        return text in json.dumps(errors.get(hostile_id, ""))

    for mode, reason in (
        ("huge", "answer larger than the 1048576-byte limit"),
        ("garbage", "/metrics: line 1"),
        ("trickle", "timed out after"),
    ):
        hostile.set(mode, "/v1/loads", "/metrics")
        # wait_until calls each lambda before the loop moves on, so the loop variables are current.
        wait_until(lambda: autoscaler_says(reason), 30, f"the autoscaler to report {reason!r} ({mode})")  # noqa: B023
        seen = hostile.hits["/v1/loads"]
        wait_until(lambda: hostile.hits["/v1/loads"] >= seen + 3, 30, f"the load poller to read /v1/loads ({mode})")  # noqa: B023
        assert engine_at(fleet, hostile.url)["status"] == "ACTIVE"
        assert peak_rss_kb(fleet.process.pid) < MEMORY_CEILING_KB, (mode, peak_rss_kb(fleet.process.pid))

    # 2. /generate never answers: the router gives up after --request-timeout-secs with 504, does
    # not retry (the engine may be working), and the other engines serve the rest.
    hostile.set("hang", "/generate")
    answers = [generate(fleet) for _ in range(6)]
    timeouts = [a for s, a in answers if s == 504]
    assert timeouts and all(a["error"]["code"] == "engine_timeout" for a in timeouts), answers
    assert hostile_id in timeouts[0]["error"]["message"]
    assert {s for s, _ in answers} == {200, 504}, answers
    # A body that trickles forever is cut at the same deadline. A request the router could move
    # is read whole before its head goes out, so its client gets a 504; any other sees the cut.
    hostile.set("trickle", "/generate")
    whole = [generate(fleet, timeout=30) for _ in range(3)]
    assert any(s == 504 and a["error"]["code"] == "engine_timeout" for s, a in whole), whole
    cut: list[int | str] = []
    for _ in range(3):
        try:
            status, answer = generate(fleet, timeout=30, batch=True)
            cut.append(status)
        except (OSError, http_client.HTTPException) as err:  # an incomplete body: the stream was cut
            cut.append(type(err).__name__)
    assert any(not isinstance(c, int) for c in cut), cut
    metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
    assert 'rollout_router_errors_total{kind="timeout"}' in metrics

    # 3. It hangs (its health probe, and /server_info, which SGLang's scheduler answers: a hung
    # scheduler, not a pause): out of routing with the reason; only the real engines serve.
    hostile.set("hang", "/health_generate", "/health", "/server_info")
    wait_until(lambda: engine_at(fleet, hostile.url)["status"] == "UNHEALTHY", 30, "the hanging engine to be UNHEALTHY")
    assert "timed out" in engine_at(fleet, hostile.url)["last_error"], engine_at(fleet, hostile.url)
    for _ in range(4):
        status, answer = generate(fleet)
        assert status == 200 and answer["engine"] != hostile_id, answer

    # 4. It answers again, but serves other weights: it may not rejoin, and says why.
    hostile.set("ok", "/health_generate", "/health", "/server_info", "/generate", "/v1/loads", "/metrics")
    hostile.set("wrong_version", "/model_info")
    wait_until(
        lambda: "weight version" in (engine_at(fleet, hostile.url)["last_error"] or ""),
        30,
        lambda: f"the wrong-version engine to be refused; {engine_at(fleet, hostile.url)}",
    )
    assert engine_at(fleet, hostile.url)["status"] == "UNHEALTHY"
    # 5. Honest again: back in routing.
    hostile.set("ok", "/model_info")
    wait_until(lambda: engine_at(fleet, hostile.url)["status"] == "ACTIVE", 30, "the engine to rejoin")
    assert fleet.process.poll() is None
    assert peak_rss_kb(fleet.process.pid) < MEMORY_CEILING_KB
    assert "panicked" not in fleet.stderr_tail(1_000_000)
    assert HUGE_BYTES > MEMORY_CEILING_KB * 1024


def fleet_of_only(start_fleet: StartManager, hostile: HostileEngine) -> ManagerHandle:
    """A manager with no engine of its own and `hostile` attached, ACTIVE."""
    fleet = start_fleet("--rollout-num-gpus", "0", wait=False)
    op = fleet.client.wait_for_operation(
        "scale_out", fleet.client.scale_out(engine_urls=[hostile.url]).request_id, timeout=STARTUP_TIMEOUT
    )
    assert op.status == "ACTIVE", op.raw
    return fleet


def test_lost_connection_to_the_only_engine_is_retried_there(start_fleet: StartManager, hostile: HostileEngine) -> None:
    """An engine that drops one request's connection is not dead: when it is the only engine the
    request may use, the retry goes to it again instead of failing with 502."""
    fleet = fleet_of_only(start_fleet, hostile)
    hostile.set("drop_once", "/generate")
    status, answer = generate(fleet)
    assert status == 200, answer
    assert answer["engine"] == engine_at(fleet, hostile.url)["engine_id"]
    assert hostile.hits["/generate"] == 2, hostile.hits
    metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
    assert "rollout_router_retries_total 1" in metrics, [m for m in metrics.splitlines() if "retries" in m]


def test_an_answer_cut_after_its_head_is_an_error_status(start_fleet: StartManager, hostile: HostileEngine) -> None:
    """A non-streamed answer the router could move is read whole before its head goes out: when
    the only engine cuts it after a 200 head, there is nowhere to start it again, and the client
    gets 502 with a JSON error telling it to send the request again, not a 200 cut short. A
    request the router cannot move (a batch) is passed on as it comes, so its client sees the cut."""
    fleet = fleet_of_only(start_fleet, hostile)
    hostile.set("cut", "/generate")
    status, answer = generate(fleet)
    assert status == 502, answer
    assert answer["error"]["code"] == "engine_lost", answer
    assert "send the request again" in answer["error"]["message"], answer
    with pytest.raises((OSError, http_client.HTTPException)):
        generate(fleet, batch=True)
