"""The Ray actors and tasks of the shim that wrap plain code (the reconciler's actor is in
:mod:`.reconciler`, which uses the others):

- :class:`ManagerActor` over :class:`~elastic_rollout_ray.manager.ManagerSupervisor`;
- :class:`NodeAgent` over :class:`~elastic_rollout_ray.node_agent.NodeAgentImpl`, which also reads
  its node's IP and id before starting the agent. Threaded, so the reconciler's pending ``watch``
  call never blocks ``info`` or ``stop``;
- :func:`bundle_gpus`, the small task run in an engine's bundle to read the GPU ids Ray gave it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray

from elastic_rollout_ray.manager import ManagerSupervisor
from elastic_rollout_ray.node_agent import NodeAgentImpl

__all__ = ["ManagerActor", "NodeAgent", "bundle_gpus"]


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
@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)  # type: ignore[call-overload]
class NodeAgent(NodeAgentImpl):
    """Runs the agent that hosts every engine of the fleet on this actor's node."""

    def __init__(self, binary: str, namespace: str, token: str | None = None, work_root: str | None = None) -> None:
        super().__init__(
            _local_binary(binary),
            namespace,
            node_ip=ray.util.get_node_ip_address(),
            node_id=ray.get_runtime_context().get_node_id(),
            token=token,
            work_root=work_root,
        )


@ray.remote(num_cpus=0, max_retries=0)
def bundle_gpus() -> tuple[str, list[str]]:
    """Run in an engine's bundle with the bundle's ``num_gpus``: the node it runs on and the GPU
    ids Ray gave it. A bundle keeps the GPU instances it reserved, so a later task in it (or the
    engine launched with these ids) gets the same ones."""
    return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]
