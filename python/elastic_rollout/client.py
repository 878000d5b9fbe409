"""Typed client for the rollout-manager control API (``/rollout/*``), stdlib only.

Every response is parsed into a frozen dataclass that keeps the full JSON object in ``raw``,
so fields the manager adds later stay reachable without a client release.

Errors: any non-2xx answer raises :class:`RolloutApiError` with the HTTP status and the
``{"error": {"code", "message"}}`` body the manager sends. Network failures propagate as
:class:`urllib.error.URLError` (or :class:`TimeoutError`).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

__all__ = [
    "SCALE_IN_TERMINAL",
    "SCALE_OUT_TERMINAL",
    "Engine",
    "EnginesView",
    "OperationKind",
    "RolloutApiError",
    "RolloutClient",
    "ScaleOperation",
    "ScaleResponse",
]

OperationKind = Literal["scale_out", "scale_in"]

#: Statuses after which a scale-out operation never changes again.
SCALE_OUT_TERMINAL: frozenset[str] = frozenset({"ACTIVE", "FAILED", "CANCELLED", "NOOP"})
#: Statuses after which a scale-in operation never changes again.
SCALE_IN_TERMINAL: frozenset[str] = frozenset({"COMPLETED", "FAILED", "NOOP"})
_TERMINAL: dict[str, frozenset[str]] = {"scale_out": SCALE_OUT_TERMINAL, "scale_in": SCALE_IN_TERMINAL}

JsonObject = dict[str, Any]


class RolloutApiError(Exception):
    """The manager answered with an HTTP error status.

    Attributes:
        status: the HTTP status code (400, 404, 409, 500, ...).
        code: ``error.code`` from the JSON body, or ``"http_<status>"`` if the body had none.
        message: ``error.message`` from the JSON body, or the raw body text.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message

    @classmethod
    def from_body(cls, status: int, body: bytes) -> RolloutApiError:
        """Build the error from a response body, tolerating bodies that are not the JSON model."""
        text = body.decode("utf-8", errors="replace")
        code, message = f"http_{status}", text.strip() or f"HTTP {status}"
        try:
            parsed = json.loads(text)
        except ValueError:
            return cls(status, code, message)
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if isinstance(error, dict):
            code = str(error.get("code") or code)
            message = str(error.get("message") or message)
        elif isinstance(error, str):
            message = error
        return cls(status, code, message)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class Engine:
    """One engine as listed by ``GET /rollout/engines``."""

    engine_id: str
    url: str
    status: str
    is_healthy: bool
    model_name: str = "default"
    origin: str | None = None
    weight_version: str | None = None
    #: SHA-256 of the weights the engine reports it loaded (when it reports one).
    weights_checksum: str | None = None
    gpu_ids: tuple[int, ...] = ()
    pid: int | None = None
    started_at: float | None = None
    log_path: str | None = None
    restarts: int = 0
    last_error: str | None = None
    raw: JsonObject = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], model_name: str = "default") -> Engine:
        return cls(
            engine_id=str(data["engine_id"]),
            url=str(data["url"]),
            status=str(data["status"]),
            is_healthy=bool(data.get("is_healthy", False)),
            model_name=str(data.get("model_name") or model_name),
            origin=_opt_str(data.get("origin")),
            weight_version=_opt_str(data.get("weight_version")),
            weights_checksum=_opt_str(data.get("weights_checksum")),
            gpu_ids=tuple(int(gpu) for gpu in data.get("gpu_ids") or ()),
            pid=_opt_int(data.get("pid")),
            started_at=_opt_float(data.get("started_at")),
            log_path=_opt_str(data.get("log_path")),
            restarts=int(data.get("restarts") or 0),
            last_error=_opt_str(data.get("last_error")),
            raw=dict(data),
        )


@dataclass(frozen=True)
class EnginesView:
    """The answer of ``GET /rollout/engines``: every engine not yet removed, by model."""

    models: dict[str, tuple[Engine, ...]]
    total_engines: int
    raw: JsonObject = field(default_factory=dict, compare=False, repr=False)

    @property
    def engines(self) -> tuple[Engine, ...]:
        """All engines of all models."""
        return tuple(engine for engines in self.models.values() for engine in engines)

    def with_status(self, status: str) -> list[Engine]:
        """The engines whose status is ``status``."""
        return [engine for engine in self.engines if engine.status == status]

    def by_id(self, engine_id: str) -> Engine | None:
        return next((engine for engine in self.engines if engine.engine_id == engine_id), None)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EnginesView:
        models: dict[str, tuple[Engine, ...]] = {}
        for model_name, model in (data.get("models") or {}).items():
            models[model_name] = tuple(Engine.from_json(engine, model_name) for engine in model.get("engines") or ())
        total = data.get("total_engines")
        count = sum(len(engines) for engines in models.values())
        return cls(models=models, total_engines=count if total is None else int(total), raw=dict(data))


