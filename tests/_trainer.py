"""The trainer's side of SGLang's distributed weight update in tests: tensors, the stand-in rank 0
(``elastic_rollout.sim.SimRank0``), and a trainer that calls the engines itself."""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from _support import http

from elastic_rollout.sim import SimRank0
from elastic_rollout.trainer import TensorSpec, plan_layout

SPECS = [
    TensorSpec("model.embed_tokens.weight", "bfloat16", (1024, 64)),
    TensorSpec("model.layers.0.mlp.down_proj.weight", "bfloat16", (64, 256)),
    TensorSpec("lm_head.weight", "bfloat16", (1024, 64)),
]


#: The stand-in rank 0 the tests use: the package's, for simulated engines.
StandInRank0 = SimRank0


def update_engines_directly(rank0: StandInRank0, engines: Sequence[tuple[str, str]], version: str) -> None:
    """What an unmodified trainer (slime calling SGLang itself) does, around the manager: a
    group of its own, then pause, begin, receive while rank 0 broadcasts, end, continue, on every
    engine (``(engine_id, url)``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    layout = plan_layout(
        [(e, u, 1) for e, u in engines], group_name="trainer_own_group", master_address="127.0.0.1", master_port=port
    )

    def on_all(route: str, body: dict) -> None:
        with ThreadPoolExecutor(len(engines)) as pool:
            for resp in pool.map(lambda m: http("POST", m.url + route, body, timeout=60), layout.members):
                assert resp.status in (200, 404), (route, resp.status, resp.body[:200])

    joined = threading.Thread(target=rank0.join_group, args=(layout,))
    joined.start()
    with ThreadPoolExecutor(len(engines)) as pool:
        bodies = [
            {"master_address": "127.0.0.1", "master_port": port, "rank_offset": m.rank_offset,
             "world_size": layout.world_size, "group_name": layout.group_name}
            for m in layout.members
        ]  # fmt: skip
        for resp in pool.map(lambda mb: http("POST", mb[0].url + "/init_weights_update_group", mb[1]),
                             zip(layout.members, bodies, strict=True)):  # fmt: skip
            assert resp.status == 200, resp.body[:200]
    joined.join()
    on_all("/pause_generation", {"mode": "retract"})
    on_all("/begin_weight_update", {})
    body = {"names": [s.name for s in SPECS], "dtypes": [s.dtype for s in SPECS],
            "shapes": [list(s.shape) for s in SPECS], "group_name": layout.group_name,
            "weight_version": version}  # fmt: skip
    sender = threading.Thread(target=rank0.broadcast, args=(layout, SPECS))
    sender.start()
    on_all("/update_weights_from_distributed", body)
    sender.join()
    on_all("/end_weight_update", {})
    on_all("/continue_generation", {})
