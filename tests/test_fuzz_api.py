"""Fuzzing of the control API from its own OpenAPI document (schemathesis).

A real manager with simulated engines serves ``/openapi.json``; schemathesis generates requests
for every operation from it, both schema-valid ones and schema-violating ones, and each answer
is checked: no 5xx unless the document lists it for that operation, the status, content type and
body match the document, and schema-violating requests are refused (4xx). Every request has a
timeout, so a hang fails the test. Afterwards the manager must still be healthy, every scale
operation the fuzzing started must have ended, and the fleet must come back to its size with no
engine process leaked (checked by the ``start_fleet`` teardown).

``FUZZ_EXAMPLES`` (default 40) sets the examples per operation; ``FUZZ_RANDOM=1`` draws new
examples each run instead of the fixed, reproducible sequence CI uses.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
from _support import INITIAL_ENGINES, STARTUP_TIMEOUT, ManagerHandle, StartManager, http, wait_until

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
REQUEST_TIMEOUT = 10.0

#: Statuses that end a scale operation.
FINISHED = {"ACTIVE", "FAILED", "CANCELLED", "NOOP", "COMPLETED"}


def documented_server_errors_only(ctx: Any, response: Any, case: Any) -> None:
    """A 5xx is allowed only where the document lists it for the operation (e.g. 503 of
    ``/autoscaler/health``, 500 ``reserve_failed``); anything else is a bug of ours."""
    if response.status_code >= 500:
        documented = case.operation.definition.raw.get("responses", {})
        assert str(response.status_code) in documented, (
            f"{case.operation.label} answered undocumented {response.status_code}: {response.text[:500]}"
        )


#: Engine URLs that reach each branch of external mode: refused by the allow-list, refused for
#: credentials or a path, accepted on loopback (nothing listens there, so the attach fails).
STEERED_URLS = [
    "http://127.0.0.1:9",
    "http://[::1]:9",
    "http://10.1.2.3:30000",
    "http://user:pw@127.0.0.1:9",
    "http://127.0.0.1:9/generate",
    "localhost:9",
]


@st.composite
def steered(draw: st.DrawFn, valid: st.SearchStrategy[Any]) -> Any:
    """A schema-valid case, often steered where purely random values rarely go: without
    ``model_name`` (it then defaults to the fleet's; a random name is refused up front), with a
    small ``num_replicas`` (random integers are nearly all above --max-engines), with engine URLs
    that reach external mode's branches. Still schema-valid, so every check applies."""
    case = draw(valid)
    if isinstance(case.body, dict):
        if draw(st.integers(0, 3)):
            case.body.pop("model_name", None)
        if "num_replicas" in case.body and draw(st.integers(0, 3)):
            case.body["num_replicas"] = draw(st.integers(0, 5))
        if "timeout_secs" in case.body and draw(st.booleans()):
            case.body["timeout_secs"] = draw(st.sampled_from([None, 0.5, 60.0]))
        if "engine_urls" in case.body and draw(st.booleans()):
            case.body["engine_urls"] = draw(st.lists(st.sampled_from(STEERED_URLS), max_size=3))
    return case


def error_code(response: Any) -> str:
    """The ``error.code`` of a JSON error answer, else ""."""
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return ""
    return code if isinstance(code, str) else ""


def bound_long_poll(case: Any) -> None:
    """A long poll (GET /rollout/placements) waits up to ``wait_secs`` (at most 60) by design:
    any value that reads as a number above 1 (positive or negative generation alike) becomes 1,
    so only a real hang exceeds the per-request timeout."""
    if not isinstance(case.query, dict) or "wait_secs" not in case.query:
        return
    try:
        wait = float(case.query["wait_secs"])
    except (TypeError, ValueError):
        return
    if wait > 1:
        case.query["wait_secs"] = 1


def fuzz_operation(operation: Any, base_url: str, failures: list[str], seen: Counter[tuple[str, int, str]]) -> None:
    positive = steered(operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    cases = st.one_of(positive, operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=os.environ.get("FUZZ_RANDOM") != "1",
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(case=cases)
    def run(case: Any) -> None:
        bound_long_poll(case)
        response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT)
        seen[(f"{operation.method.upper()} {operation.path}", response.status_code, error_code(response))] += 1
        case.validate_response(
            response,
            # A schema-valid request may still be refused for the fleet's state (a target above
            # --max-engines or the free GPUs, an unknown request id, another operation running):
            # the document cannot express those rules, and the answer is a documented 4xx.
            # 5xx are judged by the check below, against the document.
            excluded_checks=[positive_data_acceptance, schemathesis.checks.not_a_server_error],
            additional_checks=[documented_server_errors_only],
        )

    try:
        run()
    except BaseException as err:
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        failures.append(f"{operation.method.upper()} {operation.path}:\n{str(err)[:3000]}")


def operations_running(fleet: ManagerHandle) -> list[str]:
    running = []
    for kind in ("scale_out", "scale_in"):
        for record in http("GET", f"{fleet.control_url}/rollout/{kind}").json()["requests"]:
            if record["status"] not in FINISHED:
                running.append(f"{kind} {record['request_id']} {record['status']}")
    return running


def test_control_api_survives_fuzzing(start_fleet: StartManager) -> None:
    # External engines may only be attached from loopback: fuzzed URLs never reach another host.
    fleet = start_fleet("--external-allow-cidr", "127.0.0.0/8", "--scale-in-drain-timeout", "2")
    base = fleet.control_url
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    failures: list[str] = []
    seen: Counter[tuple[str, int, str]] = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15, [f"{o.method} {o.path}" for o in operations]
    for operation in operations:
        fuzz_operation(operation, base, failures, seen)
    assert not failures, "\n\n".join(failures) + f"\nmanager stderr tail:\n{fleet.stderr_tail()}"
    # The fuzzing reached the scale logic, not only the body parser: besides bodies the parser
    # refused, some request was accepted or refused by the logic behind it (a 4xx with another
    # code than invalid_body: a target above the GPUs, an unknown model, an operation running).
    for route in ("POST /rollout/scale_out", "POST /rollout/scale_in", "POST /rollout/pipeline"):
        answers = {(status, code) for (r, status, code) in seen if r == route}
        parser = any(code == "invalid_body" for _, code in answers)
        logic = any(status < 300 or (code and code != "invalid_body") for status, code in answers)
        assert parser and logic, (route, sorted((k, n) for k, n in seen.items() if k[0] == route))

    # Still alive and answering.
    assert fleet.process.poll() is None, fleet.stderr_tail()
    assert http("GET", f"{base}/health").status == 200
    assert "panicked" not in fleet.stderr_tail(1_000_000)

    # Whatever the fuzzing started ends: cancel running scale-outs, let scale-ins finish.
    http("POST", f"{base}/rollout/scale_out_cancel", {})
    wait_until(
        lambda: not operations_running(fleet),
        STARTUP_TIMEOUT,
        lambda: f"operations to end: {operations_running(fleet)}",
    )

    # The fleet returns to its size: engines the fuzzing added are removed, the initial ones serve.
    def scaled_back() -> bool:
        resp = http("POST", f"{base}/rollout/scale_in", {"num_replicas": INITIAL_ENGINES, "force": True})
        if resp.status == 200 and resp.json()["status"] != "NOOP":
            fleet.client.wait_for_operation("scale_in", resp.json()["request_id"], timeout=STARTUP_TIMEOUT)
        view = fleet.engines()
        return view.total_engines == INITIAL_ENGINES and len(view.with_status("ACTIVE")) == INITIAL_ENGINES

    wait_until(
        scaled_back,
        STARTUP_TIMEOUT,
        lambda: f"the fleet back at {INITIAL_ENGINES} ACTIVE engines; {fleet.describe([fleet.engines()], 'ACTIVE')}",
        interval=1.0,
    )
    fleet.track_children()
    assert len(fleet.surviving_engines()) == INITIAL_ENGINES, fleet.surviving_engines()
    # The router still serves.
    body = {"text": "after the fuzz", "sampling_params": {"max_new_tokens": 2}}
    assert http("POST", f"{fleet.router_url}/generate", body).status == 200
