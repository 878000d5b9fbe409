"""Locate the native binaries (``rollout-manager``, ``sglang-sim``) that this package drives."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["ENV_OVERRIDES", "BinaryNotFoundError", "find_binary"]

#: Environment variable that overrides the lookup, per binary name.
ENV_OVERRIDES: dict[str, str] = {
    "rollout-manager": "ELASTIC_ROLLOUT_MANAGER_BIN",
    "sglang-sim": "ELASTIC_ROLLOUT_SIM_BIN",
}

_PACKAGE_DIR = Path(__file__).resolve().parent


class BinaryNotFoundError(FileNotFoundError):
    """A native binary could not be found; the message lists every place tried and how to fix it."""


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _cargo_workspace_root(start: Path) -> Path | None:
    """The nearest directory at or above ``start`` that holds a ``Cargo.toml``, if any."""
    for directory in (start, *start.parents):
        if (directory / "Cargo.toml").is_file():
            return directory
    return None


def _fix_hint(name: str) -> str:
    env_var = ENV_OVERRIDES.get(name)
    hint = f"build it with `cargo build --release -p {name}` in the repository"
    if env_var is not None:
        hint += f", or set {env_var} to the path of the binary"
    return hint


def find_binary(name: str = "rollout-manager", *, package_dir: Path | None = None, use_path: bool = True) -> Path:
    """Return the path of the executable ``name``.

    Lookup order (the first hit wins):

    1. the environment variable override: ``ELASTIC_ROLLOUT_MANAGER_BIN`` for
       ``rollout-manager``, ``ELASTIC_ROLLOUT_SIM_BIN`` for ``sglang-sim``. If it is set, it
       must name an executable file; otherwise :class:`BinaryNotFoundError` names the variable
       (it is never skipped silently);
    2. a binary bundled with the package: ``elastic_rollout/_bin/<name>`` (where a wheel
       carries it), then ``elastic_rollout/bin/<name>``;
    3. a cargo build in the source tree: ``<root>/target/release/<name>``, then
       ``<root>/target/debug/<name>``, where ``<root>`` is the nearest directory above the
       package that contains ``Cargo.toml`` (present for editable installs from a checkout);
    4. ``PATH`` (:func:`shutil.which`), unless ``use_path`` is false.

    ``package_dir`` replaces the package's own directory for steps 2 and 3 (for tests).
    ``use_path=False`` is for the wheel's console scripts (:mod:`elastic_rollout._bin_entry`),
    which are themselves on ``PATH`` under the binary's name and must never find themselves.

    Raises:
        BinaryNotFoundError: nothing was found; the message lists every place tried and says
            how to fix it.
    """
    env_var = ENV_OVERRIDES.get(name)
    if env_var is not None:
        override = os.environ.get(env_var)
        if override:
            path = Path(override).expanduser()
            if _is_executable(path):
                return path.resolve()
            problem = "does not exist" if not path.exists() else "is not an executable file"
            raise BinaryNotFoundError(
                f"{env_var}={override!r} {problem}; point {env_var} at the {name} binary "
                f"or unset it (to build one: `cargo build --release -p {name}`)"
            )

    base = (package_dir or _PACKAGE_DIR).resolve()
    tried: list[str] = []
    if env_var is not None:
        tried.append(f"${env_var} (not set)")

    candidates = [base / "_bin" / name, base / "bin" / name]
    root = _cargo_workspace_root(base)
    if root is not None:
        candidates += [root / "target" / "release" / name, root / "target" / "debug" / name]
    for candidate in candidates:
        tried.append(str(candidate))
        if _is_executable(candidate):
            return candidate
    if root is None:
        tried.append(f"<cargo workspace>/target/{{release,debug}}/{name} (no Cargo.toml above {base})")

    if use_path:
        on_path = shutil.which(name)
        if on_path is not None:
            return Path(on_path)
        tried.append(f"PATH ({os.environ.get('PATH', '')})")

    places = "\n".join(f"  - {place}" for place in tried)
    raise BinaryNotFoundError(f"could not find the {name!r} binary; tried:\n{places}\nTo fix: {_fix_hint(name)}.")
