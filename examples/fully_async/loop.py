#!/usr/bin/env python3
"""A fully-async RL loop on a simulated fleet: GRPO batches through the router, a checkpoint per
step, version pins with bounded staleness, pipeline reports to the autoscaler, and a timeline.

Three threads do the work, as in a fully-async trainer (slime, AReaL):

- **rollout** generates the batch of step k (``--prompts`` prompts x ``--group-size`` samples,
  one SGLang ``/generate`` request with ``sampling_params.n`` per prompt, sent concurrently
  through the router) pinned to ``weight_version: {"min_version": step-(k-1-S)}``, S being
  ``--max-staleness``. It may run ahead of the trainer until that version is published; the time
  it waits for it is "rollout throttled". Every sample's ``meta_info.weight_version`` is checked
  against the pin (a violation raises :class:`PinViolation` and ends the run).
- **trainer** (this thread) takes batch k (the time it waits is "trainer wait"), runs a CPU
  stand-in of a GRPO step over the returned token ids, hands the new weights to the publisher
  without waiting for the fleet to take them, and reports the step to the autoscaler
  (``POST /rollout/pipeline``).
- **publisher** moves each step's weights to the fleet as ``step-<k>`` once the previous update
  has ended (the manager runs one update at a time): by default the way slime, AReaL and verl's
  async mode do, as NCCL rank 0 of a broadcast the manager runs (``DistributedWeightSync``; on
  simulated engines the rank 0 is ``elastic_rollout.sim.SimRank0``); with ``--weights
  checkpoint`` by writing a tiny ``*.safetensors`` checkpoint and publishing it (rolling).
  Engines the autoscaler adds meanwhile copy the fleet's version from a running engine before
  they serve, so every sample's version is checked against its pin either way.

A sampler thread records the fleet (ACTIVE engines, the version each serves, the published and
committed versions) and the generated tokens, written to ``timeline.json`` and plotted to
``timeline.png`` (matplotlib, imported only for the plot) in ``--out``.

Without ``--manager``/``--router`` the script starts ``rollout-manager serve --engine sim`` itself
(loopback, free ports, a temporary state dir, the autoscaler enabled) and stops it at the end.

    .venv/bin/python examples/fully_async/loop.py            # 20 steps, ~30 s
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_rollout import RolloutApiError, RolloutClient, checkpoint_checksum
from elastic_rollout._find import find_binary
from elastic_rollout.sim import SimRank0
from elastic_rollout.trainer import DistributedWeightSync, TensorSpec

HERE = Path(__file__).resolve().parent
LISTENING_RE = re.compile(r"^rollout-manager listening control=(?P<control>http://\S+) router=(?P<router>http://\S+)")
VERSION_RE = re.compile(r"^(?:v|V|step|step_|step-)?(\d+)$")
#: Seconds one /generate request may take (a pinned request waits up to --version-wait-secs first).
REQUEST_TIMEOUT = 120.0
#: Seconds one weight update may take before the run is declared stuck.
UPDATE_TIMEOUT = 120.0
SAMPLE_INTERVAL = 0.5
POLICY_DIM = 256
#: What the trainer broadcasts each step (``--weights trainer``), in broadcast order.
POLICY_TENSORS = [TensorSpec("policy.weight", "float32", (POLICY_DIM,)), TensorSpec("policy.step", "float32", (1,))]
#: Seconds over which the plot reads the token rate.
TPS_WINDOW = 2.0

JsonObject = dict[str, Any]


class PinViolation(RuntimeError):
    """A sample came from a weight version older than its request's pin (or than the staleness bound)."""


