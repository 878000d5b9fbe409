"""A supervised child process: ``rollout-manager serve`` (or ``agent``), usable with or without Ray.

Flow: :meth:`SupervisedProcess.start` spawns the argv list (never a shell string) in its own
process group, with ``ROLLOUT_MANAGER_PARENT_PID`` set to this process's pid: the binary then sets
its own parent-death signal (``--parent-pid``) and never outlives the process that started it
(nothing runs in the child between fork and exec). Stdout is read line by line (the manager prints
``rollout-manager listening control=... router=...``), stderr appended to a log file. Readiness is
a caller-given probe polled until a deadline; if the child exits first or the deadline passes, the
error carries the tail of its stderr. With ``restart=True`` a watcher thread restarts the child
when it exits unexpectedly (backoff 0.5 s doubling to 10 s), with the same argv, so a manager comes
back on the same ``--state-dir`` and re-adopts its engines. :meth:`stop` sends SIGTERM to the
process group, then SIGKILL after the grace period, and reaps the child.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["LISTENING_RE", "PARENT_PID_ENV", "ProcessStartError", "SupervisedProcess", "stderr_tail"]

LISTENING_RE = re.compile(r"^rollout-manager listening control=(?P<control>http://\S+) router=(?P<router>http://\S+)")


class ProcessStartError(RuntimeError):
    """The child did not become ready; the message has its exit status and stderr tail."""


def stderr_tail(path: Path, chars: int = 4000) -> str:
    """The last ``chars`` characters of a log file (or a note that it is empty/unreadable)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars))
            text = f.read().decode(errors="replace")
    except OSError as err:
        return f"<cannot read {path}: {err}>"
    return re.sub(r"\x1b\[[0-9;]*m", "", text).strip() or "<empty>"


#: The binary's ``--parent-pid`` from the environment (rust/rollout-manager/src/main.rs).
PARENT_PID_ENV = "ROLLOUT_MANAGER_PARENT_PID"


class SupervisedProcess:
    """One child process with readiness, stderr tail, restart on crash and clean stop."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: Path,
        ready: Callable[[SupervisedProcess], bool] | None = None,
        ready_timeout: float = 60.0,
        restart: bool = False,
        env: dict[str, str] | None = None,
        restart_argv: Callable[[SupervisedProcess], Sequence[str]] | None = None,
        name: str = "process",
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        self.name = name
        self._ready = ready
        self._ready_timeout = ready_timeout
        self._restart = restart
        self._restart_argv = restart_argv
        self._env = env
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._watcher: threading.Thread | None = None
        self.restarts = 0
        self.last_exit: int | None = None
        self.last_error: str | None = None
        #: the latest ``rollout-manager listening`` line's URLs: {"control": ..., "router": ...}
        self.listening: dict[str, str] = {}
        self._listening_event = threading.Event()

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None else None

    def running(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None

    def start(self) -> None:
        """Spawn the child and wait until it is ready (or raise :class:`ProcessStartError`)."""
        self._spawn(self.argv)
        self._wait_ready()
        if self._restart and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name=f"{self.name}-watch", daemon=True)
            self._watcher.start()

    def _spawn(self, argv: Sequence[str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._listening_event.clear()
        with self.log_path.open("ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting {self.name}\n".encode())
            log.flush()
            env = dict(os.environ if self._env is None else self._env)
            env[PARENT_PID_ENV] = str(os.getpid())
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        self._proc = proc
        threading.Thread(target=self._read_stdout, args=(proc,), name=f"{self.name}-stdout", daemon=True).start()

    def _read_stdout(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with self.log_path.open("ab") as log:
            for raw in proc.stdout:
                log.write(raw)
                log.flush()
                match = LISTENING_RE.match(raw.decode(errors="replace"))
                if match and proc is self._proc:
                    self.listening = {"control": match["control"], "router": match["router"]}
                    self._listening_event.set()

    def _wait_ready(self) -> None:
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + self._ready_timeout
        while True:
            code = proc.poll()
            if code is not None:
                self.last_exit = code
                raise ProcessStartError(
                    f"{self.name} exited with status {code} before it was ready: {' '.join(self.argv[:2])} ...\n"
                    f"stderr tail ({self.log_path}):\n{stderr_tail(self.log_path)}"
                )
            try:
                ok = self._ready(self) if self._ready is not None else True
            except Exception:  # the probe's failure just means "not yet"
                ok = False
            if ok:
                return
            if time.monotonic() >= deadline:
                self._terminate(proc, grace=5.0)
                raise ProcessStartError(
                    f"{self.name} was not ready within {self._ready_timeout:g}s (stopped it).\n"
                    f"stderr tail ({self.log_path}):\n{stderr_tail(self.log_path)}"
                )
            time.sleep(0.1)

    def wait_listening(self, timeout: float) -> dict[str, str]:
        """The URLs of the manager's ``listening`` line, waiting up to ``timeout`` seconds."""
        self._listening_event.wait(timeout)
        return dict(self.listening)

    def _watch(self) -> None:
        backoff = 0.5
        while not self._stopping.is_set():
            proc = self._proc
            if proc is None:
                return
            code = proc.wait()
            if self._stopping.is_set():
                return
            self.last_exit = code
            self.last_error = f"{self.name} (pid {proc.pid}) exited with status {code}; restarting it"
            with self.log_path.open("ab") as log:
                log.write(f"--- {self.last_error}\n".encode())
            while not self._stopping.is_set():
                if self._stopping.wait(backoff):
                    return
                backoff = min(backoff * 2, 10.0)
                with self._lock:
                    if self._stopping.is_set():
                        return
                    argv = list(self._restart_argv(self)) if self._restart_argv is not None else self.argv
                    try:
                        self._spawn(argv)
                        self._wait_ready()
                    except (OSError, ProcessStartError) as err:
                        self.last_error = str(err)
                        continue
                self.restarts += 1
                backoff = 0.5
                break

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL after ``grace`` seconds; returns the exit status."""
        self._stopping.set()
        with self._lock:
            proc = self._proc
            if proc is None:
                return None
            code = self._terminate(proc, grace)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)
        return code

    @staticmethod
    def _terminate(proc: subprocess.Popen[bytes], grace: float) -> int:
        code = proc.poll()
        if code is not None:
            return code
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return proc.wait()
