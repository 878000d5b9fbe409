#!/usr/bin/env python3
"""A scale-in of an engine running many long requests, with and without moves (issue 31).

    .venv/bin/python benches/drain_moves.py [--requests-per-engine 64 --budget 2000 --repeats 2]

Each run starts its own manager with 3 simulated engines (time scale 1: default timing model,
8 ms per decode step plus 0.05 ms per running request), late binding off
(`--max-inflight-per-engine 0`) and round-robin routing, so each engine runs
`--requests-per-engine` `/generate` requests of `--budget` tokens (prompts of 256 token ids,
`ignore_eos`, half of them streamed). Once the victim (the scaled-out engine) has them all and
they have run for `--warm-secs`, `POST /rollout/scale_in {"num_replicas": 2}`. Measured: seconds
from the scale-in to COMPLETED (the victim REMOVED), requests that did not get their whole budget
and the tokens they lost, the moves, and the prefill tokens the moves cost. Configurations: the
defaults (`--move-on-drain true`) and `--move-on-drain false` (the drain waits for the requests,
up to `--scale-in-drain-timeout-secs`, 30 s by default, then cuts what is left).

The goal (issue 31): the scale-in ends within 2 s plus one prefill of the moved tokens, with 0
tokens lost. "One prefill" is the moved tokens at the simulator's prefill cost (60 ms per 1000
uncached tokens plus 5 ms a step), shared by the 2 engines that stay.
Results: benches/results/drain_moves.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client as httpclient
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "python")]

from _chaos import shut_down  # noqa: E402
from _support import STARTUP_TIMEOUT, http, metric_total, start_manager, wait_until  # noqa: E402
from conftest import _manager_binary  # noqa: E402

PROMPT_TOKENS = 256
PREFILL_MS_PER_1K = 60.0
PREFILL_BASE_MS = 5.0


def one_request(router: str, prompt: list[int], budget: int, stream: bool, out: list[dict[str, Any]]) -> None:
    host, port = router.removeprefix("http://").split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=600)
    body = {"input_ids": prompt, "stream": stream, "sampling_params": {"max_new_tokens": budget, "ignore_eos": True}}
    record: dict[str, Any] = {"completion_tokens": 0, "moves": 0, "error": None}
    try:
        headers = {"Content-Type": "application/json", "x-routing-policy": "round_robin"}
        conn.request("POST", "/generate", json.dumps(body), headers)
        resp = conn.getresponse()
        record["engine"] = resp.getheader("x-rollout-engine-id")
        if resp.status != 200:
            record["error"] = f"HTTP {resp.status}"
        elif not stream:
            answer = json.loads(resp.read())
            record["completion_tokens"] = answer["meta_info"]["completion_tokens"]
            record["moves"] = len(answer["meta_info"].get("moves", []))
        else:
            for line in resp:
                text = line.decode().strip()
                if text.startswith("data:") and text != "data: [DONE]":
                    event = json.loads(text[5:])
                    if "error" in event:
                        record["error"] = event["error"].get("message", "error event")
                        break
                    record["completion_tokens"] = event["meta_info"]["completion_tokens"]
                    record["moves"] = len(event["meta_info"].get("moves", []))
    except (OSError, ValueError, KeyError) as e:
        record["error"] = repr(e)
    finally:
        conn.close()
    out.append(record)


def run(binary: Path, state: Path, moves: bool, per_engine: int, budget: int, warm: float) -> dict[str, Any]:
    args = (
        "--gpus", "3", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "1",
        "--engine-arg=--time-scale=1", "--max-inflight-per-engine", "0",
        "--move-on-drain", "true" if moves else "false",
    )  # fmt: skip
    fleet = start_manager(binary, state, args)
    try:
        fleet.wait_engines(2, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        op = fleet.client.scale_out(num_replicas=3)
        assert op.request_id is not None
        assert fleet.client.wait_for_operation("scale_out", op.request_id, STARTUP_TIMEOUT).status == "ACTIVE"
        victim = fleet.engines().engines[-1].engine_id
        results: list[dict[str, Any]] = []
        threads = [
            threading.Thread(
                target=one_request,
                args=(fleet.router_url, [1000 + i, *range(PROMPT_TOKENS - 1)], budget, i % 2 == 0, results),
                daemon=True,
            )
            for i in range(3 * per_engine)
        ]
        for t in threads:
            t.start()

        def victim_full() -> bool:
            e = fleet.engines().by_id(victim)
            return e is not None and e.raw.get("in_flight", 0) >= per_engine

        wait_until(victim_full, 60, f"{per_engine} requests on {victim}")
        time.sleep(warm)
        started = time.monotonic()
        op = fleet.client.scale_in(num_replicas=2)
        assert op.request_id is not None
        done = fleet.client.wait_for_operation("scale_in", op.request_id, 600)
        removal_secs = time.monotonic() - started
        assert done.status == "COMPLETED", done.raw
        for t in threads:
            t.join(timeout=600)
        metrics = http("GET", f"{fleet.control_url}/metrics").body.decode()
        on_victim = [r for r in results if r.get("engine") == victim]
        short = [r for r in on_victim if r["completion_tokens"] < budget or r["error"]]
        prefill_tokens = metric_total(metrics, "rollout_router_move_prefill_tokens_total")
        moved = metric_total(metrics, 'rollout_router_moves_total{reason="drain"}')
        one_prefill = (prefill_tokens * PREFILL_MS_PER_1K / 1000 + PREFILL_BASE_MS * (moved > 0)) / 2 / 1000
        return {
            "moves_on_drain": moves,
            "requests_on_victim": len(on_victim),
            "seconds_to_removed": round(removal_secs, 2),
            "one_prefill_secs": round(one_prefill, 2),
            "requests_cut": len(short),
            "tokens_lost": sum(budget - min(budget, r["completion_tokens"]) for r in short),
            "moved": int(moved),
            "move_prefill_tokens": int(prefill_tokens),
            "errors": sorted({r["error"] for r in short if r["error"]})[:3],
        }
    finally:
        shut_down(fleet)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests-per-engine", type=int, default=64)
    parser.add_argument("--budget", type=int, default=2000)
    parser.add_argument("--warm-secs", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benches" / "results")
    args = parser.parse_args()
    binary = _manager_binary()
    state = Path(tempfile.mkdtemp(prefix="drain-moves-bench-"))
    print(f"manager {binary}", flush=True)
    runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        for moves in (True, False):
            out = run(binary, state / f"{r}-{moves}", moves, args.requests_per_engine, args.budget, args.warm_secs)
            print(out, flush=True)
            runs.append(out)
    result = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": "python benches/drain_moves.py " + " ".join(sys.argv[1:]),
        "budget": args.budget,
        "requests_per_engine": args.requests_per_engine,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drain_moves.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Scale-in of an engine running long requests",
        "",
        f"`{result['command']}` on {result['machine']}, {result['when']}: {args.requests_per_engine} requests of "
        f"{args.budget} tokens on the engine removed, {args.repeats} runs each (median, range).",
        "",
        "| --move-on-drain | seconds to REMOVED | one prefill (s) | requests cut | tokens lost | moved |",
        "|---|---|---|---|---|---|",
    ]
    for moves in (True, False):
        mine = [r for r in runs if r["moves_on_drain"] == moves]

        def cell(key: str, rows: list[dict[str, Any]] = mine) -> str:
            values = [r[key] for r in rows]
            return f"{median(values):g} ({min(values):g}-{max(values):g})"

        lines.append(
            f"| {str(moves).lower()} | {cell('seconds_to_removed')} | {cell('one_prefill_secs')} "
            f"| {cell('requests_cut')} | {cell('tokens_lost')} | {cell('moved')} |"
        )
    (args.out / "drain_moves.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    with_moves = [r for r in runs if r["moves_on_drain"]]
    ok = all(r["tokens_lost"] == 0 and r["seconds_to_removed"] <= 2 + r["one_prefill_secs"] for r in with_moves)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