# -- versions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Versions:
    """Names and numbers of weight versions: ``step-<n>`` is n; the fleet's starting version is
    ``base_num`` (0 for a manager this script starts on ``step-0``)."""

    base: str
    base_num: int

    def name(self, num: int) -> str:
        return self.base if num == self.base_num else f"step-{num}"

    def number(self, version: str | None) -> int | None:
        if version is None:
            return None
        if version == self.base:
            return self.base_num
        match = VERSION_RE.match(version)
        return int(match.group(1)) if match else None

    @classmethod
    def of_fleet(cls, weights: JsonObject) -> Versions:
        """The fleet's committed version is the base; a fleet that published ``step-<n>`` before
        goes on from its number, so no version name is reused with other bytes."""
        base = str(weights.get("version") or "default")
        match = VERSION_RE.match(base)
        if match:
            return cls(base=base, base_num=int(match.group(1)))
        history = [VERSION_RE.match(str(h.get("version"))) for h in weights.get("history") or ()]
        return cls(base=base, base_num=max((int(m.group(1)) for m in history if m), default=0))


# -- checkpoints -----------------------------------------------------------------------------------


def safetensors_bytes(tensors: dict[str, list[float]]) -> bytes:
    """A safetensors file: 8-byte little-endian header length, JSON header, raw F32 data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name, values in tensors.items():
        data = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": [len(values)], "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writers do
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs)


def write_checkpoint(directory: Path, tensors: dict[str, list[float]]) -> str:
    """Write one ``model.safetensors`` (plus a ``config.json``) and return the checksum the
    manager computes (:func:`elastic_rollout.checkpoint_checksum`)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(safetensors_bytes(tensors))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return checkpoint_checksum(directory)


# -- the train step stand-in ---------------------------------------------------------------------


def reward(token_ids: list[int]) -> float:
    """A toy verifiable reward: the fraction of generated tokens whose id is a multiple of 3."""
    return sum(1 for t in token_ids if t % 3 == 0) / len(token_ids) if token_ids else 0.0


def train_step(policy: list[float], groups: list[list[list[int]]], lr: float = 0.05) -> tuple[list[float], float]:
    """GRPO's arithmetic on a bag-of-tokens 'policy': group-relative advantages, then one
    gradient step. Returns the new policy and the batch's mean reward."""
    grad = [0.0] * len(policy)
    rewards_seen: list[float] = []
    for group in groups:
        rewards = [reward(ids) for ids in group]
        rewards_seen += rewards
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) + 1e-6
        for ids, r in zip(group, rewards, strict=True):
            advantage = (r - mean) / std
            for t in ids:
                grad[t % len(policy)] += advantage / len(ids)
    new_policy = [w + lr * g for w, g in zip(policy, grad, strict=True)]
    return new_policy, (sum(rewards_seen) / len(rewards_seen) if rewards_seen else 0.0)


# -- shared state ----------------------------------------------------------------------------------


@dataclass
class Batch:
    step: int
    pin: str
    started: float
    finished: float
    #: one entry per sample: [prompt index, engine id, weight version, completion tokens]
    samples: list[tuple[int, str, str, int]]
    #: output token ids per prompt, per sibling (the GRPO groups)
    groups: list[list[list[int]]]


@dataclass
class Book:
    """What the threads share, under one condition variable."""

    versions: Versions
    cond: threading.Condition = field(default_factory=threading.Condition)
    stop: threading.Event = field(default_factory=threading.Event)
    published_num: int = 0
    tokens_total: int = 0
    samples_total: int = 0
    throttled_secs: float = 0.0
    error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()
        self.stop.set()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"a worker thread failed: {self.error!r}") from self.error

    def published(self, num: int) -> None:
        with self.cond:
            self.published_num = max(self.published_num, num)
            self.cond.notify_all()

    def wait_published(self, num: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.published_num >= num or self.stop.is_set(), timeout)


# -- rollout ---------------------------------------------------------------------------------------


