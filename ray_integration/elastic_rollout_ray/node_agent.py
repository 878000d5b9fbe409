"""The node agent actor: runs one ``rollout-manager agent`` per node, for every engine there.

The reconciler starts one :class:`NodeAgentImpl` (as the Ray actor ``er-agent-<node_id>``, pinned
to its node, no CPUs or GPUs of its own) on each node where a placement group of the fleet
lands. It starts the agent with ``--listen <node_ip>:0 --ready-file <f>``, waits for the ready
file (the agent's bound URL) and reports ``{url, node_id, ...}``; every engine on the node is then
launched through that one agent, on the GPUs its own bundle was given (the manager sets each
engine's ``CUDA_VISIBLE_DEVICES`` from the ids the reconciler read in the bundle). The agent gets
the manager's API token (environment, never argv), so only the manager can drive it. If the
agent exits it is restarted on the same port (the manager's stored URL stays valid and it sees
the engines gone). The agent dies with the actor (parent-death signal) and stops its engines;
:meth:`NodeAgentImpl.stop` does the same politely.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit

from elastic_rollout_ray.process import SupervisedProcess
from elastic_rollout_ray.wire import AgentInfo

__all__ = ["NodeAgentImpl", "agent_work_dir"]


def agent_work_dir(namespace: str, name: str, root: str | None = None) -> Path:
    """A new node-local directory (0700) for one agent: ready file, state, engine logs. Unique
    per agent start, so fleets and restarts never share one. Under ``root`` (the launcher's
    ``--agent-dir``) if given, else under the node's temp dir."""
    base = Path(root) if root else Path(tempfile.gettempdir()) / f"elastic-rollout-{os.getuid()}"
    parent = base / namespace
    parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=parent))


def _read_url(ready_file: Path) -> str | None:
    try:
        url = json.loads(ready_file.read_text()).get("url")
    except (OSError, ValueError):
        return None
    return url if isinstance(url, str) and url else None


class NodeAgentImpl:
    """Holds the node's agent process; the Ray actor class is built from this in :mod:`.actors`."""

    def __init__(
        self,
        binary: str,
        namespace: str,
        node_ip: str,
        node_id: str,
        token: str | None = None,
        work_root: str | None = None,
        ready_timeout: float = 60.0,
    ) -> None:
        self._stopped = threading.Event()
        self.node_id = node_id
        work = agent_work_dir(namespace, f"node-{node_id[:12]}", work_root)
        self.ready_file = work / "agent.ready.json"
        self.ready_file.unlink(missing_ok=True)
        argv = [
            binary,
            "agent",
            "--listen",
            f"{node_ip}:0",
            "--ready-file",
            str(self.ready_file),
            "--state-dir",
            str(work / "state"),
        ]
        # Each engine's CUDA_VISIBLE_DEVICES comes with its launch (its bundle's GPUs).
        env = dict(os.environ)
        if token:
            # The manager's token: the agent then refuses gRPC callers without it (docs/ray.md).
            env["ROLLOUT_MANAGER_API_TOKEN"] = token
        self._process = SupervisedProcess(
            argv,
            log_path=work / "agent.log",
            ready=lambda _p: _read_url(self.ready_file) is not None,
            ready_timeout=ready_timeout,
            restart=True,
            restart_argv=self._restart_argv,
            env=env,
            name=f"agent of node {node_id[:12]}",
        )
        self._process.start()
        url = _read_url(self.ready_file)
        if url is None:  # ready means the file had a URL; a race with its removal
            raise RuntimeError(f"the agent became ready without a URL in {self.ready_file}")
        self.url = url

    def _restart_argv(self, process: SupervisedProcess) -> list[str]:
        argv = list(process.argv)
        argv[argv.index("--listen") + 1] = urlsplit(self.url).netloc
        self.ready_file.unlink(missing_ok=True)
        return argv

    def info(self) -> AgentInfo:
        return AgentInfo(
            url=self.url,
            node_id=self.node_id,
            pid=self._process.pid,
            running=self._process.running(),
            restarts=self._process.restarts,
            log=str(self._process.log_path),
        )

    def watch(self) -> None:
        """Returns once the agent is stopped. The reconciler keeps one call pending per agent: when
        the actor (or its node) dies, Ray fails that call, which is how the death is noticed at
        once, without polling."""
        self._stopped.wait()

    def stop(self, grace: float = 30.0) -> int | None:
        code = self._process.stop(grace)
        self._stopped.set()
        return code
