"""Chaos under load, shared by the CI test (tests/test_chaos.py) and the long run (benches/chaos.py).

Flow: a manager runs a fleet of simulated engines (started with ``--enable-fault-api``);
:class:`Load` sends a steady mix of streaming and non-streaming ``/generate`` through the router
from a few client threads, :class:`Watcher` samples the engine list every 0.1 s (recording every
engine pid for the leak check, how many engines are routable, and each engine's status
history), and :class:`Chaos` breaks engines one action at a time from a seeded schedule: kill -9,
hang (the sim's fault API), freeze (SIGSTOP), slow health checks, scale out by one, scale in by
one, and publish a weight version (a fresh checkpoint, rolling update, waited for).

What is counted (see :meth:`Report.from_run`):
- a *client-visible failure* is any request that did not end with a complete answer (HTTP error,
  reset, timeout, truncated stream, ``finish_reason`` other than ``length``). It is *excused*
  only if the client had already received stream data when it failed, or if no engine was
  routable at some moment during its life. Goal: no unexcused failure.
- a *wrong version* is an answer whose ``meta_info.weight_version`` is older than the fleet's
  committed version when the request was sent (a version counts once its update COMPLETED).
  Goal: none.
- *recovery time* of an engine: from the action that broke it to the first sample that shows it
  ACTIVE again as a new process (kill, hang, freeze) or ACTIVE again (slow health).
- *leaked processes*: after the manager stopped, any engine or keeper pid ever seen that is still
  alive, or any process whose command line names the test's state directory. Goal: none.
"""

from __future__ import annotations

import http.client as httpclient
import json
import os
import random
import signal
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _checkpoints import write_checkpoint
from _support import SHUTDOWN_TIMEOUT, ManagerHandle, ProcessIdentity, http, stop_manager


#: Manager flags for a chaos fleet of ``engines`` engines with room for ``spare`` more.
def chaos_args(engines: int, spare: int, time_scale: float) -> tuple[str, ...]:
    return (
        "--gpus", str(engines + spare),
        "--rollout-num-gpus", str(engines),
        "--rollout-num-gpus-per-engine", "1",
        f"--engine-arg=--time-scale={time_scale}",
        "--engine-arg=--enable-fault-api",
        "--health-check-interval-secs", "0.5",
        "--health-check-timeout-secs", "1",
        "--health-failure-threshold", "2",
        "--scale-in-shutdown-timeout", "2",
        "--scale-in-drain-timeout", "30",
    )  # fmt: skip


# -- load -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request through the router, as its client saw it."""

    start: float
    end: float
    stream: bool
    ok: bool
    #: stream data had reached the client before it failed (then a failure is excused)
    started_streaming: bool
    error: str | None
    engine_id: str | None
    weight_version: str | None
    #: the fleet's weight version when the request was sent
    expected_version: str | None


