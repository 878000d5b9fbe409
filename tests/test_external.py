"""External engines: attached by URL, health-checked, detached (never killed) on scale-in."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _support import STARTUP_TIMEOUT, ManagerHandle, StartManager, freshest_build, http, metric_total, wait_until

from elastic_rollout import RolloutApiError
from elastic_rollout._find import find_binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        return http("GET", f"{url}/health", timeout=5).status == 200
    except OSError:
        return False


StartEngine = Callable[..., tuple[str, subprocess.Popen[bytes]]]


@pytest.fixture
def external_engine(tmp_path: Path) -> Iterator[StartEngine]:
    """Starts standalone sglang-sim processes (as someone else's engines would be)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(model: str = "sim-model", port: int | None = None, *extra: str) -> tuple[str, subprocess.Popen[bytes]]:
        port = port or free_port()
        log = open(tmp_path / f"external-{port}.log", "ab")
        argv = [
            str(freshest_build(find_binary("sglang-sim"))),
            "--model-path",
            model,
            "--port",
            str(port),
            "--time-scale",
            "0.01",
            "--enable-metrics",
            *extra,
        ]
        proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: healthy(url), 30, f"external engine {url} to be healthy")
        return url, proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=10)


def test_attach_route_and_detach(start_fleet: StartManager, external_engine: StartEngine) -> None:
    fleet: ManagerHandle = start_fleet("--health-check-interval-secs", "1")
    url_a, proc_a = external_engine()
    url_b, _ = external_engine()
    accepted = fleet.client.scale_out(engine_urls=[url_a, url_b + "/"])
    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, timeout=STARTUP_TIMEOUT)
    assert op.status == "ACTIVE", op.raw
    assert [h["status"] for h in op.raw["history"]][:3] == ["PENDING", "CONNECTING", "HEALTH_CHECKING"]
    view = fleet.wait_engines(4)
    external = {e.url: e for e in view.engines if e.origin == "external"}
    assert set(external) == {url_a, url_b}
    assert all(e.pid is None and e.gpu_ids == () for e in external.values())

    # Attaching the same URLs again does nothing.
    again = fleet.client.scale_out(engine_urls=[url_a])
    assert again.status == "NOOP"

    # The router sends traffic to the external engines too (round robin over 4 engines).
    for _ in range(8):
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        assert (
            http("POST", f"{fleet.router_url}/generate", body, headers={"x-routing-policy": "round_robin"}).status
            == 200
        )
    served = sum(
        metric_total(http("GET", f"{u}/metrics").body.decode(), "sglang:num_requests_total") for u in (url_a, url_b)
    )
    assert served >= 4, f"external engines served {served} of 8 round-robin requests"

    # Scale-in by URL detaches the engine: it leaves the fleet but its process keeps running.
    removal = fleet.client.scale_in(engine_urls=[url_a])
    done = fleet.client.wait_for_operation("scale_in", removal.request_id, timeout=STARTUP_TIMEOUT)
    assert done.status == "COMPLETED"
    assert url_a not in {e.url for e in fleet.engines().engines}
    assert proc_a.poll() is None, "an external engine was killed on scale-in"
    assert healthy(url_a)


@pytest.mark.parametrize(
    "bad_url",
    ["ftp://127.0.0.1:1", "http://user:secret@127.0.0.1:1", "http://127.0.0.1:1/generate", "not a url"],
)
def test_invalid_external_urls_are_rejected(shared_fleet: ManagerHandle, bad_url: str) -> None:
    with pytest.raises(RolloutApiError) as err:
        shared_fleet.client.scale_out(engine_urls=[bad_url])
    assert err.value.status == 400
    assert err.value.code == "invalid_engine_url"
    assert "secret" not in err.value.message or "credentials" in err.value.message


def test_wrong_model_fails_and_is_not_attached(start_fleet: StartManager, external_engine: StartEngine) -> None:
    fleet = start_fleet()
    url, proc = external_engine(model="another-model")
    accepted = fleet.client.scale_out(engine_urls=[url])
    op = fleet.client.wait_for_operation("scale_out", accepted.request_id, timeout=STARTUP_TIMEOUT)
    assert op.status == "FAILED"
    assert "another-model" in str(op.raw["failed_engines"]), op.raw
    assert url not in {e.url for e in fleet.engines().engines}
    assert proc.poll() is None


def test_unreachable_external_engine_fails_cleanly(start_fleet: StartManager) -> None:
    fleet = start_fleet()
    url = f"http://127.0.0.1:{free_port()}"
    op = fleet.client.wait_for_operation("scale_out", fleet.client.scale_out(engine_urls=[url]).request_id, timeout=60)
    assert op.status == "FAILED"
    assert fleet.engines().total_engines == 2


def test_external_engine_failure_is_reprobed(start_fleet: StartManager, external_engine: StartEngine) -> None:
    fleet = start_fleet("--health-check-interval-secs", "0.2", "--health-failure-threshold", "1")
    url, proc = external_engine()
    port = int(url.rsplit(":", 1)[1])
    op = fleet.client.wait_for_operation("scale_out", fleet.client.scale_out(engine_urls=[url]).request_id, timeout=60)
    assert op.status == "ACTIVE"
    proc.kill()
    proc.wait(timeout=10)

    def status() -> str:
        engine = next(e for e in fleet.engines().engines if e.url == url)
        return engine.status

    wait_until(lambda: status() == "UNHEALTHY", 30, "the dead external engine to be marked UNHEALTHY")
    # Someone restarts it on the same address: the next passing probe brings it back.
    external_engine(port=port)
    wait_until(lambda: status() == "ACTIVE", 30, "the external engine to be ACTIVE again")
