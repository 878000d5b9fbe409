"""Typed clients for the rollout-manager control API (``/rollout/*``, ``/autoscaler/*``), on httpx.

:class:`RolloutClient` (blocking) and :class:`AsyncRolloutClient` (asyncio) have the same methods
with the same arguments and results; they share how each request is built and how each answer is
parsed (:mod:`elastic_rollout.models`), and differ only in how they wait. Both talk TCP
(``base_url``) or the manager's Unix socket (``uds=``, ``rollout-manager serve --api-socket``)::

    with RolloutClient("http://127.0.0.1:8000") as client:
        client.scale_out(num_replicas=4)

    async with AsyncRolloutClient(uds="/run/rollout/api.sock") as client:
        update = await client.publish_weights("v3", "/ckpt/step_3")
        await client.wait_for_weight_update(update.update_id, timeout=600)

Token: ``token=`` when given (an empty string means none), else the environment variable
``ROLLOUT_MANAGER_API_TOKEN`` (read when the client is made), the same variable the manager reads.
It is sent as ``Authorization: Bearer <token>`` and never appears in ``repr``, logs or errors.

Errors: one type, :class:`RolloutApiError` (``status``, ``code``, ``message``, ``body``). An HTTP
error answer (any non-2xx status) carries the manager's ``{"error": {"code", "message"}}``. When
no answer came at all (connection refused or reset, socket missing, timeout) the error is the
subclass :class:`RolloutConnectionError` with ``status`` 0, which is also a
:class:`ConnectionError`; a timeout is :class:`RolloutTimeoutError`, also a :class:`TimeoutError`.
A POST that timed out may still have been carried out by the manager.

Timeouts: ``timeout`` (default 30 s) bounds each HTTP request; the ``wait_for_*`` helpers take
their own deadline and poll until it. ``publish_weights`` answers at once (the manager hashes the
checkpoint in the background, status ``CHECKSUMMING``), so the default suffices for any checkpoint
size; wait for the update with :meth:`RolloutClient.wait_for_weight_update`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar

import httpx

from elastic_rollout.models import (
    SCALE_IN_TERMINAL,
    SCALE_OUT_TERMINAL,
    TERMINAL,
    WEIGHT_UPDATE_TERMINAL,
    AutoscalerDecision,
    AutoscalerStatus,
    Engine,
    EnginesView,
    EngineUpdateProgress,
    EngineWeights,
    JsonObject,
    JsonRecord,
    OperationKind,
    PublishResult,
    ScaleOperation,
    ScaleResponse,
    StepReport,
    WeightsView,
    WeightUpdate,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "SCALE_IN_TERMINAL",
    "SCALE_OUT_TERMINAL",
    "TOKEN_ENV",
    "WEIGHT_UPDATE_TERMINAL",
    "AsyncRolloutClient",
    "AutoscalerDecision",
    "AutoscalerStatus",
    "Engine",
    "EngineUpdateProgress",
    "EngineWeights",
    "EnginesView",
    "JsonObject",
    "JsonRecord",
    "OperationKind",
    "PublishResult",
    "RolloutApiError",
    "RolloutClient",
    "RolloutConnectionError",
    "RolloutTimeoutError",
    "ScaleOperation",
    "ScaleResponse",
    "StepReport",
    "WeightUpdate",
    "WeightsView",
]

#: The environment variable a client reads its token from when ``token=`` is not given.
TOKEN_ENV = "ROLLOUT_MANAGER_API_TOKEN"
#: Seconds allowed for each HTTP request unless the client is given another ``timeout``.
DEFAULT_TIMEOUT = 30.0
#: Host part of URLs sent over a Unix socket (only the path matters to the manager).
UDS_BASE_URL = "http://rollout-manager"

T = TypeVar("T")


# -- errors ----------------------------------------------------------------------------------


class RolloutApiError(Exception):
    """A control API call failed.

    Attributes:
        status: the HTTP status code (400, 401, 404, 409, 500, ...), or 0 when no answer came
            (:class:`RolloutConnectionError`).
        code: ``error.code`` from the JSON body (``"below_initial_engines"``, ...), ``"http_<status>"``
            if the body had none, or for status 0 ``"unreachable"`` / ``"timeout"``.
        message: ``error.message`` from the JSON body, else the body's text, else a description.
        body: the whole answer: its decoded JSON, or its text when it was not JSON (``None`` for
            status 0).
        method, path: the request that failed, when known.
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        body: Any = None,
        method: str | None = None,
        path: str | None = None,
    ) -> None:
        where = f"{method} {path} -> " if method and path else ""
        what = f"HTTP {status} {code}" if status else code
        super().__init__(f"{where}{what}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body
        self.method = method
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status, self.code, self.message, self.body, self.method, self.path))

    @property
    def details(self) -> JsonObject:
        """The body's ``error`` object (``code``, ``message`` and anything else it carries), or
        ``{}`` when the body was not the manager's error model."""
        error = self.body.get("error") if isinstance(self.body, Mapping) else None
        return dict(error) if isinstance(error, Mapping) else {}

    @classmethod
    def from_body(cls, status: int, body: bytes, method: str | None = None, path: str | None = None) -> RolloutApiError:
        """Build the error from a response body, tolerating bodies that are not the JSON model."""
        text = body.decode("utf-8", errors="replace")
        code, message = f"http_{status}", text.strip() or f"HTTP {status}"
        parsed: Any = text
        try:
            parsed = json.loads(text)
        except ValueError:
            return cls(status, code, message, text, method, path)
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if isinstance(error, dict):
            code = str(error.get("code") or code)
            message = str(error.get("message") or message)
        elif isinstance(error, str):
            message = error
        return cls(status, code, message, parsed, method, path)


