"""Elastic Rollout: Python side of the SGLang fleet manager.

The manager itself is the native ``rollout-manager`` binary; this package finds it
(:func:`find_binary`) and talks to its control API (:class:`RolloutClient`, and
:class:`AsyncRolloutClient` for asyncio programs); :func:`checkpoint_checksum` computes a
checkpoint's checksum the way the manager does.
"""

from elastic_rollout._find import BinaryNotFoundError, find_binary
from elastic_rollout.checksum import checkpoint_checksum
from elastic_rollout.client import (
    DEFAULT_TIMEOUT,
    SCALE_IN_TERMINAL,
    SCALE_OUT_TERMINAL,
    TOKEN_ENV,
    WEIGHT_UPDATE_TERMINAL,
    AsyncRolloutClient,
    AutoscalerDecision,
    AutoscalerStatus,
    Engine,
    EnginesView,
    EngineUpdateProgress,
    EngineWeights,
    OperationKind,
    PublishResult,
    RolloutApiError,
    RolloutClient,
    RolloutConnectionError,
    RolloutTimeoutError,
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
    "BinaryNotFoundError",
    "Engine",
    "EngineUpdateProgress",
    "EngineWeights",
    "EnginesView",
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
    "checkpoint_checksum",
    "find_binary",
]
