"""What an operator's Prometheus and Grafana meet: the manager's /metrics on both ports passes
``promtool check metrics``; deploy/prometheus/ (config, alert rules and their unit tests) passes
promtool; the engines are found through ``/rollout/prometheus/targets``; and a real Prometheus,
configured from deploy/prometheus/prometheus.yml, scraping a real fleet, has data for every query
of the Grafana dashboard in deploy/grafana/ and evaluates every alert rule without error.

promtool and prometheus come from Debian's ``prometheus`` package, which ``make test`` unpacks
into .venv/tools/prometheus (no daemon is installed or started). Elsewhere the tests skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from _checkpoints import write_checkpoint
from _support import STARTUP_TIMEOUT, ManagerHandle, StartManager, file_tail, http, metric_total, wait_until
from test_openapi import check

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
TOOLS = ROOT / ".venv" / "tools" / "prometheus" / "usr" / "bin"

#: Grafana's variables, as the dashboard would fill them against deploy/prometheus/prometheus.yml
#: scraping every second.
GRAFANA_VARIABLES = {"$job": "rollout-manager", "$engine_job": "rollout-engines", "$__rate_interval": "10s"}

#: Autoscaler on a short clock, so decisions are counted during the test.
AUTOSCALER_YAML = """
min_engines: 2
max_engines: 3
metrics_interval_secs: 0.25
evaluation_interval_secs: 0.5
condition_window_secs: 1.0
"""


def tool(name: str) -> Path:
    """promtool or prometheus: $PROMTOOL/$PROMETHEUS, then .venv/tools, then PATH."""
    override = os.environ.get(name.upper())
    for candidate in (override, TOOLS / name, shutil.which(name)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    pytest.skip(f"{name} not found: `make test` unpacks Debian's prometheus package into {TOOLS.parent.parent}")


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([str(tool("promtool")), *args], input=stdin, capture_output=True, timeout=60, check=False)


def targets(fleet: ManagerHandle) -> list[dict[str, Any]]:
    resp = http("GET", f"{fleet.control_url}/rollout/prometheus/targets")
    assert resp.status == 200, resp.body
    groups: list[dict[str, Any]] = resp.json()
    return groups


def test_scrape_of_either_port_passes_promtool(fleet: ManagerHandle) -> None:
    """The router port answers the manager's own metrics (not a random engine's), and both
    scrapes are valid exposition text by Prometheus's own linter."""
    for i in range(3):
        resp = http("POST", f"{fleet.router_url}/generate", {"text": f"m{i}", "sampling_params": {"max_new_tokens": 2}})
        assert resp.status == 200, resp.body
    for url in (fleet.control_url, fleet.router_url):
        resp = http("GET", f"{url}/metrics")
        assert resp.status == 200 and resp.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "x-rollout-engine-id" not in resp.headers, resp.headers
        text = resp.body.decode()
        assert "sglang:" not in text
        assert metric_total(text, "rollout_router_requests_total") >= 3, url
        assert metric_total(text, 'rollout_engines{status="ACTIVE"}') == 2
        for name in ("rollout_build_info", "process_resident_memory_bytes", "rollout_engine_startup_seconds_count"):
            assert re.search(rf"^{name}[{{ ]", text, re.MULTILINE), f"{name} missing from {url}/metrics"
        checked = promtool("check", "metrics", stdin=resp.body)
        assert checked.returncode == 0, (url, checked.stdout.decode(), checked.stderr.decode())


def test_latency_buckets_reach_the_request_timeout(start_fleet: StartManager) -> None:
    fleet = start_fleet("--request-timeout-secs", "900")
    text = http("GET", f"{fleet.control_url}/metrics").body.decode()
    bounds = re.findall(r'^rollout_router_request_duration_seconds_bucket\{le="([^"]+)"\}', text, re.MULTILINE)
    assert bounds[-3:] == ["600", "900", "+Inf"], bounds


def test_deploy_prometheus_files_pass_promtool() -> None:
    for args in (
        ("check", "rules", str(DEPLOY / "prometheus" / "rules.yml")),
        ("check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")),
        ("test", "rules", str(DEPLOY / "prometheus" / "rules_test.yml")),
    ):
        checked = promtool(*args)
        assert checked.returncode == 0, (args, checked.stdout.decode(), checked.stderr.decode())


