"""A trainer's rank 0 for the real-engine tests: joins a weight-update group over gloo and
broadcasts the tensors of a checkpoint, as a trainer broadcasts its weights to SGLang engines
(slime, AReaL and verl do it over NCCL on GPUs; SGLang on CPU takes gloo).

Run with the SGLang venv's Python. It reads one JSON command per line on stdin and answers one
JSON line on stdout:

- ``{"join": {"master_address", "master_port", "world_size", "group_name"}}`` joins the group as
  rank 0 (it returns once every rank joined): ``{"joined": group_name}``;
- ``{"send": {"checkpoint": DIR, "names": [...]}}`` broadcasts those tensors of the checkpoint's
  safetensors files, in that order: ``{"sent": n}``;
- ``{"tensors": {"checkpoint": DIR}}`` answers ``{"tensors": [[name, dtype, shape], ...]}``;
- ``{"destroy": {}}`` leaves the group: ``{"destroyed": group_name}``.

An error answers ``{"error": "..."}``. The group is built as SGLang builds its side
(``sglang.srt.utils.common.init_custom_process_group``: a store prefixed with the group's name),
else the two sides' keys never meet.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def tensors(checkpoint: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # safe_open is not a mapping
                out[name] = f.get_tensor(name)
    return out


def main() -> None:
    from sglang.srt.utils.common import init_custom_process_group

    group: Any = None
    name = ""
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        try:
            if "join" in command:
                c = command["join"]
                name = c["group_name"]
                group = init_custom_process_group(
                    backend="gloo",
                    init_method=f"tcp://{c['master_address']}:{c['master_port']}",
                    world_size=int(c["world_size"]),
                    rank=0,
                    group_name=name,
                )
                answer: dict[str, Any] = {"joined": name}
            elif "tensors" in command:
                found = tensors(command["tensors"]["checkpoint"])
                answer = {"tensors": [[n, DTYPES[t.dtype], list(t.shape)] for n, t in found.items()]}
            elif "send" in command:
                found = tensors(command["send"]["checkpoint"])
                for tensor_name in command["send"]["names"]:
                    dist.broadcast(found[tensor_name].contiguous(), src=0, group=group)
                answer = {"sent": len(command["send"]["names"])}
            elif "destroy" in command:
                if group is not None:
                    dist.destroy_process_group(group)
                group = None
                answer = {"destroyed": name}
            else:
                answer = {"error": f"unknown command {sorted(command)}"}
        except Exception as err:  # every failure is answered, the test reads it
            answer = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
