"""The wheels of `make wheel`, installed in a fresh venv outside the checkout, run the quick start.

One module fixture builds both wheels with deploy/build-wheels.sh as `make wheel` runs it: for
this machine's architecture, linked against glibc 2.28 with zig
(TARGET=<arch>-unknown-linux-gnu.2.28), with PROFILE=debug (a debug build of the binaries for that
target, not a release build). It creates a venv in a temp dir outside the repository
(``python -m venv``, with pip, without the checkout's site-packages) and pip-installs the wheels
there with ``--no-index`` (the client's runtime dependencies, httpx and its own, from a directory
the checkout's pip downloads them to first: the one step that needs the package index). The Ray
shim's wheel is installed with ``--no-deps``: Ray itself is not installed in that venv (that would need the
package index and ~1 GB), so what is proven for it is that the wheel installs, imports, declares
its dependencies, and that its launcher parses and validates a command line with the installed
native module. Its run on a Ray cluster is tests/ray/'s job, from the checkout.

Every command runs from a directory outside the checkout, with a PATH of the venv and the system
only, and without the ELASTIC_ROLLOUT_*_BIN overrides, so nothing can come from the checkout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _support import INITIAL_ENGINES, STARTUP_TIMEOUT, http, start_manager, stop_manager, wait_until

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "deploy" / "build-wheels.sh"
#: What `make wheel` builds by default: this machine's architecture, for glibc 2.28 and newer.
WHEEL_GLIBC_MINOR = 28
TARGET = f"{platform.machine()}-unknown-linux-gnu.2.{WHEEL_GLIBC_MINOR}"
#: A cold build of the binaries and the native module for the target takes a few minutes.
BUILD_TIMEOUT = 1200.0
PIP_TIMEOUT = 300.0

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("maturin") is None or importlib.util.find_spec("ziglang") is None,
        reason=f"maturin or ziglang is not installed in {sys.executable} (`make venv` installs both): no wheel",
    ),
    # The first test pays the module fixture's build and installs (each bounded above), past
    # pytest.ini's 300 s when the machine is busy.
    pytest.mark.timeout(int(BUILD_TIMEOUT + 3 * PIP_TIMEOUT)),
]


@dataclass(frozen=True)
class Installed:
    wheels: Path
    venv: Path
    site_packages: Path
    cwd: Path
    env: dict[str, str]

    def bin(self, name: str) -> Path:
        return self.venv / "bin" / name

    def run(self, *argv: str | Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(a) for a in argv], cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def python(self, code: str) -> str:
        done = self.run(self.bin("python"), "-c", code)
        assert done.returncode == 0, f"venv python failed ({done.returncode}):\n{done.stderr}"
        return done.stdout


def _wheel(directory: Path, prefix: str) -> Path:
    found = sorted(directory.glob(f"{prefix}-*.whl"))
    assert len(found) == 1, f"expected one {prefix}-*.whl in {directory}, found {[p.name for p in found]}"
    return found[0]


def _runtime_requires(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` entries that are not behind an extra."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    found = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    return [r for r in found if "extra ==" not in r]


def _clean_env(venv: Path) -> dict[str, str]:
    """The environment of a shell in which only the fresh venv is activated."""
    drop = {"ELASTIC_ROLLOUT_MANAGER_BIN", "ELASTIC_ROLLOUT_SIM_BIN", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PIP_")}
    env.update(PATH=f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", VIRTUAL_ENV=str(venv), NO_COLOR="1")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    assert not root.resolve().is_relative_to(REPO), f"temp dir {root} is inside the checkout"
    wheels, venv, cwd = root / "dist", root / "venv", root / "elsewhere"
    cwd.mkdir()

    build = subprocess.run(
        [str(BUILD_SCRIPT), str(wheels)],
        cwd=REPO,
        env={**os.environ, "PROFILE": "debug", "PYTHON": sys.executable, "TARGET": TARGET},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    assert build.returncode == 0, f"{BUILD_SCRIPT.name} failed ({build.returncode}):\n{build.stdout}\n{build.stderr}"

    # The client's runtime dependencies (httpx and what it needs), fetched once by the checkout's
    # pip into a local directory: the wheels themselves are still installed with --no-index.
    requires = _runtime_requires(_wheel(wheels, "elastic_rollout"))
    assert any(r.startswith("httpx") for r in requires), requires
    deps = root / "deps"
    fetch = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--dest", str(deps), *requires]
    done = subprocess.run(fetch, cwd=cwd, capture_output=True, text=True, timeout=PIP_TIMEOUT)
    assert done.returncode == 0, f"{' '.join(fetch)} failed:\n{done.stdout}\n{done.stderr}"

    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, cwd=cwd, timeout=PIP_TIMEOUT)
    env = _clean_env(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(deps)]
    for argv in (
        [*pip, str(_wheel(wheels, "elastic_rollout"))],
        [*pip, "--no-deps", str(_wheel(wheels, "elastic_rollout_ray"))],
    ):
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=PIP_TIMEOUT)
        assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"

    site = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=cwd, env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    return Installed(wheels, venv, site, cwd, env)


def _glibc_minor(path: Path) -> int:
    """The newest GLIBC_2.y symbol version an ELF file needs (readelf --dyn-syms)."""
    dump = subprocess.run(["readelf", "--dyn-syms", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    return max((int(m) for m in re.findall(r"GLIBC_2\.(\d+)", dump)), default=0)


def test_platform_tag_is_the_glibc_the_binaries_need(installed: Installed) -> None:
    wheel = _wheel(installed.wheels, "elastic_rollout")
    tag = re.fullmatch(r"elastic_rollout-[^-]+-cp310-abi3-manylinux_2_(\d+)_(x86_64|aarch64)\.whl", wheel.name)
    assert tag, f"unexpected wheel name {wheel.name}"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {"elastic_rollout/_bin/rollout-manager", "elastic_rollout/_bin/sglang-sim"} <= names
    assert "rollout-manager=elastic_rollout._bin_entry:rollout_manager" in entry_points.replace(" ", "")
    assert "sglang-sim=elastic_rollout._bin_entry:sglang_sim" in entry_points.replace(" ", "")
    package = installed.site_packages / "elastic_rollout"
    needs = {p.name: _glibc_minor(p) for p in [package / "_bin" / "rollout-manager", package / "_bin" / "sglang-sim"]}
    needs["_native"] = _glibc_minor(next(package.glob("_native*.so")))
    # The tag is the binaries' newest glibc (never below manylinux's 2.17), and nothing needs more.
    assert int(tag[1]) == max(17, needs["rollout-manager"], needs["sglang-sim"]), (wheel.name, needs)
    assert max(needs.values()) <= int(tag[1]), (wheel.name, needs)
    # Installable where many GPU clusters still run: RHEL/Rocky 8 (2.28), Ubuntu 20.04 and Debian 11.
    assert int(tag[1]) <= WHEEL_GLIBC_MINOR and tag[2] == platform.machine(), (wheel.name, needs)


def test_auditwheel_finds_the_wheel_consistent_with_its_tag(installed: Installed) -> None:
    """auditwheel (the PyPA's checker) reads every ELF file in the wheel, the packaged binaries
    too, and must find the tag the wheel carries within what they need."""
    wheel = _wheel(installed.wheels, "elastic_rollout")
    tag = wheel.name.rsplit("-", 1)[1].removesuffix(".whl")
    shown = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", str(wheel)], capture_output=True, text=True, timeout=300
    )
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert f'consistent with the following platform tag: "{tag}"' in text, text


def test_console_scripts_exec_the_packaged_binaries(installed: Installed) -> None:
    for name in ("rollout-manager", "sglang-sim"):
        packaged = installed.site_packages / "elastic_rollout" / "_bin" / name
        assert os.access(packaged, os.X_OK), f"{packaged} is not executable"
        assert installed.bin(name).is_file(), f"no console script {installed.bin(name)}"
    version = installed.run("rollout-manager", "--version")
    assert version.returncode == 0 and version.stdout.startswith("rollout-manager "), version
    # Arguments pass through untouched and the binary's exit status is the command's.
    bad = installed.run("rollout-manager", "serve", "--no-such-flag")
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr, bad
    sim = installed.run("sglang-sim", "--help")
    assert sim.returncode == 0 and "Usage: sglang-sim" in sim.stdout, sim


def test_installed_package_finds_its_own_binaries(installed: Installed) -> None:
    # A checkout's cargo build on PATH does not shadow the packaged binaries.
    env = {**installed.env, "PATH": f"{installed.env['PATH']}:{REPO / 'target' / 'debug'}"}
    done = subprocess.run(
        [
            str(installed.bin("python")),
            "-c",
            "import json; from elastic_rollout import find_binary, _native; "
            "print(json.dumps([str(find_binary('rollout-manager')), str(find_binary('sglang-sim')),"
            " _native.binary_path()]))",
        ],
        cwd=installed.cwd, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    bundled = installed.site_packages / "elastic_rollout" / "_bin"
    manager, sim, native = (Path(p) for p in json.loads(done.stdout))
    assert (manager, sim, native) == (bundled / "rollout-manager", bundled / "sglang-sim", bundled / "rollout-manager")


@pytest.fixture
def in_fresh_shell(installed: Installed, monkeypatch: pytest.MonkeyPatch) -> Iterator[Installed]:
    """Run this test's child processes as from a shell with only the fresh venv, outside the checkout."""
    monkeypatch.chdir(installed.cwd)
    for key in list(os.environ):
        if key not in installed.env:
            monkeypatch.delenv(key)
    for key, value in installed.env.items():
        monkeypatch.setenv(key, value)
    yield installed


def test_quick_start_with_the_installed_wheel(in_fresh_shell: Installed) -> None:
    """README's quick start: `rollout-manager serve --engine sim ...` (on free loopback ports, with a
    faster simulator), 2 engines ACTIVE, a /generate through the router, scale out to 4 and in to 2,
    then SIGTERM: the manager and every engine exit."""
    installed = in_fresh_shell
    bundled = (installed.site_packages / "elastic_rollout" / "_bin").resolve()
    fleet = start_manager(installed.bin("rollout-manager"), installed.cwd / ".rollout-state", ("--engine", "sim"))
    try:
        # The console script exec'd the packaged binary: same pid, no Python in between.
        assert Path(f"/proc/{fleet.process.pid}/exe").resolve() == bundled / "rollout-manager"
        wait_until(lambda: http("GET", f"{fleet.control_url}/health").status == 200, STARTUP_TIMEOUT, "/health 200")
        view = fleet.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        for engine in view.engines:
            assert engine.pid is not None
            assert Path(f"/proc/{engine.pid}/exe").resolve() == bundled / "sglang-sim", engine

        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16}}
        answer = http("POST", f"{fleet.router_url}/generate", body)
        assert answer.status == 200, answer.body[:500]
        assert isinstance(answer.json().get("text"), str) and answer.json()["text"], answer.json()

        out = fleet.client.scale_out(num_replicas=4)
        assert out.request_id, out.raw
        op = fleet.client.wait_for_operation("scale_out", out.request_id, timeout=STARTUP_TIMEOUT)
        assert op.status == "ACTIVE", f"scale_out -> {op.status}: {op.error_message}\n{fleet.stderr_tail()}"
        fleet.engines()
        scale_in = fleet.client.scale_in(num_replicas=2)
        assert scale_in.request_id, scale_in.raw
        op = fleet.client.wait_for_operation("scale_in", scale_in.request_id, timeout=STARTUP_TIMEOUT)
        assert op.status == "COMPLETED", f"scale_in -> {op.status}: {op.error_message}\n{fleet.stderr_tail()}"
        fleet.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT)
    finally:
        stop_manager(fleet)
    assert fleet.process.returncode == 0, f"manager exit code {fleet.process.returncode}\n{fleet.stderr_tail()}"
    assert not fleet.surviving_engines()


def test_ray_shim_wheel_installs_and_its_launcher_validates(installed: Installed) -> None:
    wheel = _wheel(installed.wheels, "elastic_rollout_ray")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = {line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")}
    assert {"elastic-rollout", "ray[serve]==2.60.*"} <= requires, requires

    help_run = installed.run("python", "-m", "elastic_rollout_ray.launch", "--help")
    assert help_run.returncode == 0 and "--serve-port" in help_run.stdout, help_run
    # The launcher's plan (no Ray needed with an explicit --state-dir): the installed native
    # module's parser accepts a good command line and refuses one without --fully-async.
    code = (
        "import json, sys; from elastic_rollout_ray.launch import plan; "
        "p = plan(sys.argv[1:]); print(json.dumps(p.serve_args))"
    )
    args = ["--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "1", "--state-dir", str(installed.cwd / "s")]
    good = installed.run("python", "-c", code, "--fully-async", *args)
    assert good.returncode == 0, good.stderr
    assert "--placement" in json.loads(good.stdout)
    refused = installed.run("python", "-c", code, *args)
    assert refused.returncode == 2 and "--fully-async" in refused.stderr, refused