def post_json(url: str, body: JsonObject, timeout: float) -> tuple[Any, str]:
    """POST ``body``; returns the decoded answer and the router's ``x-rollout-engine-id``."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read()), str(resp.headers.get("x-rollout-engine-id") or "?")
    except urllib.error.HTTPError as err:
        try:
            detail = err.read().decode(errors="replace")[:500]
        finally:
            err.close()
        raise RuntimeError(f"POST {url} answered {err.code}: {detail}") from None


class Rollout(threading.Thread):
    """Generates the batches of steps 1..N in order, each pinned to its staleness bound."""

    def __init__(
        self, book: Book, router: str, args: argparse.Namespace, out: queue.Queue[Batch | BaseException]
    ) -> None:
        super().__init__(name="rollout", daemon=True)
        self.book, self.router, self.args, self.out = book, router.rstrip("/"), args, out
        self.pool = ThreadPoolExecutor(max_workers=min(args.prompts, 64), thread_name_prefix="generate")

    def pin_num(self, step: int) -> int:
        """The oldest version step ``step`` may learn from: the trainer's policy before the step
        (``step - 1``) minus ``--max-staleness``, never below the fleet's starting version."""
        base = self.book.versions.base_num
        return max(base, base + step - 1 - int(self.args.max_staleness))

    def run(self) -> None:
        try:
            for step in range(1, self.args.steps + 1):
                pin_num = self.pin_num(step)
                began = time.monotonic()
                if not self.book.wait_published(pin_num, UPDATE_TIMEOUT * 2):
                    raise TimeoutError(f"version {self.book.versions.name(pin_num)} was never published")
                with self.book.cond:
                    self.book.throttled_secs += time.monotonic() - began
                if self.book.stop.is_set():
                    return
                self.out.put(self.generate(step, pin_num))
        except BaseException as err:  # handed to the trainer, which raises it
            self.book.fail(err)
            self.out.put(err)
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def generate(self, step: int, pin_num: int) -> Batch:
        pin = self.book.versions.name(pin_num)
        started = time.time()
        futures = [self.pool.submit(self.group, step, i, pin, pin_num) for i in range(self.args.prompts)]
        samples: list[tuple[int, str, str, int]] = []
        groups: list[list[list[int]]] = []
        for future in futures:
            group_samples, group_ids = future.result()
            samples += group_samples
            groups.append(group_ids)
        return Batch(step=step, pin=pin, started=started, finished=time.time(), samples=samples, groups=groups)

    def group(
        self, step: int, index: int, pin: str, pin_num: int
    ) -> tuple[list[tuple[int, str, str, int]], list[list[int]]]:
        """One prompt, ``--group-size`` siblings (``n``), one engine; every sibling checked against the pin."""
        a, b = (step * 7919 + index * 104729) % 1000, (step * 31 + index * 17) % 1000
        body: JsonObject = {
            "text": f"Question {step}.{index}: what is {a} + {b}? Think step by step.",
            "sampling_params": {
                "max_new_tokens": self.args.max_new_tokens,
                "n": self.args.group_size,
                "temperature": 1.0,
            },
            "weight_version": {"min_version": pin},
        }
        answer, engine = post_json(f"{self.router}/generate", body, REQUEST_TIMEOUT)
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != self.args.group_size:
            raise RuntimeError(f"asked for {self.args.group_size} samples, got {len(items)}: {str(answer)[:300]}")
        samples: list[tuple[int, str, str, int]] = []
        ids: list[list[int]] = []
        for item in items:
            meta = item.get("meta_info") or {}
            version = meta.get("weight_version")
            number = self.book.versions.number(version)
            if number is None or number < pin_num:
                raise PinViolation(
                    f"step {step} prompt {index}: engine {engine} answered with weight version {version!r},"
                    f" older than the pin min_version={pin!r}"
                )
            tokens = int(meta.get("completion_tokens") or len(item.get("output_ids") or ()))
            samples.append((index, engine, str(version), tokens))
            ids.append([int(t) for t in item.get("output_ids") or ()])
        with self.book.cond:
            self.book.tokens_total += sum(s[3] for s in samples)
            self.book.samples_total += len(samples)
        return samples, ids


# -- publishing ------------------------------------------------------------------------------------


