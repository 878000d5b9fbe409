"""The real-engine tier: SGLang 0.5.23 itself, on this machine's CPU, with tiny models made here.

``make test`` installs SGLang into a venv of its own (``make sglang-venv``, outside the clone) and
names its Python in ``ER_SGLANG_PYTHON``; without that variable the default venv is used if it
exists, else the tier's tests skip, saying how to install it. The venv holds the suite's CPU
platform plugin (``tests/sglang_cpu``), which keeps SGLang on its plain-PyTorch paths.

Checkpoints are made at test time by ``tests/sglang_cpu/make_model.py`` (a byte-level BPE trained
on the repository's own docs, random Llama weights; nothing from a hub): ``MODEL_A`` and
``MODEL_B`` have the same tokenizer and shapes and different weights, so greedy answers tell
which one an engine serves.

SGLang's costs on a 2-core machine: 25-40 s from start to healthy (imports), about 3-4 GB
resident per server (so at most two at once), a few hundred tokens/s per stream.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _support import file_tail, wait_until

REPO = Path(__file__).resolve().parent.parent
ENV_PYTHON = "ER_SGLANG_PYTHON"
DEFAULT_VENV = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "elastic-rollout" / "sglang-0.5.23"
#: Start to healthy, generously: two engines importing torch at once on 2 busy cores.
STARTUP_TIMEOUT = 240.0
#: SGLang's own flags for CPU: the KV pool sized (else 72% of RAM), no warm-up request.
ENGINE_FLAGS: tuple[str, ...] = ("--device", "cpu", "--max-total-tokens", "16384", "--skip-server-warmup")
#: The same, as the manager's --engine-arg flags.
MANAGER_ENGINE_ARGS: tuple[str, ...] = (
    "--engine-arg=--device=cpu",
    "--engine-arg=--max-total-tokens=16384",
    "--engine-arg=--skip-server-warmup",
)
#: The environment an engine needs here: no hub.
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def sglang_python() -> Path:
    """The SGLang venv's Python; skips the test when there is none and none was asked for."""
    named = os.environ.get(ENV_PYTHON)
    if named:
        path = Path(named)
        if not path.is_file():
            raise AssertionError(f"{ENV_PYTHON}={named} does not exist; run `make sglang-venv`")
        return path
    path = DEFAULT_VENV / "bin" / "python"
    if not path.is_file():
        pytest.skip(f"no SGLang venv ({path}); `make sglang-venv` installs it (make test does)")
    return path


@dataclass(frozen=True)
class Models:
    """Two checkpoints of one tokenizer and shape, with different weights."""

    a: Path
    b: Path


def make_models(python: Path, directory: Path) -> Models:
    """Makes ``a`` (seed 1) and ``b`` (seed 2) under ``directory`` with the venv's Python."""
    corpus = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    a, b = directory / "model-a", directory / "model-b"
    argv = [str(python), str(REPO / "tests" / "sglang_cpu" / "make_model.py"), f"{a}:1", f"{b}:2"]
    for path in corpus:
        argv += ["--corpus", str(path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, **ENGINE_ENV})
    assert done.returncode == 0, f"make_model.py failed:\n{done.stderr[-3000:]}"
    return Models(a=a, b=b)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request(
    method: str, url: str, body: Any = None, timeout: float = 60.0, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """One HTTP call; the status and the parsed JSON body (or its text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    for key, value in (headers or {}).items():
        req.add_header(key, value)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


@dataclass
class SglangServer:
    """One ``python -m sglang.launch_server`` started by a test, in a process group of its own."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        """Asks the main process to stop (SIGINT: SGLang's server stops its own children), then
        makes sure nothing of the group is left."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def scheduler_pid(self) -> int:
        """The pid of the engine's scheduler subprocess (``sglang::scheduler``)."""
        for child in children(self.process.pid):
            if process_name(child).startswith("sglang::scheduler"):
                return child
        raise AssertionError(f"no sglang::scheduler under {self.process.pid}")


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def start_sglang(python: Path, model: Path, log: Path, *extra: str) -> SglangServer:
    """Starts SGLang on a free loopback port and waits until ``/health`` answers 200."""
    port = free_port()
    argv = [str(python), "-m", "sglang.launch_server", "--model-path", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), *ENGINE_FLAGS, *extra]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENGINE_ENV},
            start_new_session=True,
        )
    server = SglangServer(process=process, url=f"http://127.0.0.1:{port}", log=log)

    def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"SGLang exited with {process.returncode}:\n{file_tail(log)}")
        try:
            return request("GET", f"{server.url}/health", timeout=5)[0] == 200
        except OSError:
            return False

    try:
        wait_until(healthy, STARTUP_TIMEOUT, lambda: f"SGLang healthy at {server.url}\n{file_tail(log)}", interval=0.5)
    except BaseException:
        server.stop()
        raise
    return server