@dataclass(frozen=True)
class ScaleResponse:
    """The answer of ``POST /rollout/scale_out`` or ``POST /rollout/scale_in``.

    For a dry run, ``dry_run`` is true, ``request_id``/``status`` are usually ``None`` and
    ``engines`` lists the engines that would be removed.
    """

    request_id: str | None
    status: str | None
    message: str | None = None
    dry_run: bool = False
    engines: tuple[Engine, ...] = ()
    raw: JsonObject = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScaleResponse:
        return cls(
            request_id=_opt_str(data.get("request_id")),
            status=_opt_str(data.get("status")),
            message=_opt_str(data.get("message")),
            dry_run=bool(data.get("dry_run", False)),
            engines=tuple(Engine.from_json(engine) for engine in data.get("engines") or ()),
            raw=dict(data),
        )


@dataclass(frozen=True)
class ScaleOperation:
    """A scale-out or scale-in operation record (``GET /rollout/scale_{out,in}/{id}``)."""

    kind: OperationKind
    request_id: str
    status: str
    model_name: str | None = None
    num_replicas: int | None = None
    engine_urls: tuple[str, ...] = ()
    engine_ids: tuple[str, ...] = ()
    failed_engines: tuple[Any, ...] = ()
    created_at: float | None = None
    updated_at: float | None = None
    error_message: str | None = None
    weight_version: str | None = None
    history: tuple[JsonObject, ...] = ()
    raw: JsonObject = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_terminal(self) -> bool:
        """True once the status can no longer change."""
        return self.status in _TERMINAL[self.kind]

    @property
    def statuses(self) -> list[str]:
        """The statuses this operation went through, oldest first (from ``history``)."""
        return [str(entry.get("status")) for entry in self.history]

    @classmethod
    def from_json(cls, kind: OperationKind, data: Mapping[str, Any]) -> ScaleOperation:
        return cls(
            kind=kind,
            request_id=str(data["request_id"]),
            status=str(data["status"]),
            model_name=_opt_str(data.get("model_name")),
            num_replicas=_opt_int(data.get("num_replicas")),
            engine_urls=tuple(str(url) for url in data.get("engine_urls") or ()),
            engine_ids=tuple(str(engine_id) for engine_id in data.get("engine_ids") or ()),
            failed_engines=tuple(data.get("failed_engines") or ()),
            created_at=_opt_float(data.get("created_at")),
            updated_at=_opt_float(data.get("updated_at")),
            error_message=_opt_str(data.get("error_message")),
            weight_version=_opt_str(data.get("weight_version")),
            history=tuple(dict(entry) for entry in data.get("history") or ()),
            raw=dict(data),
        )