class Publisher(threading.Thread):
    """Moves each step's weights to the fleet in order, each once the previous update has ended.

    ``--weights trainer`` (the default, what slime, AReaL and verl's async mode do): the
    trainer broadcasts them in buckets as NCCL rank 0 through the manager (``DistributedWeightSync``; on
    simulated engines rank 0 is :class:`elastic_rollout.sim.SimRank0`, which needs no torch).
    ``--weights checkpoint``: it publishes the step's checkpoint directory (``rolling``).
    """

    def __init__(self, book: Book, client: RolloutClient, mode: str) -> None:
        super().__init__(name="publisher", daemon=True)
        self.book, self.client, self.mode = book, client, mode
        self.todo: queue.Queue[tuple[int, Path | None, str | None] | None] = queue.Queue()
        self.records: list[JsonObject] = []
        self.last_update: str | None = None
        rank0 = SimRank0()
        self.sync = DistributedWeightSync(client, join_group=rank0.join_group, broadcast=rank0.broadcast,
                                          timeout=UPDATE_TIMEOUT)  # fmt: skip

    def run(self) -> None:
        try:
            while (item := self.todo.get()) is not None:
                num, path, checksum = item
                waited = time.monotonic()
                self.finish_last()
                waited = time.monotonic() - waited
                version = self.book.versions.name(num)
                if path is None:
                    # The trainer's broadcast, one bucket per tensor as the frameworks bucket
                    # theirs: answered when the fleet serves the version.
                    self.book.published(num)
                    result = self.sync.update(version, buckets=([t] for t in POLICY_TENSORS))
                    assert result.update is not None
                    self.last_update = result.update.update_id
                else:
                    answer = self.client.publish_weights(version, str(path), strategy="rolling", checksum=checksum)
                    self.last_update = str(answer["update_id"])
                    self.book.published(num)
                self.records.append(
                    {"version": version, "update_id": self.last_update, "at": time.time(), "checksum": checksum,
                     "source": self.mode, "waited_for_previous_secs": round(waited, 3)}
                )  # fmt: skip
        except BaseException as err:
            self.book.fail(err)

    def finish_last(self) -> None:
        """Wait for the update in flight (one update at a time); a FAILED one ends the run."""
        if self.last_update is None:
            return
        update = self.client.wait_for_weight_update(self.last_update, UPDATE_TIMEOUT, poll_interval=0.05)
        for record in self.records:
            if record["update_id"] == self.last_update:
                record["status"], record["finished_at"] = update["status"], update.get("finished_at")
        if update["status"] != "COMPLETED":
            raise RuntimeError(
                f"weight update {update['version']} ended {update['status']}: {update.get('error_message')}"
            )


# -- the fleet's timeline --------------------------------------------------------------------------


class Sampler(threading.Thread):
    def __init__(self, book: Book, client: RolloutClient, t0: float) -> None:
        super().__init__(name="sampler", daemon=True)
        self.book, self.client, self.t0 = book, client, t0
        self.points: list[JsonObject] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.sample()
            except (RolloutApiError, urllib.error.URLError, ConnectionError, TimeoutError) as err:
                print(f"[sampler] {err}", file=sys.stderr)
            self.done.wait(SAMPLE_INTERVAL)

    def sample(self) -> JsonObject:
        view = self.client.engines()
        weights = self.client.weights()
        with self.book.cond:
            tokens, published = self.book.tokens_total, self.book.published_num
        point: JsonObject = {
            "t": round(time.time() - self.t0, 3),
            "active": len(view.with_status("ACTIVE")),
            "engines_total": view.total_engines,
            "engines": {e.engine_id: {"status": e.status, "version": e.weight_version} for e in view.engines},
            "fleet_version": weights.get("version"),
            "fleet_source": weights.get("source"),
            "updating_to": (weights.get("update") or {}).get("version"),
            "published": self.book.versions.name(published),
            "tokens_total": tokens,
        }
        self.points.append(point)
        return point


# -- the manager this script starts ----------------------------------------------------------------


