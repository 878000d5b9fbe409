"""The `rollout-relay` binary end to end: receiver processes on loopback, the CLI sender, and
engines (real sim engines started by the manager) loading what the relay delivered, with the
checksum they report matching the sender's manifest."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _support import ManagerHandle, http

REPO = Path(__file__).resolve().parent.parent


def relay_binary() -> Path:
    """The newest build of rollout-relay in this checkout."""
    builds = [p for p in (REPO / "target" / d / "rollout-relay" for d in ("debug", "release")) if p.is_file()]
    if not builds:
        pytest.fail("rollout-relay is not built: run `cargo build --workspace --bins`")
    return max(builds, key=lambda p: p.stat().st_mtime)


def write_safetensors(path: Path, n: int, seed: int) -> bytes:
    """A valid safetensors file with one U8 tensor of ``n`` pseudo-random bytes."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    data = hashlib.shake_256(str(seed).encode()).digest(n)
    blob = struct.pack("<Q", len(header)) + header + data
    path.write_bytes(blob)
    return blob


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, str]:
    """A two-shard checkpoint and its version checksum (SHA-256 of the shards' sha256sum listing)."""
    src = tmp_path / "ckpt"
    src.mkdir()
    a = write_safetensors(src / "model-00001-of-00002.safetensors", 700_000, 1)
    b = write_safetensors(src / "model-00002-of-00002.safetensors", 300_001, 2)
    (src / "config.json").write_text('{"model_type": "llama"}')
    listing = "".join(
        f"{hashlib.sha256(blob).hexdigest()}  {name}\n"
        for name, blob in (("model-00001-of-00002.safetensors", a), ("model-00002-of-00002.safetensors", b))
    )
    return src, hashlib.sha256(listing.encode()).hexdigest()


class RelayReceiver:
    def __init__(self, dest: Path, *extra: str) -> None:
        self.dest = dest
        self.stderr_path = dest.parent / f"{dest.name}.stderr"
        self.proc = subprocess.Popen(
            [str(relay_binary()), "recv", "--listen", "127.0.0.1:0", "--dest", str(dest), *extra],
            stdout=subprocess.PIPE,
            stderr=self.stderr_path.open("wb"),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        assert line.startswith("listening on "), f"receiver said {line!r}; stderr: {self.stderr_path.read_text()}"
        self.addr = line.split()[-1]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=20)


@pytest.fixture
def receivers(tmp_path: Path) -> Iterator[list[RelayReceiver]]:
    started = [RelayReceiver(tmp_path / f"dest{i}") for i in range(3)]
    yield started
    for r in started:
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait(timeout=20)


def run_send(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(relay_binary()), "send", *args], capture_output=True, text=True, timeout=120)


