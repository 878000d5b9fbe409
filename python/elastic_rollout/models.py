"""Typed results of the control API, shared by :class:`~elastic_rollout.RolloutClient` and
:class:`~elastic_rollout.AsyncRolloutClient`.

Every result is a frozen dataclass parsed from the manager's JSON answer, which it keeps whole in
``raw``: fields the manager adds later stay reachable without a client release. Statuses are plain
strings, never an enum, so a state added by a newer manager parses (and a wait treats it as still
running until a terminal status).

The weights and autoscaler results (:class:`WeightsView`, :class:`WeightUpdate`,
:class:`PublishResult`, :class:`StepReport`, :class:`AutoscalerStatus`) are also read-only dicts
of that answer, because the client returned plain dicts for these calls before: code written as
``update["update_id"]``, ``weights.get("version")`` or ``json.dumps(update)`` keeps working. Prefer
the attributes (``update.update_id``) in new code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

__all__ = [
    "SCALE_IN_TERMINAL",
    "SCALE_OUT_TERMINAL",
    "WEIGHT_UPDATE_TERMINAL",
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
    "ScaleOperation",
    "ScaleResponse",
    "StepReport",
    "WeightUpdate",
    "WeightsView",
]

JsonObject = dict[str, Any]
OperationKind = Literal["scale_out", "scale_in"]

#: Statuses after which a scale-out operation never changes again.
SCALE_OUT_TERMINAL: frozenset[str] = frozenset({"ACTIVE", "FAILED", "CANCELLED", "NOOP"})
#: Statuses after which a scale-in operation never changes again.
SCALE_IN_TERMINAL: frozenset[str] = frozenset({"COMPLETED", "FAILED", "NOOP"})
#: Statuses in which a weight update has ended. Every other status (``CHECKSUMMING``, ``PENDING``,
#: ``UPDATING``, or one a newer manager adds) means it is still running.
WEIGHT_UPDATE_TERMINAL: frozenset[str] = frozenset({"COMPLETED", "FAILED"})
TERMINAL: dict[str, frozenset[str]] = {"scale_out": SCALE_OUT_TERMINAL, "scale_in": SCALE_IN_TERMINAL}


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _obj(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


class JsonRecord(dict[str, Any]):
    """Base of the results that are also the manager's JSON answer as a read-only dict.

    Subclasses are frozen dataclasses (``eq=False``: two records are equal when their answers
    are); the dict holds ``raw``, filled once by ``__post_init__``.
    """

    raw: JsonObject

    def __post_init__(self) -> None:
        dict.update(self, self.raw)

    def _read_only(self, *_args: Any, **_kwargs: Any) -> NoReturn:
        raise TypeError(f"{type(self).__name__} is read-only (copy it with dict(...) to change it)")

    def __setitem__(self, key: str, value: Any) -> None:
        self._read_only()

    def __delitem__(self, key: str) -> None:
        self._read_only()

    def __ior__(self, other: Any) -> Any:  # type: ignore[misc]  # read-only
        self._read_only()

    def clear(self) -> None:
        self._read_only()

    def pop(self, *args: Any, **kwargs: Any) -> Any:
        self._read_only()

    def popitem(self) -> tuple[str, Any]:
        self._read_only()

    def setdefault(self, *args: Any, **kwargs: Any) -> Any:
        self._read_only()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._read_only()

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the answer (pickle would otherwise set the items one by one).
        return (_rebuild, (type(self), dict(self.raw)))


def _rebuild(cls: type[Any], raw: JsonObject) -> Any:
    return cls.from_json(raw)


# -- engines and scale operations -------------------------------------------------------------


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
    #: What the engine waits for, or why it stays FAILED (a spent restart budget).
    detail: str | None = None
    #: The last lines of its log, kept when the manager gave up restarting it.
    log_tail: tuple[str, ...] | None = None
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
            detail=_opt_str(data.get("detail")),
            log_tail=None if data.get("log_tail") is None else tuple(str(line) for line in data["log_tail"]),
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
        return self.status in TERMINAL[self.kind]

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


# -- weights -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineUpdateProgress:
    """One engine's turn in a weight update: ``PENDING -> UPDATING -> VERIFIED | FAILED``, or
    ``SKIPPED`` (it left the fleet first)."""

    status: str
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    raw: JsonObject = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EngineUpdateProgress:
        return cls(
            status=str(data.get("status")),
            error=_opt_str(data.get("error")),
            started_at=_opt_float(data.get("started_at")),
            finished_at=_opt_float(data.get("finished_at")),
            raw=dict(data),
        )


@dataclass(frozen=True, eq=False)
class WeightUpdate(JsonRecord):
    """A weight update (``GET /rollout/weights/updates/{id}``; also the shorter entries of
    ``WeightsView.history``, where absent fields are ``None``/empty).

    ``status`` is a plain string: ``CHECKSUMMING`` (the checkpoint is being hashed), ``PENDING``,
    ``UPDATING``, then ``COMPLETED`` or ``FAILED`` (see :attr:`is_terminal`). ``engines`` maps each
    engine id to its progress; ``error_message`` says why a FAILED update failed.
    """

    update_id: str
    version: str
    status: str
    path: str | None = None
    checksum: str | None = None
    engine_path: str | None = None
    previous_version: str | None = None
    strategy: str | None = None
    max_unavailable: int | None = None
    pause_mode: str | None = None
    transport: str | None = None
    engines: Mapping[str, EngineUpdateProgress] = field(default_factory=dict)
    created_at: float | None = None
    updated_at: float | None = None
    finished_at: float | None = None
    error_message: str | None = None
    message: str | None = None
    history: tuple[JsonObject, ...] = ()
    resumed: int = 0
    #: ``checkpoint`` (a publish) or ``trainer`` (the trainer's broadcast).
    source: str = "checkpoint"
    #: A trainer update's group layout and tensors (``group``: ``group_name``,
    #: ``master_address``, ``master_port``, ``world_size``, ``members``, ``new``), else None.
    trainer: JsonObject | None = None
    raw: JsonObject = field(default_factory=dict, repr=False)

    @property
    def is_terminal(self) -> bool:
        """True once the update has ended (COMPLETED or FAILED)."""
        return self.status in WEIGHT_UPDATE_TERMINAL

    @property
    def succeeded(self) -> bool:
        return self.status == "COMPLETED"

    @property
    def statuses(self) -> list[str]:
        """The statuses the update went through, oldest first (``RESUMED`` entries included)."""
        return [str(entry.get("status")) for entry in self.history]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WeightUpdate:
        return cls(
            update_id=str(data["update_id"]),
            version=str(data.get("version")),
            status=str(data["status"]),
            path=_opt_str(data.get("path")),
            checksum=_opt_str(data.get("checksum")),
            engine_path=_opt_str(data.get("engine_path")),
            previous_version=_opt_str(data.get("previous_version")),
            strategy=_opt_str(data.get("strategy")),
            max_unavailable=_opt_int(data.get("max_unavailable")),
            pause_mode=_opt_str(data.get("pause_mode")),
            transport=_opt_str(data.get("transport")),
            engines={str(k): EngineUpdateProgress.from_json(_obj(v)) for k, v in _obj(data.get("engines")).items()},
            # The list in GET /rollout/weights names the creation time published_at.
            created_at=_opt_float(data.get("created_at", data.get("published_at"))),
            updated_at=_opt_float(data.get("updated_at")),
            finished_at=_opt_float(data.get("finished_at")),
            error_message=_opt_str(data.get("error_message")),
            message=_opt_str(data.get("message")),
            history=tuple(dict(entry) for entry in data.get("history") or ()),
            resumed=int(data.get("resumed") or 0),
            source=str(data.get("source") or "checkpoint"),
            trainer=dict(data["trainer"]) if isinstance(data.get("trainer"), Mapping) else None,
            raw=dict(data),
        )


@dataclass(frozen=True, eq=False)
class PublishResult(JsonRecord):
    """The answer of ``POST /rollout/weights/publish``.

    ``accepted`` is true when the manager started a new update, or this publish joined the running
    update of the same version and path (HTTP 202); false when that version had been published
    from that path before and the existing update answered (HTTP 200; ``update_id`` may then be
    ``None`` for a version the fleet started on). ``checksum`` is ``None`` while the manager still
    hashes the checkpoint (status ``CHECKSUMMING``).
    """

    update_id: str | None
    status: str
    version: str
    checksum: str | None = None
    message: str | None = None
    accepted: bool = False
    raw: JsonObject = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], http_status: int | None = None) -> PublishResult:
        return cls(
            update_id=_opt_str(data.get("update_id")),
            status=str(data.get("status")),
            version=str(data.get("version")),
            checksum=_opt_str(data.get("checksum")),
            message=_opt_str(data.get("message")),
            accepted=http_status == 202,
            raw=dict(data),
        )


@dataclass(frozen=True)
class EngineWeights:
    """One engine's weights as ``GET /rollout/weights`` lists them."""

    engine_id: str
    status: str
    weight_version: str | None = None
    weights_checksum: str | None = None
    raw: JsonObject = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EngineWeights:
        return cls(
            engine_id=str(data["engine_id"]),
            status=str(data.get("status")),
            weight_version=_opt_str(data.get("weight_version")),
            weights_checksum=_opt_str(data.get("weights_checksum")),
            raw=dict(data),
        )


