"""A CPU platform for SGLang that needs no compiled SGLang kernels.

PyPI's ``sgl-kernel`` is built for CUDA only, so SGLang's own CPU engine
(``SGLANG_USE_CPU_ENGINE=1``) cannot import its kernels here. This platform keeps SGLang on its
plain-PyTorch code paths instead: no Triton, no graph capture, no pynccl, the ``torch_native``
attention backend, the ``native`` forward of fused ops, gloo for collectives, and no pinned
memory. SGLang loads it from the ``sglang.srt.platforms`` entry-point group; ``activate``
returns the class's dotted path on a machine without CUDA, else None (SGLang's own discovery
then picks the GPU platform).
"""

from __future__ import annotations

__all__ = ["activate"]


def activate() -> str | None:
    """The platform class SGLang should use here, or None where a GPU is present."""
    import torch

    if torch.cuda.is_available():
        return None
    return "er_sglang_cpu.platform:PlainCpuPlatform"
