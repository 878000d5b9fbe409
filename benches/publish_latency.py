#!/usr/bin/env python3
"""Publishing a large checkpoint: how long `POST /rollout/weights/publish` takes to answer, how
long the manager takes to hash the checkpoint in the background, and how long the whole update
takes, against the hashing peers measured in the same run.

One manager (`--engine sim`, 2 engines) publishes a checkpoint of `--size-gib` GiB in `--shards`
safetensors shards, `--repeats` times under new version names (the same directory, so every
publish hashes the same bytes). For each publish:

- answer: the POST's round trip as the client sees it (status 202, update CHECKSUMMING);
- hashed: POST sent -> the update leaves CHECKSUMMING (polled every 20 ms), and the hashing
  throughput that gives;
- completed: POST sent -> COMPLETED (the engines then read and hash the checkpoint themselves,
  one after the other with the default rolling strategy, as `sglang-sim` does on every load).

Peers on the same files, in the same run: `cat` of every shard to /dev/null (reading alone);
OpenSSL's SHA-256 (Python's hashlib, which uses the CPU's SHA extensions like the manager's
`sha2`) over all shards with one thread (what the checksum costs on one core: the manager hashed
that way, and answered only afterwards, before this change) and with one thread per core; and
coreutils `sha256sum` (no SHA extensions in Debian 12's build) for scale. The shards are written
just before, so they are in the page cache for every reader alike: the figures are hashing, not
disk, throughput.

Run from the repository root after `cargo build --release -p rollout-manager -p sglang-sim`:

    .venv/bin/python benches/publish_latency.py                       # 4 GiB, 8 shards, 3 publishes
    .venv/bin/python benches/publish_latency.py --size-gib 8 --shards 16 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic_rollout import RolloutClient, checkpoint_checksum

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"
BLOCK = 64 << 20


def write_checkpoint(directory: Path, size_gib: float, shards: int) -> int:
    """``shards`` safetensors files of one U8 tensor each, ``size_gib`` GiB in all; returns bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    per = int(size_gib * (1 << 30)) // shards
    block = os.urandom(BLOCK)
    total = 0
    for i in range(shards):
        header = json.dumps({f"w{i}": {"dtype": "U8", "shape": [per], "data_offsets": [0, per]}}).encode()
        with open(directory / f"model-{i:05d}-of-{shards:05d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            left = per
            while left:
                n = min(left, BLOCK)
                # Every shard differs (its index in the first bytes of each block).
                f.write(struct.pack("<I", i) + block[4:n] if n >= 4 else block[:n])
                left -= n
        total += 8 + len(header) + per
    return total


def binary() -> Path:
    p = ROOT / "target" / "release" / "rollout-manager"
    if not p.exists():
        sys.exit("build first: cargo build --release -p rollout-manager -p sglang-sim")
    return p


def timed(argv: list[str], **kwargs: Any) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, **kwargs)
    return time.perf_counter() - start


# One process hashing files with OpenSSL's SHA-256 (hashlib; it uses the CPU's SHA extensions
# where there are some, as the manager's sha2 does): argv[1] is the thread count.
HASHLIB = """
import hashlib, sys
from concurrent.futures import ThreadPoolExecutor
def one(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()
with ThreadPoolExecutor(int(sys.argv[1])) as pool:
    list(pool.map(one, sys.argv[2:]))
"""


def peers(ckpt: Path) -> dict[str, float]:
    files = sorted(str(p) for p in ckpt.glob("*.safetensors"))
    nproc = str(os.cpu_count() or 1)
    return {
        "cat": timed(["cat", *files]),
        "hashlib_one_thread": timed([sys.executable, "-c", HASHLIB, "1", *files]),
        "hashlib_threads": timed([sys.executable, "-c", HASHLIB, nproc, *files]),
        "coreutils_sha256sum": timed(["sha256sum", *files]),
    }


