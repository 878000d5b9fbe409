"""The Ray actors of the shim that wrap plain classes (the reconciler's actor is in
:mod:`.reconciler`, which uses :class:`EngineHost`):

- :class:`ManagerActor` over :class:`~elastic_rollout_ray.manager.ManagerSupervisor`;
- :class:`EngineHost` over :class:`~elastic_rollout_ray.host.EngineHostImpl`, which also reads what
  Ray assigned to the actor (node IP and id, GPU ids) before starting the agent. Threaded, so the
  reconciler's pending ``watch`` call never blocks ``info`` or ``stop``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray

from elastic_rollout_ray.host import EngineHostImpl
from elastic_rollout_ray.manager import ManagerSupervisor

__all__ = ["EngineHost", "ManagerActor"]


def _local_binary(binary: str) -> str:
    """The given binary if this node has it, else this node's own ``rollout-manager``."""
    if os.access(binary, os.X_OK) and Path(binary).is_file():
        return binary
    from elastic_rollout import find_binary

    return str(find_binary("rollout-manager"))


@ray.remote(num_cpus=0, max_restarts=0)
class ManagerActor(ManagerSupervisor):
    """``rollout-manager serve --placement ray``, supervised (restarted on crash) by this actor."""

    def __init__(self, binary: str, serve_args: list[str], **kwargs: Any) -> None:
        super().__init__(_local_binary(binary), serve_args, **kwargs)


# Ray's stubs type ray.remote's options for tasks only; max_concurrency is an actor option.
@ray.remote(max_restarts=0, max_concurrency=4)  # type: ignore[call-overload]
class EngineHost(EngineHostImpl):
    """Runs the node agent of one engine on the GPUs Ray assigned to this actor."""

    def __init__(
        self, engine_id: str, binary: str, namespace: str, token: str | None = None, work_root: str | None = None
    ) -> None:
        ctx = ray.get_runtime_context()
        super().__init__(
            engine_id,
            _local_binary(binary),
            namespace,
            node_ip=ray.util.get_node_ip_address(),
            node_id=ctx.get_node_id(),
            gpu_ids=[str(g) for g in ray.get_gpu_ids()],
            token=token,
            work_root=work_root,
        )