AUTOSCALER_YAML = """\
# Written by examples/fully_async/loop.py: the seed's policy, compressed in time for a demo.
enabled: true
min_engines: {min}
max_engines: {max}
metrics_interval_secs: 0.5
evaluation_interval_secs: 1.0
condition_window_secs: 2.0
scale_out_cooldown_secs: 2.0
scale_in_cooldown_secs: 10.0
scale_out_policy:
  condition_duration_secs: 2.0
  max_delta: 1
scale_in_policy:
  condition_duration_secs: 5.0
pipeline_policy:
  min_steps: 2
  report_max_age_secs: 10.0
"""


class OwnManager:
    """``rollout-manager serve --engine sim`` on loopback, stopped (SIGTERM, wait, reap) by ``stop``."""

    def __init__(self, args: argparse.Namespace, state_dir: Path) -> None:
        self.args, self.state_dir = args, state_dir
        self.process: subprocess.Popen[bytes] | None = None
        self.control = self.router = ""

    def start(self) -> None:
        binary = find_binary("rollout-manager")
        config = self.state_dir / "autoscaler.yaml"
        config.write_text(AUTOSCALER_YAML.format(min=self.args.engines_min, max=self.args.engines_max))
        argv = [
            str(binary), "serve", "--engine", "sim",
            "--host", "127.0.0.1", "--port", "0", "--router-port", "0",
            "--state-dir", str(self.state_dir / "manager"),
            "--gpus", str(self.args.engines_max), "--max-engines", str(self.args.engines_max),
            "--rollout-num-gpus", str(self.args.engines_min), "--rollout-num-gpus-per-engine", "1",
            "--weight-version", "step-0",
            "--autoscaler-config", str(config),
            "--max-inflight-per-engine", str(self.args.inflight_per_engine),
            "--scale-in-drain-timeout", "10",
            "--parent-pid", str(os.getpid()),
            f"--engine-arg=--time-scale={self.args.time_scale}",
        ]  # fmt: skip
        print(f"[manager] starting {binary} (sim engines, {self.args.engines_min}..{self.args.engines_max} engines)")
        self.stderr = open(self.state_dir / "manager.stderr", "wb")  # closed in stop()
        self.process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.stderr, start_new_session=True
        )
        listening = threading.Event()
        stdout = self.process.stdout
        assert stdout is not None

        def drain() -> None:  # read the listening line, then keep the pipe from filling up
            with open(self.state_dir / "manager.stdout", "wb") as log:
                for line in stdout:
                    log.write(line)
                    log.flush()
                    match = LISTENING_RE.match(line.decode(errors="replace").strip())
                    if match and not listening.is_set():
                        self.control, self.router = match["control"], match["router"]
                        listening.set()
            listening.set()  # the manager exited: wake the waiter, which sees the exit

        threading.Thread(target=drain, name="manager-stdout", daemon=True).start()
        if not listening.wait(30.0) or not self.control:
            raise RuntimeError(f"the manager did not start listening:\n{self.stderr_tail()}")

    def stderr_tail(self, chars: int = 3000) -> str:
        try:
            return (self.state_dir / "manager.stderr").read_text(errors="replace")[-chars:]
        except OSError as err:
            return f"<{err}>"

    def stop(self) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process is not None:
            print(f"[manager] stopped (exit {process.returncode})")
        if hasattr(self, "stderr"):
            self.stderr.close()


# -- the loop --------------------------------------------------------------------------------------


