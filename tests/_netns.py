"""Simulated nodes on one machine: one network namespace per node, every node wired to a bridge
in a "switch" namespace by its own veth pair, and each pair rate-limited with `tc tbf` in both
directions, so that every node has a full-duplex NIC of a chosen rate.

    node0 (10.231.K.1) eth0 ==veth== p0 \
    node1 (10.231.K.2) eth0 ==veth== p1 -- br0   (namespace "switch")
    ...                                 /
    tbf on eth0 (the node's uplink)  +  tbf on pI (the node's downlink)

A star through one switch, not point-to-point pairs: any node can reach any other (the relay's
chain picks its own order, the plain copy goes node0 -> node1), and every byte a node sends or
receives crosses exactly its own two limited directions, as on a real top-of-rack switch whose
fabric is not the bound.

Every namespace is named ``errelay<pid>x<k>-...`` (pid of the creating process, k a counter), so
that :func:`remove_stale` can delete what a crashed run left behind (its pid no longer lives)
without touching a concurrent run's. The veth ends are created directly inside their
namespaces; deleting a namespace deletes its ends, so nothing is ever left in the root one.

Used by ``benches/weights_relay.py --netns`` and ``tests/test_relay.py``. Needs root (or
CAP_NET_ADMIN + CAP_SYS_ADMIN), iproute2's ``ip`` and ``tc``, and the kernel's veth, bridge and
tbf support; :class:`Unavailable` says what was missing.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence

PREFIX = "errelay"
_STALE = re.compile(rf"^{PREFIX}(\d+)x\d+-")
_counter = itertools.count()


class Unavailable(RuntimeError):
    """Namespaces, veth pairs, the bridge or tbf cannot be set up here; the message says why."""


def _run(argv: Sequence[str]) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, list(argv), done.stdout, done.stderr)
    return done.stdout


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_and_delete(ns: str) -> None:
    """Kill what still runs in `ns` (only processes this module's users started there), then
    delete it; its veth ends go with it."""
    try:
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns]).split()]
    except (subprocess.CalledProcessError, ValueError):
        pids = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def remove_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose creating process is gone; return their names."""
    removed = []
    for ns in _namespaces():
        m = _STALE.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # its creator still runs: a concurrent run's namespace
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _kill_and_delete(ns)
        removed.append(ns)
    return removed


def check_available() -> None:
    """Raise :class:`Unavailable` unless this process can plausibly build a :class:`Net`."""
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root (or CAP_NET_ADMIN and CAP_SYS_ADMIN)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise Unavailable(f"`{tool}` (iproute2) is not installed")


class Net:
    """``nodes`` namespaces on one bridge, each link limited to ``mbps`` megabits per second in
    each direction. Use as a context manager, or call :meth:`close` (idempotent) in a finally."""

    def __init__(self, nodes: int, mbps: float, burst_kib: int = 256, latency_ms: int = 50, nice: int = 0) -> None:
        check_available()
        #: Niceness of what :meth:`exec_argv` starts (negative: ahead of other work on the box,
        #: as if every node had its cores to itself).
        self.nice = nice
        if nodes < 1 or nodes > 250:
            raise ValueError("nodes must be between 1 and 250")
        self.mbps = mbps
        k = next(_counter)
        base = f"{PREFIX}{os.getpid()}x{k}"
        self.switch = f"{base}-sw"
        self.nodes = [f"{base}-n{i}" for i in range(nodes)]
        # One /24 per Net of this process; every namespace has its own routing table, so two
        # runs using the same addresses never see each other.
        self.ips = [f"10.231.{k % 250}.{i + 1}" for i in range(nodes)]
        self.burst_kib = burst_kib
        self.latency_ms = latency_ms
        self._made: list[str] = []
        try:
            self._build()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            self.close()
            detail = getattr(e, "stderr", "") or str(e)
            raise Unavailable(f"cannot set up namespaces: {' '.join(getattr(e, 'cmd', []) or [])}: {detail}") from e

    def _ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _limit(self, ns: str, dev: str) -> None:
        # tbf: a token bucket of `burst` bytes refilled at the rate; at least one 64 KiB GSO
        # packet must fit in the bucket, or tbf splits every packet (CPU) before sending it.
        _run(
            [
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{self.mbps}mbit",
                "burst",
                f"{self.burst_kib}kb",
                "latency",
                f"{self.latency_ms}ms",
            ]
        )

    def _build(self) -> None:
        self._ns(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for i, (ns, ip) in enumerate(zip(self.nodes, self.ips, strict=True)):
            self._ns(ns)
            port = f"p{i}"
            _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch])
            _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", self.switch, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            self._limit(ns, "eth0")  # the node's uplink
            self._limit(self.switch, port)  # the node's downlink

    def exec_argv(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``node``'s namespace (``ip netns exec`` execs it, and so does
        ``nice``: the child's pid is the program's own), at niceness :attr:`nice` when not 0."""
        niced = ["nice", "-n", str(self.nice)] if self.nice else []
        return ["ip", "netns", "exec", self.nodes[node], *niced, *argv]

    def qdisc_stats(self) -> dict[str, str]:
        """`tc -s qdisc` of every limited device, for the record (drops, overlimits)."""
        out = {}
        for i, ns in enumerate(self.nodes):
            out[f"n{i} up"] = _run(["tc", "-s", "-n", ns, "qdisc", "show", "dev", "eth0"]).strip()
            out[f"n{i} down"] = _run(["tc", "-s", "-n", self.switch, "qdisc", "show", "dev", f"p{i}"]).strip()
        return out

    def close(self) -> None:
        for ns in reversed(self._made):
            _kill_and_delete(ns)
        self._made.clear()

    def __enter__(self) -> Net:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
