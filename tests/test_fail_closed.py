"""Failing closed on faults: a crash loop ends within its restart budget, a failure of every
health probe at once (a blip) takes at most the bounded share of engines out of routing, and
the router retries what a dying engine dropped before its first byte and ends a cut stream with
an error event.

Real manager, real sglang-sim engines under load through the router.
"""

from __future__ import annotations

import concurrent.futures
import http.client as httpclient
import json
import os
import signal
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

from _chaos import Load, Watcher, shut_down
from _checkpoints import write_checkpoint
from _support import (
    INITIAL_ENGINES,
    STARTUP_TIMEOUT,
    ManagerHandle,
    StartManager,
    http,
    metric_total,
    start_manager,
    wait_until,
)
from test_external import StartEngine, external_engine  # noqa: F401 - the fixture

from elastic_rollout.models import Engine


def fast_health(*extra: str) -> tuple[str, ...]:
    return (
        "--health-check-interval-secs", "0.2",
        "--health-check-timeout-secs", "0.5",
        "--health-failure-threshold", "2",
        "--engine-arg=--time-scale=0.05",
        *extra,
    )  # fmt: skip


def unexcused(load: Load) -> list[str]:
    """Failed requests whose client had not received stream data (the router must have
    retried them elsewhere)."""
    return [f"{o.engine_id}: {o.error}" for o in load.outcomes if not o.ok and not o.started_streaming]


