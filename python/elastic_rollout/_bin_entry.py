"""Console scripts ``rollout-manager`` and ``sglang-sim`` of the wheel.

Each replaces itself (:func:`os.execv`, no shell) with the binary the wheel carries in
``elastic_rollout/_bin/`` (or what :func:`~elastic_rollout._find.find_binary` finds first: the
``ELASTIC_ROLLOUT_*_BIN`` override, or a cargo build for an editable install), passing every
argument through. The binary keeps the process id, so signals reach it directly and its exit
status is the command's. ``PATH`` is not searched: this script is on ``PATH`` under the same name.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from elastic_rollout._find import BinaryNotFoundError, find_binary

__all__ = ["rollout_manager", "sglang_sim"]

#: Exit status when the binary cannot be found (as a shell's "command not found").
NOT_FOUND = 127


def _exec(name: str) -> NoReturn:
    try:
        path = find_binary(name, use_path=False)
    except BinaryNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(NOT_FOUND) from None
    os.execv(path, [sys.argv[0] if sys.argv and sys.argv[0] else name, *sys.argv[1:]])


def rollout_manager() -> NoReturn:
    """``rollout-manager ...``: the manager (``serve``, ``agent``, ``autoscaler-replay``, ...)."""
    _exec("rollout-manager")


def sglang_sim() -> NoReturn:
    """``sglang-sim ...``: the SGLang engine simulator."""
    _exec("sglang-sim")
