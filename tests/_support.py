"""Helpers shared by the black-box tests: waiting, process checks, raw HTTP, a manager handle."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from elastic_rollout import Engine, EnginesView, RolloutClient
from elastic_rollout._find import ENV_OVERRIDES

T = TypeVar("T")

#: How the default fleet is started: 4 logical GPUs, 2 initial engines of 1 GPU each, fast sim.
DEFAULT_ARGS: tuple[str, ...] = (
    "--gpus",
    "4",
    "--rollout-num-gpus",
    "2",
    "--rollout-num-gpus-per-engine",
    "1",
    "--engine-arg=--time-scale=0.01",
)
INITIAL_ENGINES = 2
STARTUP_TIMEOUT = 60.0
LISTEN_TIMEOUT = 20.0
SHUTDOWN_TIMEOUT = 30.0

LISTENING_RE = re.compile(
    r"^rollout-manager listening control=(?P<control>http://\S+) router=(?P<router>http://\S+)\s*$"
)


def freshest_build(found: Path) -> Path:
    """Prefer target/debug over target/release when the debug build is newer."""
    if os.environ.get(ENV_OVERRIDES.get(found.name, "")) or found.parent.name != "release":
        return found
    debug = found.parent.parent / "debug" / found.name
    if debug.is_file() and os.access(debug, os.X_OK) and debug.stat().st_mtime > found.stat().st_mtime:
        return debug
    return found


def wait_until(
    condition: Callable[[], T | None],
    timeout: float,
    what: str | Callable[[], str],
    interval: float = 0.05,
) -> T:
    """Poll ``condition`` until it returns something truthy and return that value.

    Fails the test with ``what`` (a string, or a callable producing one at failure time) and
    the last value seen if ``timeout`` seconds pass first. Exceptions from ``condition``
    propagate: a condition that may raise should catch what it expects.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            description = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:g}s waiting for {description}; last value: {value!r}")
        time.sleep(interval)


# -- processes -----------------------------------------------------------------------------


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw[raw.rindex(")") + 2 :].split()


@dataclass(frozen=True)
class ProcessIdentity:
    """A pid plus its start time, so a recycled pid is never mistaken for the original."""

    pid: int
    start_ticks: str

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        fields = _proc_stat(pid)
        return None if fields is None else cls(pid, fields[19])

    def alive(self) -> bool:
        """True while the process exists and is not a zombie."""
        fields = _proc_stat(self.pid)
        return fields is not None and fields[0] != "Z" and fields[19] == self.start_ticks


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (read from /proc)."""
    kids: list[int] = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _proc_stat(int(entry.name))
            if fields is not None and fields[1] == str(pid):
                kids.append(int(entry.name))
    return kids


# -- raw HTTP ------------------------------------------------------------------------------


@dataclass
class HttpResult:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http(
    method: str,
    url: str,
    body: Any = None,
    *,
    raw_body: bytes | None = None,
    content_type: str = "application/json",
    timeout: float = 30.0,
    headers: dict[str, str] | None = None,
) -> HttpResult:
    """One HTTP request that returns error statuses instead of raising."""
    data = raw_body if raw_body is not None else (None if body is None else json.dumps(body).encode())
    headers = {**({"Content-Type": content_type} if data is not None else {}), **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return HttpResult(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
    except urllib.error.HTTPError as err:
        try:
            payload = err.read()
        finally:
            err.close()
        return HttpResult(err.code, {k.lower(): v for k, v in err.headers.items()}, payload)


def health_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether ``GET {url}/health`` answers 200 (False while nothing listens there yet)."""
    try:
        return http("GET", f"{url}/health", timeout=timeout).status == 200
    except OSError:
        return False


