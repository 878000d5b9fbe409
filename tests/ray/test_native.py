"""``elastic_rollout._native`` (rust/rollout-py) against the real ``rollout-manager`` binary:
the same parser and messages, the same autoscaler replay, and where the binary is found."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from elastic_rollout import _native
from elastic_rollout._find import find_binary

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "benches" / "autoscaler"


def binary_stderr(manager_bin: Path, argv: list[str]) -> tuple[int, str]:
    """Exit status and stderr of ``rollout-manager serve <argv>`` (which must fail before starting)."""
    done = subprocess.run(
        [str(manager_bin), "serve", *argv], capture_output=True, text=True, timeout=30, check=False,
        env={**os.environ, "NO_COLOR": "1"},
    )  # fmt: skip
    return done.returncode, done.stderr.rstrip("\n")


BAD_ARGVS = [
    ["--no-such-flag"],
    ["--port", "not-a-port"],
    ["--rollout-num-gpus", "8", "--gpus", "4"],
    ["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "3"],
    ["--placement", "cloud"],
    ["--api-socket", "/tmp/" + "s" * 120, "--placement", "ray"],
    ["--scale-out-partial-success-policy", "keep_some"],
    ["--engine-arg"],
]


@pytest.mark.parametrize("argv", BAD_ARGVS, ids=lambda a: " ".join(a)[:40])
def test_bad_flags_get_the_binarys_own_message(manager_bin: Path, argv: list[str]) -> None:
    code, stderr = binary_stderr(manager_bin, argv)
    assert code != 0 and stderr, f"the binary accepted {argv}"
    with pytest.raises(ValueError) as caught:
        _native.parse_serve_args(argv)
    assert str(caught.value) == stderr


def test_valid_flags_parse_as_the_manager_reads_them() -> None:
    config = _native.parse_serve_args(
        ["--fully-async", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2", "--placement", "ray",
         "--gpus", "0", "--engine-arg=--time-scale=0.1", "--port", "1", "--port", "9100"]
    )  # fmt: skip
    assert config["fully_async"] is True
    assert (config["rollout_num_gpus"], config["rollout_num_gpus_per_engine"]) == (4, 2)
    assert config["placement"] == "ray"
    assert config["engine_args"] == ["--time-scale=0.1"]
    assert config["port"] == 9100  # a repeated flag takes its last value, as in the binary
    assert config["host"] == "127.0.0.1"  # loopback by default
    assert _native.parse_serve_args([])["fully_async"] is False


def test_environment_and_config_file_are_layered_as_in_the_binary(
    manager_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text('max-engines = 12\nmodel-name = "from-file"\nscale-out-timeout = 60\nlog-format = "json"\n')
    monkeypatch.setenv("ROLLOUT_MANAGER_CONFIG", str(config))
    monkeypatch.setenv("ROLLOUT_MANAGER_MODEL_NAME", "from-env")
    described = _native.describe_serve_args(["--max-engines", "13"])
    assert described["config"]["max_engines"] == 13
    assert described["config"]["model_name"] == "from-env"
    assert described["config"]["scale_out_timeout"] == 60.0
    assert (described["config_file"], described["log_format"]) == (str(config), "json")
    sources = described["sources"]
    assert (sources["max_engines"], sources["model_name"], sources["scale_out_timeout"]) == (
        "command_line",
        "env",
        "config_file",
    )
    assert (sources["config_file"], sources["log_format"], sources["gpus"]) == ("env", "config_file", "default")
    assert _native.parse_serve_args([]) == {**described["config"], "max_engines": 12}
    # A bad file or variable: the binary's own message, naming the flag (and the file and key).
    config.write_text("max_engines = 3\n")
    code, stderr = binary_stderr(manager_bin, [])
    assert code == 2 and "unknown key `max_engines`" in stderr
    with pytest.raises(ValueError) as caught:
        _native.parse_serve_args([])
    assert str(caught.value) == stderr
    monkeypatch.delenv("ROLLOUT_MANAGER_CONFIG")
    monkeypatch.setenv("ROLLOUT_MANAGER_PORT", "http")
    code, stderr = binary_stderr(manager_bin, [])
    assert code == 2 and "ROLLOUT_MANAGER_PORT" in stderr
    with pytest.raises(ValueError) as caught:
        _native.parse_serve_args([])
    assert str(caught.value) == stderr


def test_autoscaler_replay_matches_the_binary(manager_bin: Path) -> None:
    config, trace = EXAMPLE / "example.yaml", EXAMPLE / "example-trace.jsonl"
    done = subprocess.run(
        [str(manager_bin), "autoscaler-replay", "--config", str(config), "--trace", str(trace)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    from_binary = [json.loads(line) for line in done.stdout.splitlines()]
    from_python = _native.autoscaler_replay(config.read_text(), trace.read_text())
    assert len(from_python) == len(from_binary) > 0
    for py, cli in zip(from_python, from_binary, strict=True):
        assert (py["at"], py["action"], py["reason"], py["signal"]) == (
            cli["at"],
            cli["action"],
            cli["reason"],
            cli["signal"],
        )
        if py["action"] != "none":
            assert (py["delta"], py["to_engines"]) == (cli["delta"], cli["to_engines"])
    assert {"scale_out", "scale_in"} <= {e["action"] for e in from_python}


def test_autoscaler_replay_rejects_bad_input() -> None:
    trace = (EXAMPLE / "example-trace.jsonl").read_text()
    with pytest.raises(ValueError, match="config"):
        _native.autoscaler_replay("no_such_field: 1\n", trace)
    with pytest.raises(ValueError, match="trace"):
        _native.autoscaler_replay((EXAMPLE / "example.yaml").read_text(), "{not json\n")


def test_binary_path_finds_a_working_manager(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ELASTIC_ROLLOUT_MANAGER_BIN", raising=False)
    path = Path(_native.binary_path())
    done = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout.startswith("rollout-manager ")
    monkeypatch.setenv("ELASTIC_ROLLOUT_MANAGER_BIN", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="ELASTIC_ROLLOUT_MANAGER_BIN"):
        _native.binary_path()
    monkeypatch.setenv("ELASTIC_ROLLOUT_MANAGER_BIN", str(path))
    assert _native.binary_path() == str(path)


def test_finder_prefers_the_wheels_bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTIC_ROLLOUT_MANAGER_BIN", raising=False)
    (tmp_path / "Cargo.toml").write_text("[workspace]\n")
    package = tmp_path / "python" / "elastic_rollout"
    for where in ("_bin", "bin"):
        (package / where).mkdir(parents=True)
        (package / where / "rollout-manager").write_text("#!/bin/sh\n")
        (package / where / "rollout-manager").chmod(0o755)
    assert find_binary(package_dir=package) == package / "_bin" / "rollout-manager"
