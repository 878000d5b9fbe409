"""Fixtures of the real-engine tier: SGLang 0.5.23's Python and the two tiny checkpoints, made
once per test session (``tests/_sglang.py`` says how)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _sglang import Models, make_models, sglang_python


@pytest.fixture(scope="session")
def sglang_py() -> Path:
    """The Python of the SGLang venv (``make sglang-venv``); skips the tier without one."""
    return sglang_python()


@pytest.fixture(scope="session")
def models(sglang_py: Path, tmp_path_factory: pytest.TempPathFactory) -> Models:
    """Checkpoints ``a`` and ``b``: one tokenizer and shape, different weights."""
    return make_models(sglang_py, tmp_path_factory.mktemp("models"))
