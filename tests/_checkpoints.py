"""Tiny safetensors checkpoints for the weight tests, written without any ML library.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the raw bytes. The checksum the manager and ``sglang-sim``
report is :func:`elastic_rollout.checkpoint_checksum`'s (the SHA-256 of the shards' ``sha256sum``
listing).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from elastic_rollout import checkpoint_checksum


def safetensors_bytes(tensors: dict[str, bytes]) -> bytes:
    """One file holding each named tensor as a flat F32 vector (len(data) must be a multiple of 4)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, data in tensors.items():
        header[name] = {"dtype": "F32", "shape": [len(data) // 4], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values())


def write_checkpoint(directory: Path, seed: int, files: int = 2) -> str:
    """Write ``files`` safetensors shards whose bytes depend on ``seed``; return their checksum."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        tensors = {
            f"layers.{i}.weight": struct.pack("<16f", *[seed + i + k / 16 for k in range(16)]),
            f"layers.{i}.bias": struct.pack("<4f", *[seed * 10.0 + i] * 4),
        }
        data = safetensors_bytes(tensors)
        (directory / f"model-{i:05d}-of-{files:05d}.safetensors").write_bytes(data)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return checkpoint_checksum(directory)


def corrupt(directory: Path) -> None:
    """Overwrite the first shard with bytes whose header length points past the end of the file."""
    first = sorted(directory.glob("*.safetensors"))[0]
    first.write_bytes(struct.pack("<Q", 1 << 20) + b"{}")