class RolloutClient:
    """Client for one rollout-manager's control API.

    Args:
        base_url: the control address, e.g. ``http://127.0.0.1:8000``.
        token: sent as ``Authorization: Bearer <token>`` when given.
        timeout: seconds allowed for each HTTP request.
    """

    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"RolloutClient({self.base_url!r})"

    # -- transport -----------------------------------------------------------------------

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """Send one request and return the decoded JSON answer (``None`` for an empty body).

        Raises:
            RolloutApiError: the manager answered with a status >= 400.
        """
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as err:
            try:
                error_body = err.read()
            except OSError:
                error_body = b""
            finally:
                err.close()
            raise RolloutApiError.from_body(err.code, error_body) from None
        return json.loads(payload) if payload.strip() else None

    # -- read ----------------------------------------------------------------------------

    def health(self) -> JsonObject:
        """``GET /health``."""
        result: JsonObject = self.request("GET", "/health")
        return result

    def engines(self) -> EnginesView:
        """``GET /rollout/engines``: every engine not yet removed, in any status."""
        return EnginesView.from_json(self.request("GET", "/rollout/engines"))

    # -- scale-out -----------------------------------------------------------------------

    def engine(self, engine_id: str) -> Engine:
        """``GET /rollout/engines/{id}``: one engine (``RolloutApiError`` 404 if unknown)."""
        return Engine.from_json(self.request("GET", f"/rollout/engines/{_quote(engine_id)}"))

    def scale_out(
        self,
        num_replicas: int | None = None,
        engine_urls: list[str] | None = None,
        model_name: str = "default",
        timeout_secs: float | None = None,
    ) -> ScaleResponse:
        """``POST /rollout/scale_out``: grow to ``num_replicas`` engines in total (absolute), or
        attach the external ``engine_urls``. Answers ``NOOP`` when the target is already met."""
        body: JsonObject = {"model_name": model_name}
        if num_replicas is not None:
            body["num_replicas"] = num_replicas
        if engine_urls is not None:
            body["engine_urls"] = list(engine_urls)
        if timeout_secs is not None:
            body["timeout_secs"] = timeout_secs
        return ScaleResponse.from_json(self.request("POST", "/rollout/scale_out", body))

    def scale_out_status(self, request_id: str) -> ScaleOperation:
        """``GET /rollout/scale_out/{id}``."""
        return self.operation("scale_out", request_id)

    def scale_out_requests(self) -> list[ScaleOperation]:
        """``GET /rollout/scale_out``: every scale-out request the manager remembers."""
        data = self.request("GET", "/rollout/scale_out")
        return [ScaleOperation.from_json("scale_out", record) for record in data.get("requests") or ()]

    def cancel_scale_out(self, request_id: str) -> JsonObject:
        """``POST /rollout/scale_out/{id}/cancel``; returns the manager's JSON answer."""
        result: JsonObject = self.request("POST", f"/rollout/scale_out/{_quote(request_id)}/cancel", {})
        return result

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
        body: JsonObject = {"model_name": model_name, "force": force, "dry_run": dry_run}
        if num_replicas is not None:
            body["num_replicas"] = num_replicas
        if engine_urls is not None:
            body["engine_urls"] = list(engine_urls)
        if timeout_secs is not None:
            body["timeout_secs"] = timeout_secs
        return ScaleResponse.from_json(self.request("POST", "/rollout/scale_in", body))

    def scale_in_status(self, request_id: str) -> ScaleOperation:
        """``GET /rollout/scale_in/{id}``."""
        return self.operation("scale_in", request_id)

    # -- operations ----------------------------------------------------------------------

    def operation(self, kind: OperationKind, request_id: str) -> ScaleOperation:
        """The record of a scale-out or scale-in operation."""
        data = self.request("GET", f"/rollout/{kind}/{_quote(request_id)}")
        return ScaleOperation.from_json(kind, data)

    def wait_for_operation(
        self, kind: OperationKind, request_id: str, timeout: float, poll_interval: float = 0.1
    ) -> ScaleOperation:
        """Poll an operation until it reaches a terminal status and return its record.

        Terminal statuses: scale-out ACTIVE, FAILED, CANCELLED, NOOP; scale-in COMPLETED,
        FAILED, NOOP. A FAILED operation is returned, not raised: check ``status``.

        Raises:
            TimeoutError: still not terminal after ``timeout`` seconds; names the last status.
        """
        if kind not in _TERMINAL:
            raise ValueError(f"kind must be 'scale_out' or 'scale_in', not {kind!r}")

        def late(op: ScaleOperation | None) -> str:
            last = "unknown (the manager did not answer)" if op is None else op.status
            history = "none" if op is None else " -> ".join(op.statuses) or "none"
            return f"{kind} {request_id} not finished after {timeout:g}s; last status {last} (history: {history})"

        return _poll(lambda: self.operation(kind, request_id), lambda op: op.is_terminal, late, timeout, poll_interval)

    def wait_for_engines(
        self, count: int, status: str = "ACTIVE", timeout: float = 60.0, poll_interval: float = 0.1
    ) -> EnginesView:
        """Poll ``/rollout/engines`` until exactly ``count`` engines have ``status``.

        Raises:
            TimeoutError: the condition did not hold within ``timeout`` seconds; the message
                shows the last status of every engine.
        """

        def late(view: EnginesView | None) -> str:
            seen = "no answer" if view is None else ", ".join(f"{e.engine_id}={e.status}" for e in view.engines)
            return f"wanted {count} engine(s) {status} within {timeout:g}s; last seen: {seen or 'no engines'}"

        return _poll(self.engines, lambda view: len(view.with_status(status)) == count, late, timeout, poll_interval)

    # -- the RL pipeline signal -------------------------------------------------------------

    def report_step(
        self,
        step: int,
        trainer_wait_secs: float,
        rollout_throttled_secs: float,
        step_secs: float,
        rollout_samples: int | None = None,
        next_step_samples: int | None = None,
    ) -> JsonObject:
        """``POST /rollout/pipeline``: one trainer step, for the autoscaler.

        ``trainer_wait_secs``: how long the trainer waited for rollout data in the step;
        ``rollout_throttled_secs``: how long rollout was held back by its staleness limit;
        ``step_secs``: the step's wall time. Optionally, both of ``rollout_samples`` (samples
        rollout completed during the step) and ``next_step_samples`` (samples the next step will
        consume): with them the autoscaler compares rollout's rate with the trainer's and can
        scale out before the trainer starves. Returns ``{accepted, signal, trainer_starved,
        rollout_short, rollout_throttled, decision}``.
        """
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
        result: JsonObject = self.request("POST", "/rollout/pipeline", body)
        return result

    # -- weights ---------------------------------------------------------------------------

    def weights(self) -> JsonObject:
        """``GET /rollout/weights``: the fleet's version, the update in flight, each engine's
        version and checksum, and the history of updates."""
        result: JsonObject = self.request("GET", "/rollout/weights")
        return result

    def publish_weights(
        self,
        version: str,
        path: str,
        strategy: str = "rolling",
        max_unavailable: int | None = None,
        checksum: str | None = None,
        pause_mode: str | None = None,
    ) -> JsonObject:
        """``POST /rollout/weights/publish``: make the fleet converge to the checkpoint directory
        ``path`` as ``version``. Returns ``{update_id, status, version, checksum, message}``
        (the existing update when the same version, path and checksum were published before)."""
        body: JsonObject = {"version": version, "path": path, "strategy": strategy}
        if max_unavailable is not None:
            body["max_unavailable"] = max_unavailable
        if checksum is not None:
            body["checksum"] = checksum
        if pause_mode is not None:
            body["pause_mode"] = pause_mode
        result: JsonObject = self.request("POST", "/rollout/weights/publish", body)
        return result

    def weight_update(self, update_id: str) -> JsonObject:
        """``GET /rollout/weights/updates/{id}``: one update with per-engine progress."""
        result: JsonObject = self.request("GET", f"/rollout/weights/updates/{_quote(update_id)}")
        return result

    def wait_for_weight_update(self, update_id: str, timeout: float, poll_interval: float = 0.1) -> JsonObject:
        """Poll an update until it is COMPLETED or FAILED and return its record (a FAILED one
        is returned, not raised).

        Raises:
            TimeoutError: still running after ``timeout`` seconds; names the last status.
        """

        def late(update: JsonObject | None) -> str:
            last = "unknown (the manager did not answer)" if update is None else update.get("status")
            return f"weight update {update_id} not finished after {timeout:g}s; last status {last}"

        return _poll(
            lambda: self.weight_update(update_id),
            lambda update: update.get("status") in WEIGHT_UPDATE_TERMINAL,
            late,
            timeout,
            poll_interval,
        )


