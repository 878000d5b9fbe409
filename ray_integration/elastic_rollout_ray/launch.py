"""``python -m elastic_rollout_ray.launch --fully-async --rollout-num-gpus 4 ...``: the fleet on Ray.

Usually run as ``ray job submit -- python -m elastic_rollout_ray.launch ...``. Flow:

1. split the launcher's own flags (``--serve-host``, ``--serve-port``, ``--namespace``,
   ``--ray-address``, ``--ready-timeout-secs``, ``--agent-dir``, ``--resume``,
   ``--serve-proxy-location``) from the manager's, add the flags the shim owns
   (``--placement ray --api-socket ... --state-dir ...``) and validate everything with the
   manager's own parser (:func:`elastic_rollout._native.describe_serve_args`) BEFORE touching
   the cluster; refuse a run without ``--fully-async``. The parser layers the manager's flags as
   the binary does: command line, then this process's ``ROLLOUT_MANAGER_*`` environment
   variables, then the ``--config`` file, then the defaults. The manager is started with this
   process's environment and the config file's absolute path, so it sees what was validated;
   a setting from any of these sources counts as given (``--port``, ``--api-socket`` and
   ``--state-dir`` are then not defaulted by the launcher);
2. connect to Ray; start, pinned to this node, the manager actor (it spawns and supervises
   ``rollout-manager serve --placement ray``), the placement reconciler, and the Serve ingress;
3. print where the API is (Serve's HTTP URL and the manager's router URL) and a machine-readable
   ``ELASTIC_ROLLOUT_READY {...}`` line;
4. stay up until SIGTERM/SIGINT (``ray job stop``); a manager or reconciler actor that dies is
   started again (the manager on the same state dir and ports, so it re-adopts its engines);
5. tear down everything it created: the Serve app, the manager (which stops its engines), every
   agent actor and placement group, the resource request, its actors. Ray's default stop wait
   (3 s) may end this early with SIGKILL: then the actors, which this driver owns (and the agent
   actors, which the reconciler owns), die with it, the placement groups of the job are removed by
   Ray, and agents and engines die with their actors. Only Serve is not owned by the job: the
   app is deleted first (Serve shut down with it when no other application uses Serve), and if
   the SIGKILL comes before that, the app's replica does it once it sees the job dead.

Fleet state belongs to one job: the default ``--state-dir`` is
``~/.cache/elastic-rollout/<namespace>/<job>``, where ``<job>`` is the job's submission id (a new
key per run when not submitted as a job). ``--resume <job>`` takes up that earlier job's fleet.

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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

__all__ = ["LaunchPlan", "main", "plan"]


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
    p.add_argument(
        "--serve-proxy-location",
        choices=["HeadOnly", "EveryNode"],
        default="HeadOnly",
        help="where Ray Serve runs HTTP proxies for the control API (default HeadOnly: one front door on the head)",
    )
    p.add_argument("--namespace", default="elastic-rollout", help="Ray namespace of the fleet's actors")
    p.add_argument("--ray-address", default="auto", help="Ray cluster to join (default: the running one)")
    p.add_argument(
        "--ready-timeout-secs",
        "--ready-timeout",
        dest="ready_timeout",
        type=float,
        default=120.0,
        help="seconds the manager may take to answer (default 120; --ready-timeout is the old spelling)",
    )
    p.add_argument(
        "--resume",
        metavar="JOB",
        default=None,
        help="take up the fleet of an earlier job of this namespace (its submission id, printed at its start); "
        "by default every job starts a fresh fleet",
    )
    p.add_argument(
        "--agent-dir",
        default=None,
        help="directory for node agents' files and engine logs, on each node (default: the node's temp dir)",
    )
    return p


def plan(argv: Sequence[str]) -> LaunchPlan:
    """Parse and validate the command line with the manager's own parser.

    Raises:
        SystemExit(2): bad arguments (the manager's message, naming the flag) or no --fully-async.
    """
    options, rest = _parser().parse_known_args(list(argv))
    serve_args = list(rest)
    first = _try_parse(serve_args)
    # Given on the command line, in a ROLLOUT_MANAGER_* variable or in the --config file.
    given = {field for field, source in first["sources"].items() if source != "default"}
    if "placement" in given and first["config"]["placement"] != "ray":
        _fail("error: invalid --placement: the Ray launcher always runs with --placement ray; drop the flag")
    if first["config_file"] is not None:
        # The manager actor may run in another working directory.
        serve_args += ["--config", str(Path(first["config_file"]).expanduser().resolve())]
    private = Path(tempfile.gettempdir()) / f"elastic-rollout-{os.getuid()}" / options.namespace
    if "api_socket" not in given:
        serve_args += ["--api-socket", str(private / "api.sock")]
    jobs = Path.home() / ".cache" / "elastic-rollout" / options.namespace
    if options.resume is not None:
        if "state_dir" in given:
            _fail("error: --resume and --state-dir both name the state to use; give one")
        if not options.resume or "/" in options.resume or options.resume in (".", ".."):
            _fail(f"error: invalid --resume {options.resume!r}: give the submission id of an earlier job")
        if not (jobs / options.resume).is_dir():
            known = sorted(d.name for d in jobs.iterdir() if d.is_dir()) if jobs.is_dir() else []
            _fail(
                f"error: invalid --resume {options.resume!r}: no fleet state in {jobs / options.resume}; "
                f"known jobs: {known}"
            )
        serve_args += ["--state-dir", str(jobs / options.resume)]
    elif "state_dir" not in given:
        serve_args += ["--state-dir", str(jobs / job_key())]
    if "port" not in given:
        # Serve's proxy is the control API's front door; the manager's own TCP port is a free one.
        serve_args += ["--port", "0"]
    serve_args += ["--placement", "ray"]
    config = _try_parse(serve_args)["config"]
    if not config.get("fully_async"):
        _fail(NOT_FULLY_ASYNC)
    config["state_dir"] = str(Path(config["state_dir"]).expanduser().resolve())
    config["api_socket"] = str(Path(config["api_socket"]).expanduser().resolve())
    return LaunchPlan(options, serve_args, config)


def job_key() -> str:
    """This job's submission id (``ray job submit`` passes it in the job config), else a new key."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    try:
        metadata = json.loads(os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR, "{}")).get("metadata") or {}
    except ValueError:
        metadata = {}
    submission = metadata.get("job_submission_id")
    if isinstance(submission, str) and submission and "/" not in submission and submission not in (".", ".."):
        return submission
    return f"run-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"