def run(args: argparse.Namespace, client: RolloutClient, router: str, ckpt_root: Path) -> JsonObject:
    versions = Versions.of_fleet(client.weights())
    book = Book(versions=versions, published_num=versions.base_num)
    t0 = time.time()
    sampler = Sampler(book, client, t0)
    publisher = Publisher(book, client, args.weights)
    batches: queue.Queue[Batch | BaseException] = queue.Queue()
    rollout = Rollout(book, router, args, batches)
    sampler.start()
    publisher.start()
    rollout.start()
    steps: list[JsonObject] = []
    policy = [0.0] * POLICY_DIM
    try:
        for step in range(1, args.steps + 1):
            num = versions.base_num + step
            began = time.monotonic()
            with book.cond:
                throttled0, samples0 = book.throttled_secs, book.samples_total
            item = batches.get(timeout=REQUEST_TIMEOUT + UPDATE_TIMEOUT)
            if isinstance(item, BaseException):
                raise item
            book.check()
            waited = time.monotonic() - began
            # The fully-async bound: trained at step k (policy k-1), no sample older than k-1-S.
            policy_num = num - 1
            staleness = [policy_num - (versions.number(s[2]) or 0) for s in item.samples]
            if max(staleness) > args.max_staleness:
                raise PinViolation(f"step {step}: a sample is {max(staleness)} versions stale (> {args.max_staleness})")
            policy, mean_reward = train_step(policy, item.groups)
            version = versions.name(num)
            if args.weights == "trainer":
                publisher.todo.put((num, None, None))  # broadcast in the background
            else:
                tensors = {"policy.weight": policy, "policy.step": [float(num)]}
                checksum = write_checkpoint(ckpt_root / version, tensors)
                publisher.todo.put((num, ckpt_root / version, checksum))  # published in the background
            with book.cond:
                throttled, samples_done = book.throttled_secs - throttled0, book.samples_total - samples0
            step_secs = time.monotonic() - began
            report = client.report_step(
                num, round(waited, 4), round(min(throttled, step_secs), 4), round(step_secs, 4),
                rollout_samples=samples_done, next_step_samples=args.prompts * args.group_size,
            )  # fmt: skip
            tokens = sum(s[3] for s in item.samples)
            steps.append({
                "step": step, "version": version, "pin": item.pin, "t_start": round(item.started - t0, 3),
                "t_batch": round(item.finished - t0, 3), "t_end": round(time.time() - t0, 3),
                "trainer_wait_secs": round(waited, 4), "rollout_throttled_secs": round(throttled, 4),
                "step_secs": round(step_secs, 4), "tokens": tokens, "mean_reward": round(mean_reward, 4),
                "max_staleness": max(staleness), "sample_versions": dict(Counter(s[2] for s in item.samples)),
                "engines": dict(Counter(s[1] for s in item.samples)),
                "samples": [list(s) for s in item.samples],
                "autoscaler": {"signal": report.get("signal"), "decision": report.get("decision")},
            })  # fmt: skip
            print(
                f"step {step:>3}  pin>={item.pin:<8} versions {sorted(steps[-1]['sample_versions'])}  "
                f"wait {waited:5.2f}s  {tokens:>6} tokens  reward {mean_reward:.3f}  -> {version}"
            )
        publisher.todo.put(None)
        publisher.join(UPDATE_TIMEOUT * 2)
        book.check()
        publisher.finish_last()  # the last version is on every engine before the final sample
        sampler.done.set()
        sampler.join(10.0)
        final = sampler.sample()
    finally:
        book.stop.set()
        sampler.done.set()
        publisher.todo.put(None)
        with book.cond:
            book.cond.notify_all()
    sampler.join(5.0)
    history = client.request("GET", "/autoscaler/scale_history?limit=100").get("history") or []
    return {
        "t0": t0,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "token"},
        "versions": {"base": versions.base, "base_num": versions.base_num},
        "steps": steps,
        "published": publisher.records,
        "timeline": sampler.points,
        "final": final,
        "scale_history": [
            {k: h.get(k) for k in ("action", "status", "from_engines", "to_engines", "reason", "signal")}
            | {"t": round(float(h.get("triggered_at") or t0) - t0, 3)}
            for h in reversed(history)
            if float(h.get("triggered_at") or 0) >= t0
        ],
    }


def summarize(result: JsonObject, wall_secs: float) -> JsonObject:
    steps, points = result["steps"], result["timeline"]
    # Engines in service: ACTIVE, or out of routing for a weight update (paused while the trainer
    # broadcasts; requests wait in the router meanwhile).
    in_service = ("ACTIVE", "WEIGHT_SYNCING", "READY")
    active = [sum(1 for e in p["engines"].values() if e["status"] in in_service) for p in points]
    return {
        "steps": len(steps),
        "samples": sum(len(s["samples"]) for s in steps),
        "tokens": sum(s["tokens"] for s in steps),
        "max_staleness": max((s["max_staleness"] for s in steps), default=0),
        "fleet_min": min(active, default=0),
        "fleet_max": max(active, default=0),
        "published": [p["version"] for p in result["published"]],
        "final_versions": sorted(
            {e["version"] for e in result["final"]["engines"].values() if e["status"] == "ACTIVE"}
        ),
        "wall_secs": round(wall_secs, 1),
    }


