"""deploy/: the Dockerfile, the KubeRay RayJob and the KEDA alternative, checked without a cluster.

- the manifests against JSON Schemas of the KubeRay and KEDA CRDs (tests/schemas/, written for
  this repository; each names the upstream commit it was derived from), plus KubeRay's own checks
  that a schema cannot express;
- the RayJob's entrypoint through the launcher's own planning (its parser and the manager's, via
  elastic_rollout._native), so a flag typo fails here and not on the cluster;
- the names the files share: image tag, Ray version, ports, Service name, Secret, metric names;
- the KEDA engines' postStart / preStop hooks, run as written against a real manager (with a
  token) and a standalone sglang-sim standing in for the SGLang pod;
- what can be checked of the Dockerfile without Docker (there is none on the CI machine): COPY
  sources, the base image's Ray version, the wheels it installs, no secrets, a non-root user.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from _support import STARTUP_TIMEOUT, StartManager, freshest_build, http, wait_until
from jsonschema import Draft202012Validator

from elastic_rollout import _native
from elastic_rollout._find import find_binary

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
RAYJOB = DEPLOY / "kuberay" / "rayjob.yaml"
KEDA = DEPLOY / "kuberay" / "keda-scaledobject.yaml"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
LAUNCH_MODULE = "elastic_rollout_ray.launch"


def _schema(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((SCHEMAS / name).read_text())
    Draft202012Validator.check_schema(schema)
    return schema


def _errors(schema: dict[str, Any], doc: Any) -> list[str]:
    validator = Draft202012Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]


def _rayjob() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(RAYJOB.read_text())
    return doc


def _keda_docs() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(KEDA.read_text())}


def _ray_pin() -> str:
    """The Ray minor version the Makefile installs (`ray[serve]==2.60.*` -> "2.60")."""
    pin = re.search(r"ray\[serve\]==(\d+\.\d+)\.\*", (REPO / "Makefile").read_text())
    assert pin, "the Makefile no longer pins ray[serve]==X.Y.*"
    return pin[1]


def _version(pyproject: Path) -> str:
    version: str = tomllib.loads(pyproject.read_text())["project"]["version"]
    return version


def _documented_image() -> str:
    """The tag the Dockerfile's header tells you to build: the name the manifests must use."""
    tags = set(re.findall(r"docker build -f deploy/docker/Dockerfile -t (\S+)", DOCKERFILE.read_text()))
    assert len(tags) == 1, f"the Dockerfile should document one tag, found {tags}"
    return tags.pop()