@dataclass(frozen=True, eq=False)
class WeightsView(JsonRecord):
    """The answer of ``GET /rollout/weights``: the fleet's committed version, the update in
    flight (``in_flight``, the JSON's ``update``), each engine's version and checksum, and the last
    updates, newest first."""

    version: str | None
    path: str | None = None
    checksum: str | None = None
    #: ``startup`` (``--weight-version``, never published) or ``publish``.
    source: str | None = None
    since: float | None = None
    update_id: str | None = None
    strategy: str | None = None
    transport: str | None = None
    in_flight: WeightUpdate | None = None
    engines: tuple[EngineWeights, ...] = ()
    history: tuple[WeightUpdate, ...] = ()
    raw: JsonObject = field(default_factory=dict, repr=False)

    def engine_versions(self) -> dict[str, str | None]:
        """Each engine's weight version, by engine id."""
        return {engine.engine_id: engine.weight_version for engine in self.engines}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WeightsView:
        update = data.get("update")
        return cls(
            version=_opt_str(data.get("version")),
            path=_opt_str(data.get("path")),
            checksum=_opt_str(data.get("checksum")),
            source=_opt_str(data.get("source")),
            since=_opt_float(data.get("since")),
            update_id=_opt_str(data.get("update_id")),
            strategy=_opt_str(data.get("strategy")),
            transport=_opt_str(data.get("transport")),
            in_flight=WeightUpdate.from_json(update) if isinstance(update, Mapping) else None,
            engines=tuple(EngineWeights.from_json(e) for e in data.get("engines") or ()),
            history=tuple(WeightUpdate.from_json(u) for u in data.get("history") or ()),
            raw=dict(data),
        )