def wait_for(cond: Any, timeout: float, what: str, poll: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(poll)
    raise TimeoutError(what)


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="publish-latency-", dir=args.dir))
    ckpt = work / "ckpt"
    print(f"writing {args.size_gib} GiB in {args.shards} shards to {ckpt} ...", flush=True)
    total = write_checkpoint(ckpt, args.size_gib, args.shards)
    expected = checkpoint_checksum(ckpt)
    argv = [
        str(binary()), "serve", "--host", "127.0.0.1", "--port", "0", "--router-port", "0",
        "--state-dir", str(work / "state"), "--gpus", "2", "--rollout-num-gpus", "2",
        "--weight-update-timeout-secs", "600",
    ]  # fmt: skip
    out = work / "manager.out"
    proc = subprocess.Popen(argv, stdout=out.open("wb"), stderr=(work / "manager.err").open("wb"))
    rows: list[dict[str, Any]] = []
    peer_rows: list[dict[str, float]] = []
    try:
        found = wait_for(lambda: re.search(r"listening control=(\S+)", out.read_text()), 30, "manager to listen", 0.1)
        client = RolloutClient(found.group(1))
        wait_for(lambda: len(client.engines().with_status("ACTIVE")) == 2, 60, "2 engines", 0.1)
        for rep in range(args.repeats):
            peer_rows.append(peers(ckpt))
            version = f"v{rep + 1}"
            sent = time.perf_counter()
            answer = client.publish_weights(version, str(ckpt), checksum=expected)
            answered = time.perf_counter() - sent
            update_id = answer["update_id"]

            def hashed(uid: str = update_id) -> Any:
                u = client.weight_update(uid)
                return u if u["status"] != "CHECKSUMMING" else None

            after = wait_for(hashed, 600, "the checkpoint to be hashed")
            hashed_at = time.perf_counter() - sent
            assert after["checksum"] == expected, (after["checksum"], expected)
            done = client.wait_for_weight_update(update_id, timeout=900, poll_interval=0.05)
            completed = time.perf_counter() - sent
            assert done["status"] == "COMPLETED", done
            rows.append(
                {
                    "version": version,
                    "answer_status": answer["status"],
                    "answer_s": answered,
                    "hashed_s": hashed_at,
                    "completed_s": completed,
                    "hash_gib_per_s": total / (1 << 30) / hashed_at,
                }
            )
            print(json.dumps(rows[-1] | peer_rows[-1]), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "load_average_at_end": os.getloadavg(),
        "size_bytes": total,
        "shards": args.shards,
        "rows": rows,
        "peers": peer_rows,
    }


def summarize(result: dict[str, Any]) -> str:
    gib = result["size_bytes"] / (1 << 30)
    lines = [
        f"{result['date']}, {result['machine']}; {gib:.2f} GiB in {result['shards']} shards "
        f"(page cache); load average at the end {result['load_average_at_end'][0]:.2f}",
        "",
        "| publish | answer | answer (ms) | hashed (s) | hash GiB/s | completed (s) | cat (s) "
        "| hashlib, 1 thread (s) | hashlib, 1 thread per core (s) | coreutils sha256sum (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row, peer in zip(result["rows"], result["peers"], strict=True):
        lines.append(
            f"| {row['version']} | {row['answer_status']} | {row['answer_s'] * 1000:.1f} | {row['hashed_s']:.2f} "
            f"| {row['hash_gib_per_s']:.2f} | {row['completed_s']:.1f} | {peer['cat']:.2f} "
            f"| {peer['hashlib_one_thread']:.2f} | {peer['hashlib_threads']:.2f} | {peer['coreutils_sha256sum']:.2f} |"
        )
    med = statistics.median
    answer = med(r["answer_s"] for r in result["rows"])
    hashed = med(r["hashed_s"] for r in result["rows"])
    one = med(p["hashlib_one_thread"] for p in result["peers"])
    par = med(p["hashlib_threads"] for p in result["peers"])
    lines += [
        "",
        f"Medians: answer {answer * 1000:.1f} ms; hashed {hashed:.2f} s (POST to PENDING, polled every 20 ms) = "
        f"{hashed / one:.2f}x one thread of OpenSSL SHA-256 ({one:.2f} s: about what the answer took before the "
        f"publish went asynchronous) and {hashed / par:.2f}x one thread per core ({par:.2f} s).",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: the temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the manager's logs")
    ap.add_argument("--out", default=str(RESULTS / "publish_latency.json"))
    args = ap.parse_args()
    result = run(args)
    text = summarize(result)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    Path(args.out).with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
