"""The platform class (imported by SGLang only once ``activate`` named it)."""

from __future__ import annotations

from typing import Any

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.interface import PlatformCapabilities, PlatformEnum, SRTPlatform


class PlainCpuPlatform(CpuDeviceMixin, SRTPlatform):  # type: ignore[misc]
    """CPU device operations from SGLang's own mixin; every kernel choice the plain one."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    # Every capability off: SGLang then picks its torch-native allocator and writers.
    capabilities = PlatformCapabilities()

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_dispatch_key_name(self) -> str:
        return "native"

    def is_pin_memory_available(self, device: Any = None) -> bool:
        return False
