"""The checkpoint checksum the manager, ``sglang-sim`` and the relay compute.

Each ``*.safetensors`` file of the checkpoint directory is hashed on its own (SHA-256); the
checkpoint's checksum is the SHA-256 of the listing ``sha256sum`` prints for those files in
byte-wise sorted name order, one line ``<file hex digest>  <file name>\\n`` per file. From a shell::

    cd /ckpt/step_3 && LC_ALL=C sha256sum -- *.safetensors | sha256sum

Pass it as ``checksum=`` to :meth:`~elastic_rollout.RolloutClient.publish_weights` and the update
fails, with nothing loaded, unless the files the manager hashes have exactly these bytes.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["checkpoint_checksum", "file_sha256"]

_CHUNK = 4 << 20


def file_sha256(path: Path) -> str:
    """Lowercase hex SHA-256 of one file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_checksum(directory: str | Path, threads: int = 4) -> str:
    """The checksum of the checkpoint in ``directory`` (its ``*.safetensors`` files); ``threads``
    files are hashed at once (hashlib releases the GIL while it hashes)."""
    root = Path(directory)
    files = sorted(
        (p for p in root.iterdir() if p.is_file() and p.suffix == ".safetensors"), key=lambda p: p.name.encode()
    )
    if not files:
        raise FileNotFoundError(f"{root} holds no *.safetensors files")
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        digests = list(pool.map(file_sha256, files))
    listing = "".join(f"{digest}  {path.name}\n" for digest, path in zip(digests, files, strict=True))
    return hashlib.sha256(listing.encode()).hexdigest()
