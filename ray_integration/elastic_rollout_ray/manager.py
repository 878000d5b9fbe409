"""The manager process (``rollout-manager serve --placement ray``) and the Ray actor that holds it.

:class:`ManagerSupervisor` is plain Python (usable and testable without Ray): it spawns the
binary with ``--api-socket`` and ``--state-dir``, waits until the control API answers on the socket
(deadline; stderr tail in the error), and restarts the manager when it exits unexpectedly with the
same state dir and the same ports (so agents' engines are re-adopted and clients keep their URLs).
:data:`ManagerActor` is the same class as a Ray actor, pinned by the caller to the node whose
filesystem holds the state dir and the socket.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from elastic_rollout import RolloutClient
from elastic_rollout_ray.process import SupervisedProcess

__all__ = ["ManagerSupervisor", "manager_argv"]


def manager_argv(binary: str, serve_args: Sequence[str], *, api_socket: str, state_dir: str) -> list[str]:
    """``rollout-manager serve`` argv: the user's flags, then the ones the shim owns (last wins)."""
    return [
        binary,
        "serve",
        *serve_args,
        "--placement",
        "ray",
        "--api-socket",
        api_socket,
        "--state-dir",
        state_dir,
    ]


def _probe(api_socket: str) -> bool:
    # No token: reads are open (and a token in the environment must not matter here).
    with RolloutClient(uds=api_socket, token="", timeout=2.0) as client:
        client.get("/rollout/engines")
    return True


class ManagerSupervisor:
    """Runs ``rollout-manager serve`` and keeps it running until :meth:`stop`."""

    def __init__(
        self,
        binary: str,
        serve_args: Sequence[str],
        *,
        api_socket: str,
        state_dir: str,
        ready_timeout: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.api_socket = api_socket
        self.state_dir = state_dir
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        argv = manager_argv(binary, serve_args, api_socket=api_socket, state_dir=state_dir)
        self._process = SupervisedProcess(
            argv,
            log_path=Path(state_dir) / "manager.log",
            ready=lambda _p: _probe(api_socket),
            ready_timeout=ready_timeout,
            restart=True,
            restart_argv=self._restart_argv,
            env=env,
            name="rollout-manager",
        )
        self._process.start()
        self._urls = self._process.wait_listening(timeout=5.0)

    def _restart_argv(self, process: SupervisedProcess) -> list[str]:
        """The first start's argv with its bound ports pinned, so a restart keeps every URL."""
        pins: list[str] = []
        for flag, key in (("--port", "control"), ("--router-port", "router")):
            url = self._urls.get(key)
            port = urlsplit(url).port if url else None
            if port:
                pins += [flag, str(port)]
        return [*process.argv, *pins]

    def info(self) -> dict[str, Any]:
        """Where the manager is and how it is doing (pid, restarts, URLs, last error)."""
        urls = self._process.listening or self._urls
        return {
            "pid": self._process.pid,
            "running": self._process.running(),
            "restarts": self._process.restarts,
            "last_exit": self._process.last_exit,
            "last_error": self._process.last_error,
            "api_socket": self.api_socket,
            "state_dir": self.state_dir,
            "control_url": urls.get("control"),
            "router_url": urls.get("router"),
            "log": str(self._process.log_path),
        }

    def stop(self, grace: float = 60.0) -> int | None:
        """Stop the manager (SIGTERM: it stops its engines), SIGKILL after ``grace``."""
        return self._process.stop(grace)
