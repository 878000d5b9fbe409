"""Ray Serve ingress: ``/rollout/*``, ``/autoscaler/*``, ``/metrics``, ``/health`` and
``/openapi.json`` on Serve's HTTP port, forwarded to the manager's Unix socket.

Each request is passed on as it came (method, path, query, body, ``Content-Type`` and
``Authorization``), and the manager's answer (status, body, ``Content-Type``) is returned as it
is, so the manager's validation, token auth and error model apply unchanged. If the manager cannot
be reached the answer is 503 with a JSON error in the manager's own shape. The replica must run on
the manager's node (the socket is node-local); the launcher pins it there. The data plane
(``/generate``) stays on the manager's router port.

Serve's applications outlive the job that deployed them, and so do Serve's controller and
proxies. This one must not: the replica watches the job of the launcher that deployed it and,
once that job is dead (the launcher killed, or stopped before its teardown reached Serve),
deletes its own application; when the fleet had Serve to itself (no other application at launch
nor now) it shuts Serve down, controller and proxies included, as the launcher's own teardown
does.
"""

import logging
import threading
import time
from typing import Any

import httpx
import ray
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from ray import serve

from elastic_rollout_ray.uds import BASE_URL

__all__ = ["RolloutIngress", "build_app"]

METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
#: Longer than the longest long-poll the manager allows (60 s).
TIMEOUT = 75.0
#: Name of the Serve application (one per fleet).
APP_NAME = "elastic-rollout"
#: How often the replica checks that the job which deployed it is alive.
OWNER_CHECK_SECS = 2.0

log = logging.getLogger("elastic_rollout_ray.serve_app")


def other_applications() -> list[str]:
    """The Serve applications on the cluster other than this fleet's (none when Serve is not
    running)."""
    return [name for name in serve.status().applications if name != APP_NAME]


def job_alive(job_id_hex: str) -> bool:
    """Whether Ray's job table has the job and does not mark it dead."""
    # ray.init sets gcs_client on the worker; Ray's Worker class does not declare it.
    gcs = ray._private.worker.global_worker.gcs_client  # type: ignore[attr-defined]
    for job_id, info in gcs.get_all_job_info().items():
        if job_id.hex() == job_id_hex:
            return not info.is_dead
    return False


# FastAPI's own docs would describe only the catch-all routes: /openapi.json is the manager's.
app = FastAPI(title="Elastic Rollout control API (via Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(num_replicas=1, max_ongoing_requests=256)
@serve.ingress(app)
class RolloutIngress:
    def __init__(self, api_socket: str, owner_job: str | None = None, owns_serve: bool = False) -> None:
        self.api_socket = api_socket
        self.owns_serve = owns_serve
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=api_socket), base_url=BASE_URL, timeout=TIMEOUT
        )
        if owner_job:
            threading.Thread(target=self._watch_owner, args=(owner_job,), name="owner-watch", daemon=True).start()

    def _watch_owner(self, owner_job: str) -> None:
        """Once the launcher's job is dead, deletes this application, or shuts Serve down when the
        fleet had it to itself (a thread of the replica; the shutdown ends the replica too)."""
        while True:
            time.sleep(OWNER_CHECK_SECS)
            try:
                alive = job_alive(owner_job)
            except Exception as err:  # the GCS restarting: ask again
                log.warning("cannot read the job table: %r", err)
                continue
            if not alive:
                try:
                    alone = self.owns_serve and not other_applications()
                except Exception as err:
                    log.warning("cannot read Serve's applications: %r", err)
                    continue
                if alone:
                    log.warning(
                        "job %s that deployed %s is gone and no other application uses Serve; shutting Serve down "
                        "(controller and proxies)",
                        owner_job,
                        APP_NAME,
                    )
                    serve.shutdown()
                else:
                    log.warning("job %s that deployed %s is gone; deleting the application", owner_job, APP_NAME)
                    serve.delete(APP_NAME, _blocking=False)
                return

    async def _forward(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            resp = await self.client.request(
                request.method,
                request.url.path,
                params=request.url.query or None,
                content=await request.body(),
                headers=headers,
            )
        except httpx.HTTPError as err:
            body = {
                "error": {
                    "code": "manager_unreachable",
                    "message": f"the rollout manager does not answer on its socket ({err.__class__.__name__}); "
                    "it may be restarting: retry in a few seconds",
                }
            }
            return JSONResponse(body, status_code=503)
        out_headers = {}
        if "content-type" in resp.headers:
            out_headers["content-type"] = resp.headers["content-type"]
        return Response(content=resp.content, status_code=resp.status_code, headers=out_headers)

    @app.api_route("/rollout/{rest:path}", methods=METHODS)
    async def rollout(self, rest: str, request: Request) -> Response:
        return await self._forward(request)

    @app.api_route("/autoscaler/{rest:path}", methods=METHODS)
    async def autoscaler(self, rest: str, request: Request) -> Response:
        return await self._forward(request)

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        return await self._forward(request)

    @app.get("/health")
    async def health(self, request: Request) -> Response:
        return await self._forward(request)

    @app.get("/openapi.json")
    async def openapi(self, request: Request) -> Response:
        return await self._forward(request)


#: Ray's label of a node's id.
NODE_ID_LABEL = "ray.io/node-id"


def build_app(api_socket: str, node_id: str, owner_job: str | None = None, owns_serve: bool = False) -> Any:
    """The Serve application, its replica pinned to node ``node_id`` (where the socket is); with
    ``owner_job`` (a job id in hex) it deletes itself once that job is dead, and shuts Serve down
    then if ``owns_serve`` (the launcher found no other application) and still no other runs."""
    # @serve.deployment made the class a Deployment; Ray's stubs still see the class.
    deployment = RolloutIngress.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": 0, "label_selector": {NODE_ID_LABEL: node_id}}
    )
    return deployment.bind(api_socket, owner_job, owns_serve)