# -- the plot --------------------------------------------------------------------------------------


def plot(result: JsonObject, path: Path) -> bool:
    """Three panels sharing the time axis; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return False
    versions = Versions(**result["versions"])
    points = result["timeline"]
    ts = [p["t"] for p in points]
    fig, (ax_fleet, ax_ver, ax_tps) = plt.subplots(3, 1, sharex=True, figsize=(10, 7.5), height_ratios=[1, 1.4, 1])

    ax_fleet.step(ts, [p["active"] for p in points], where="post", color="tab:blue", lw=2, label="ACTIVE")
    ax_fleet.step(ts, [p["engines_total"] for p in points], where="post", color="tab:blue", lw=1, ls=":",
                  label="all engines (starting / updating included)")  # fmt: skip
    for event in result["scale_history"]:
        colour = "tab:green" if event["action"] == "scale_out" else "tab:red"
        ax_fleet.axvline(event["t"], color=colour, lw=0.8, alpha=0.6)
        ax_fleet.annotate(f"{event['from_engines']}→{event['to_engines']}", (event["t"], 0.3), fontsize=7,
                          color=colour, xytext=(2, 0), textcoords="offset points")  # fmt: skip
    ax_fleet.set_ylabel("engines")
    ax_fleet.set_ylim(0, max([p["engines_total"] for p in points] + [1]) + 0.8)
    ax_fleet.legend(loc="lower right", fontsize=8)
    ax_fleet.set_title("fully-async loop on a simulated fleet (autoscaler: pipeline signal)", fontsize=10)

    engine_ids = sorted({e for p in points for e in p["engines"]}, key=lambda e: (len(e), e))
    for i, engine_id in enumerate(engine_ids):
        xs, ys = [], []
        for p in points:
            record = p["engines"].get(engine_id)
            if record and record["status"] == "ACTIVE":
                xs.append(p["t"])
                ys.append((versions.number(record["version"]) or 0) + (i - len(engine_ids) / 2) * 0.06)
        ax_ver.plot(xs, ys, ".", ms=3, label=engine_id)
    ax_ver.step(ts, [versions.number(p["published"]) for p in points], where="post", color="black", lw=1.2,
                label="published")  # fmt: skip
    ax_ver.step(ts, [versions.number(p["fleet_version"]) for p in points], where="post", color="grey", lw=1,
                ls="--", label="committed (fleet)")  # fmt: skip
    pins = [(s["t_start"], versions.number(s["pin"])) for s in result["steps"]]
    ax_ver.plot([t for t, _ in pins], [v for _, v in pins], "v", color="tab:red", ms=4, label="batch pin (min_version)")
    ax_ver.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_ver.set_ylabel("weight version (step)")
    ax_ver.legend(loc="upper left", fontsize=7, ncol=2)

    # Tokens are counted when a group's answer arrives, so rates are read over a trailing window.
    tps_t, tps = [], []
    for i, point in enumerate(points):
        j = next(j for j in range(i + 1) if points[j]["t"] >= point["t"] - TPS_WINDOW)
        if point["t"] > points[j]["t"]:
            tps_t.append(point["t"])
            tps.append((point["tokens_total"] - points[j]["tokens_total"]) / (point["t"] - points[j]["t"]))
    ax_tps.plot(tps_t, tps, color="tab:orange", lw=1.2)
    ax_tps.fill_between(tps_t, tps, color="tab:orange", alpha=0.2)
    ax_tps.set_ylabel(f"generated tokens/s ({TPS_WINDOW:g} s window)")
    ax_tps.set_xlabel("seconds since the loop started")
    for ax in (ax_fleet, ax_ver, ax_tps):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=20, help="trainer steps (default 20)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per batch (default 16)")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt, GRPO's group (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--max-staleness", type=int, default=1,
                   help="batch k is pinned to min_version step-(k-1-S): 0 is on-policy (default 1)")  # fmt: skip
    p.add_argument("--out", type=Path, default=HERE / "out", help="where timeline.json/.png go")
    p.add_argument("--manager", help="control URL of a running manager (else one is started)")
    p.add_argument("--router", help="router URL of that manager")
    p.add_argument("--token", help="API token of that manager (mutating requests)")
    p.add_argument("--engines-min", type=int, default=1, help="own manager: initial engines = autoscaler floor")
    p.add_argument("--engines-max", type=int, default=4, help="own manager: GPUs = autoscaler ceiling")
    p.add_argument("--inflight-per-engine", type=int, default=2,
                   help="own manager: --max-inflight-per-engine (prompt groups per engine at once)")  # fmt: skip
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="own manager: sglang-sim --time-scale (1: modelled GPU speed)"
    )
    weights_help = (
        "how each step's weights reach the fleet: the trainer's NCCL broadcast through the manager "
        "(default, as slime, AReaL and verl's async mode do), or a checkpoint from disk"
    )
    p.add_argument("--weights", choices=("trainer", "checkpoint"), default="trainer", help=weights_help)
    args = p.parse_args(argv)
    if (args.manager is None) != (args.router is None):
        p.error("--manager and --router go together")
    for name in ("steps", "prompts", "group_size", "max_new_tokens", "engines_min", "inflight_per_engine"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_staleness < 0 or args.engines_max < args.engines_min:
        p.error("--max-staleness must be >= 0 and --engines-max >= --engines-min")
    return args


def _terminate(signum: int, frame: types.FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)  # a SIGTERM runs the same cleanup as Ctrl-C
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="fully-async-"))
    manager: OwnManager | None = None
    ok = interrupted = False
    try:
        if args.manager is None:
            manager = OwnManager(args, work)
            manager.start()
            control, router = manager.control, manager.router
        else:
            control, router = args.manager, args.router
        client = RolloutClient(control, token=args.token, timeout=30.0)
        if manager is not None:
            client.wait_for_engines(args.engines_min, timeout=60.0)
        # A running manager keeps needing a published version's files (an engine that joins later
        # loads the fleet's version from them), so they stay in --out; our own go with the manager.
        ckpt_root = work / "ckpt" if manager is not None else args.out.resolve() / "checkpoints"
        print(f"[loop] control {control}  router {router}  checkpoints {ckpt_root}")
        result = run(args, client, router, ckpt_root)
        result["summary"] = summary = summarize(result, time.monotonic() - started)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "timeline.json").write_text(json.dumps(result, indent=1))
        plotted = plot(result, args.out / "timeline.png")
        print(
            f"[loop] {summary['steps']} steps, {summary['samples']} samples, {summary['tokens']} tokens;"
            f" max staleness {summary['max_staleness']} (bound {args.max_staleness});"
            f" engines in service {summary['fleet_min']}..{summary['fleet_max']};"
            f" published {summary['published'][0]}..{summary['published'][-1]};"
            f" final engines on {summary['final_versions']}; {summary['wall_secs']} s"
        )
        print(
            f"[loop] wrote {args.out / 'timeline.json'}"
            + (" and timeline.png" if plotted else " (no matplotlib: no plot)")
        )
        ok = True
        return 0
    except KeyboardInterrupt:
        print("[loop] interrupted", file=sys.stderr)
        interrupted = True
        return 130
    finally:
        if manager is not None:
            manager.stop()
        if ok or interrupted or manager is None:
            shutil.rmtree(work, ignore_errors=True)
        else:  # a failure: keep what explains it
            print(f"[manager] stderr tail:\n{manager.stderr_tail()}", file=sys.stderr)
            print(f"[loop] kept {work} (manager logs, checkpoints)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