def sse_events(url: str, body: Any, timeout: float = 30.0) -> Iterator[str]:
    """POST ``body`` and yield the ``data:`` payloads of the server-sent-event answer."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        content_type = resp.headers.get("Content-Type", "")
        assert content_type.startswith("text/event-stream"), f"stream content type: {content_type!r}"
        for line in resp:
            text = line.decode().rstrip("\r\n")
            if text.startswith("data:"):
                yield text[len("data:") :].strip()


def metric_total(metrics_text: str, name: str) -> float:
    """Sum of every sample of the Prometheus metric ``name`` (all label sets)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def file_tail(path: Path, chars: int = 4000) -> str:
    """The last ``chars`` characters of a log file, without terminal colour codes."""
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        return f"<cannot read {path}: {err}>"
    return ANSI_ESCAPE.sub("", text)[-chars:] or "<empty>"


# -- the manager ---------------------------------------------------------------------------


@dataclass
class ManagerHandle:
    """A running ``rollout-manager serve`` started by the tests."""

    process: subprocess.Popen[bytes]
    control_url: str
    router_url: str
    client: RolloutClient
    state_dir: Path
    stdout_path: Path
    stderr_path: Path
    #: every engine process seen during the test; teardown checks that none survives.
    engine_processes: dict[int, ProcessIdentity] = field(default_factory=dict)
    #: ``--trainer-port``, when the test gave one.
    trainer_port: int | None = None

    def stderr_tail(self, chars: int = 4000) -> str:
        return file_tail(self.stderr_path, chars)

    def engines(self) -> EnginesView:
        """The engine list, recording every pid in it for the teardown check."""
        view = self.client.engines()
        for engine in view.engines:
            self.track(engine)
        return view

    def track(self, engine: Engine) -> None:
        if engine.pid is not None and engine.pid not in self.engine_processes:
            identity = ProcessIdentity.of(engine.pid)
            if identity is not None:
                self.engine_processes[engine.pid] = identity

    def track_children(self) -> None:
        """Record the manager's direct children too, in case an engine was never listed."""
        for pid in children_of(self.process.pid):
            identity = ProcessIdentity.of(pid)
            if identity is not None:
                self.engine_processes.setdefault(pid, identity)

    def wait_engines(
        self, count: int, status: str = "ACTIVE", timeout: float = 60.0, *, fail_on_failed: bool = False
    ) -> EnginesView:
        """Wait until exactly ``count`` engines have ``status``.

        With ``fail_on_failed`` an engine in FAILED ends the wait at once (used at startup,
        where no engine may fail). The failure message shows every engine's status, the log
        tail of each engine that is not in ``status``, and the manager's stderr tail.
        """
        last: list[EnginesView] = []

        def reached() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"manager exited with {self.process.returncode} while waiting for {count} engine(s)"
                    f" {status}\nmanager stderr tail:\n{self.stderr_tail()}"
                )
            view = self.engines()
            last[:] = [view]
            if fail_on_failed and view.with_status("FAILED"):
                raise AssertionError(
                    f"an engine FAILED while waiting for {count} {status}; {self.describe(last, status)}"
                )
            return len(view.with_status(status)) == count

        wait_until(reached, timeout, lambda: f"{count} engine(s) {status}; {self.describe(last, status)}", interval=0.1)
        return last[0]

    def describe(self, last: list[EnginesView], status: str) -> str:
        """Engines, log tails of those not in ``status``, and the manager's stderr (for failures)."""
        if not last:
            return f"no engine list was read\nmanager stderr tail:\n{self.stderr_tail()}"
        parts = ["engines: " + (", ".join(f"{e.engine_id}={e.status}" for e in last[0].engines) or "none")]
        for engine in last[0].engines:
            if engine.status != status and engine.log_path:
                tail = file_tail(Path(engine.log_path), 1500)
                parts.append(f"{engine.engine_id} log ({engine.log_path}):\n{tail}")
        parts.append(f"manager stderr tail:\n{self.stderr_tail()}")
        return "\n".join(parts)

    def surviving_engines(self) -> list[int]:
        return [pid for pid, identity in self.engine_processes.items() if identity.alive()]

    def signal(self, signum: signal.Signals) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def kill_leftovers(self) -> None:
        """Last resort so a failing test leaks no processes: SIGKILL the engines we recorded."""
        for pid, identity in self.engine_processes.items():
            if identity.alive():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


