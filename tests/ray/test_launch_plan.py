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