class RolloutConnectionError(RolloutApiError, ConnectionError):
    """No answer from the manager: connection refused or reset, no socket, a broken answer.
    ``status`` is 0 and ``code`` ``"unreachable"``. Also a :class:`ConnectionError` (an
    :class:`OSError`), as the network errors of the earlier urllib client were."""


class RolloutTimeoutError(RolloutConnectionError, TimeoutError):
    """The manager did not answer within the request's timeout (``code`` ``"timeout"``). Also a
    :class:`TimeoutError`. A mutating request may still have been carried out."""


def _transport_error(err: httpx.RequestError, method: str, path: str, where: str) -> RolloutApiError:
    detail = str(err) or type(err).__name__
    if isinstance(err, httpx.TimeoutException):
        message = f"no answer from the manager at {where} in time ({detail})"
        return RolloutTimeoutError(0, "timeout", message, None, method, path)
    message = f"cannot reach the manager at {where}: {detail}"
    return RolloutConnectionError(0, "unreachable", message, None, method, path)


# -- requests and answers, shared by both clients ----------------------------------------------


@dataclass(frozen=True)
class _Call(Generic[T]):
    """One API call: the request to send and how to read its answer (JSON, HTTP status)."""

    method: str
    path: str
    body: Mapping[str, Any] | None
    parse: Callable[[Any, int], T]


def _json(data: Any, _status: int) -> Any:
    return data