def _entrypoint_args() -> list[str]:
    argv = shlex.split(_rayjob()["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", LAUNCH_MODULE], argv
    return argv[3:]


def _flag(args: list[str], flag: str, default: str) -> str:
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return default


def _containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    containers: list[dict[str, Any]] = template["spec"]["containers"]
    return containers


def _pod_templates() -> list[dict[str, Any]]:
    cluster = _rayjob()["spec"]["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    return [*templates, _keda_docs()["Deployment"]["spec"]["template"]]


# -- the RayJob ----------------------------------------------------------------------------


def test_rayjob_matches_the_kuberay_schema() -> None:
    errors = _errors(_schema("rayjob.schema.json"), _rayjob())
    assert not errors, "\n".join(errors)


def test_rayjob_schema_rejects_what_kuberay_would() -> None:
    """The schema is not vacuous: typical mistakes fail it."""
    schema = _schema("rayjob.schema.json")
    bad_field = _rayjob()
    bad_field["spec"]["shutdownAfterJobFinish"] = True
    bad_mode = _rayjob()
    bad_mode["spec"]["submissionMode"] = "K8sJob"
    bad_quantity = _rayjob()
    bad_quantity["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"][
        "limits"
    ]["memory"] = "64 GB"
    bad_container_field = _rayjob()
    bad_container_field["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imge"] = "x"
    long_name = _rayjob()
    long_name["metadata"]["name"] = "e" * 48
    for doc in (bad_field, bad_mode, bad_quantity, bad_container_field, long_name):
        assert _errors(schema, doc), "the schema accepted a broken RayJob"


def test_rayjob_passes_kuberays_own_checks() -> None:
    """What ray-operator/controllers/ray/utils/validation.go checks and a schema cannot."""
    spec = _rayjob()["spec"]
    cluster = spec["rayClusterSpec"]
    for group in cluster["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"], group
    if cluster.get("authOptions", {}).get("mode") == "token":
        assert tuple(map(int, cluster["rayVersion"].split("."))) >= (2, 52), "token auth needs Ray >= 2.52"
    if spec.get("suspend"):
        assert spec.get("shutdownAfterJobFinishes"), "a suspended RayJob needs shutdownAfterJobFinishes"
    assert "clusterSelector" not in spec, "this RayJob brings its own cluster"


def test_rayjob_head_has_no_gpus_and_workers_do() -> None:
    cluster = _rayjob()["spec"]["rayClusterSpec"]
    for container in _containers(cluster["headGroupSpec"]["template"]):
        for kind in ("limits", "requests"):
            assert "nvidia.com/gpu" not in container.get("resources", {}).get(kind, {}), container["name"]
    assert "num-gpus" not in cluster["headGroupSpec"].get("rayStartParams", {})
    for group in cluster["workerGroupSpecs"]:
        for container in _containers(group["template"]):
            gpus = container["resources"]["limits"].get("nvidia.com/gpu")
            assert isinstance(gpus, int) and gpus >= 1, f"{group['groupName']}: no nvidia.com/gpu limit"
            # Bundles are {"GPU": --rollout-num-gpus-per-engine}: a pod must hold one engine.
            assert gpus >= int(_flag(_entrypoint_args(), "--rollout-num-gpus-per-engine", "1"))


def test_rayjob_entrypoint_plans_with_the_launchers_own_parser(tmp_path: Path) -> None:
    """A dry run of the entrypoint: the launcher's flags and the manager's, as on the cluster."""
    import importlib.util

    from elastic_rollout_ray.launch import plan

    assert importlib.util.find_spec(LAUNCH_MODULE) is not None
    args = _entrypoint_args()
    launch = plan([*args, "--state-dir", str(tmp_path / "state")])
    assert launch.config["fully_async"] and launch.config["placement"] == "ray"
    # A typo of either kind of flag is caught by the same dry run.
    for typo in ("--rollout-num-gpu", "--serve-prot"):
        with pytest.raises(SystemExit) as exited:
            plan([*args, typo, "1", "--state-dir", str(tmp_path / "state")])
        assert exited.value.code == 2
    help_run = subprocess.run([sys.executable, "-m", LAUNCH_MODULE, "--help"], capture_output=True, text=True)
    assert help_run.returncode == 0, help_run.stderr
    for flag in re.findall(r"(--[a-z-]+)", " ".join(a for a in args if a.startswith("--serve") or a == "--namespace")):
        assert flag in help_run.stdout, f"{flag} is not a launcher flag"


def test_rayjob_ports_match_the_entrypoint_and_the_defaults() -> None:
    args = _entrypoint_args()
    defaults = _native.parse_serve_args([])
    serve_port = int(_flag(args, "--serve-port", "8000"))
    router_port = int(_flag(args, "--router-port", str(defaults["router_port"])))
    # The README's ports: the control API on 8000 (Serve, in Ray mode) and the router on 30000.
    assert (serve_port, router_port) == (defaults["port"], defaults["router_port"]) == (8000, 30000)
    head = _containers(_rayjob()["spec"]["rayClusterSpec"]["headGroupSpec"]["template"])[0]
    ports = {p["containerPort"] for p in head["ports"]}
    assert {serve_port, router_port, 6379, 8265} <= ports, ports
    # Reachable from other pods: Serve and the router listen beyond loopback.
    assert _flag(args, "--serve-host", "127.0.0.1") == "0.0.0.0"
    assert _flag(args, "--host", "127.0.0.1") == "0.0.0.0"


def test_manifests_use_the_dockerfiles_image_and_ray_version() -> None:
    image = _documented_image()
    tag = image.rsplit(":", 1)[1]
    version = _version(REPO / "python" / "pyproject.toml")
    assert tag.startswith(f"{version}-ray{_ray_pin()}."), (image, version, _ray_pin())
    cluster = _rayjob()["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == tag.split("-ray", 1)[1]
    images = {c["image"] for t in _pod_templates() for c in _containers(t)}
    assert images == {image}, images


def test_token_comes_from_one_secret_everywhere() -> None:
    refs = set()
    for template in _pod_templates():
        for container in _containers(template):
            for env in container.get("env", []):
                if env["name"] == "ROLLOUT_MANAGER_API_TOKEN":
                    assert "value" not in env, "the token must come from a Secret, not the manifest"
                    ref = env["valueFrom"]["secretKeyRef"]
                    refs.add((ref["name"], ref["key"]))
    assert len(refs) == 1, refs
    head_env = _containers(_rayjob()["spec"]["rayClusterSpec"]["headGroupSpec"]["template"])[0]["env"]
    assert any(e["name"] == "ROLLOUT_MANAGER_API_TOKEN" for e in head_env)
    (secret, key), = refs  # fmt: skip
    assert f"secret generic {secret} --from-literal={key}=" in RAYJOB.read_text()


# -- the KEDA alternative ------------------------------------------------------------------


def test_scaledobject_matches_the_keda_schema() -> None:
    docs = _keda_docs()
    assert set(docs) == {"ScaledObject", "Deployment"}, set(docs)
    errors = _errors(_schema("scaledobject.schema.json"), docs["ScaledObject"])
    assert not errors, "\n".join(errors)
    broken = _keda_docs()["ScaledObject"]
    broken["spec"]["triggers"][0]["metadata"]["treshold"] = "1"
    assert _errors(_schema("scaledobject.schema.json"), broken), "the schema accepted a misspelt trigger key"


def test_keda_deployment_is_the_scale_target_and_its_pods_are_valid() -> None:
    docs = _keda_docs()
    target, deployment = docs["ScaledObject"]["spec"]["scaleTargetRef"], docs["Deployment"]
    assert (target.get("apiVersion"), target.get("kind"), target["name"]) == (
        deployment["apiVersion"],
        deployment["kind"],
        deployment["metadata"]["name"],
    )
    assert deployment["apiVersion"] == "apps/v1"
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    rayjob_schema = _schema("rayjob.schema.json")
    pod_schema = {"$defs": rayjob_schema["$defs"], "$ref": "#/$defs/podTemplate"}
    errors = _errors(pod_schema, deployment["spec"]["template"])
    assert not errors, "\n".join(errors)


def _engine_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_keda_engines_reach_the_rayjobs_head_and_allowed_network() -> None:
    container = _containers(_keda_docs()["Deployment"]["spec"]["template"])[0]
    env = _engine_env(container)
    head = _rayjob()["spec"]["rayClusterSpec"]["headGroupSpec"]["headService"]["metadata"]["name"]
    assert env["ROLLOUT_CONTROL_URL"] == f"http://{head}:{_flag(_entrypoint_args(), '--serve-port', '8000')}"
    assert env["ENGINE_PORT"] == _flag(container["args"], "--port", "") == str(container["ports"][0]["containerPort"])
    assert _flag(_entrypoint_args(), "--external-allow-cidr", ""), "the manager must allow the engines' network"
    assert f"{head}:8000/metrics" in KEDA.read_text(), "say where Prometheus scrapes the manager"


def _prometheus_query() -> str:
    trigger = _keda_docs()["ScaledObject"]["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    query: str = trigger["metadata"]["query"]
    return query


@pytest.fixture
def token_file(tmp_path: Path) -> tuple[Path, str]:
    token = "deploy-test-token"
    path = tmp_path / "token"
    path.write_text(token)
    path.chmod(0o600)
    return path, token


def test_keda_metrics_and_hooks_against_a_real_manager(
    start_fleet: StartManager, token_file: tuple[Path, str], tmp_path: Path
) -> None:
    """The metrics the trigger's query reads exist on the manager, and the pod's postStart hook
    attaches an engine (with the token) that its preStop hook then detaches."""
    path, token = token_file
    fleet = start_fleet("--api-token-file", str(path), "--max-inflight-per-engine", "32")
    metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
    exported = set(re.findall(r"^([a-z_]+)(?:\{| )", metrics, flags=re.M))
    wanted = set(re.findall(r"\b(rollout_[a-z_]+)\b", _prometheus_query()))
    assert wanted and wanted <= exported, f"not exported: {wanted - exported}"

    port = _free_port()
    sim = subprocess.Popen(
        [str(freshest_build(find_binary("sglang-sim"))), "--model-path", "sim-model", "--port", str(port),
         "--time-scale", "0.01"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "sim.log", "wb"), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        container = _containers(_keda_docs()["Deployment"]["spec"]["template"])[0]
        env = {
            **os.environ,
            "POD_IP": "127.0.0.1",
            "ENGINE_PORT": str(port),
            "ROLLOUT_CONTROL_URL": fleet.control_url,
            "ROLLOUT_MANAGER_API_TOKEN": token,
        }
        me = f"http://127.0.0.1:{port}"

        def hook(name: str) -> subprocess.CompletedProcess[str]:
            argv = container["lifecycle"][name]["exec"]["command"]
            assert argv[:2] == ["python", "-c"], argv
            return subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True, text=True, timeout=120)

        attached = hook("postStart")
        assert attached.returncode == 0, attached.stderr
        fleet.wait_engines(3, "ACTIVE", STARTUP_TIMEOUT)
        assert any(e.url == me and e.origin == "external" for e in fleet.engines().engines)

        detached = hook("preStop")
        assert detached.returncode == 0, detached.stderr
        assert detached.stdout.strip().splitlines()[-1] == "COMPLETED", detached.stdout
        wait_until(lambda: all(e.url != me for e in fleet.engines().engines), 30, "the engine to be detached")
        assert sim.poll() is None, "an external engine is detached, never stopped"
    finally:
        sim.kill()
        sim.wait(timeout=10)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the Dockerfile ------------------------------------------------------------------------


def _dockerfile_lines() -> list[str]:
    """Instructions with their continuation lines joined, comments dropped."""
    joined, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += " " + line.rstrip("\\").strip()
        if not line.endswith("\\"):
            joined.append(current.strip())
            current = ""
    return joined


def test_dockerfile_copies_what_exists_and_the_context_admits() -> None:
    ignore = (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copies = [line.split()[1:] for line in _dockerfile_lines() if line.startswith("COPY ")]
    assert copies
    for words in copies:
        if any(w.startswith("--from=") for w in words):
            continue
        for source in [w for w in words if not w.startswith("--")][:-1]:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            assert source.rstrip("/") in admitted, f"COPY {source}: excluded by Dockerfile.dockerignore"


def test_dockerfile_base_image_is_the_pinned_ray_and_installs_both_wheels() -> None:
    lines = _dockerfile_lines()
    base = next(line.split("=", 1)[1] for line in lines if line.startswith("ARG RAY_IMAGE="))
    assert re.fullmatch(rf"rayproject/ray:{re.escape(_ray_pin())}\.\d+-py311(-gpu)?", base), base
    assert _documented_image().endswith(f"-ray{base.split(':')[1].split('-')[0]}")
    install = next(line for line in lines if "pip install" in line and "--mount=type=bind,from=builder" in line)
    for project in (REPO / "python" / "pyproject.toml", REPO / "ray_integration" / "pyproject.toml"):
        wheel_name = tomllib.loads(project.read_text())["project"]["name"].replace("-", "_")
        assert f"/tmp/wheels/{wheel_name}-*.whl" in install, f"{wheel_name} wheel not installed"
    build = next(line for line in lines if "deploy/build-wheels.sh" in line and line.startswith("RUN "))
    assert "cargo build --release --workspace --bins" in build and "PROFILE=release" in build


def test_dockerfile_runs_as_non_root_and_keeps_no_secrets() -> None:
    lines = _dockerfile_lines()
    runtime = lines[next(i for i, line in enumerate(lines) if line.startswith("FROM ${RAY_IMAGE}")) :]
    users = [line.split()[1] for line in runtime if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), users
    for line in lines:
        if line.startswith(("ARG ", "ENV ")):
            assert not re.search(r"TOKEN|SECRET|PASSWORD|KEY", line.split()[1], re.I), line