# -- autoscaler --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AutoscalerDecision:
    """What the autoscaler decided at one evaluation: ``action`` ``scale_out``, ``scale_in`` or
    ``none``, by ``delta`` engines, why (``reason``, ``triggered_conditions``), and on which
    ``signal`` (``serving``: the engines' load; ``pipeline``: the trainer's step reports)."""

    action: str
    delta: int = 0
    reason: str | None = None
    triggered_conditions: tuple[str, ...] = ()
    signal: str | None = None
    at: float | None = None
    raw: JsonObject = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AutoscalerDecision:
        return cls(
            action=str(data.get("action")),
            delta=int(data.get("delta") or 0),
            reason=_opt_str(data.get("reason")),
            triggered_conditions=tuple(str(c) for c in data.get("triggered_conditions") or ()),
            signal=_opt_str(data.get("signal")),
            at=_opt_float(data.get("at")),
            raw=dict(data),
        )


def _opt_decision(value: Any) -> AutoscalerDecision | None:
    return AutoscalerDecision.from_json(value) if isinstance(value, Mapping) else None


@dataclass(frozen=True, eq=False)
class StepReport(JsonRecord):
    """The answer of ``POST /rollout/pipeline`` (:meth:`RolloutClient.report_step`): which
    pipeline conditions the step triggered and the autoscaler's decision on it."""

    accepted: bool
    step: int | None = None
    signal: str | None = None
    trainer_starved: bool = False
    rollout_throttled: bool = False
    rollout_short: bool = False
    decision: AutoscalerDecision | None = None
    raw: JsonObject = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepReport:
        return cls(
            accepted=bool(data.get("accepted", False)),
            step=_opt_int(data.get("step")),
            signal=_opt_str(data.get("signal")),
            trainer_starved=bool(data.get("trainer_starved", False)),
            rollout_throttled=bool(data.get("rollout_throttled", False)),
            rollout_short=bool(data.get("rollout_short", False)),
            decision=_opt_decision(data.get("decision")),
            raw=dict(data),
        )


