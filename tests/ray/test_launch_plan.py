"""What ``elastic_rollout_ray.launch`` decides before touching a cluster (no Ray needed): the
manager's flags validated by the manager's own parser, the shim's flags added, bad runs refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_rollout_ray.launch import plan


def test_the_seed_flags_plan_a_ray_fleet(tmp_path: Path) -> None:
    p = plan(["--fully-async", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "1",
              "--serve-port", "8100", "--namespace", "fleet-a", "--state-dir", str(tmp_path / "s")])  # fmt: skip
    assert p.config["placement"] == "ray" and p.config["fully_async"] is True
    assert (p.config["rollout_num_gpus"], p.config["rollout_num_gpus_per_engine"]) == (4, 1)
    assert p.config["port"] == 0  # Serve is the front door; the manager's TCP port is a free one
    assert p.state_dir == str((tmp_path / "s").resolve())
    assert p.api_socket.endswith("/fleet-a/api.sock")
    assert (p.options.serve_port, p.options.namespace) == (8100, "fleet-a")
    # Launcher flags are not passed to the manager; the manager's are, in order.
    assert "--serve-port" not in p.serve_args and "--namespace" not in p.serve_args
    assert p.serve_args[:5] == ["--fully-async", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "1"]


def test_given_socket_port_and_state_dir_are_kept(tmp_path: Path) -> None:
    sock = str(tmp_path / "m.sock")
    p = plan(["--fully-async", "--api-socket", sock, "--port=9001", f"--state-dir={tmp_path}"])
    assert (p.api_socket, p.config["port"], p.state_dir) == (sock, 9001, str(tmp_path))
    assert p.serve_args.count("--api-socket") == 1


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--rollout-num-gpus", "2"], "needs --fully-async"),
        (["--fully-async", "--placement", "local"], "invalid --placement"),
        (["--fully-async", "--rollout-num-gpus-per-engine", "0"], "invalid --rollout-num-gpus-per-engine"),
        (["--fully-async", "--no-such-flag"], "unexpected argument '--no-such-flag'"),
        (["--fully-async", "--api-socket", "/tmp/" + "x" * 120], "invalid --api-socket"),
    ],
)
def test_bad_runs_are_refused_with_the_flag_named(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        plan(argv)
    assert caught.value.code == 2
    assert expected in capsys.readouterr().err


def test_each_job_gets_its_own_state_and_resume_is_explicit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    jobs = tmp_path / ".cache" / "elastic-rollout" / "fleet-b"
    # A submitted job: Ray passes its submission id in the job config.
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"metadata": {"job_submission_id": "raysubmit_abc"}}')
    first = plan(["--fully-async", "--namespace", "fleet-b"])
    assert first.state_dir == str(jobs / "raysubmit_abc")
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"metadata": {"job_submission_id": "raysubmit_def"}}')
    assert plan(["--fully-async", "--namespace", "fleet-b"]).state_dir == str(jobs / "raysubmit_def")
    (jobs / "raysubmit_abc").mkdir(parents=True)
    resumed = plan(["--fully-async", "--namespace", "fleet-b", "--resume", "raysubmit_abc"])
    assert resumed.state_dir == first.state_dir
    for argv, expected in [
        (["--resume", "nosuch"], "invalid --resume 'nosuch'"),
        (["--resume", "../x"], "invalid --resume"),
        (["--resume", "raysubmit_abc", "--state-dir", str(tmp_path)], "--resume and --state-dir"),
    ]:
        with pytest.raises(SystemExit) as caught:
            plan(["--fully-async", "--namespace", "fleet-b", *argv])
        assert caught.value.code == 2
        assert expected in capsys.readouterr().err


def test_environment_and_config_file_count_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The launcher validates what the manager will read: its ROLLOUT_MANAGER_* variables (the
    manager actor gets the launcher's environment) and the --config file (passed on by absolute
    path, as the actor may run elsewhere); a setting from either is not overridden by the
    launcher's own defaults."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fleet.yaml").write_text(f"port: 9200\nrollout-num-gpus: 4\nstate-dir: {tmp_path / 'st'}\n")
    monkeypatch.setenv("ROLLOUT_MANAGER_FULLY_ASYNC", "true")
    monkeypatch.setenv("ROLLOUT_MANAGER_API_SOCKET", str(tmp_path / "env.sock"))
    p = plan(["--config", "fleet.yaml"])
    assert (p.config["port"], p.config["rollout_num_gpus"], p.config["fully_async"]) == (9200, 4, True)
    assert (p.state_dir, p.api_socket) == (str(tmp_path / "st"), str(tmp_path / "env.sock"))
    assert p.serve_args[p.serve_args.index("--config", 2) + 1] == str(tmp_path / "fleet.yaml")
    assert "--port" not in p.serve_args and "--state-dir" not in p.serve_args and "--api-socket" not in p.serve_args
    # --resume conflicts with a state dir from the file as with the flag.
    with pytest.raises(SystemExit):
        plan(["--config", "fleet.yaml", "--resume", "x"])
    assert "--resume and --state-dir" in capsys.readouterr().err
    # A placement other than ray, from the environment, is refused as the flag is.
    monkeypatch.setenv("ROLLOUT_MANAGER_PLACEMENT", "local")
    with pytest.raises(SystemExit):
        plan([])
    assert "invalid --placement" in capsys.readouterr().err
    monkeypatch.delenv("ROLLOUT_MANAGER_PLACEMENT")
    # Bad files fail before anything starts, naming --config, the file and the key.
    (tmp_path / "bad.yml").write_text("rollout_num_gpus: 4\n")
    with pytest.raises(SystemExit) as caught:
        plan(["--config", "bad.yml"])
    assert caught.value.code == 2
    assert "invalid --config bad.yml: unknown key `rollout_num_gpus`" in capsys.readouterr().err


def test_the_old_ready_timeout_spelling_still_works(tmp_path: Path) -> None:
    args = ["--fully-async", "--state-dir", str(tmp_path)]
    assert plan([*args, "--ready-timeout", "7"]).options.ready_timeout == 7.0
    assert plan([*args, "--ready-timeout-secs", "8"]).options.ready_timeout == 8.0