def wait_gone(pids: list[int], timeout: float) -> float:
    """Waits until none of ``pids`` runs (zombies count as gone); the seconds it took."""
    start = time.monotonic()

    def gone() -> bool:
        return not any(alive(p) for p in pids)

    wait_until(gone, timeout, lambda: f"processes {[p for p in pids if alive(p)]} to exit", interval=0.05)
    return time.monotonic() - start


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def greedy(max_new_tokens: int) -> dict[str, Any]:
    """Sampling parameters of a greedy answer of exactly ``max_new_tokens`` tokens."""
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}


class Call:
    """One ``/generate`` (or other POST) running in a thread: a stream's events as they come,
    or a whole answer, and the answer's headers."""

    def __init__(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 300.0):
        self.url, self.body, self.headers_sent, self.timeout = url, body, headers or {}, timeout
        self.events: list[dict[str, Any]] = []
        self.first = threading.Event()
        self.done = threading.Event()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.answer: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        data = json.dumps(self.body).encode()
        req = urllib.request.Request(self.url, data=data, method="POST", headers={"Content-Type": "application/json"})
        for key, value in self.headers_sent.items():
            req.add_header(key, value)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                self.status, self.headers = resp.status, {k.lower(): v for k, v in resp.headers.items()}
                if self.body.get("stream"):
                    for line in resp:
                        text = line.decode().strip()
                        if text.startswith("data:") and text[5:].strip() != "[DONE]":
                            self.events.append(json.loads(text[5:]))
                            self.first.set()
                    self.answer = self.events[-1] if self.events else None
                else:
                    self.answer = json.loads(resp.read())
        except urllib.error.HTTPError as err:
            self.status, self.answer = err.code, err.read().decode(errors="replace")
        except BaseException as err:  # kept for the test to report
            self.error = err
        finally:
            self.first.set()
            self.done.set()

    def result(self, timeout: float = 300.0) -> dict[str, Any]:
        """The whole answer (a stream's last event); fails on an error or a non-200 status."""
        assert self.done.wait(timeout), f"no answer from {self.url} within {timeout} s"
        assert self.error is None, f"{self.url}: {self.error!r}"
        assert self.status == 200 and isinstance(self.answer, dict), (self.status, self.answer)
        return self.answer


def generate(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """One whole ``/generate`` answer from ``url`` (a router or an engine)."""
    status, answer = request("POST", f"{url}/generate", body, timeout=timeout)
    assert status == 200 and isinstance(answer, dict), (status, answer)
    return answer


class Rank0:
    """A trainer's rank 0 over gloo (``tests/sglang_cpu/gloo_rank0.py`` in the SGLang venv),
    driven one JSON command at a time."""

    def __init__(self, python: Path) -> None:
        script = REPO / "tests" / "sglang_cpu" / "gloo_rank0.py"
        self.process = subprocess.Popen(
            [str(python), str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **ENGINE_ENV},
        )
        self.answers: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.answers.put(line)

    def call(self, command: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        try:
            answer: dict[str, Any] = json.loads(self.answers.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"rank 0 did not answer {sorted(command)} within {timeout} s") from None
        assert "error" not in answer, answer
        return answer

    def tensors(self, checkpoint: Path) -> list[tuple[str, str, tuple[int, ...]]]:
        """The checkpoint's tensors as ``(name, dtype, shape)``."""
        found = self.call({"tensors": {"checkpoint": str(checkpoint)}})["tensors"]
        return [(name, dtype, tuple(shape)) for name, dtype, shape in found]

    def join(self, master_address: str, master_port: int, world_size: int, group_name: str) -> None:
        layout = {"master_address": master_address, "master_port": master_port, "world_size": world_size,
                  "group_name": group_name}  # fmt: skip
        self.call({"join": layout})

    def send(self, checkpoint: Path, names: list[str]) -> None:
        self.call({"send": {"checkpoint": str(checkpoint), "names": names}})

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
