"""The router's HTTP/1.1 client against uvicorn (the server SGLang runs on).

An external engine served by uvicorn with a 1 s keep-alive: plain and streamed answers, a
concurrent burst, and requests after uvicorn has closed the router's idle connections, which
the router must notice and replace without failing or retrying a request.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _support import STARTUP_TIMEOUT, StartManager, health_ok, http, metric_total, sse_events, wait_until

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

TESTS = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def states_to(port: int) -> list[str]:
    """The TCP states (as /proc/net/tcp writes them) of this host's sockets to 127.0.0.1:``port``."""
    states = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[2] == f"0100007F:{port:04X}":
            states.append(fields[3])
    return states


def all_closed_by_peer(port: int) -> bool:
    """Every connection to ``port`` was closed by the server (CLOSE_WAIT: "08"), none is open ("01")."""
    states = states_to(port)
    return "08" in states and "01" not in states


@pytest.fixture
def uvicorn_engine(tmp_path: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    log = open(tmp_path / "uvicorn.log", "ab")
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "_uvicorn_engine:app",
        "--app-dir",
        str(TESTS),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--timeout-keep-alive",
        "1",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    try:
        wait_until(lambda: health_ok(url), 30, f"uvicorn engine at {url}")
        yield url, port
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()


def test_uvicorn_engine_through_the_router(start_fleet: StartManager, uvicorn_engine: tuple[str, int]) -> None:
    url, port = uvicorn_engine
    # Health probes and load polls rarely, so that the router's are the only connections to the
    # engine that matter below (uvicorn closes the manager's idle probe connections too).
    quiet = ("--health-check-interval-secs", "3600", "--load-poll-interval-secs", "3600")
    fleet = start_fleet("--rollout-num-gpus", "0", *quiet, wait=False)
    op = fleet.client.wait_for_operation(
        "scale_out", fleet.client.scale_out(engine_urls=[url]).request_id, timeout=STARTUP_TIMEOUT
    )
    assert op.status == "ACTIVE", op.raw
    generate = f"{fleet.router_url}/generate"

    def plain(n: int) -> str:
        answer = http("POST", generate, {"text": "hi", "sampling_params": {"max_new_tokens": n}})
        assert answer.status == 200, answer.body
        return str(answer.json()["text"])

    def streamed(n: int) -> list[str]:
        body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": n}}
        return list(sse_events(generate, body))

    assert plain(5) == "yyyyy"
    events = streamed(3)
    assert events[-1] == "[DONE]" and len(events) == 4, events

    # A burst: many connections to uvicorn at once, half of them streams.
    with ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(plain, [1 + i % 9 for i in range(100)]))
        streams = list(pool.map(streamed, [1 + i % 5 for i in range(100)]))
    assert texts == ["y" * (1 + i % 9) for i in range(100)]
    assert [len(s) for s in streams] == [2 + i % 5 for i in range(100)]

    # uvicorn closes idle connections after 1 s; once it has closed the router's, the next
    # requests go on new connections: none fails, none is retried on another attempt.
    wait_until(lambda: all_closed_by_peer(port), 30, "uvicorn to close the router's idle connections")
    assert [plain(4) for _ in range(10)] == ["yyyy"] * 10
    assert all(len(streamed(2)) == 3 for _ in range(10))

    metrics = http("GET", f"{fleet.router_url}/metrics").body.decode()
    assert metric_total(metrics, "rollout_router_retries_total") == 0
    assert metric_total(metrics, "rollout_router_errors_total") == 0