class Load:
    """``threads`` clients, each sending one request after another until :meth:`stop`."""

    def __init__(self, router_url: str, threads: int, seed: int, fleet_version: Any, timeout: float = 120.0) -> None:
        parsed = urllib.parse.urlsplit(router_url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.outcomes: list[Outcome] = []
        self.timeout = timeout
        self.fleet_version = fleet_version  # a callable: the fleet's current weight version
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(random.Random(seed * 1000 + i), i), daemon=True)
            for i in range(threads)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout + 10)

    def _run(self, rng: random.Random, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = rng.random() < 0.5
            tokens = rng.randint(16, 400)
            outcome = self.one(f"client {index} request {n} {rng.random():.6f}", tokens, stream)
            with self._lock:
                self.outcomes.append(outcome)

    def one(self, prompt: str, tokens: int, stream: bool) -> Outcome:
        body = {"text": prompt, "stream": stream, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
        expected = self.fleet_version()
        start = time.monotonic()
        chunks = 0
        engine_id: str | None = None

        def done(ok: bool, error: str | None, version: str | None = None) -> Outcome:
            return Outcome(start, time.monotonic(), stream, ok, chunks > 0, error, engine_id, version, expected)

        conn = httpclient.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            engine_id = resp.getheader("x-rollout-engine-id")
            if resp.status != 200:
                return done(False, f"HTTP {resp.status}: {resp.read()[:300]!r}")
            last: dict[str, Any] | None = None
            if stream:
                finished = False
                for line in resp:
                    text = line.decode().strip()
                    if not text.startswith("data:"):
                        continue
                    payload = text[len("data:") :].strip()
                    if payload == "[DONE]":
                        finished = True
                        break
                    last = json.loads(payload)
                    chunks += 1
                if not finished:
                    return done(False, f"stream ended without [DONE] after {chunks} chunks")
            else:
                last = json.loads(resp.read())
            if last is None:
                return done(False, "no answer in the body")
            meta = last.get("meta_info", {})
            version = meta.get("weight_version")
            if meta.get("finish_reason") != {"type": "length", "length": tokens}:
                return done(False, f"finish_reason {meta.get('finish_reason')!r}, wanted length {tokens}", version)
            return done(True, None, version)
        except (OSError, httpclient.HTTPException, ValueError) as err:
            return done(False, f"{type(err).__name__}: {err}")
        finally:
            conn.close()


# -- watching the fleet ---------------------------------------------------------------------


@dataclass
class Sample:
    at: float
    #: engine_id -> (status, pid, url)
    engines: dict[str, tuple[str, int | None, str]]

    @property
    def routable(self) -> int:
        return sum(1 for status, _, _ in self.engines.values() if status == "ACTIVE")


class Watcher:
    """Samples GET /rollout/engines every ``interval`` seconds in a thread."""

    def __init__(self, fleet: ManagerHandle, interval: float = 0.1) -> None:
        self.fleet = fleet
        self.interval = interval
        self.samples: list[Sample] = []
        self.keepers: dict[int, ProcessIdentity] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.errors = 0

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def sample(self) -> Sample | None:
        try:
            view = self.fleet.engines()  # records every pid for the leak check
            self.fleet.track_children()
        except OSError:
            self.errors += 1
            return None
        sample = Sample(time.monotonic(), {e.engine_id: (e.status, e.pid, e.url) for e in view.engines})
        self.samples.append(sample)
        return sample

    def latest(self) -> Sample:
        return self.samples[-1]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def min_routable(self, start: float, end: float) -> int:
        """Fewest routable engines seen from the sample before ``start`` to the one after ``end``."""
        window = [s.routable for s in self.samples if start - self.interval <= s.at <= end + self.interval]
        return min(window, default=0)


# -- chaos ----------------------------------------------------------------------------------

ACTIONS = ("kill", "hang", "freeze", "slow_health", "scale_out", "scale_in", "publish")


@dataclass
class Breakage:
    action: str
    engine_id: str
    pid: int | None
    at: float
    recovered_at: float | None = None
    went_down_at: float | None = None
    identity: ProcessIdentity | None = None
    #: when the chaos loop turned a slow-health fault off again
    cleared_at: float | None = None


def publish_weights(fleet: ManagerHandle, version: str, seed: int) -> tuple[bool, str]:
    """Publish a fresh checkpoint as ``version`` (rolling) and wait for the update to end.

    Returns (committed, detail). The chaos loop waits here, so "the fleet's version" moves only
    once the update COMPLETED; an update that FAILED (an engine broke while loading) leaves it
    where it was, as the manager does.
    """
    directory = fleet.state_dir / "checkpoints" / version
    write_checkpoint(directory, seed)
    result = http(
        "POST",
        f"{fleet.control_url}/rollout/weights/publish",
        {"version": version, "path": str(directory), "strategy": "rolling"},
        timeout=30,
    )
    if result.status not in (200, 202):
        return False, f"{result.status} {result.json().get('error', result.json())}"
    update = fleet.client.wait_for_weight_update(result.json()["update_id"], timeout=120)
    return update["status"] == "COMPLETED", f"{update['status']} {update.get('error_message') or ''}".strip()


class Chaos:
    """Breaks the fleet from a seeded schedule, never more than ``max_broken`` engines at once."""

    def __init__(
        self,
        fleet: ManagerHandle,
        watcher: Watcher,
        seed: int,
        base_engines: int,
        max_engines: int,
        max_broken: int = 3,
    ) -> None:
        self.fleet = fleet
        self.watcher = watcher
        self.rng = random.Random(seed)
        self.base_engines = base_engines
        self.max_engines = max_engines
        self.max_broken = max_broken
        self.breakages: list[Breakage] = []
        self.log: list[tuple[float, str, str]] = []
        #: Versions the fleet committed (what a request sent later must get at least).
        self.versions: list[str] = ["default"]
        #: Every version published, in order, committed or not (an engine may serve a version
        #: whose update later failed: newer than the fleet's, not wrong).
        self.published: list[str] = ["default"]
        self._slow: list[tuple[float, Breakage, str]] = []  # (clear at, breakage, url)

    def fleet_version(self) -> str:
        return self.versions[-1]

    def note(self, action: str, detail: str) -> None:
        self.log.append((time.monotonic(), action, detail))

    def done(self) -> set[str]:
        """The kinds of action performed so far (not skipped)."""
        return {action for _, action, detail in self.log if not detail.startswith("skipped")}

    def broken(self) -> list[Breakage]:
        self.update_recoveries()
        return [b for b in self.breakages if b.recovered_at is None]

    def update_recoveries(self) -> None:
        """Marks breakages recovered from the watcher's samples."""
        for b in self.breakages:
            if b.recovered_at is not None:
                continue
            for s in self.watcher.samples:
                if s.at < b.at or b.engine_id not in s.engines:
                    continue
                status, pid, _ = s.engines[b.engine_id]
                if status != "ACTIVE" and b.went_down_at is None:
                    b.went_down_at = s.at
                if status != "ACTIVE":
                    continue
                if b.action == "slow_health" and (
                    (b.went_down_at is not None and s.at > b.went_down_at)
                    or (b.cleared_at is not None and s.at > b.cleared_at)
                ):
                    # Back after being taken out, or never taken out before the fault ended.
                    b.recovered_at = s.at
                    break
                if b.action != "slow_health" and pid is not None and pid != b.pid:
                    b.recovered_at = s.at
                    break
            # An engine removed by scale-in while broken has nothing left to recover.
            last = self.watcher.latest()
            if b.recovered_at is None and b.engine_id not in last.engines:
                b.recovered_at = float("nan")

    def step(self, action: str) -> None:
        """Performs one action (or notes why it was skipped)."""
        self.clear_slow_health()
        sample = self.watcher.latest()
        broken_ids = {b.engine_id for b in self.broken()}
        healthy = sorted(
            (eid, pid, url)
            for eid, (status, pid, url) in sample.engines.items()
            if status == "ACTIVE" and eid not in broken_ids and pid is not None
        )
        if action in ("kill", "hang", "freeze", "slow_health"):
            if len(broken_ids) >= self.max_broken or len(healthy) <= 1:
                self.note(action, f"skipped: {len(broken_ids)} engines broken, {len(healthy)} healthy")
                return
            engine_id, pid, url = self.rng.choice(healthy)
            assert pid is not None
            breakage = Breakage(action, engine_id, pid, time.monotonic(), identity=ProcessIdentity.of(pid))
            if breakage.identity is None or not breakage.identity.alive():
                self.note(action, f"skipped: {engine_id} pid {pid} is gone already")
                return
            if action == "kill":
                os.kill(pid, signal.SIGKILL)
            elif action == "freeze":
                os.kill(pid, signal.SIGSTOP)
            elif action == "hang":
                result = http("POST", f"{url}/sim/faults", {"hang": True}, timeout=5)
                assert result.status == 200, (result.status, result.body)
            else:
                result = http("POST", f"{url}/sim/faults", {"slow_health": 3.0}, timeout=5)
                assert result.status == 200, (result.status, result.body)
                self._slow.append((time.monotonic() + 4.0, breakage, url))
            self.breakages.append(breakage)
            self.note(action, f"{engine_id} pid {pid}")
        elif action == "scale_out":
            total = len(sample.engines)
            if total >= self.max_engines:
                self.note(action, f"skipped: {total} engines")
                return
            result = http("POST", f"{self.fleet.control_url}/rollout/scale_out", {"num_replicas": total + 1})
            self.note(action, f"to {total + 1}: {result.status} {result.json().get('status', result.json())}")
        elif action == "scale_in":
            total = len(sample.engines)
            if total <= self.base_engines:
                self.note(action, f"skipped: {total} engines")
                return
            result = http("POST", f"{self.fleet.control_url}/rollout/scale_in", {"num_replicas": total - 1})
            self.note(action, f"to {total - 1}: {result.status} {result.json().get('status', result.json())}")
        elif action == "publish":
            version = f"v{len(self.published)}"
            self.published.append(version)
            committed, detail = publish_weights(self.fleet, version, seed=len(self.published))
            if committed:
                self.versions.append(version)
            self.note(action, f"{version}: {detail}")
        else:
            raise ValueError(f"unknown chaos action {action!r}")

    def clear_slow_health(self, force: bool = False) -> None:
        """Turns the slow health fault off again once its time is up (if the process still runs)."""
        keep = []
        for clear_at, breakage, url in self._slow:
            if not force and time.monotonic() < clear_at:
                keep.append((clear_at, breakage, url))
                continue
            try:
                http("POST", f"{url}/sim/faults", {"slow_health": 0}, timeout=5)
            except OSError:
                pass  # restarted meanwhile: the new process has no fault
            breakage.cleared_at = time.monotonic()
        self._slow = keep

    def schedule(self, count: int) -> list[str]:
        """``count`` actions: every kind at least once, the rest random, in a seeded order."""
        actions = list(ACTIONS) + [self.rng.choice(ACTIONS) for _ in range(max(0, count - len(ACTIONS)))]
        self.rng.shuffle(actions)
        return actions


# -- the report -----------------------------------------------------------------------------


@dataclass
class Report:
    requests: int
    streams: int
    failures: list[Outcome]
    unexcused: list[Outcome]
    excused_streaming: int
    excused_no_engine: int
    wrong_version: list[Outcome]
    recoveries: dict[str, list[float]]
    unrecovered: list[Breakage]
    actions: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_run(cls, load: Load, watcher: Watcher, chaos: Chaos) -> Report:
        failures = [o for o in load.outcomes if not o.ok]
        unexcused, streaming, no_engine = [], 0, 0
        for o in failures:
            if o.started_streaming:
                streaming += 1
            elif watcher.min_routable(o.start, o.end) == 0:
                no_engine += 1
            else:
                unexcused.append(o)
        order = {v: i for i, v in enumerate(chaos.published)}
        wrong = [
            o
            for o in load.outcomes
            if o.ok and order.get(o.weight_version or "", -1) < order.get(o.expected_version or "default", 0)
        ]
        chaos.update_recoveries()
        recoveries: dict[str, list[float]] = {}
        for b in chaos.breakages:
            if b.recovered_at is not None and b.recovered_at == b.recovered_at:  # not NaN
                recoveries.setdefault(b.action, []).append(b.recovered_at - b.at)
        actions: dict[str, int] = {}
        for _, action, detail in chaos.log:
            if not detail.startswith("skipped"):
                actions[action] = actions.get(action, 0) + 1
        return cls(
            requests=len(load.outcomes),
            streams=sum(1 for o in load.outcomes if o.stream),
            failures=failures,
            unexcused=unexcused,
            excused_streaming=streaming,
            excused_no_engine=no_engine,
            wrong_version=wrong,
            recoveries=recoveries,
            unrecovered=[b for b in chaos.breakages if b.recovered_at is None],
            actions=actions,
        )

    def describe(self) -> str:
        lines = [
            f"requests {self.requests} ({self.streams} streaming), failures {len(self.failures)}: "
            f"unexcused {len(self.unexcused)}, after stream data {self.excused_streaming}, "
            f"with no routable engine {self.excused_no_engine}; wrong version {len(self.wrong_version)}",
            f"actions done: {self.actions}",
        ]
        for action, times in sorted(self.recoveries.items()):
            lines.append(
                f"recovery {action}: n={len(times)} max={max(times):.2f}s " + " ".join(f"{t:.2f}" for t in times)
            )
        for o in self.unexcused[:10]:
            lines.append(
                f"unexcused failure: stream={o.stream} engine={o.engine_id} after {o.end - o.start:.2f}s: {o.error}"
            )
        for b in self.unrecovered:
            lines.append(f"not recovered: {b}")
        return "\n".join(lines)


def leaked_processes(fleet: ManagerHandle, extra: dict[int, ProcessIdentity]) -> list[str]:
    """Processes that outlived the manager: recorded pids still alive, or anything naming the state dir."""
    leaks = [f"pid {pid}" for pid, ident in {**fleet.engine_processes, **extra}.items() if ident.alive()]
    marker = str(fleet.state_dir)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ident = ProcessIdentity.of(int(entry.name))
        if marker in cmdline and ident is not None and ident.alive():
            leaks.append(f"pid {entry.name}: {cmdline[:200]}")
    return leaks


def resume_frozen(chaos: Chaos) -> None:
    """SIGCONT every process the chaos loop froze that still exists (so cleanup can end it)."""
    for b in chaos.breakages:
        if b.action == "freeze" and b.identity is not None and b.identity.alive():
            try:
                os.kill(b.identity.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def shut_down(fleet: ManagerHandle) -> list[str]:
    """SIGTERM the manager and wait for it; returns the processes still alive 15 s later."""
    try:
        fleet.engines()
        fleet.track_children()
    except OSError:
        pass
    fleet.signal(signal.SIGTERM)
    try:
        fleet.process.wait(timeout=SHUTDOWN_TIMEOUT)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 15
    while (leaks := leaked_processes(fleet, {})) and time.monotonic() < deadline:
        time.sleep(0.2)
    stop_manager(fleet, check=False)  # kills whatever is left, so a failing run leaks nothing
    return leaks
