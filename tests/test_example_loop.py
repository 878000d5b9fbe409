"""examples/fully_async/loop.py, the one-command fully-async loop, at a small size.

The script starts its own manager (the binary under test, through ELASTIC_ROLLOUT_MANAGER_BIN),
runs 3 steps of 2 prompts x 4 samples, stops the manager and writes timeline.json (and
timeline.png with matplotlib). The assertions read what it recorded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "fully_async" / "loop.py"
STEPS, PROMPTS, GROUP, STALENESS = 3, 2, 4, 1
RUN_TIMEOUT = 180.0


def version_number(version: str) -> int:
    match = re.fullmatch(r"step-(\d+)", version)
    assert match, f"unexpected weight version {version!r}"
    return int(match.group(1))


@pytest.fixture(scope="module")
def loop_run(manager_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str]:
    out = tmp_path_factory.mktemp("fully_async")
    argv = [
        sys.executable, str(SCRIPT),
        "--steps", str(STEPS), "--prompts", str(PROMPTS), "--group-size", str(GROUP),
        "--max-new-tokens", "32", "--max-staleness", str(STALENESS),
        # Two initial engines, so the autoscaler's floor keeps both while it grows the fleet.
        "--engines-min", "2", "--engines-max", "3",
        "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "ELASTIC_ROLLOUT_MANAGER_BIN": str(manager_bin), "NO_COLOR": "1"}
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # the script stops its manager on SIGTERM
        try:
            output, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        pytest.fail(f"the loop did not finish within {RUN_TIMEOUT:g}s; output tail:\n{output[-4000:]}")
    assert process.returncode == 0, f"exit {process.returncode}; output tail:\n{output[-4000:]}"
    timeline = json.loads((out / "timeline.json").read_text())
    return timeline, out, output


def test_every_sample_respects_its_pin_and_the_staleness_bound(loop_run: tuple[dict[str, Any], Path, str]) -> None:
    timeline, _, _ = loop_run
    steps = timeline["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        pin = version_number(s["pin"])
        assert pin == max(0, s["step"] - 1 - STALENESS), s["pin"]
        assert len(s["samples"]) == PROMPTS * GROUP, s
        for prompt, engine, version, tokens in s["samples"]:
            assert version_number(version) >= pin, (s["step"], prompt, engine, version, s["pin"])
            assert (s["step"] - 1) - version_number(version) <= STALENESS
            assert tokens > 0
        assert s["max_staleness"] <= STALENESS
        # every group (the siblings of one prompt, one request with n) was answered by one
        # engine; its siblings may end on two versions, as on SGLang: an update that pauses
        # with retract lets the unfinished ones end on the new weights
        for prompt in range(PROMPTS):
            group = [x[1:3] for x in s["samples"] if x[0] == prompt]
            assert len(group) == GROUP and len({engine for engine, _ in group}) == 1, group
            assert len({version for _, version in group}) <= 2, group
    assert timeline["summary"]["max_staleness"] <= STALENESS


def test_one_version_per_step_and_the_fleet_ends_on_the_last(loop_run: tuple[dict[str, Any], Path, str]) -> None:
    timeline, _, output = loop_run
    published = timeline["published"]
    assert [p["version"] for p in published] == [f"step-{k}" for k in range(1, STEPS + 1)]
    assert {p["status"] for p in published} == {"COMPLETED"}, published
    # By default the trainer broadcasts each step through the manager, as RL frameworks do.
    assert {p["source"] for p in published} == {"trainer"}, published
    assert timeline["final"]["fleet_source"] == "trainer", timeline["final"]
    final = timeline["final"]
    last = f"step-{STEPS}"
    assert final["fleet_version"] == last, final
    active = {e: r for e, r in final["engines"].items() if r["status"] == "ACTIVE"}
    assert active and {r["version"] for r in active.values()} == {last}, final["engines"]
    # every step was reported to the autoscaler, which answered with its signal
    assert all(s["autoscaler"]["signal"] == "pipeline" for s in timeline["steps"]), timeline["steps"]
    assert "[manager] stopped (exit 0)" in output, output[-2000:]


def test_the_fleet_served_throughout(loop_run: tuple[dict[str, Any], Path, str]) -> None:
    timeline, _, _ = loop_run
    points = timeline["timeline"]
    assert len(points) >= 2

    # Serving: engines ACTIVE, or the fleet's engines out of routing for a trainer update (they
    # are paused while the trainer broadcasts; requests wait in the router meanwhile).
    def serving(p: dict[str, Any]) -> bool:
        updating = sum(1 for e in p["engines"].values() if e["status"] == "WEIGHT_SYNCING")
        return p["engines_total"] >= 1 and (p["active"] >= 1 or updating >= 1)

    assert all(serving(p) for p in points), [(p["t"], p["active"], p["engines_total"], p["engines"]) for p in points]
    assert timeline["summary"]["fleet_min"] >= 1
    assert points[-1]["tokens_total"] == sum(s["tokens"] for s in timeline["steps"])


def test_the_plot_is_written(loop_run: tuple[dict[str, Any], Path, str]) -> None:
    _, out, _ = loop_run
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: the loop writes timeline.json only")
    png = out / "timeline.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
