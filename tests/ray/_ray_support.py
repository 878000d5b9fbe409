"""What the Ray tests share: the cluster handle and a free port."""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Logical GPUs of the head node.
HEAD_GPUS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RayCluster:
    cluster: Any
    temp_dir: Path
    dashboard_url: str
    env: dict[str, str]

    def ray_cli(self) -> list[str]:
        return [sys.executable, "-m", "ray.scripts.scripts"]