@dataclass(frozen=True, eq=False)
class AutoscalerStatus(JsonRecord):
    """The answer of ``GET /autoscaler/status``. ``config`` and ``recent_metrics`` stay JSON
    objects (their fields follow the autoscaler's config file and metrics)."""

    enabled: bool
    running: bool
    config_path: str | None = None
    current_engines: int | None = None
    active_engines: int | None = None
    starting_engines: int | None = None
    min_engines: int | None = None
    max_engines: int | None = None
    effective_min_engines: int | None = None
    effective_max_engines: int | None = None
    last_scale_time: float | None = None
    last_scale_action: str | None = None
    last_decision: AutoscalerDecision | None = None
    pending_requests: tuple[str, ...] = ()
    recent_metrics: JsonObject | None = None
    signal: str | None = None
    next_evaluation_in_secs: float | None = None
    expected_time_to_ready_secs: float | None = None
    config: JsonObject = field(default_factory=dict)
    raw: JsonObject = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AutoscalerStatus:
        metrics = data.get("recent_metrics")
        return cls(
            enabled=bool(data.get("enabled", False)),
            running=bool(data.get("running", False)),
            config_path=_opt_str(data.get("config_path")),
            current_engines=_opt_int(data.get("current_engines")),
            active_engines=_opt_int(data.get("active_engines")),
            starting_engines=_opt_int(data.get("starting_engines")),
            min_engines=_opt_int(data.get("min_engines")),
            max_engines=_opt_int(data.get("max_engines")),
            effective_min_engines=_opt_int(data.get("effective_min_engines")),
            effective_max_engines=_opt_int(data.get("effective_max_engines")),
            last_scale_time=_opt_float(data.get("last_scale_time")),
            last_scale_action=_opt_str(data.get("last_scale_action")),
            last_decision=_opt_decision(data.get("last_decision")),
            pending_requests=tuple(str(r) for r in data.get("pending_requests") or ()),
            recent_metrics=dict(metrics) if isinstance(metrics, Mapping) else None,
            signal=_opt_str(data.get("signal")),
            next_evaluation_in_secs=_opt_float(data.get("next_evaluation_in_secs")),
            expected_time_to_ready_secs=_opt_float(data.get("expected_time_to_ready_secs")),
            config=dict(_obj(data.get("config"))),
            raw=dict(data),
        )