#: ``start_fleet(*extra_args, wait=True)`` (the conftest fixture's factory).
StartManager = Callable[..., ManagerHandle]


def start_manager(
    binary: Path,
    state_dir: Path,
    extra_args: tuple[str, ...] = (),
    *,
    base_args: tuple[str, ...] = DEFAULT_ARGS,
    env: dict[str, str] | None = None,
) -> ManagerHandle:
    """Start ``rollout-manager serve`` on loopback with free ports and parse its listening line.

    ``base_args`` replace the simulated fleet's defaults (:data:`DEFAULT_ARGS`), e.g. for real
    engines; ``env`` is added to the manager's environment (its engines inherit it). Does not
    wait for engines. On failure the manager is killed and its stderr is quoted.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    stdout_path, stderr_path = state_dir / "manager.stdout", state_dir / "manager.stderr"
    argv = [
        str(binary), "serve",
        "--host", "127.0.0.1", "--port", "0", "--router-port", "0",
        "--state-dir", str(state_dir),
        *base_args, *extra_args,
    ]  # fmt: skip
    # stderr is appended: a manager restarted on the same state dir keeps its predecessor's log
    # (stdout is read for the listening line, so it starts empty).
    with open(stdout_path, "wb") as out, open(stderr_path, "ab") as err:
        full_env = {**os.environ, "NO_COLOR": "1", **(env or {})}
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=full_env)

    def listening() -> tuple[str, str] | None:
        for line in stdout_path.read_text(errors="replace").splitlines():
            match = LISTENING_RE.match(line)
            if match:
                return match["control"], match["router"]
        if process.poll() is not None:
            raise AssertionError(
                f"manager exited with {process.returncode} before listening; argv: {argv}\n"
                f"stderr tail:\n{file_tail(stderr_path)}"
            )
        return None

    try:
        control, router = wait_until(
            listening,
            LISTEN_TIMEOUT,
            lambda: (
                "the manager's 'rollout-manager listening control=... router=...' line"
                f"\nstdout:\n{file_tail(stdout_path, 2000)}"
                f"\nstderr tail:\n{file_tail(stderr_path)}"
            ),
        )
    except BaseException:
        process.kill()
        process.wait()
        raise
    return ManagerHandle(
        process=process,
        control_url=control,
        router_url=router,
        client=RolloutClient(control, timeout=10.0),
        state_dir=state_dir,
        stdout_path=stdout_path,
        stderr_path=stderr_path,
    )


def stop_manager(handle: ManagerHandle, *, check: bool = True) -> None:
    """SIGTERM the manager, wait for it, and check that no engine process survived it."""
    try:
        if handle.process.poll() is None:
            handle.track_children()
            handle.signal(signal.SIGTERM)
            try:
                handle.process.wait(timeout=SHUTDOWN_TIMEOUT)
            except subprocess.TimeoutExpired:
                handle.process.kill()
                handle.process.wait()
                if check:
                    raise AssertionError(
                        f"manager ignored SIGTERM for {SHUTDOWN_TIMEOUT}s\nstderr tail:\n{handle.stderr_tail()}"
                    ) from None
        if check:
            wait_until(
                lambda: not handle.surviving_engines(),
                10.0,
                lambda: (
                    f"engine processes to exit after the manager stopped; alive: {handle.surviving_engines()}"
                    f"\nstderr tail:\n{handle.stderr_tail()}"
                ),
            )
    finally:
        handle.kill_leftovers()


def load_example(relative: str) -> Any:
    """Loads an example adapter (``examples/...py``) as a module, as a framework would import it
    from its own path; the examples are not a package."""
    path = Path(__file__).resolve().parent.parent / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