#: Statuses in which a weight update has ended.
WEIGHT_UPDATE_TERMINAL = frozenset({"COMPLETED", "FAILED"})


T = TypeVar("T")


def _poll(
    fetch: Callable[[], T], done: Callable[[T], bool], late: Callable[[T | None], str], timeout: float, interval: float
) -> T:
    """Calls ``fetch`` every ``interval`` s until ``done`` holds for its answer and returns that
    answer; polls through a restarting manager; raises ``TimeoutError(late(last answer))``."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        answer = _unless_restarting(fetch)
        if answer is not None:
            last = answer
            if done(answer):
                return answer
        if time.monotonic() >= deadline:
            raise TimeoutError(late(last))
        time.sleep(interval)


def _unless_restarting(call: Callable[[], T]) -> T | None:
    """``call()``, or None while the manager is unreachable (restarting: connection refused or
    reset, or the Ray ingress's 503 ``manager_unreachable``). The wait helpers poll through a
    manager restart until their deadline instead of failing on the first refused poll."""
    try:
        return call()
    except RolloutApiError as e:
        if e.status == 503 and e.code == "manager_unreachable":
            return None
        raise
    except (urllib.error.URLError, ConnectionError) as e:
        if isinstance(e, urllib.error.HTTPError):
            raise
        return None


def _quote(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")