def test_a_relayed_version_is_what_the_engines_load(
    checkpoint: tuple[Path, str], receivers: list[RelayReceiver], fleet: ManagerHandle
) -> None:
    src, checksum = checkpoint
    done = run_send(
        "--version", "v1", "--source", str(src), "--to", ",".join(r.addr for r in receivers), "--chunk-mib", "1"
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["checksum"] == checksum
    assert [r["ok"] for r in report["receivers"]] == [True, True, True]
    assert [r["addr"] for r in report["receivers"]] == [r.addr for r in receivers]
    for r in receivers:
        assert sorted(os.listdir(r.dest)) == ["v1"]
        for f in src.iterdir():
            assert (r.dest / "v1" / f.name).read_bytes() == f.read_bytes()

    # Each engine loads its node-local copy; the checksum it reports is the manifest's.
    engines = fleet.engines().with_status("ACTIVE")
    for engine, r in zip(engines, receivers, strict=False):  # more receivers than engines
        out = http(
            "POST", engine.url + "/update_weights_from_disk", {"model_path": str(r.dest / "v1"), "weight_version": "v1"}
        )
        assert out.status == 200, out.body
        info = http("GET", engine.url + "/model_info").json()
        assert (info["weights_checksum"], info["weight_version"]) == (checksum, "v1")

    # Sending it again finds it present everywhere.
    again = json.loads(run_send("--version", "v1", "--source", str(src), "--to", receivers[0].addr).stdout)
    assert again["receivers"][0]["already_present"] is True
    for r in receivers:
        assert r.stop() == 0


def test_an_unreachable_receiver_fails_the_send_but_not_the_others(
    checkpoint: tuple[Path, str], receivers: list[RelayReceiver]
) -> None:
    src, _ = checkpoint
    dead = receivers[1]
    assert dead.stop() == 0
    done = run_send(
        "--version", "v2", "--source", str(src), "--to", ",".join(r.addr for r in receivers), "--attempts", "2"
    )
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    oks = [r["ok"] for r in report["receivers"]]
    assert oks == [True, False, True]
    failed = report["receivers"][1]
    assert failed["attempts"] == 2 and "unreachable" in failed["error"]
    assert (receivers[2].dest / "v2").is_dir(), "the hop behind the dead one was reached by skipping it"


def test_stale_partials_are_removed_and_sigterm_exits_cleanly(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    (dest / "v9.partial").mkdir(parents=True)
    (dest / "v9.partial" / "half.safetensors").write_bytes(b"x" * 10)
    r = RelayReceiver(dest)
    try:
        assert not (dest / "v9.partial").exists()
    finally:
        assert r.stop() == 0


def test_cli_errors_name_the_flag(tmp_path: Path, checkpoint: tuple[Path, str]) -> None:
    src, _ = checkpoint
    bad_chunk = run_send("--version", "v1", "--source", str(src), "--to", "127.0.0.1:9", "--chunk-mib", "0")
    assert bad_chunk.returncode == 2 and "--chunk-mib" in bad_chunk.stderr
    bad_to = run_send("--version", "v1", "--source", str(src), "--to", "not-an-address")
    assert bad_to.returncode == 2 and "--to" in bad_to.stderr
    bad_token = run_send(
        "--version", "v1", "--source", str(src), "--to", "127.0.0.1:9", "--token-file", str(tmp_path / "missing")
    )
    assert bad_token.returncode == 2 and "--token-file" in bad_token.stderr
    bad_version = run_send("--version", "../v1", "--source", str(src), "--to", "127.0.0.1:9")
    assert bad_version.returncode == 2 and "--version" in bad_version.stderr and "escape" in bad_version.stderr
    listen = subprocess.run(
        [str(relay_binary()), "recv", "--listen", "256.0.0.1:1", "--dest", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert listen.returncode == 2 and "--listen" in listen.stderr


def test_a_receiver_with_a_token_refuses_senders_without_it(tmp_path: Path, checkpoint: tuple[Path, str]) -> None:
    src, _ = checkpoint
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    r = RelayReceiver(tmp_path / "dest", "--token-file", str(token))
    try:
        refused = run_send("--version", "v1", "--source", str(src), "--to", r.addr, "--attempts", "1")
        assert refused.returncode == 1
        assert "unauthorized" in json.loads(refused.stdout)["receivers"][0]["error"]
        ok = run_send("--version", "v1", "--source", str(src), "--to", r.addr, "--token-file", str(token))
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "s3cret" not in ok.stdout + ok.stderr + r.stderr_path.read_text(), "the token is never logged"
    finally:
        assert r.stop() == 0


def test_the_chain_crosses_rate_limited_links_between_network_namespaces(tmp_path: Path) -> None:
    """Sender and two receivers each in their own network namespace, on a bridge, every link
    limited with tc (as `benches/weights_relay.py --netns` measures it): the version arrives
    byte-identical at both. Skipped where namespaces cannot be made (not root, no iproute2, no
    veth/bridge/tbf in the kernel, a container that forbids it)."""
    import _netns

    try:
        _netns.check_available()
        _netns.remove_stale()
        net = _netns.Net(3, mbps=2000)
    except (_netns.Unavailable, OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"network namespaces unavailable: {e}")
    src = tmp_path / "ckpt"
    src.mkdir()
    write_safetensors(src / "model-00001-of-00002.safetensors", 3 << 20, 11)
    write_safetensors(src / "model-00002-of-00002.safetensors", (1 << 20) + 7, 12)
    (src / "config.json").write_text('{"model_type": "llama"}')
    procs: list[subprocess.Popen[bytes]] = []
    try:
        addrs = []
        for i in (1, 2):
            argv = [str(relay_binary()), "recv", "--listen", f"{net.ips[i]}:0", "--dest", str(tmp_path / f"dest{i}")]
            p = subprocess.Popen(net.exec_argv(i, argv), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            procs.append(p)
            assert p.stdout is not None
            line = p.stdout.readline().decode()
            assert line.startswith(f"listening on {net.ips[i]}:"), line
            addrs.append(line.split()[-1])
        send = [str(relay_binary()), "send", "--version", "v1", "--source", str(src), "--to", ",".join(addrs)]
        done = subprocess.run(
            net.exec_argv(0, [*send, "--chunk-mib", "1"]), capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads(done.stdout)
        assert [r["ok"] for r in report["receivers"]] == [True, True]
        for i in (1, 2):
            got = tmp_path / f"dest{i}" / "v1"
            assert {f.name for f in src.iterdir()} <= set(os.listdir(got))  # and the receiver's manifest
            for f in src.iterdir():
                assert (got / f.name).read_bytes() == f.read_bytes()
        for p in procs:
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=20) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=20)
        net.close()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert not any(ns in left.split() for ns in [net.switch, *net.nodes]), left
