"""``rollout-manager serve``'s command line as an operator meets it, on the real binary: help
grouped by headings and naming each flag's ``ROLLOUT_MANAGER_*`` variable, settings from the
environment and a ``--config`` file (command line > environment > file > default), JSON logs,
the token from the environment, and none of the manager's variables reaching its engines."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from _support import (
    DEFAULT_ARGS,
    INITIAL_ENGINES,
    LISTEN_TIMEOUT,
    LISTENING_RE,
    STARTUP_TIMEOUT,
    ManagerHandle,
    StartManager,
    file_tail,
    http,
    stop_manager,
    wait_until,
)

from elastic_rollout import RolloutClient

HEADINGS = (
    "Network & security:",
    "Engines:",
    "Placement (GPUs, Ray):",
    "Weights:",
    "Scaling & lifecycle:",
    "Health & recovery:",
    "Router:",
    "Autoscaler:",
    "State, config & logging:",
)


def _run(manager_bin: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(manager_bin), *args],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
        check=False,
        env={**os.environ, **(env or {})},
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(manager_bin: Path, state_dir: Path, args: list[str]) -> ManagerHandle:
    """``serve`` with exactly ``args`` (no --port given, unlike ``start_manager``), in this
    process's environment; returns once it prints its listening line."""
    state_dir.mkdir(parents=True, exist_ok=True)
    stdout_path, stderr_path = state_dir / "manager.stdout", state_dir / "manager.stderr"
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        process = subprocess.Popen(
            [str(manager_bin), "serve", "--state-dir", str(state_dir), *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env={**os.environ, "NO_COLOR": "1"},
        )

    def listening() -> tuple[str, str] | None:
        for line in stdout_path.read_text(errors="replace").splitlines():
            match = LISTENING_RE.match(line)
            if match:
                return match["control"], match["router"]
        if process.poll() is not None:
            raise AssertionError(f"manager exited with {process.returncode}\n{file_tail(stderr_path)}")
        return None

    try:
        control, router = wait_until(listening, LISTEN_TIMEOUT, "the manager's listening line")
    except BaseException:
        process.kill()
        process.wait()
        raise
    return ManagerHandle(
        process=process,
        control_url=control,
        router_url=router,
        client=RolloutClient(control, timeout=10.0),
        state_dir=state_dir,
        stdout_path=stdout_path,
        stderr_path=stderr_path,
    )


def _no_manager_variables_in_engines(handle: ManagerHandle) -> None:
    for engine in handle.engines().engines:
        assert engine.pid is not None
        environ = Path(f"/proc/{engine.pid}/environ").read_bytes().split(b"\0")
        leaked = [v for v in environ if v.startswith(b"ROLLOUT_MANAGER_")]
        assert not leaked, f"engine {engine.engine_id} inherited {leaked}"


def test_help_is_grouped_and_names_every_variable(manager_bin: Path) -> None:
    secret_env = {"ROLLOUT_MANAGER_ENGINE_ARG": "--api-key=s3cret-arg", "ROLLOUT_MANAGER_API_TOKEN": "s3cret-token"}
    long_help = _run(manager_bin, "serve", "--help", env=secret_env)
    short_help = _run(manager_bin, "serve", "-h", env=secret_env)
    assert long_help.returncode == 0 and short_help.returncode == 0, long_help.stderr
    for text in (long_help.stdout, short_help.stdout):
        for heading in HEADINGS:
            assert f"\n{heading}\n" in text, heading
        assert "[env: ROLLOUT_MANAGER_PORT]" in text
        assert "[env: ROLLOUT_MANAGER_SCALE_OUT_TIMEOUT_SECS]" in text
        assert "[env: ROLLOUT_MANAGER_CONFIG]" in text
        assert "[env: ROLLOUT_MANAGER_LOG_FORMAT]" in text
        # A variable that may hold a secret is named, its value never shown.
        assert "[env: ROLLOUT_MANAGER_ENGINE_ARG]" in text
        assert "s3cret" not in text
        # The seeds' spellings are still accepted, and said so.
        assert "--scale-out-timeout-secs" in text and "[alias: --scale-out-timeout]" in text
    assert len(short_help.stdout.splitlines()) < len(long_help.stdout.splitlines()) / 2
    # Every long flag of serve has its variable.
    flags = [line.split()[0] for line in short_help.stdout.splitlines() if line.startswith("      --")]
    assert len(flags) > 40
    for flag in flags:
        name = "ROLLOUT_MANAGER_" + flag[2:].upper().replace("-", "_")
        assert f"[env: {name}" in short_help.stdout, flag
    agent = _run(manager_bin, "agent", "--help")
    assert "[env: ROLLOUT_MANAGER_AGENT_STATE_DIR]" in agent.stdout
    assert "--log-format" in agent.stdout


def test_bad_config_files_and_variables_name_what_to_fix(manager_bin: Path, tmp_path: Path) -> None:
    json_file = tmp_path / "fleet.json"
    json_file.write_text("{}")
    unknown = tmp_path / "fleet.yaml"
    unknown.write_text("max_engines: 4\n")
    bad_value = tmp_path / "fleet.toml"
    bad_value.write_text('scale-out-timeout-secs = "soon"\n')
    invalid = tmp_path / "invalid.yaml"
    invalid.write_text("scale-out-timeout: 0\n")
    cases = [
        (["--config", str(json_file)], {}, [f"invalid --config {json_file}", ".yaml, .yml or .toml"]),
        (["--config", str(unknown)], {}, [str(unknown), "unknown key `max_engines`", "`max-engines`"]),
        (["--config", str(bad_value)], {}, [str(bad_value), "'soon'", "--scale-out-timeout-secs"]),
        ([], {"ROLLOUT_MANAGER_CONFIG": str(invalid)}, ["invalid --scale-out-timeout-secs"]),
        ([], {"ROLLOUT_MANAGER_ROUTER_PORT": "high"}, ["'high'", "--router-port", "ROLLOUT_MANAGER_ROUTER_PORT"]),
        (["--scale-in-drain-timeout=-1"], {}, ["invalid --scale-in-drain-timeout-secs"]),
    ]
    for args, env, expected in cases:
        result = _run(manager_bin, "serve", "--state-dir", str(tmp_path / "state"), *args, env=env)
        assert result.returncode == 2, (args, env, result.stderr)
        for part in expected:
            assert part in result.stderr, (args, env, result.stderr)


def test_flag_beats_environment_beats_file(manager_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"port: {port}\n"
        "router-port: 0\n"
        "model-name: model-from-file\n"
        "weight-version: v-file\n"
        "gpus: 4\n"
        "rollout-num-gpus: 2\n"
        "engine-arg: [--time-scale=0.01]\n"
        "scale-in-drain-timeout: 5\n"
    )
    monkeypatch.setenv("ROLLOUT_MANAGER_CONFIG", str(config))
    monkeypatch.setenv("ROLLOUT_MANAGER_MODEL_NAME", "model-from-env")
    monkeypatch.setenv("ROLLOUT_MANAGER_WEIGHT_VERSION", "v-env")
    handle = _start(manager_bin, tmp_path / "fleet", ["--weight-version", "v-flag"])
    try:
        assert handle.control_url == f"http://127.0.0.1:{port}", "the port comes from the file"
        handle.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        answer = http("GET", f"{handle.control_url}/rollout/engines").json()
        assert list(answer["models"]) == ["model-from-env"], "the environment beats the file"
        engines = answer["models"]["model-from-env"]["engines"]
        assert {e["weight_version"] for e in engines} == {"v-flag"}, "the flag beats the environment"
        _no_manager_variables_in_engines(handle)
    finally:
        stop_manager(handle)


def test_a_flag_overrides_the_files_port(
    start_fleet: StartManager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = _free_port()
    config = tmp_path / "fleet.toml"
    config.write_text(f'port = {taken}\nmodel-name = "toml-model"\n')
    monkeypatch.setenv("ROLLOUT_MANAGER_CONFIG", str(config))
    fleet = start_fleet()  # with --port 0
    assert not fleet.control_url.endswith(f":{taken}")
    assert list(http("GET", f"{fleet.control_url}/rollout/engines").json()["models"]) == ["toml-model"]


def test_json_logs_and_the_token_from_the_environment(
    manager_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUT_MANAGER_API_TOKEN", "env-s3cret-token")
    monkeypatch.setenv("RUST_LOG", "debug")
    args = ["--port", "0", "--router-port", "0", "--log-format", "json", *DEFAULT_ARGS]
    handle = _start(manager_bin, tmp_path / "fleet", args)
    try:
        handle.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        scale = f"{handle.control_url}/rollout/scale_out"
        assert http("POST", scale, {"num_replicas": 2}).status == 401
        authed = http("POST", scale, {"num_replicas": 2}, headers={"Authorization": "Bearer env-s3cret-token"})
        assert authed.status == 200, authed.body
        _no_manager_variables_in_engines(handle)
    finally:
        stop_manager(handle)
    lines = [line for line in handle.stderr_path.read_text().splitlines() if line.strip()]
    assert lines, "the manager logged nothing"
    for line in lines:
        event = json.loads(line)
        assert {"timestamp", "level", "target"} <= event.keys(), line
    assert any(json.loads(line).get("message") == "launching engine" for line in lines)
    assert "env-s3cret" not in handle.stderr_path.read_text()