def test_a_crash_loop_ends_failed_within_its_budget_while_the_others_serve(manager_bin: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken-disk"
    args = fast_health(
        "--gpus", "3", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "1",
        f"--engine-arg=--fail-startup-while={broken}",
        "--restart-budget", "3", "--restart-window-secs", "60",
    )  # fmt: skip
    fleet = start_manager(manager_bin, tmp_path / "m", args)
    try:
        fleet.wait_engines(2, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        op = fleet.client.scale_out(num_replicas=3)
        assert op.request_id is not None
        assert fleet.client.wait_for_operation("scale_out", op.request_id, STARTUP_TIMEOUT).status == "ACTIVE"
        victim = next(e for e in fleet.engines().engines if e.engine_id not in ("engine_0", "engine_1"))
        assert victim.pid is not None
        load = Load(fleet.router_url, threads=2, seed=7, fleet_version=lambda: "default", timeout=60)
        load.start()
        try:
            # Every start of the engine now fails (out of memory at load, a broken disk).
            broken.touch()
            os.kill(victim.pid, signal.SIGKILL)

            def gave_up() -> bool:
                engine = fleet.engines().by_id(victim.engine_id)
                return engine is not None and engine.status == "FAILED" and engine.log_tail is not None

            wait_until(gave_up, 60, lambda: f"{victim.engine_id} to give up: {fleet.engines().by_id(victim.engine_id)}")
        finally:
            load.stop()
        assert load.outcomes and not unexcused(load), unexcused(load)
        engine = fleet.engines().by_id(victim.engine_id)
        assert engine is not None and engine.log_tail is not None and engine.detail is not None
        assert engine.restarts == 3, engine
        assert "crash loop" in engine.detail and "--restart-budget 3" in engine.detail
        assert any("simulated startup failure" in line for line in engine.log_tail), engine.log_tail
        metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
        assert metric_total(metrics, "rollout_engines_crash_looping") == 1, metrics

        # It stays FAILED: further health rounds restart nothing.
        def probes() -> float:
            text = http("GET", f"{fleet.control_url}/metrics").body.decode()
            return metric_total(text, "rollout_health_probes_total")

        before = probes()
        wait_until(lambda: probes() >= before + 10, 30, "ten more health probes")
        again = fleet.engines().by_id(victim.engine_id)
        assert again is not None and again.status == "FAILED" and again.restarts == 3, again
        # The others served throughout; a scale-in removes the failed engine first.
        assert len(fleet.engines().with_status("ACTIVE")) == 2
        broken.unlink()
        op = fleet.client.scale_in(num_replicas=2)
        assert op.request_id is not None
        assert fleet.client.wait_for_operation("scale_in", op.request_id, 60).status == "COMPLETED"
        assert fleet.engines().by_id(victim.engine_id) is None
    finally:
        leaks = shut_down(fleet)
    assert not leaks, leaks


def test_a_blip_takes_no_more_than_the_bounded_share_out_of_routing(manager_bin: Path, tmp_path: Path) -> None:
    # Probes fail outright (a slow health route counts: no pause grace), generation works.
    args = fast_health(
        "--gpus", "4", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "1",
        "--engine-arg=--enable-fault-api", "--health-pause-grace-secs", "0",
        "--health-max-unhealthy-fraction", "0.5",
    )  # fmt: skip
    fleet = start_manager(manager_bin, tmp_path / "m", args)
    watcher: Watcher | None = None
    try:
        fleet.wait_engines(4, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        watcher = Watcher(fleet, interval=0.05)
        watcher.start()
        load = Load(fleet.router_url, threads=2, seed=3, fleet_version=lambda: "default", timeout=60)
        load.start()
        try:
            slowed = [e.url for e in fleet.engines().engines]
            for url in slowed:
                assert http("POST", f"{url}/sim/faults", {"slow_health": 5.0}, timeout=5).status == 200

            def held() -> float:
                metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
                return metric_total(metrics, 'rollout_health_probes_total{result="held"}')

            # Two engines leave routing; the other two are held there, round after round, until the
            # first two are restarted (past 3x the threshold) and come back without the fault.
            wait_until(lambda: held() >= 6, 60, "engines held in routing by the bound")
            for url in slowed:
                try:
                    http("POST", f"{url}/sim/faults", {"slow_health": 0}, timeout=5)
                except OSError:
                    pass  # that process was restarted (a hung engine is, past 3x the threshold)
            wait_until(lambda: len(fleet.engines().with_status("ACTIVE")) == 4, 60, "every engine back in routing")
        finally:
            load.stop()
            watcher.stop()
        out = max(sum(1 for status, _, _ in s.engines.values() if status != "ACTIVE") for s in watcher.samples)
        assert out == 2, f"at most half of 4 engines out of routing at once, saw {out}"
        assert load.outcomes and not unexcused(load), unexcused(load)
    finally:
        if watcher is not None:
            watcher.stop()
        leaks = shut_down(fleet)
    assert not leaks, leaks


def test_bad_budget_flags_name_the_flag(manager_bin: Path, tmp_path: Path) -> None:
    for flag, value in (
        ("--restart-budget", "0"),
        ("--restart-window-secs", "0"),
        ("--health-max-unhealthy-fraction", "0"),
        ("--health-max-unhealthy-fraction", "1.5"),
    ):
        fleet: ManagerHandle | None = None
        try:
            fleet = start_manager(manager_bin, tmp_path / f"bad{flag}{value}", (flag, value))
        except AssertionError as err:
            assert flag in str(err), err
        else:
            shut_down(fleet)
            raise AssertionError(f"{flag} {value} was accepted")


def open_stream(router_url: str, body: dict[str, object]) -> tuple[httpclient.HTTPConnection, httpclient.HTTPResponse]:
    parsed = urllib.parse.urlsplit(router_url)
    conn = httpclient.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 80, timeout=60)
    conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def events(resp: httpclient.HTTPResponse) -> Iterator[str]:
    for line in resp:
        text = line.decode().strip()
        if text.startswith("data:"):
            yield text[len("data:") :].strip()


def busy_engine(fleet: ManagerHandle) -> Engine | None:
    return next((e for e in fleet.engines().engines if e.raw.get("in_flight")), None)


def test_a_stream_whose_engine_dies_before_its_first_byte_is_sent_to_another(start_fleet: StartManager) -> None:
    """SGLang sends a stream's headers before its prefill. An engine killed between the two gave
    the client nothing, so the router holds the headers until the first byte and retries."""
    fleet = start_fleet("--engine-arg=--time-scale=1", "--engine-arg=--prefill-base-ms=2000")
    body = {"text": "a long prefill", "stream": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(lambda: open_stream(fleet.router_url, body))
        victim = wait_until(lambda: busy_engine(fleet), 30, "the request on an engine")
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        conn, resp = answer.result(timeout=60)
    try:
        assert resp.status == 200
        data = list(events(resp))
        assert data[-1] == "[DONE]" and all("error" not in json.loads(d) for d in data[:-1]), data
        assert json.loads(data[-2])["meta_info"]["completion_tokens"] == 4
    finally:
        conn.close()
    # It was sent again: to the other engine, or to the killed one restarted (the same id); as a
    # retry, or (a text prompt can move) as a move of a request that had produced nothing yet.
    metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
    again = metric_total(metrics, "rollout_router_retries_total")
    again += metric_total(metrics, 'rollout_router_moves_total{reason="lost"}')
    assert again >= 1, metrics


def test_a_stream_cut_by_its_engine_ends_with_an_error_event(start_fleet: StartManager) -> None:
    # Moves off: with them, the stream continues on another engine instead (tests/test_moves.py).
    fleet = start_fleet("--engine-arg=--decode-tokens-per-sec=5", "--move-on-drain", "false", "--move-tail", "false")
    body = {"text": "slow", "stream": True, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    conn, resp = open_stream(fleet.router_url, body)
    try:
        assert resp.status == 200
        engine = fleet.engines().by_id(resp.getheader("x-rollout-engine-id") or "")
        assert engine is not None and engine.pid is not None
        stream = events(resp)
        first = json.loads(next(stream))
        assert "error" not in first and first["meta_info"]["completion_tokens"] >= 1
        os.kill(engine.pid, signal.SIGKILL)
        rest = list(stream)
        assert rest[-1] == "[DONE]", rest
        error = json.loads(rest[-2])["error"]
        assert error["type"] == "engine_lost" and error["code"] == 502 and error["retryable"] is True, error
        assert engine.engine_id in error["message"] and "send the request again" in error["message"]
    finally:
        conn.close()


def test_a_disk_update_changes_no_name_a_client_sees(
    start_fleet: StartManager,
    external_engine: StartEngine,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    """SGLang renames an engine's served model to the checkpoint's path on every update from
    disk, whatever `--served-model-name` says (0.5.23 `tokenizer_manager.py:2368`). Through the
    router the fleet keeps one name; an engine that took the publish can be attached again."""
    fleet = start_fleet("--model-name", "qwen-rl", "--health-check-interval-secs", "0.5")
    url, _ = external_engine()
    attached = fleet.client.wait_for_operation(
        "scale_out", fleet.client.scale_out(engine_urls=[url], model_name="qwen-rl").request_id, timeout=STARTUP_TIMEOUT
    )
    assert attached.status == "ACTIVE", attached.raw
    checkpoint = tmp_path / "step-1"
    write_checkpoint(checkpoint, 1)
    update = fleet.client.publish_weights("step-1", str(checkpoint))
    done = fleet.client.wait_for_weight_update(update["update_id"], STARTUP_TIMEOUT)
    assert done["status"] == "COMPLETED", done

    # Each engine, asked directly, now lists the checkpoint's path, as SGLang does.
    for engine in fleet.wait_engines(INITIAL_ENGINES + 1).with_status("ACTIVE"):
        listed = http("GET", f"{engine.url}/v1/models").json()["data"][0]["id"]
        assert listed == str(checkpoint), (engine.engine_id, listed)

    # Through the router: the fleet's name, from whichever engine is asked.
    for _ in range(6):
        models = http("GET", f"{fleet.router_url}/v1/models")
        assert models.status == 200, models.body[:300]
        cards = models.json()["data"]
        assert [(c["id"], c["root"]) for c in cards] == [("qwen-rl", "qwen-rl")], cards
        assert cards[0]["max_model_len"] > 0
    card = http("GET", f"{fleet.router_url}/v1/models/qwen-rl")
    assert card.status == 200 and card.json()["id"] == "qwen-rl", card.body[:300]
    gone = http("GET", f"{fleet.router_url}/v1/models/{checkpoint}")
    assert gone.status == 404 and gone.json()["error"]["code"] == "model_not_found", gone.body[:300]
    assert "qwen-rl" in gone.json()["error"]["message"]
    chat = http(
        "POST",
        f"{fleet.router_url}/v1/chat/completions",
        {"model": "qwen-rl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert chat.status == 200 and chat.json()["model"] == "qwen-rl", chat.body[:300]

    # The external engine, detached and attached again, names the published checkpoint as its
    # model: it is the fleet's model.
    detach = fleet.client.scale_in(engine_urls=[url], model_name="qwen-rl")
    assert fleet.client.wait_for_operation("scale_in", detach.request_id, timeout=STARTUP_TIMEOUT).status == "COMPLETED"
    assert http("GET", f"{url}/model_info").json()["model_path"] == str(checkpoint)
    again = fleet.client.wait_for_operation(
        "scale_out", fleet.client.scale_out(engine_urls=[url], model_name="qwen-rl").request_id, timeout=STARTUP_TIMEOUT
    )
    assert again.status == "ACTIVE", again.raw
    assert {e.url: e.weight_version for e in fleet.engines().engines}[url] == "step-1"
