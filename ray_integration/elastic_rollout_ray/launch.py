"""``python -m elastic_rollout_ray.launch --fully-async --rollout-num-gpus 4 ...``: the fleet on Ray.

Usually run as ``ray job submit -- python -m elastic_rollout_ray.launch ...``. Flow:

1. split the launcher's own flags (``--serve-host``, ``--serve-port``, ``--namespace``,
   ``--ray-address``, ``--ready-timeout``, ``--agent-dir``) from the manager's, add the flags the shim owns
   (``--placement ray --api-socket ... --state-dir ...``) and validate everything with the
   manager's own parser (:func:`elastic_rollout._native.parse_serve_args`) BEFORE touching the
   cluster; refuse a run without ``--fully-async``;
2. connect to Ray; start, pinned to this node, the manager actor (it spawns and supervises
   ``rollout-manager serve --placement ray``), the placement reconciler, and the Serve ingress;
3. print where the API is (Serve's HTTP URL and the manager's router URL) and a machine-readable
   ``ELASTIC_ROLLOUT_READY {...}`` line;
4. stay up until SIGTERM/SIGINT (``ray job stop``) or until the manager actor dies, then tear down
   everything it created: the Serve app, the manager (which stops its engines), every host actor
   and placement group, the resource request, its actors.

Exit status: 0 after a signal, 2 for bad arguments (nothing started), 1 when a start step failed
or the manager actor died (after teardown).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["LaunchPlan", "main", "plan"]

APP_NAME = "elastic-rollout"

NOT_FULLY_ASYNC = (
    "error: elastic_rollout_ray.launch needs --fully-async: elastic rollout gives the rollout engines "
    "their own GPUs and runs them as an independent service that scales while training goes on, which "
    "is the fully-async pipeline. A colocated/synchronous run shares GPUs with training and cannot be "
    "scaled. Add --fully-async (and give the trainer its own GPUs)."
)


class LaunchPlan:
    """What a launch will start, decided (and validated) before anything touches the cluster."""

    def __init__(self, options: argparse.Namespace, serve_args: list[str], config: dict[str, Any]) -> None:
        self.options = options
        self.serve_args = serve_args
        self.config = config

    @property
    def api_socket(self) -> str:
        return str(self.config["api_socket"])

    @property
    def state_dir(self) -> str:
        return str(self.config["state_dir"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m elastic_rollout_ray.launch",
        description="Run the Elastic Rollout manager on a Ray cluster. Every flag not listed here is a "
        "`rollout-manager serve` flag (see `rollout-manager serve --help`).",
        allow_abbrev=False,
    )
    p.add_argument("--serve-host", default="127.0.0.1", help="address of Ray Serve's HTTP proxy (default loopback)")
    p.add_argument("--serve-port", type=int, default=8000, help="port of Ray Serve's HTTP proxy (default 8000)")
    p.add_argument("--namespace", default="elastic-rollout", help="Ray namespace of the fleet's actors")
    p.add_argument("--ray-address", default="auto", help="Ray cluster to join (default: the running one)")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds the manager may take to answer")
    p.add_argument(
        "--agent-dir",
        default=None,
        help="directory for node agents' files and engine logs, on each node (default: the node's temp dir)",
    )
    return p


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def plan(argv: Sequence[str]) -> LaunchPlan:
    """Parse and validate the command line with the manager's own parser.

    Raises:
        SystemExit(2): bad arguments (the manager's message, naming the flag) or no --fully-async.
    """
    from elastic_rollout import _native

    options, rest = _parser().parse_known_args(list(argv))
    serve_args = list(rest)
    if _given(serve_args, "--placement"):
        cfg = _try_parse(serve_args)
        if cfg.get("placement") != "ray":
            _fail("error: invalid --placement: the Ray launcher always runs with --placement ray; drop the flag")
    private = Path(tempfile.gettempdir()) / f"elastic-rollout-{os.getuid()}" / options.namespace
    if not _given(serve_args, "--api-socket"):
        serve_args += ["--api-socket", str(private / "api.sock")]
    if not _given(serve_args, "--state-dir"):
        serve_args += ["--state-dir", str(Path.home() / ".cache" / "elastic-rollout" / options.namespace)]
    if not _given(serve_args, "--port"):
        # Serve's proxy is the control API's front door; the manager's own TCP port is a free one.
        serve_args += ["--port", "0"]
    serve_args += ["--placement", "ray"]
    config = _try_parse(serve_args)
    if not config.get("fully_async"):
        _fail(NOT_FULLY_ASYNC)
    config["state_dir"] = str(Path(config["state_dir"]).expanduser().resolve())
    config["api_socket"] = str(Path(config["api_socket"]).expanduser().resolve())
    return LaunchPlan(options, serve_args, config)


def _try_parse(serve_args: list[str]) -> dict[str, Any]:
    from elastic_rollout import _native

    try:
        return _native.parse_serve_args(serve_args)
    except ValueError as err:
        _fail(str(err))
        raise  # unreachable


def _fail(message: str) -> None:
    print(message, file=sys.stderr)
    raise SystemExit(2)


class Fleet:
    """Everything a launch started on the cluster, and its teardown."""

    def __init__(self, launch: LaunchPlan) -> None:
        self.plan = launch
        self.manager: Any = None
        self.reconciler: Any = None
        self.serve_started = False
        self._reconciler_args: tuple[Any, ...] = ()

    def start(self) -> dict[str, Any]:
        import ray
        from ray import serve

        from elastic_rollout import _native
        from elastic_rollout_ray.actors import ManagerActor, Reconciler
        from elastic_rollout_ray.serve_app import build_app
        from elastic_rollout_ray.uds import load_token

        launch = self.plan
        node_ip = ray.util.get_node_ip_address()
        here = {f"node:{node_ip}": 0.001}
        Path(launch.api_socket).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        binary = _native.binary_path()
        token = load_token(launch.config.get("api_token_file"))
        env = dict(os.environ)
        self.manager = ManagerActor.options(name="er-manager", resources=here).remote(
            binary,
            launch.serve_args,
            api_socket=launch.api_socket,
            state_dir=launch.state_dir,
            ready_timeout=launch.options.ready_timeout,
            env=env,
        )
        info = ray.get(self.manager.info.remote())
        self._reconciler_args = (here, launch.api_socket, binary, launch.options.namespace, token, launch.options.agent_dir)
        self.start_reconciler()
        serve.start(http_options={"host": launch.options.serve_host, "port": launch.options.serve_port})
        self.serve_started = True
        serve.run(build_app(launch.api_socket, node_ip), name=APP_NAME, route_prefix="/")
        return {
            "control_url": f"http://{launch.options.serve_host}:{launch.options.serve_port}",
            "router_url": info["router_url"],
            "manager_pid": info["pid"],
            "api_socket": launch.api_socket,
            "state_dir": launch.state_dir,
            "namespace": launch.options.namespace,
        }

    def start_reconciler(self) -> None:
        """(Re)start the reconciler; a new one adopts what Ray still holds (it is idempotent)."""
        import ray

        from elastic_rollout_ray.actors import Reconciler

        here, api_socket, binary, namespace, token, agent_dir = self._reconciler_args
        self.reconciler = Reconciler.options(name="er-reconciler", resources=here).remote(
            api_socket, binary, namespace, token, agent_dir
        )
        ray.get(self.reconciler.status.remote())

    def check(self) -> bool:
        """False when the manager actor is gone; a dead reconciler is replaced."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            ray.get(self.manager.info.remote(), timeout=30)
        except GetTimeoutError:
            pass
        except RayActorError as err:
            print(f"error: the manager actor is gone ({err!r}); tearing down", file=sys.stderr)
            return False
        try:
            ray.get(self.reconciler.status.remote(), timeout=30)
        except GetTimeoutError:
            pass
        except RayActorError as err:
            print(f"warning: the reconciler actor died ({err!r}); starting a new one", file=sys.stderr, flush=True)
            self.start_reconciler()
        return True

    def teardown(self) -> None:
        import ray
        from ray import serve

        if self.serve_started:
            try:
                serve.delete(APP_NAME)
                if not serve.status().applications:
                    serve.shutdown()
            except Exception as err:
                print(f"warning: removing the Serve app failed: {err!r}", file=sys.stderr)
        if self.manager is not None:
            try:
                ray.get(self.manager.stop.remote(), timeout=180)
            except Exception as err:
                print(f"warning: stopping the manager failed: {err!r}", file=sys.stderr)
        if self.reconciler is not None:
            try:
                ray.get(self.reconciler.shutdown.remote(), timeout=180)
            except Exception as err:
                print(f"warning: stopping the reconciler failed: {err!r}", file=sys.stderr)
        for actor in (self.reconciler, self.manager):
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.manager = self.reconciler = None


def main(argv: Sequence[str] | None = None) -> int:
    launch = plan(sys.argv[1:] if argv is None else argv)

    import ray

    ray.init(address=launch.options.ray_address, namespace=launch.options.namespace, log_to_driver=True)
    # After ray.init, which installs a SIGTERM handler of its own that would end the process
    # before the teardown below ran.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    fleet = Fleet(launch)
    status = 0
    try:
        where = fleet.start()
        print(f"Elastic Rollout is up on Ray (namespace {where['namespace']}).")
        print(f"  control API (Ray Serve): {where['control_url']}/rollout/engines")
        print(f"  router (data plane):     {where['router_url']}/generate")
        print(f"  manager socket:          {where['api_socket']} (state in {where['state_dir']})")
        print("ELASTIC_ROLLOUT_READY " + json.dumps(where), flush=True)
        while not stop.wait(2.0):
            if not fleet.check():
                status = 1
                break
    except Exception as err:
        print(f"error: launch failed: {err}", file=sys.stderr)
        status = 1
    finally:
        fleet.teardown()
        print("Elastic Rollout stopped; every actor and placement group it created is gone.", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
