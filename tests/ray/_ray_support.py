"""What the Ray tests share: a real local Ray cluster (fixture ``ray_cluster``,
``ray.cluster_utils.Cluster`` with logical GPUs), its handle and a free port.

One cluster per test module (Ray's start is the slow part); :func:`local_cluster` makes one with
several nodes. Every cluster gets its own temp dir
(``RAY_TMPDIR`` too, so even Ray's "current cluster" address file is ours) and is stopped by
killing only its own node processes: never ``ray stop``, which would kill every Ray of the user.
This is not a ``conftest.py``: a second module of that name would shadow ``tests/conftest.py``
for the tests that import from it. A module using the fixture imports it.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: Logical GPUs of the head node.
HEAD_GPUS = 4


#: Ports Ray's components take by default (dashboard agent HTTP, dashboard, GCS, client server,
#: metrics export): a port the kernel hands out may be one of them, just freed by a cluster that
#: shut down, and Ray refuses a dashboard port that another component also wants.
RAY_DEFAULT_PORTS = {52365, 8265, 6379, 10001, 8080}


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port not in RAY_DEFAULT_PORTS:
            return port


def serve_actors() -> list[dict[str, str]]:
    """Ray Serve's named actors on the connected cluster (its controller, proxies and replicas)."""
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]


@dataclass
class RayCluster:
    cluster: Any
    temp_dir: Path
    dashboard_url: str
    env: dict[str, str]

    def ray_cli(self) -> list[str]:
        return [sys.executable, "-m", "ray.scripts.scripts"]


@contextmanager
def local_cluster(
    temp_dir: Path,
    manager_bin: Path,
    head: dict[str, Any],
    workers: Sequence[dict[str, Any]] = (),
    home: Path | None = None,
) -> Iterator[RayCluster]:
    """A real Ray cluster on this machine: a head (with the dashboard, for ``ray job``) and one
    raylet per entry of ``workers``. Ray's own settings are left at their defaults (the job stop
    wait included). ``home`` becomes the cluster processes' ``HOME`` (where the launcher keeps
    fleet state by default)."""
    import ray
    from ray.cluster_utils import Cluster

    (temp_dir / "ray").mkdir(exist_ok=True)
    keys = ("RAY_TMPDIR", "ELASTIC_ROLLOUT_MANAGER_BIN", "HOME")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["RAY_TMPDIR"] = str(temp_dir)
    # The processes Ray starts use the binary the other tests use (the freshest cargo build).
    os.environ["ELASTIC_ROLLOUT_MANAGER_BIN"] = str(manager_bin)
    if home is not None:
        os.environ["HOME"] = str(home)
    dashboard_port = free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **head,
            "temp_dir": str(temp_dir / "ray"),
            "include_dashboard": True,
            "dashboard_port": dashboard_port,
        },
    )
    env = {**os.environ, "RAY_ADDRESS": f"http://127.0.0.1:{dashboard_port}"}
    try:
        for worker in workers:
            cluster.add_node(**worker)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="er-tests", log_to_driver=False)
        yield RayCluster(cluster, temp_dir, f"http://127.0.0.1:{dashboard_port}", env)
    finally:
        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory, manager_bin: Path) -> Iterator[RayCluster]:
    """One node: a head with :data:`HEAD_GPUS` logical GPUs."""
    # Short paths: Ray's Unix sockets live under the temp dir (108-byte limit).
    temp_dir = Path(tmp_path_factory.mktemp("ray", numbered=True))
    with local_cluster(temp_dir, manager_bin, {"num_cpus": 16, "num_gpus": HEAD_GPUS}) as cluster:
        yield cluster