def test_service_discovery_follows_the_fleet(fleet: ManagerHandle) -> None:
    def listed() -> dict[str, str]:
        return {g["labels"]["engine_id"]: g["targets"][0] for g in targets(fleet)}

    def serving() -> dict[str, str]:
        return {
            e.engine_id: urllib.parse.urlsplit(e.url).netloc for e in fleet.engines().engines if e.status == "ACTIVE"
        }

    assert listed() == serving() and len(listed()) == 2
    spec = http("GET", f"{fleet.control_url}/openapi.json").json()
    check(spec, "PrometheusTargets", targets(fleet))
    group = targets(fleet)[0]
    assert group["labels"]["__meta_rollout_status"] == "ACTIVE"
    assert group["labels"]["__meta_rollout_model_name"] == "default"
    # Each target is an engine's own metrics endpoint.
    host_port = group["targets"][0]
    assert http("GET", f"http://{host_port}/metrics").body.decode().count("sglang:num_running_reqs") >= 1

    fleet.client.scale_out(num_replicas=3)
    fleet.wait_engines(3, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
    wait_until(lambda: len(listed()) == 3 and listed() == serving(), STARTUP_TIMEOUT, "3 targets")
    fleet.client.scale_in(num_replicas=2)
    wait_until(
        lambda: len(listed()) == 2 and listed() == serving(), STARTUP_TIMEOUT, "the removed engine to leave the targets"
    )


# -- a real Prometheus --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def prometheus_config(control_url: str, out: Path) -> Path:
    """deploy/prometheus/prometheus.yml pointed at `control_url`, scraping every second."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    address = urllib.parse.urlsplit(control_url).netloc
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(DEPLOY / "prometheus" / "rules.yml")]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["rollout-manager"]["static_configs"] = [{"targets": [address]}]
    jobs["rollout-engines"]["http_sd_configs"][0]["url"] = f"{control_url}/rollout/prometheus/targets"
    jobs["rollout-engines"]["http_sd_configs"][0]["refresh_interval"] = "1s"
    path = out / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Starts Prometheus (config written later to tmp_path/prometheus.yml, reloaded by SIGHUP)."""
    binary = tool("prometheus")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s}\n")
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(binary),
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--web.enable-lifecycle",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"Prometheus exited: {file_tail(log)}"
            try:
                return http("GET", f"{url}/-/ready", timeout=2).status == 200
            except OSError:
                return False

        wait_until(ready, 60, lambda: f"Prometheus ready: {file_tail(log)}")
        yield url, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables filled in) for every query of the dashboard."""
    dashboard = json.loads((DEPLOY / "grafana" / "elastic-rollout.json").read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"{panel['title']}: unknown variable in {expr}"
            out.append((panel["title"], expr))
    return out


def query(prom: str, expr: str) -> dict[str, Any]:
    resp = http("GET", f"{prom}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10)
    answer: dict[str, Any] = resp.json()
    assert resp.status == 200 and answer["status"] == "success", (expr, answer)
    return answer


def test_prometheus_has_data_for_every_dashboard_query(
    start_fleet: StartManager, prometheus: tuple[str, Path], tmp_path: Path
) -> None:
    prom, log = prometheus
    config = tmp_path / "autoscaler.yaml"
    config.write_text(AUTOSCALER_YAML)
    fleet = start_fleet("--autoscaler-config", str(config), "--engine-arg=--time-scale=0.05")
    prometheus_config(fleet.control_url, tmp_path)
    assert http("POST", f"{prom}/-/reload").status == 200, file_tail(log)

    # What the panels show: traffic, a scale-out and a scale-in, a weight update.
    for i in range(6):
        assert http("POST", f"{fleet.router_url}/generate", {"text": f"d{i}"}).status == 200
    fleet.client.scale_out(num_replicas=3)
    fleet.wait_engines(3, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
    write_checkpoint(tmp_path / "v1", seed=1)
    published = http(
        "POST", f"{fleet.control_url}/rollout/weights/publish", {"version": "v1", "path": str(tmp_path / "v1")}
    )
    assert published.status in (200, 202), published.body
    update_id = published.json()["update_id"]
    wait_until(
        lambda: http("GET", f"{fleet.control_url}/rollout/weights/updates/{update_id}").json()["status"] == "COMPLETED",
        STARTUP_TIMEOUT,
        "the weight update to complete",
    )

    queries = dashboard_queries()
    assert len(queries) >= 25, queries

    def empty() -> list[str]:
        return [f"{title}: {expr}" for title, expr in queries if not query(prom, expr)["data"]["result"]]

    missing: list[str] = []

    def all_have_data() -> bool:
        missing[:] = empty()
        return not missing

    wait_until(all_have_data, 90, lambda: "queries without data:\n" + "\n".join(missing), interval=1.0)

    # Engines came through the manager's service discovery, one target each.
    active = {urllib.parse.urlsplit(e.url).netloc for e in fleet.engines().engines if e.status == "ACTIVE"}
    up = query(prom, 'up{job="rollout-engines"} == 1')["data"]["result"]
    assert {r["metric"]["instance"] for r in up} >= active, up
    assert {r["metric"]["engine_id"] for r in up} >= {
        e.engine_id for e in fleet.engines().engines if e.status == "ACTIVE"
    }
    # The weight version per engine is the one just published.
    versions = query(prom, 'rollout_engine_weight_version_info{job="rollout-manager"}')["data"]["result"]
    wait_until(
        lambda: (
            {
                r["metric"]["version"]
                for r in query(prom, 'rollout_engine_weight_version_info{job="rollout-manager"}')["data"]["result"]
            }
            == {"v1"}
        ),
        30,
        lambda: f"every engine on v1 in Prometheus: {versions}",
    )
    # Every alert rule loaded and evaluates without error on live data.
    groups = http("GET", f"{prom}/api/v1/rules").json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    expected = sum(len(g["rules"]) for g in yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"])
    assert len(rules) == expected, [r["name"] for r in rules]
    unhealthy: list[tuple[str, str]] = []

    def rules_healthy() -> bool:
        groups = http("GET", f"{prom}/api/v1/rules").json()["data"]["groups"]
        unhealthy[:] = [(r["name"], r.get("lastError", "")) for g in groups for r in g["rules"] if r["health"] != "ok"]
        return not unhealthy

    wait_until(rules_healthy, 30, lambda: f"every rule evaluated without error: {unhealthy}")
    # A healthy fleet fires nothing.
    firing = [a for a in http("GET", f"{prom}/api/v1/alerts").json()["data"]["alerts"] if a["state"] == "firing"]
    assert not firing, firing
