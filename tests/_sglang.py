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
import signal
import socket
import subprocess
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