def _try_parse(serve_args: list[str]) -> dict[str, Any]:
    """``describe_serve_args``: the config, the config file, and where each value came from."""
    from elastic_rollout import _native

    try:
        return _native.describe_serve_args(serve_args)
    except ValueError as err:
        _fail(str(err))


def _fail(message: str) -> NoReturn:
    print(message, file=sys.stderr)
    raise SystemExit(2)


class Fleet:
    """Everything a launch started on the cluster, and its teardown."""

    #: How often a dead manager actor is started again before the launch gives up.
    MAX_MANAGER_RESTARTS = 5

    def __init__(self, launch: LaunchPlan) -> None:
        self.plan = launch
        self.manager: Any = None
        self.reconciler: Any = None
        self.serve_started = False
        #: No other application used Serve when this launcher started it: the fleet may shut it down.
        self.owns_serve = False
        self.manager_restarts = 0
        #: Ray's label selector of this node (by node id: nodes may share an IP, in containers).
        self._here: dict[str, str] = {}
        self._binary = ""
        self._token: str | None = None
        self._ports: list[str] = []

    def start(self) -> dict[str, Any]:
        import ray
        from ray import serve

        from elastic_rollout import _native
        from elastic_rollout_ray.serve_app import APP_NAME, NODE_ID_LABEL, build_app, other_applications
        from elastic_rollout_ray.uds import load_token

        launch = self.plan
        node_id = ray.get_runtime_context().get_node_id()
        # The manager, the reconciler and the ingress share this node: the socket and the state
        # dir are node-local. Pinned by node id, not by `node:<ip>`: nodes sharing an IP
        # (containers on one host, ray.cluster_utils.Cluster) all have that resource.
        self._here = {NODE_ID_LABEL: node_id}
        Path(launch.api_socket).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._binary = str(_native.binary_path())
        self._token = load_token(launch.config.get("api_token_file"))
        info = self.start_manager()
        self.start_reconciler()
        # Serve not running, or running for nobody else (left by a launcher that was killed).
        self.owns_serve = not other_applications()
        serve.start(
            proxy_location=launch.options.serve_proxy_location,
            http_options={"host": launch.options.serve_host, "port": launch.options.serve_port},
        )
        self.serve_started = True
        owner = ray.get_runtime_context().get_job_id()
        serve.run(build_app(launch.api_socket, node_id, owner, self.owns_serve), name=APP_NAME, route_prefix="/")
        return {
            "control_url": f"http://{launch.options.serve_host}:{launch.options.serve_port}",
            "router_url": info["router_url"],
            "manager_pid": info["pid"],
            "api_socket": launch.api_socket,
            "state_dir": launch.state_dir,
            "namespace": launch.options.namespace,
            "job": Path(launch.state_dir).name,
        }

    def start_manager(self) -> dict[str, Any]:
        """(Re)starts the manager actor. A new one runs on the same state dir and the first one's
        ports, so it re-adopts the engines and clients keep their URLs."""
        import ray

        from elastic_rollout_ray.actors import ManagerActor

        launch = self.plan
        self.manager = ManagerActor.options(name="er-manager", label_selector=self._here).remote(  # type: ignore[attr-defined]
            self._binary,
            [*launch.serve_args, *self._ports],
            api_socket=launch.api_socket,
            state_dir=launch.state_dir,
            ready_timeout=launch.options.ready_timeout,
            env=dict(os.environ),
        )
        info: dict[str, Any] = ray.get(self.manager.info.remote())
        if not self._ports:
            for flag, key in (("--port", "control_url"), ("--router-port", "router_url")):
                port = urlsplit(info.get(key) or "").port
                if port:
                    self._ports += [flag, str(port)]
        return info

    def start_reconciler(self) -> None:
        """(Re)starts the reconciler; a new one adopts what Ray still holds (it is idempotent)."""
        import ray

        from elastic_rollout_ray.reconciler import Reconciler

        launch = self.plan
        self.reconciler = Reconciler.options(name="er-reconciler", label_selector=self._here).remote(  # type: ignore[attr-defined]
            launch.api_socket, self._binary, launch.options.namespace, self._token, launch.options.agent_dir
        )
        ray.get(self.reconciler.start.remote())

    def check(self) -> bool:
        """Starts a dead manager or reconciler actor again; False when the manager keeps dying."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            ray.get(self.manager.info.remote(), timeout=30)
        except GetTimeoutError:
            pass
        except RayActorError as err:
            if self.manager_restarts >= self.MAX_MANAGER_RESTARTS:
                print(f"error: the manager actor died again ({err!r}); tearing down", file=sys.stderr)
                return False
            self.manager_restarts += 1
            print(f"warning: the manager actor died ({err!r}); starting it again", file=sys.stderr, flush=True)
            self.start_manager()
        try:
            ray.get(self.reconciler.status.remote(), timeout=30)
        except GetTimeoutError:
            pass
        except RayActorError as err:
            print(f"warning: the reconciler actor died ({err!r}); starting a new one", file=sys.stderr, flush=True)
            self.start_reconciler()
        return True

    def teardown(self) -> None:
        """Everything at once: the manager (stopping its engines) and the reconciler (stopping
        every agent, removing every group) in parallel while the Serve app is deleted. Whatever a
        SIGKILL interrupts, Ray finishes: the actors die with this driver, the groups with the
        job, and the Serve app deletes itself when it sees the job dead."""
        import ray
        from ray import serve

        from elastic_rollout_ray.serve_app import APP_NAME, other_applications

        pending = []
        if self.manager is not None:
            pending.append(("stopping the manager", self.manager.stop.remote(10.0)))
        if self.reconciler is not None:
            pending.append(("stopping the reconciler", self.reconciler.shutdown.remote()))
        if self.serve_started:
            try:
                if self.owns_serve and not other_applications():
                    serve.shutdown()
                else:
                    serve.delete(APP_NAME, _blocking=False)
            except Exception as err:
                print(f"warning: removing the Serve app failed: {err!r}", file=sys.stderr)
        for what, ref in pending:
            try:
                ray.get(ref, timeout=120)
            except Exception as err:
                print(f"warning: {what} failed: {err!r}", file=sys.stderr)
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
        print(
            f"  job:                     {where['job']} (a later job takes this fleet up with --resume {where['job']})"
        )
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
