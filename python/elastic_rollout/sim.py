"""The trainer's rank 0 for a fleet of ``sglang-sim`` engines, without torch or a GPU.

``sglang-sim`` speaks SGLang's distributed weight routes but moves no tensors: at
``/init_weights_update_group`` each engine connects to ``master_address:master_port`` and writes
one JSON line (``group_name``, ``rank_offset``, ``tp_size``, ``world_size``, ``engine_port``); at
``/update_weights_from_distributed`` it connects again, writes ``{"group_name", "rank_offset",
"engine_port"}`` and waits for rank 0's line ``{"names": [...]}`` (the tensors broadcast, which
must be the ones it was told to receive), as an NCCL rank waits for the root. :class:`SimRank0`
is the other side, so a trainer loop can be rehearsed against simulated engines with the same
:class:`~elastic_rollout.trainer.DistributedWeightSync` a real trainer uses::

    rank0 = SimRank0()
    sync = DistributedWeightSync(manager_url, join_group=rank0.join_group, broadcast=rank0.broadcast)
    sync.update("step-1", specs)
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from typing import Any

from elastic_rollout.trainer import GroupLayout, TensorSpec

__all__ = ["SimRank0"]


class SimRank0:
    """Plays rank 0 of a weight-update group of ``sglang-sim`` engines.

    ``join_group`` accepts one rendezvous per member and checks each engine's ranks against the
    layout; ``broadcast`` sends every member still expected (``gone``: members known to be dead,
    not waited for) the names of the tensors. ``timeout`` bounds each wait for an engine.
    """

    def __init__(self, timeout: float = 30.0) -> None:
        self.timeout = timeout
        #: the rendezvous lines of every group joined, in order.
        self.joined: list[list[dict[str, Any]]] = []
        #: ``(group_name, tensor names)`` of every broadcast.
        self.broadcasts: list[tuple[str, list[str]]] = []
        #: members known to be gone: a broadcast does not wait for them.
        self.gone: set[str] = set()

    def _listen(self, layout: GroupLayout) -> socket.socket:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((layout.master_address, layout.master_port))
        srv.listen(len(layout.members))
        srv.settimeout(self.timeout)
        return srv

    def join_group(self, layout: GroupLayout) -> None:
        lines: list[dict[str, Any]] = []
        with self._listen(layout) as srv:
            for _ in layout.members:
                conn, _addr = srv.accept()
                with conn, conn.makefile("r") as f:
                    lines.append(dict(json.loads(f.readline())))
        expected = sorted((m.rank_offset, m.tp_size) for m in layout.members)
        got = sorted((int(line["rank_offset"]), int(line["tp_size"])) for line in lines)
        if got != expected:
            raise RuntimeError(f"engines joined as {got}, the layout says {expected}")
        if {line["group_name"] for line in lines} != {layout.group_name}:
            raise RuntimeError(f"engines joined another group than {layout.group_name}: {lines}")
        if {line["world_size"] for line in lines} != {layout.world_size}:
            raise RuntimeError(f"engines disagree on the world size {layout.world_size}: {lines}")
        self.joined.append(lines)

    def broadcast(self, layout: GroupLayout, specs: Sequence[TensorSpec]) -> None:
        names = [s.name for s in specs]
        receivers = [m for m in layout.members if m.engine_id not in self.gone]
        with self._listen(layout) as srv:
            for _ in receivers:
                conn, _addr = srv.accept()
                with conn, conn.makefile("rw") as f:
                    hello = json.loads(f.readline())
                    if hello.get("group_name") != layout.group_name:
                        raise RuntimeError(f"an engine of group {hello.get('group_name')} asked {layout.group_name}")
                    f.write(json.dumps({"names": names}) + "\n")
                    f.flush()
        self.broadcasts.append((layout.group_name, names))
