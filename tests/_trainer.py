"""A stand-in for the trainer's side of SGLang's distributed weight update (NCCL rank 0)."""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence

from elastic_rollout.trainer import GroupLayout, TensorSpec

SPECS = [
    TensorSpec("model.embed_tokens.weight", "bfloat16", (1024, 64)),
    TensorSpec("model.layers.0.mlp.down_proj.weight", "bfloat16", (64, 256)),
    TensorSpec("lm_head.weight", "bfloat16", (1024, 64)),
]


class StandInRank0:
    """Plays the trainer's rank 0: accepts one rendezvous per engine and checks the layout,
    then broadcasts (sends each engine the names of the tensors) when asked."""

    def __init__(self) -> None:
        self.joined: list[list[dict]] = []
        self.broadcasts: list[tuple[str, list[str]]] = []
        #: members known to be gone (killed by the test): the broadcast does not wait for them.
        self.gone: set[str] = set()

    def join_group(self, layout: GroupLayout) -> None:
        lines: list[dict] = []
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((layout.master_address, layout.master_port))
            srv.listen(len(layout.members))
            srv.settimeout(20)
            for _ in layout.members:
                conn, _addr = srv.accept()
                with conn, conn.makefile("r") as f:
                    lines.append(json.loads(f.readline()))
        expected = sorted((m.rank_offset, m.tp_size) for m in layout.members)
        got = sorted((line["rank_offset"], line["tp_size"]) for line in lines)
        assert got == expected, f"engines joined as {got}, layout says {expected}"
        assert {line["group_name"] for line in lines} == {layout.group_name}
        assert {line["world_size"] for line in lines} == {layout.world_size}
        self.joined.append(lines)

    def broadcast(self, layout: GroupLayout, specs: Sequence[TensorSpec]) -> None:
        """Sends the tensors' names to every engine of the group: each connects while its
        ``/update_weights_from_distributed`` waits for rank 0, as NCCL's receiving ranks do."""
        names = [s.name for s in specs]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((layout.master_address, layout.master_port))
            receivers = [m for m in layout.members if m.engine_id not in self.gone]
            srv.listen(len(layout.members))
            srv.settimeout(30)
            for _ in receivers:
                conn, _addr = srv.accept()
                with conn, conn.makefile("rw") as f:
                    hello = json.loads(f.readline())
                    assert hello["group_name"] == layout.group_name, hello
                    f.write(json.dumps({"names": names}) + "\n")
                    f.flush()
        self.broadcasts.append((layout.group_name, names))
