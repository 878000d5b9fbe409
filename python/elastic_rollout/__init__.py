"""Elastic Rollout: Python side of the SGLang fleet manager.

The manager itself is the native ``rollout-manager`` binary; this package finds it
(:func:`find_binary`) and talks to its control API (:class:`RolloutClient`).
"""

from elastic_rollout._find import BinaryNotFoundError, find_binary
from elastic_rollout.client import (
    SCALE_IN_TERMINAL,
    SCALE_OUT_TERMINAL,
    WEIGHT_UPDATE_TERMINAL,
    Engine,
    EnginesView,
    OperationKind,
    RolloutApiError,
    RolloutClient,
    ScaleOperation,
    ScaleResponse,
)

__all__ = [
    "SCALE_IN_TERMINAL",
    "SCALE_OUT_TERMINAL",
    "WEIGHT_UPDATE_TERMINAL",
    "BinaryNotFoundError",
    "Engine",
    "EnginesView",
    "OperationKind",
    "RolloutApiError",
    "RolloutClient",
    "ScaleOperation",
    "ScaleResponse",
    "find_binary",
]