def _quote(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")


def _tensor_fields(tensors: Sequence[tuple[str, str, Sequence[int]]]) -> JsonObject:
    return {
        "names": [t[0] for t in tensors],
        "dtypes": [t[1] for t in tensors],
        "shapes": [list(t[2]) for t in tensors],
    }


def _scale_body(
    model_name: str, num_replicas: int | None, engine_urls: list[str] | None, timeout_secs: float | None
) -> JsonObject:
    body: JsonObject = {"model_name": model_name}
    if num_replicas is not None:
        body["num_replicas"] = num_replicas
    if engine_urls is not None:
        body["engine_urls"] = list(engine_urls)
    if timeout_secs is not None:
        body["timeout_secs"] = timeout_secs
    return body


class _Calls:
    """The request and the parser of every API method (no I/O)."""

    @staticmethod
    def health() -> _Call[JsonObject]:
        return _Call("GET", "/health", None, _json)

    @staticmethod
    def engines() -> _Call[EnginesView]:
        return _Call("GET", "/rollout/engines", None, lambda data, _s: EnginesView.from_json(data))

    @staticmethod
    def engine(engine_id: str) -> _Call[Engine]:
        return _Call("GET", f"/rollout/engines/{_quote(engine_id)}", None, lambda data, _s: Engine.from_json(data))

    @staticmethod
    def scale_out(
        num_replicas: int | None, engine_urls: list[str] | None, model_name: str, timeout_secs: float | None
    ) -> _Call[ScaleResponse]:
        body = _scale_body(model_name, num_replicas, engine_urls, timeout_secs)
        return _Call("POST", "/rollout/scale_out", body, lambda data, _s: ScaleResponse.from_json(data))

    @staticmethod
    def scale_out_requests() -> _Call[list[ScaleOperation]]:
        def parse(data: Any, _status: int) -> list[ScaleOperation]:
            return [ScaleOperation.from_json("scale_out", record) for record in data.get("requests") or ()]

        return _Call("GET", "/rollout/scale_out", None, parse)

    @staticmethod
    def cancel_scale_out(request_id: str) -> _Call[JsonObject]:
        return _Call("POST", f"/rollout/scale_out/{_quote(request_id)}/cancel", {}, _json)

    @staticmethod
    def scale_in(
        num_replicas: int | None,
        engine_urls: list[str] | None,
        force: bool,
        dry_run: bool,
        timeout_secs: float | None,
        model_name: str,
    ) -> _Call[ScaleResponse]:
        body: JsonObject = {"model_name": model_name, "force": force, "dry_run": dry_run}
        body.update(_scale_body(model_name, num_replicas, engine_urls, timeout_secs))
        return _Call("POST", "/rollout/scale_in", body, lambda data, _s: ScaleResponse.from_json(data))

    @staticmethod
    def operation(kind: OperationKind, request_id: str) -> _Call[ScaleOperation]:
        if kind not in TERMINAL:
            raise ValueError(f"kind must be 'scale_out' or 'scale_in', not {kind!r}")
        path = f"/rollout/{kind}/{_quote(request_id)}"
        return _Call("GET", path, None, lambda data, _s: ScaleOperation.from_json(kind, data))

    @staticmethod
    def report_step(
        step: int,
        trainer_wait_secs: float,
        rollout_throttled_secs: float,
        step_secs: float,
        rollout_samples: int | None,
        next_step_samples: int | None,
    ) -> _Call[StepReport]:
        body: JsonObject = {
            "step": step,
            "trainer_wait_secs": trainer_wait_secs,
            "rollout_throttled_secs": rollout_throttled_secs,
            "step_secs": step_secs,
        }
        if rollout_samples is not None:
            body["rollout_samples"] = rollout_samples
        if next_step_samples is not None:
            body["next_step_samples"] = next_step_samples
        return _Call("POST", "/rollout/pipeline", body, lambda data, _s: StepReport.from_json(data))

    @staticmethod
    def autoscaler_status() -> _Call[AutoscalerStatus]:
        return _Call("GET", "/autoscaler/status", None, lambda data, _s: AutoscalerStatus.from_json(data))

    @staticmethod
    def set_autoscaler_enabled(enabled: bool) -> _Call[JsonObject]:
        return _Call("POST", "/autoscaler/enable", {"enabled": enabled}, _json)

    @staticmethod
    def weights() -> _Call[WeightsView]:
        return _Call("GET", "/rollout/weights", None, lambda data, _s: WeightsView.from_json(data))

    @staticmethod
    def publish_weights(
        version: str,
        path: str,
        strategy: str,
        max_unavailable: int | None,
        checksum: str | None,
        pause_mode: str | None,
    ) -> _Call[PublishResult]:
        body: JsonObject = {"version": version, "path": path, "strategy": strategy}
        if max_unavailable is not None:
            body["max_unavailable"] = max_unavailable
        if checksum is not None:
            body["checksum"] = checksum
        if pause_mode is not None:
            body["pause_mode"] = pause_mode
        return _Call("POST", "/rollout/weights/publish", body, PublishResult.from_json)

    @staticmethod
    def weight_update(update_id: str) -> _Call[WeightUpdate]:
        path = f"/rollout/weights/updates/{_quote(update_id)}"
        return _Call("GET", path, None, lambda data, _s: WeightUpdate.from_json(data))

    @staticmethod
    def open_trainer_update(
        version: str,
        tensors: Sequence[tuple[str, str, Sequence[int]]],
        master_address: str,
        master_port: int,
        group_name: str | None,
        pause_mode: str | None,
        flush_cache: bool,
        group_prefix: str | None,
        backend: str | None = None,
    ) -> _Call[WeightUpdate]:
        body: JsonObject = {
            "version": version,
            **_tensor_fields(tensors),
            "master_address": master_address,
            "master_port": master_port,
            "flush_cache": flush_cache,
        }
        if group_name is not None:
            body["group_name"] = group_name
        if pause_mode is not None:
            body["pause_mode"] = pause_mode
        if group_prefix is not None:
            body["group_prefix"] = group_prefix
        if backend is not None:
            body["backend"] = backend
        return _Call("POST", "/rollout/weights/trainer_updates", body, lambda data, _s: WeightUpdate.from_json(data))

    @staticmethod
    def destroy_trainer_group() -> _Call[JsonObject]:
        return _Call("POST", "/rollout/weights/trainer_group/destroy", {}, _json)

    @staticmethod
    def build_trainer_group(
        group_name: str, master_address: str, master_port: int, world_size: int, backend: str | None = None
    ) -> _Call[JsonObject]:
        body: JsonObject = {
            "group_name": group_name,
            "master_address": master_address,
            "master_port": master_port,
            "world_size": world_size,
        }
        if backend is not None:
            body["backend"] = backend
        return _Call("POST", "/rollout/weights/trainer_group", body, _json)

    @staticmethod
    def trainer_group() -> _Call[JsonObject]:
        return _Call("GET", "/rollout/weights/trainer_group", None, _json)

    @staticmethod
    def start_broadcast(
        update_id: str, tensors: Sequence[tuple[str, str, Sequence[int]]] | None, last: bool | None
    ) -> _Call[WeightUpdate]:
        path = f"/rollout/weights/updates/{_quote(update_id)}/broadcast"
        body: JsonObject = {}
        if tensors is not None:
            body.update(_tensor_fields(tensors))
        if last is not None:
            body["last"] = last
        return _Call("POST", path, body, lambda data, _s: WeightUpdate.from_json(data))

    @staticmethod
    def abort_weight_update(update_id: str, reason: str) -> _Call[WeightUpdate]:
        path = f"/rollout/weights/updates/{_quote(update_id)}/abort"
        return _Call("POST", path, {"reason": reason}, lambda data, _s: WeightUpdate.from_json(data))

    @staticmethod
    def weight_updates(status: str | None) -> _Call[list[WeightUpdate]]:
        query = "" if status is None else "?" + urllib.parse.urlencode({"status": status})

        def parse(data: Any, _status: int) -> list[WeightUpdate]:
            return [WeightUpdate.from_json(update) for update in data.get("updates") or ()]

        return _Call("GET", f"/rollout/weights/updates{query}", None, parse)


def _operation_late(kind: str, request_id: str, timeout: float) -> Callable[[ScaleOperation | None], str]:
    def late(op: ScaleOperation | None) -> str:
        last = "unknown (the manager did not answer)" if op is None else op.status
        history = "none" if op is None else " -> ".join(op.statuses) or "none"
        return f"{kind} {request_id} not finished after {timeout:g}s; last status {last} (history: {history})"

    return late


def _engines_late(count: int, status: str, timeout: float) -> Callable[[EnginesView | None], str]:
    def late(view: EnginesView | None) -> str:
        seen = "no answer" if view is None else ", ".join(f"{e.engine_id}={e.status}" for e in view.engines)
        return f"wanted {count} engine(s) {status} within {timeout:g}s; last seen: {seen or 'no engines'}"

    return late


def _update_late(update_id: str, timeout: float) -> Callable[[WeightUpdate | None], str]:
    def late(update: WeightUpdate | None) -> str:
        last = "unknown (the manager did not answer)" if update is None else update.status
        return f"weight update {update_id} not finished after {timeout:g}s; last status {last}"

    return late


def _restarting(err: RolloutApiError) -> bool:
    """Whether a failed poll means the manager is restarting (connection refused or reset, or the
    Ray ingress's 503 ``manager_unreachable``): the wait helpers then poll on until their deadline
    instead of failing on the first refused poll."""
    return isinstance(err, RolloutConnectionError) or (err.status == 503 and err.code == "manager_unreachable")


def _env_token() -> str | None:
    return os.environ.get(TOKEN_ENV, "").strip() or None


class _Base:
    """What both clients hold: where the manager is, the token, the timeout; request building."""

    def __init__(self, base_url: str | None, token: str | None, timeout: float, uds: str | None) -> None:
        if base_url is None and uds is None:
            raise ValueError("give the manager's base_url (http://host:port) or its Unix socket (uds=PATH)")
        self.base_url = (base_url or UDS_BASE_URL).rstrip("/")
        self.uds = uds
        self.timeout = timeout
        self._token = _env_token() if token is None else (token.strip() or None)

    @property
    def token(self) -> str | None:
        """The token sent with each request (``None``: none). Not shown by ``repr``."""
        return self._token

    @property
    def _where(self) -> str:
        return f"unix:{self.uds}" if self.uds else self.base_url

    def __repr__(self) -> str:
        where = f"uds={self.uds!r}" if self.uds else repr(self.base_url)
        auth = ", token=<set>" if self._token else ""
        return f"{type(self).__name__}({where}{auth})"

    def _headers(self, has_body: bool) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if has_body:
            headers["Content-Type"] = "application/json"
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _build(self, http: httpx.Client | httpx.AsyncClient, call: _Call[Any], timeout: float | None) -> httpx.Request:
        content = None if call.body is None else json.dumps(call.body).encode()
        return http.build_request(
            call.method,
            call.path,
            content=content,
            headers=self._headers(content is not None),
            timeout=self.timeout if timeout is None else timeout,
        )

    @staticmethod
    def _answer(call: _Call[T], resp: httpx.Response) -> T:
        """The parsed answer of a 2xx response; a :class:`RolloutApiError` for any other."""
        if not resp.is_success:
            raise RolloutApiError.from_body(resp.status_code, resp.content, call.method, call.path)
        payload = resp.content
        data = json.loads(payload) if payload.strip() else None
        return call.parse(data, resp.status_code)


# -- the blocking client -----------------------------------------------------------------------


class RolloutClient(_Base):
    """Blocking client for one rollout-manager's control API (safe to share between threads).

    Args:
        base_url: the control address, e.g. ``http://127.0.0.1:8000`` (or the Ray Serve ingress).
        token: sent as ``Authorization: Bearer <token>``. ``None`` (the default): the environment
            variable ``ROLLOUT_MANAGER_API_TOKEN`` if set; ``""``: no token.
        timeout: seconds allowed for each HTTP request (default 30).
        uds: the manager's Unix socket (``--api-socket``) instead of ``base_url``.
        transport: an httpx transport to use instead (tests: ``httpx.MockTransport``).

    Use it as a context manager, or :meth:`close` it, to release its pooled connections.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        uds: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, token, timeout, uds)
        if transport is None and uds is not None:
            transport = httpx.HTTPTransport(uds=uds)
        self._http = httpx.Client(base_url=self.base_url, transport=transport, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- transport -----------------------------------------------------------------------

    def _call(self, call: _Call[T], timeout: float | None = None) -> T:
        request = self._build(self._http, call, timeout)
        try:
            resp = self._http.send(request)
        except httpx.RequestError as err:
            raise _transport_error(err, call.method, call.path, self._where) from err
        return self._answer(call, resp)

    def request(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> Any:
        """Send one request and return the decoded JSON answer (``None`` for an empty body).

        ``path`` may carry a query string. ``timeout`` overrides the client's for this request.

        Raises:
            RolloutApiError: the manager answered with a status outside 2xx.
            RolloutConnectionError: no answer (status 0; :class:`RolloutTimeoutError` on timeout).
        """
        return self._call(_Call(method.upper(), path, body, _json), timeout)

    def get(self, path: str, *, timeout: float | None = None) -> Any:
        """``GET path``; the decoded JSON answer."""
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        """``POST path`` with ``body`` (``{}`` when omitted); the decoded JSON answer."""
        return self.request("POST", path, {} if body is None else body, timeout=timeout)

    # -- read ----------------------------------------------------------------------------

    def health(self) -> JsonObject:
        """``GET /health``."""
        return self._call(_Calls.health())

    def engines(self) -> EnginesView:
        """``GET /rollout/engines``: every engine not yet removed, in any status."""
        return self._call(_Calls.engines())

    def engine(self, engine_id: str) -> Engine:
        """``GET /rollout/engines/{id}``: one engine (``RolloutApiError`` 404 if unknown)."""
        return self._call(_Calls.engine(engine_id))

    # -- scale-out -----------------------------------------------------------------------

    def scale_out(
        self,
        num_replicas: int | None = None,
        engine_urls: list[str] | None = None,
        model_name: str = "default",
        timeout_secs: float | None = None,
    ) -> ScaleResponse:
        """``POST /rollout/scale_out``: grow to ``num_replicas`` engines in total (absolute), or
        attach the external ``engine_urls``. Answers ``NOOP`` when the target is already met."""
        return self._call(_Calls.scale_out(num_replicas, engine_urls, model_name, timeout_secs))

    def scale_out_status(self, request_id: str) -> ScaleOperation:
        """``GET /rollout/scale_out/{id}``."""
        return self.operation("scale_out", request_id)

    def scale_out_requests(self) -> list[ScaleOperation]:
        """``GET /rollout/scale_out``: every scale-out request the manager remembers."""
        return self._call(_Calls.scale_out_requests())

    def cancel_scale_out(self, request_id: str) -> JsonObject:
        """``POST /rollout/scale_out/{id}/cancel``; returns the manager's JSON answer."""
        return self._call(_Calls.cancel_scale_out(request_id))

    # -- scale-in ------------------------------------------------------------------------

    def scale_in(
        self,
        num_replicas: int | None = None,
        engine_urls: list[str] | None = None,
        force: bool = False,
        dry_run: bool = False,
        timeout_secs: float | None = None,
        model_name: str = "default",
    ) -> ScaleResponse:
        """``POST /rollout/scale_in``: shrink to ``num_replicas`` engines (newest dynamic ones
        first), or remove the engines at ``engine_urls``. ``dry_run`` only reports which
        engines would go; ``force`` skips the drain wait."""
        return self._call(_Calls.scale_in(num_replicas, engine_urls, force, dry_run, timeout_secs, model_name))

    def scale_in_status(self, request_id: str) -> ScaleOperation:
        """``GET /rollout/scale_in/{id}``."""
        return self.operation("scale_in", request_id)

    # -- operations ----------------------------------------------------------------------

    def operation(self, kind: OperationKind, request_id: str) -> ScaleOperation:
        """The record of a scale-out or scale-in operation."""
        return self._call(_Calls.operation(kind, request_id))

    def wait_for_operation(
        self, kind: OperationKind, request_id: str, timeout: float, poll_interval: float = 0.1
    ) -> ScaleOperation:
        """Poll an operation until it reaches a terminal status and return its record.

        Terminal statuses: scale-out ACTIVE, FAILED, CANCELLED, NOOP; scale-in COMPLETED,
        FAILED, NOOP. A FAILED operation is returned, not raised: check ``status``. Polls on
        through a restarting manager (no answer, or the Ray ingress's 503) until the deadline.

        Raises:
            TimeoutError: still not terminal after ``timeout`` seconds; names the last status.
        """
        call = _Calls.operation(kind, request_id)
        late = _operation_late(kind, request_id, timeout)
        return _poll(lambda: self._call(call), lambda op: op.is_terminal, late, timeout, poll_interval)

    def wait_for_engines(
        self, count: int, status: str = "ACTIVE", timeout: float = 60.0, poll_interval: float = 0.1
    ) -> EnginesView:
        """Poll ``/rollout/engines`` until exactly ``count`` engines have ``status``.

        Raises:
            TimeoutError: the condition did not hold within ``timeout`` seconds; the message
                shows the last status of every engine.
        """
        done: Callable[[EnginesView], bool] = lambda view: len(view.with_status(status)) == count  # noqa: E731
        return _poll(self.engines, done, _engines_late(count, status, timeout), timeout, poll_interval)

    # -- the RL pipeline signal and the autoscaler -------------------------------------------

    def report_step(
        self,
        step: int,
        trainer_wait_secs: float,
        rollout_throttled_secs: float,
        step_secs: float,
        rollout_samples: int | None = None,
        next_step_samples: int | None = None,
    ) -> StepReport:
        """``POST /rollout/pipeline``: one trainer step, for the autoscaler.

        ``trainer_wait_secs``: how long the trainer waited for rollout data in the step;
        ``rollout_throttled_secs``: how long rollout was held back by its staleness limit;
        ``step_secs``: the step's wall time. Optionally, both of ``rollout_samples`` (samples
        rollout completed during the step) and ``next_step_samples`` (samples the next step will
        consume): with them the autoscaler compares rollout's rate with the trainer's and can
        scale out before the trainer starves. Returns which conditions the step triggered
        (``trainer_starved``, ``rollout_short``, ``rollout_throttled``) and the ``decision``.
        """
        call = _Calls.report_step(
            step, trainer_wait_secs, rollout_throttled_secs, step_secs, rollout_samples, next_step_samples
        )
        return self._call(call)

    def autoscaler_status(self) -> AutoscalerStatus:
        """``GET /autoscaler/status``: enabled/running, the fleet's size and bounds, the last
        decision, the pending requests and the config."""
        return self._call(_Calls.autoscaler_status())

    def set_autoscaler_enabled(self, enabled: bool) -> JsonObject:
        """``POST /autoscaler/enable``: turn the autoscaler's decisions on or off."""
        return self._call(_Calls.set_autoscaler_enabled(enabled))

    # -- weights ---------------------------------------------------------------------------

    def weights(self) -> WeightsView:
        """``GET /rollout/weights``: the fleet's version, the update in flight, each engine's
        version and checksum, and the history of updates."""
        return self._call(_Calls.weights())

    def publish_weights(
        self,
        version: str,
        path: str,
        strategy: str = "rolling",
        max_unavailable: int | None = None,
        checksum: str | None = None,
        pause_mode: str | None = None,
    ) -> PublishResult:
        """``POST /rollout/weights/publish``: make the fleet converge to the checkpoint directory
        ``path`` as ``version``. Answers at once, 202 (a new update, ``accepted``) or 200 (the
        same version, path and checksum were published before: the existing update); the
        checkpoint is checked and hashed afterwards (status ``CHECKSUMMING`` on managers that
        do it in the background), and a bad one ends the update FAILED. Follow it with
        :meth:`wait_for_weight_update`."""
        return self._call(_Calls.publish_weights(version, path, strategy, max_unavailable, checksum, pause_mode))

    def weight_update(self, update_id: str) -> WeightUpdate:
        """``GET /rollout/weights/updates/{id}``: one update with per-engine progress."""
        return self._call(_Calls.weight_update(update_id))

    def open_trainer_update(
        self,
        version: str,
        tensors: Sequence[tuple[str, str, Sequence[int]]],
        master_address: str,
        master_port: int,
        group_name: str | None = None,
        pause_mode: str | None = None,
        flush_cache: bool = True,
        group_prefix: str | None = None,
        backend: str | None = None,
    ) -> WeightUpdate:
        """``POST /rollout/weights/trainer_updates``: open an update whose bytes the trainer
        broadcasts (``tensors``: ``(name, dtype, shape)`` in broadcast order; ``backend`` of a
        new group: ``nccl`` by default, ``gloo`` for engines on CPU). The answer's
        ``trainer["group"]`` is the group layout; when its ``new`` is true the trainer joins it
        as rank 0 at ``master_address:master_port``. Then :meth:`start_broadcast`, broadcast,
        and :meth:`wait_for_weight_update`. ``elastic_rollout.trainer.DistributedWeightSync``
        does all of this."""
        return self._call(
            _Calls.open_trainer_update(
                version,
                tensors,
                master_address,
                master_port,
                group_name,
                pause_mode,
                flush_cache,
                group_prefix,
                backend,
            )
        )

    def start_broadcast(
        self,
        update_id: str,
        tensors: Sequence[tuple[str, str, Sequence[int]]] | None = None,
        last: bool | None = None,
    ) -> WeightUpdate:
        """``POST /rollout/weights/updates/{id}/broadcast``: the trainer is about to broadcast;
        answered once every member joined the group (the manager then pauses them and starts
        their side). For an update opened without tensors, each call names the next bucket
        (``tensors``: ``(name, dtype, shape)``) and is answered once every member received the
        bucket before; ``last=True`` (with or without a bucket) ends the broadcast."""
        return self._call(_Calls.start_broadcast(update_id, tensors, last))

    def abort_weight_update(self, update_id: str, reason: str) -> WeightUpdate:
        """``POST /rollout/weights/updates/{id}/abort``: the trainer gives up before its
        broadcast; answered once the update is FAILED and its group destroyed."""
        return self._call(_Calls.abort_weight_update(update_id, reason))

    def destroy_trainer_group(self) -> JsonObject:
        """``POST /rollout/weights/trainer_group/destroy``: the engines leave the trainer's
        weight-update group; the next trainer update builds a new one."""
        return self._call(_Calls.destroy_trainer_group())

    def build_trainer_group(
        self, group_name: str, master_address: str, master_port: int, world_size: int, backend: str | None = None
    ) -> JsonObject:
        """``POST /rollout/weights/trainer_group``: a weight-update group whose name and world
        size the trainer fixes (AReaL builds its group once; ``backend`` as for
        :meth:`open_trainer_update`). The first engines that fill
        ``world_size - 1`` ranks join it while the trainer joins as rank 0; the answer is the
        group (``fixed.state`` ``joining``), :meth:`trainer_group` says when it is ``joined``."""
        return self._call(_Calls.build_trainer_group(group_name, master_address, master_port, world_size, backend))

    def trainer_group(self) -> JsonObject:
        """``GET /rollout/weights/trainer_group``: the group the engines hold now."""
        return self._call(_Calls.trainer_group())

    def weight_updates(self, status: str | None = None) -> list[WeightUpdate]:
        """``GET /rollout/weights/updates``: the updates the manager remembers, oldest first,
        optionally only those in ``status``."""
        return self._call(_Calls.weight_updates(status))

    def wait_for_weight_update(self, update_id: str, timeout: float, poll_interval: float = 0.1) -> WeightUpdate:
        """Poll an update until it is COMPLETED or FAILED and return its record (a FAILED one is
        returned, not raised: check ``status``/``error_message``). Any other status
        (``CHECKSUMMING``, ``PENDING``, ``UPDATING``, ...) counts as still running.

        Raises:
            TimeoutError: still running after ``timeout`` seconds; names the last status.
        """
        call = _Calls.weight_update(update_id)
        late = _update_late(update_id, timeout)
        return _poll(lambda: self._call(call), lambda update: update.is_terminal, late, timeout, poll_interval)


def _poll(
    fetch: Callable[[], T], done: Callable[[T], bool], late: Callable[[T | None], str], timeout: float, interval: float
) -> T:
    """Calls ``fetch`` every ``interval`` s until ``done`` holds for its answer and returns that
    answer; polls through a restarting manager; raises ``TimeoutError(late(last answer))``."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        try:
            answer: T | None = fetch()
        except RolloutApiError as err:
            if not _restarting(err):
                raise
            answer = None
        if answer is not None:
            last = answer
            if done(answer):
                return answer
        if time.monotonic() >= deadline:
            raise TimeoutError(late(last))
        time.sleep(interval)


# -- the asyncio client ------------------------------------------------------------------------


class AsyncRolloutClient(_Base):
    """The same client for asyncio programs (an async trainer, the Ray reconciler): every method
    of :class:`RolloutClient`, as a coroutine, with the same arguments and results; the waits
    sleep with :func:`asyncio.sleep`, never blocking the event loop.

    Args: as :class:`RolloutClient` (``transport`` an ``httpx.AsyncBaseTransport``).

    Use it within one event loop, as ``async with``, or :meth:`aclose` it.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        uds: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, token, timeout, uds)
        if transport is None and uds is not None:
            transport = httpx.AsyncHTTPTransport(uds=uds)
        self._http = httpx.AsyncClient(base_url=self.base_url, transport=transport, timeout=timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- transport -----------------------------------------------------------------------

    async def _call(self, call: _Call[T], timeout: float | None = None) -> T:
        request = self._build(self._http, call, timeout)
        try:
            resp = await self._http.send(request)
        except httpx.RequestError as err:
            raise _transport_error(err, call.method, call.path, self._where) from err
        return self._answer(call, resp)

    async def request(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> Any:
        """As :meth:`RolloutClient.request`."""
        return await self._call(_Call(method.upper(), path, body, _json), timeout)

    async def get(self, path: str, *, timeout: float | None = None) -> Any:
        """As :meth:`RolloutClient.get`."""
        return await self.request("GET", path, timeout=timeout)

    async def post(self, path: str, body: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        """As :meth:`RolloutClient.post`."""
        return await self.request("POST", path, {} if body is None else body, timeout=timeout)

    # -- read ----------------------------------------------------------------------------

    async def health(self) -> JsonObject:
        return await self._call(_Calls.health())

    async def engines(self) -> EnginesView:
        """As :meth:`RolloutClient.engines`."""
        return await self._call(_Calls.engines())

    async def engine(self, engine_id: str) -> Engine:
        return await self._call(_Calls.engine(engine_id))

    # -- scale -----------------------------------------------------------------------------

    async def scale_out(
        self,
        num_replicas: int | None = None,
        engine_urls: list[str] | None = None,
        model_name: str = "default",
        timeout_secs: float | None = None,
    ) -> ScaleResponse:
        """As :meth:`RolloutClient.scale_out`."""
        return await self._call(_Calls.scale_out(num_replicas, engine_urls, model_name, timeout_secs))

    async def scale_out_status(self, request_id: str) -> ScaleOperation:
        return await self.operation("scale_out", request_id)

    async def scale_out_requests(self) -> list[ScaleOperation]:
        return await self._call(_Calls.scale_out_requests())

    async def cancel_scale_out(self, request_id: str) -> JsonObject:
        return await self._call(_Calls.cancel_scale_out(request_id))

    async def scale_in(
        self,
        num_replicas: int | None = None,
        engine_urls: list[str] | None = None,
        force: bool = False,
        dry_run: bool = False,
        timeout_secs: float | None = None,
        model_name: str = "default",
    ) -> ScaleResponse:
        """As :meth:`RolloutClient.scale_in`."""
        return await self._call(_Calls.scale_in(num_replicas, engine_urls, force, dry_run, timeout_secs, model_name))

    async def scale_in_status(self, request_id: str) -> ScaleOperation:
        return await self.operation("scale_in", request_id)

    async def operation(self, kind: OperationKind, request_id: str) -> ScaleOperation:
        return await self._call(_Calls.operation(kind, request_id))

    async def wait_for_operation(
        self, kind: OperationKind, request_id: str, timeout: float, poll_interval: float = 0.1
    ) -> ScaleOperation:
        """As :meth:`RolloutClient.wait_for_operation`."""
        call = _Calls.operation(kind, request_id)
        late = _operation_late(kind, request_id, timeout)
        return await _apoll(lambda: self._call(call), lambda op: op.is_terminal, late, timeout, poll_interval)

    async def wait_for_engines(
        self, count: int, status: str = "ACTIVE", timeout: float = 60.0, poll_interval: float = 0.1
    ) -> EnginesView:
        """As :meth:`RolloutClient.wait_for_engines`."""
        done: Callable[[EnginesView], bool] = lambda view: len(view.with_status(status)) == count  # noqa: E731
        return await _apoll(self.engines, done, _engines_late(count, status, timeout), timeout, poll_interval)

    # -- the RL pipeline signal and the autoscaler -------------------------------------------

    async def report_step(
        self,
        step: int,
        trainer_wait_secs: float,
        rollout_throttled_secs: float,
        step_secs: float,
        rollout_samples: int | None = None,
        next_step_samples: int | None = None,
    ) -> StepReport:
        """As :meth:`RolloutClient.report_step`."""
        call = _Calls.report_step(
            step, trainer_wait_secs, rollout_throttled_secs, step_secs, rollout_samples, next_step_samples
        )
        return await self._call(call)

    async def autoscaler_status(self) -> AutoscalerStatus:
        return await self._call(_Calls.autoscaler_status())

    async def set_autoscaler_enabled(self, enabled: bool) -> JsonObject:
        return await self._call(_Calls.set_autoscaler_enabled(enabled))

    # -- weights ---------------------------------------------------------------------------

    async def weights(self) -> WeightsView:
        """As :meth:`RolloutClient.weights`."""
        return await self._call(_Calls.weights())

    async def publish_weights(
        self,
        version: str,
        path: str,
        strategy: str = "rolling",
        max_unavailable: int | None = None,
        checksum: str | None = None,
        pause_mode: str | None = None,
    ) -> PublishResult:
        """As :meth:`RolloutClient.publish_weights`."""
        return await self._call(_Calls.publish_weights(version, path, strategy, max_unavailable, checksum, pause_mode))

    async def weight_update(self, update_id: str) -> WeightUpdate:
        return await self._call(_Calls.weight_update(update_id))

    async def open_trainer_update(
        self,
        version: str,
        tensors: Sequence[tuple[str, str, Sequence[int]]],
        master_address: str,
        master_port: int,
        group_name: str | None = None,
        pause_mode: str | None = None,
        flush_cache: bool = True,
        group_prefix: str | None = None,
        backend: str | None = None,
    ) -> WeightUpdate:
        """As :meth:`RolloutClient.open_trainer_update`."""
        return await self._call(
            _Calls.open_trainer_update(
                version,
                tensors,
                master_address,
                master_port,
                group_name,
                pause_mode,
                flush_cache,
                group_prefix,
                backend,
            )
        )

    async def start_broadcast(
        self,
        update_id: str,
        tensors: Sequence[tuple[str, str, Sequence[int]]] | None = None,
        last: bool | None = None,
    ) -> WeightUpdate:
        """As :meth:`RolloutClient.start_broadcast`."""
        return await self._call(_Calls.start_broadcast(update_id, tensors, last))

    async def abort_weight_update(self, update_id: str, reason: str) -> WeightUpdate:
        """As :meth:`RolloutClient.abort_weight_update`."""
        return await self._call(_Calls.abort_weight_update(update_id, reason))

    async def destroy_trainer_group(self) -> JsonObject:
        """As :meth:`RolloutClient.destroy_trainer_group`."""
        return await self._call(_Calls.destroy_trainer_group())

    async def build_trainer_group(
        self, group_name: str, master_address: str, master_port: int, world_size: int, backend: str | None = None
    ) -> JsonObject:
        """As :meth:`RolloutClient.build_trainer_group`."""
        return await self._call(
            _Calls.build_trainer_group(group_name, master_address, master_port, world_size, backend)
        )

    async def trainer_group(self) -> JsonObject:
        """As :meth:`RolloutClient.trainer_group`."""
        return await self._call(_Calls.trainer_group())

    async def weight_updates(self, status: str | None = None) -> list[WeightUpdate]:
        return await self._call(_Calls.weight_updates(status))

    async def wait_for_weight_update(self, update_id: str, timeout: float, poll_interval: float = 0.1) -> WeightUpdate:
        """As :meth:`RolloutClient.wait_for_weight_update`."""
        call = _Calls.weight_update(update_id)
        late = _update_late(update_id, timeout)
        return await _apoll(lambda: self._call(call), lambda update: update.is_terminal, late, timeout, poll_interval)


async def _apoll(
    fetch: Callable[[], Awaitable[T]],
    done: Callable[[T], bool],
    late: Callable[[T | None], str],
    timeout: float,
    interval: float,
) -> T:
    """:func:`_poll` for coroutines: sleeps with :func:`asyncio.sleep`."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        try:
            answer: T | None = await fetch()
        except RolloutApiError as err:
            if not _restarting(err):
                raise
            answer = None
        if answer is not None:
            last = answer
            if done(answer):
                return answer
        if time.monotonic() >= deadline:
            raise TimeoutError(late(last))
        await asyncio.sleep(interval)
