"""Weights from the trainer, run by the manager: the documented trainer API
(``elastic_rollout.trainer.DistributedWeightSync``) with a stand-in rank 0 against real sim
engines the manager started.

After an update the manager says the trainer's version everywhere (registry, engines, metrics,
answers, pins); engines added by a scale-out or restarted after SIGKILL copy that version from
a running engine (SGLang's remote-instance loading) before they are routable, so no answer ever
comes from another version; an update during a scale-out and a scale-in during an update both
end correctly; an engine killed before the broadcast is caught up after it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from _support import STARTUP_TIMEOUT, ManagerHandle, ProcessIdentity, StartManager, http, load_example, wait_until
from _trainer import SPECS, StandInRank0, update_engines_directly
from test_weights_resume import ENGINES, engine_identities, free_port, start, stop_both

from elastic_rollout.models import Engine
from elastic_rollout.trainer import (
    DistributedWeightSync,
    FixedGroupSync,
    GroupLayout,
    TensorSpec,
    UpdateResult,
    WeightSyncError,
)


def make_sync(fleet: ManagerHandle, rank0: StandInRank0) -> DistributedWeightSync:
    return DistributedWeightSync(fleet.client, join_group=rank0.join_group, broadcast=rank0.broadcast, timeout=60)


def model_info(url: str) -> dict:
    return dict(http("GET", url + "/model_info").json())


def kill_and_wait_restarted(fleet: ManagerHandle, victim: Engine) -> None:
    """SIGKILLs the engine and waits until the manager has it ACTIVE again, restarted once more."""
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)

    def back() -> bool:
        e = fleet.engines().by_id(victim.engine_id)
        return e is not None and e.status == "ACTIVE" and e.restarts == victim.restarts + 1

    wait_until(back, STARTUP_TIMEOUT, f"{victim.engine_id} restarted")
    fleet.track_children()


def busy_sending(url: str) -> bool:
    """Whether this seed is sending its weights to a new instance now: it does so from inside its
    scheduler's event loop, which then answers no `/server_info` (SGLang 0.5.23
    managers/scheduler.py:6095-6100; sglang-sim does the same)."""
    try:
        http("GET", url + "/server_info", timeout=0.5)
    except OSError:  # timed out
        return True
    return False


def send_count(url: str) -> int:
    """How many times this engine sent its weights to a new instance (it was a seed)."""
    groups = http("GET", url + "/server_info").json()["weight_sync"]["weight_send_groups"]
    return sum(int(g["sends"]) for g in groups.values())


class Traffic:
    """Sends ``/generate`` requests to the router from one thread until stopped (at most
    ``limit`` of them) and counts the answers by the weight version that made them."""

    def __init__(self, router_url: str, limit: int = 2000) -> None:
        self.router_url = router_url
        self.limit = limit
        self.versions: Counter[str] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"text": "count the sheep", "sampling_params": {"max_new_tokens": 4}}
        for _ in range(self.limit):
            if self._stop.is_set():
                return
            resp = http("POST", self.router_url + "/generate", body, timeout=60)
            if resp.status == 200:
                self.versions[str(resp.json()["meta_info"]["weight_version"])] += 1
            else:
                self.errors.append(f"{resp.status}: {resp.body[:200]!r}")

    def answered(self) -> int:
        return sum(self.versions.values())

    @contextmanager
    def running(self) -> Iterator[Traffic]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(timeout=120)


#: SGLang releases the scenarios below run on: the oldest that RL frameworks pin and whose engines
#: can send weights to a new instance (AReaL's 0.5.10.post1), and the newest. On 0.5.2, which
#: cannot, a new engine waits for the trainer's next update instead (test_sglang_releases).
RELEASES = ["0.5.10.post1", "0.5.23"]


@pytest.fixture(params=RELEASES)
def release_fleet(request: pytest.FixtureRequest, start_fleet: StartManager) -> ManagerHandle:
    return start_fleet(f"--engine-arg=--sglang-api={request.param}")


def test_an_update_is_the_fleets_version_everywhere(fleet: ManagerHandle) -> None:
    rank0 = StandInRank0()
    sync = make_sync(fleet, rank0)
    result = sync.update("step-1", SPECS)
    assert result.rebuilt and result.update is not None
    assert result.update.status == "COMPLETED" and result.update.source == "trainer"
    assert {p.status for p in result.update.engines.values()} == {"VERIFIED"}
    assert rank0.broadcasts == [(result.layout.group_name, [s.name for s in SPECS])]

    weights = fleet.client.weights()
    assert (weights.version, weights.raw["source"]) == ("step-1", "trainer")
    assert weights.raw["history"][0]["source"] == "trainer"
    view = fleet.engines()
    assert {e.weight_version for e in view.engines} == {"step-1"}
    for e in view.engines:
        assert model_info(e.url)["weight_version"] == "step-1"
    metrics = http("GET", fleet.control_url + "/metrics").body.decode()
    for e in view.engines:
        assert f'rollout_engine_weight_version_info{{engine_id="{e.engine_id}",version="step-1"}} 1' in metrics
    assert 'rollout_weight_version_info{version="step-1"} 1' in metrics

    # A pin on the trainer's version is served at once; its answer says the version.
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "weight_version": {"min_version": "step-1"}}
    out = http("POST", fleet.router_url + "/generate", body)
    assert out.status == 200 and out.json()["meta_info"]["weight_version"] == "step-1"

    # The same engines: the group is kept, nobody joins again.
    again = sync.update("step-2", SPECS)
    assert not again.rebuilt and again.layout == result.layout and len(rank0.joined) == 1
    assert fleet.client.weights().version == "step-2"

    # A version name is never reused; a refused update changes nothing.
    refused = http(
        "POST",
        fleet.control_url + "/rollout/weights/trainer_updates",
        {
            "version": "step-1",
            "names": ["w"],
            "dtypes": ["bfloat16"],
            "shapes": [[2]],
            "master_address": "127.0.0.1",
            "master_port": 1,
        },
    )
    assert refused.status == 409 and refused.json()["error"]["code"] == "version_conflict"
    assert fleet.client.weights().version == "step-2"


def test_a_scale_out_and_a_sigkilled_engine_never_answer_on_another_version(release_fleet: ManagerHandle) -> None:
    fleet = release_fleet
    sync = make_sync(fleet, StandInRank0())
    sync.update("step-1", SPECS)
    seeds = fleet.engines().with_status("ACTIVE")

    with Traffic(fleet.router_url).running() as traffic:
        wait_until(lambda: traffic.answered() >= 5, 30, "answers before the scale-out")
        op = fleet.client.scale_out(num_replicas=4)
        assert fleet.client.wait_for_operation("scale_out", op.request_id, STARTUP_TIMEOUT).status == "ACTIVE"
        fleet.track_children()
        during_scale_out = traffic.answered()
        wait_until(lambda: traffic.answered() >= during_scale_out + 20, 30, "answers after the scale-out")

        # The new engines copied step-1 from the two running ones, one each.
        view = fleet.wait_engines(4)
        new = [e for e in view.engines if e.engine_id not in {s.engine_id for s in seeds}]
        assert len(new) == 2
        for e in new:
            info = model_info(e.url)
            assert info["weight_version"] == "step-1", info
        assert sorted(send_count(s.url) for s in seeds) == [1, 1]

        # SIGKILL one engine: it comes back on step-1, copied from a peer.
        victim = view.with_status("ACTIVE")[0]
        kill_and_wait_restarted(fleet, victim)
        after_kill = traffic.answered()
        wait_until(lambda: traffic.answered() >= after_kill + 20, 30, "answers after the restart")
        restarted = fleet.engines().by_id(victim.engine_id)
        assert restarted is not None and model_info(restarted.url)["weight_version"] == "step-1"

    assert traffic.answered() >= 45 and set(traffic.versions) == {"step-1"}, traffic.versions
    assert {e.weight_version for e in fleet.engines().engines} == {"step-1"}


def test_an_update_during_a_scale_out_reaches_every_engine(release_fleet: ManagerHandle) -> None:
    fleet = release_fleet
    sync = make_sync(fleet, StandInRank0())
    sync.update("step-1", SPECS)
    op = fleet.client.scale_out(num_replicas=4)
    # The update's members are the engines ACTIVE now; the scale-out's engines wait for it to
    # end, then copy step-2 from a member.
    result = sync.update("step-2", SPECS)
    assert result.update is not None and result.update.status == "COMPLETED"
    assert fleet.client.wait_for_operation("scale_out", op.request_id, STARTUP_TIMEOUT).status == "ACTIVE"
    fleet.track_children()
    view = fleet.wait_engines(4)
    assert {e.weight_version for e in view.engines} == {"step-2"}
    for e in view.engines:
        assert model_info(e.url)["weight_version"] == "step-2"
    assert fleet.client.weights().version == "step-2"


def test_a_scale_in_waits_for_the_update_its_engine_is_part_of(release_fleet: ManagerHandle) -> None:
    fleet = release_fleet
    op = fleet.client.scale_out(num_replicas=3)
    assert fleet.client.wait_for_operation("scale_out", op.request_id, STARTUP_TIMEOUT).status == "ACTIVE"
    fleet.track_children()
    dynamic = [e for e in fleet.engines().with_status("ACTIVE") if e.origin == "dynamic"]
    assert len(dynamic) == 1
    rank0 = StandInRank0()
    scale_ins: list[str] = []

    def join_while_scaling_in(layout: GroupLayout) -> None:
        assert dynamic[0].engine_id in {m.engine_id for m in layout.members}
        scale_ins.append(fleet.client.scale_in(num_replicas=2).request_id)

        def waiting() -> bool:
            record = fleet.client.operation("scale_in", scale_ins[0])
            return "waiting for trainer update" in str(record.raw.get("message"))

        wait_until(waiting, 30, "the scale-in to wait for the update")
        assert fleet.engines().by_id(dynamic[0].engine_id) is not None, "removed while the update runs"
        rank0.join_group(layout)

    sync = DistributedWeightSync(fleet.client, join_group=join_while_scaling_in, broadcast=rank0.broadcast, timeout=60)
    result = sync.update("step-1", SPECS)
    assert result.update is not None and result.update.status == "COMPLETED"
    assert result.update.engines[dynamic[0].engine_id].status == "VERIFIED", "the draining member took part"
    done = fleet.client.wait_for_operation("scale_in", scale_ins[0], STARTUP_TIMEOUT)
    assert done.status == "COMPLETED"
    view = fleet.wait_engines(2)
    assert {e.weight_version for e in view.engines} == {"step-1"}


def test_an_engine_killed_before_the_broadcast_is_caught_up(release_fleet: ManagerHandle) -> None:
    fleet = release_fleet
    rank0 = StandInRank0()
    sync = make_sync(fleet, rank0)
    sync.update("step-1", SPECS)
    victim = fleet.engines().with_status("ACTIVE")[1]
    assert victim.pid is not None

    def kill_then_broadcast(layout: GroupLayout, specs: Sequence[TensorSpec]) -> None:
        os.kill(victim.pid or 0, signal.SIGKILL)
        rank0.gone.add(victim.engine_id)
        wait_until(lambda: fleet.engines().by_id(victim.engine_id).status != "ACTIVE", 30, "the kill to be seen")
        rank0.broadcast(layout, specs)

    sync.broadcast = kill_then_broadcast
    result = sync.update("step-2", SPECS)
    assert result.update is not None and result.update.status == "COMPLETED"
    assert result.update.engines[victim.engine_id].status in ("SKIPPED", "FAILED")

    def caught_up() -> bool:
        e = fleet.engines().by_id(victim.engine_id)
        return e is not None and e.status == "ACTIVE" and e.weight_version == "step-2"

    wait_until(caught_up, STARTUP_TIMEOUT, f"{victim.engine_id} back on step-2")
    fleet.track_children()
    e = fleet.engines().by_id(victim.engine_id)
    assert e is not None and e.restarts == victim.restarts + 1
    assert model_info(e.url)["weight_version"] == "step-2"
    assert fleet.client.weights().version == "step-2"


def test_an_engine_out_during_an_update_catches_up_before_it_rejoins(start_fleet: StartManager) -> None:
    """An engine UNHEALTHY while the trainer updates the fleet is not a member of the update, and
    the trainer's version has no checkpoint to load. When it answers its probes again it copies
    that version from an engine that serves it and only then rejoins: never on the base weights."""
    fleet = start_fleet(
        "--engine-arg=--enable-fault-api",
        "--health-check-interval-secs", "0.5", "--health-check-timeout-secs", "1",
        "--health-failure-threshold", "2", "--restart-failed-engines", "false",
        # A slow /health with a scheduler that answers looks like a pause; here it is the fault.
        "--health-pause-grace-secs", "0",
    )  # fmt: skip
    a, b = sorted(fleet.engines().engines, key=lambda e: e.engine_id)
    base = model_info(b.url)["weight_version"]

    def status(engine_id: str) -> str | None:
        e = fleet.engines().by_id(engine_id)
        return None if e is None else e.status

    assert http("POST", f"{b.url}/sim/faults", {"slow_health": 3.0}, timeout=5).status == 200
    wait_until(lambda: status(b.engine_id) == "UNHEALTHY", 30, f"{b.engine_id} to be taken out")
    rank0 = StandInRank0()
    result = make_sync(fleet, rank0).update("step-1", SPECS)
    assert result.update is not None and result.update.status == "COMPLETED", result
    assert set(result.update.engines) == {a.engine_id}, result.update.engines
    assert model_info(b.url)["weight_version"] == base
    assert status(b.engine_id) == "UNHEALTHY"

    with Traffic(fleet.router_url).running() as traffic:
        assert http("POST", f"{b.url}/sim/faults", {"slow_health": 0}, timeout=5).status == 200

        def caught_up() -> bool:
            e = fleet.engines().by_id(b.engine_id)
            return e is not None and e.status == "ACTIVE" and e.weight_version == "step-1"

        wait_until(
            caught_up, STARTUP_TIMEOUT, lambda: f"{b.engine_id} back on step-1: {fleet.engines().by_id(b.engine_id)}"
        )
        wait_until(lambda: traffic.answered() >= 20, 60, "answers after the rejoin")
    fleet.track_children()
    e = fleet.engines().by_id(b.engine_id)
    assert e is not None and model_info(e.url)["weight_version"] == "step-1"
    assert dict(traffic.versions) == {"step-1": traffic.answered()}, (traffic.versions, traffic.errors)
    assert send_count(a.url) >= 1, "the copy came from the engine that serves the version"


def test_a_bucketed_update_reaches_every_engine_bucket_by_bucket(release_fleet: ManagerHandle) -> None:
    """What slime, AReaL and verl do: the tensors go in buckets, each its own
    ``/update_weights_from_distributed`` on every engine, and the version only with the end."""
    fleet = release_fleet
    rank0 = StandInRank0()
    sync = make_sync(fleet, rank0)
    buckets = [SPECS[:2], SPECS[2:]]
    with Traffic(fleet.router_url).running() as traffic:
        wait_until(lambda: traffic.answered() >= 5, 60, "answers before the update")
        result = sync.update("step-1", buckets=buckets)
        after = traffic.answered()
        wait_until(lambda: traffic.answered() >= after + 10, 60, "answers after the update")
    assert result.update is not None and result.update.status == "COMPLETED"
    trainer = result.update.trainer or {}
    assert (trainer["buckets_sent"], trainer["buckets_received"], trainer["last_sent"]) == (2, 2, True)
    assert rank0.broadcasts == [(result.layout.group_name, [s.name for s in b]) for b in buckets]
    assert fleet.client.weights().version == "step-1"
    for e in fleet.engines().engines:
        assert model_info(e.url)["weight_version"] == "step-1"
    assert set(traffic.versions) <= {"default", "step-1"} and not traffic.errors, (traffic.versions, traffic.errors)

    # A bucket that does not fit the update is refused with what to do instead.
    opened = fleet.client.open_trainer_update("step-2", [], "127.0.0.1", 1, group_name=result.layout.group_name)
    url = f"{fleet.control_url}/rollout/weights/updates/{opened.update_id}/broadcast"
    refused = http("POST", url, {})
    assert refused.status == 400 and refused.json()["error"]["code"] == "bucket_expected", refused.body
    bad = http("POST", url, {"names": ["w"], "dtypes": ["bfloat17"], "shapes": [[2]]})
    assert bad.status == 400 and bad.json()["error"]["code"] == "invalid_dtype", bad.body
    early_end = http("POST", url, {"last": True})
    assert early_end.status == 400 and early_end.json()["error"]["code"] == "bucket_expected", early_end.body
    fleet.client.abort_weight_update(opened.update_id, "test done")

    # No bucket at all: the helper refuses and leaves no update open behind it.
    with pytest.raises(ValueError, match="no bucket was sent"):
        sync.update("step-3", buckets=[])
    assert not fleet.client.weight_updates(status="PENDING") and not fleet.client.weight_updates(status="UPDATING")
    assert fleet.client.weights().version == "step-1"


def test_a_trainer_that_gives_up_between_buckets_leaves_no_engine_on_part_of_a_version(fleet: ManagerHandle) -> None:
    rank0 = StandInRank0()
    sync = make_sync(fleet, rank0)
    sync.update("step-1", SPECS)
    before = engine_identities(fleet)
    with Traffic(fleet.router_url).running() as traffic:
        wait_until(lambda: traffic.answered() >= 5, 60, "answers before the update")
        try:
            with sync.begin("step-2") as bucketed:
                bucketed.send(SPECS[:2])
                rank0.broadcast(bucketed.layout, SPECS[:2])
                raise MemoryError("CUDA out of memory while gathering bucket 2")
        except MemoryError:
            pass
        # Every member loaded bucket 1 of step-2: none may generate again, so each is stopped
        # without resuming and started afresh (a copy of step-1 needs a seed: none is left, so
        # each waits for the trainer's next update).
        fleet.wait_engines(2, "WEIGHT_SYNCING", STARTUP_TIMEOUT)
    failed = fleet.client.weight_updates(status="FAILED")
    # The trainer's reason is on the record, whether its abort came after the members answered
    # bucket 1 or while they still did (then each member's part says the trainer gave it up).
    assert len(failed) == 1 and "CUDA out of memory" in (failed[0].error_message or ""), failed
    assert failed[0].raw["trainer"]["aborted"] == "the trainer failed: CUDA out of memory while gathering bucket 2"
    assert fleet.client.weights().version == "step-1"
    after = engine_identities(fleet)
    assert all(after.get(k) != v for k, v in before.items()), "every member was started again"
    assert set(traffic.versions) == {"step-1"}, traffic.versions

    # The trainer's next update brings them back.
    sync.update("step-3", SPECS)
    fleet.wait_engines(2, "ACTIVE", STARTUP_TIMEOUT)
    assert {e.weight_version for e in fleet.engines().engines} == {"step-3"}


def test_a_trainer_that_cannot_join_leaves_no_group_and_nothing_paused(fleet: ManagerHandle) -> None:
    def broken_join(layout: GroupLayout) -> None:
        StandInRank0().join_group(layout)
        raise RuntimeError("NCCL init failed on the trainer")

    sync = DistributedWeightSync(fleet.client, join_group=broken_join, broadcast=lambda layout, specs: None, timeout=30)
    try:
        sync.update("v1", SPECS)
        raise AssertionError("the update should have raised")
    except RuntimeError as err:
        assert "NCCL init failed" in str(err)
    failed = fleet.client.weight_updates(status="FAILED")
    assert len(failed) == 1 and "could not join" in (failed[0].error_message or "")
    assert fleet.client.weights().version == "default"
    for e in fleet.engines().with_status("ACTIVE"):
        info = http("GET", e.url + "/server_info").json()
        assert info["weight_sync"]["weight_update_groups"] == {}
        assert http("GET", e.url + "/ready").status == 200


@pytest.mark.parametrize("bucketed", [False, True], ids=["one_broadcast", "between_buckets"])
def test_a_manager_killed_mid_broadcast_fails_the_update_and_restarts_its_members(
    manager_bin: Path, tmp_path: Path, bucketed: bool
) -> None:
    """SIGKILL of the manager while the members receive (engines under keepers, so they outlive
    it): the restarted manager cannot resume the broadcast, ends the update FAILED, and does not
    trust what the members report (their receive may still finish, or, between two buckets, they
    hold part of the version): it restarts them on the fleet's version."""
    state = tmp_path / "state"
    ports = (free_port(), free_port())
    first = start(manager_bin, state, ports, load_delay=3)
    second: ManagerHandle | None = None
    identities: dict[str, ProcessIdentity] = {}
    try:
        first.wait_engines(ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        rank0 = StandInRank0()
        specs = [(s.name, s.dtype, s.shape) for s in SPECS]
        opened = first.client.open_trainer_update("step-1", [] if bucketed else specs, "127.0.0.1", free_port())
        layout = GroupLayout.from_json((opened.trainer or {})["group"])
        rank0.join_group(layout)
        if bucketed:
            first.client.start_broadcast(opened.update_id, specs[:1], last=False)
            rank0.broadcast(layout, SPECS[:1])
            # Every member loads the first bucket for 3 s, then waits for the next one.
            wait_until(
                lambda: (first.client.weight_update(opened.update_id).trainer or {}).get("buckets_received") == 1,
                30,
                "the first bucket received",
            )
        else:
            first.client.start_broadcast(opened.update_id)
            # Every member is paused and in its session; they receive, then load for 3 s.
            rank0.broadcast(layout, SPECS)
        before = first.client.weight_update(opened.update_id)
        assert before.status == "UPDATING", before
        identities = engine_identities(first)
        first.process.kill()
        first.process.wait()

        second = start(manager_bin, state, ports, load_delay=3)
        ended = second.client.wait_for_weight_update(opened.update_id, timeout=60)
        assert ended.status == "FAILED" and "cannot resume" in (ended.error_message or ""), ended
        view = second.wait_engines(ENGINES, "ACTIVE", STARTUP_TIMEOUT)
        second.track_children()
        assert {e.weight_version for e in view.engines} == {"default"}
        for e in view.engines:
            assert e.restarts == 1, e
            assert model_info(e.url)["weight_version"] == "default"
            assert http("GET", e.url + "/ready").status == 200
        assert second.client.weights().version == "default"
    finally:
        stop_both(first, second, identities)


def test_a_trainer_that_calls_the_engines_itself_is_followed(start_fleet: StartManager) -> None:
    """An unmodified trainer updates the engines around the manager: the health round reads
    each engine's version, the registry follows it, the fleet takes it once every ACTIVE engine
    reports it, and an engine added afterwards copies it from a peer."""
    fleet = start_fleet("--health-check-interval-secs", "0.2")
    engines = [(e.engine_id, e.url) for e in fleet.engines().with_status("ACTIVE")]
    update_engines_directly(StandInRank0(), engines, "slime-1")

    def taken() -> bool:
        w = fleet.client.weights()
        return w.version == "slime-1" and w.raw["source"] == "trainer"

    wait_until(taken, 30, "the fleet to take the trainer's version")
    assert {e.weight_version for e in fleet.engines().engines} == {"slime-1"}
    history = fleet.client.weights().raw["history"]
    assert history[0]["version"] == "slime-1" and history[0]["source"] == "trainer"
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "weight_version": {"min_version": "slime-1"}}
    out = http("POST", fleet.router_url + "/generate", body)
    assert out.status == 200 and out.json()["meta_info"]["weight_version"] == "slime-1"

    op = fleet.client.scale_out(num_replicas=3)
    assert fleet.client.wait_for_operation("scale_out", op.request_id, STARTUP_TIMEOUT).status == "ACTIVE"
    fleet.track_children()
    view = fleet.wait_engines(3)
    for e in view.engines:
        assert model_info(e.url)["weight_version"] == "slime-1"


def test_a_seed_that_dies_mid_copy_is_replaced_by_another(start_fleet: StartManager) -> None:
    """The transfer model makes a copy take 3.2 s (4 GB at 10 Gbit/s); the seed a new engine
    copies from is killed during it. The new engine's start fails, and the manager starts it
    again copying from the other seed; the scale-out still ends ACTIVE on the trainer's version."""
    fleet = start_fleet("--engine-arg=--weight-bytes=4000000000", "--engine-arg=--transfer-gbps=10")
    make_sync(fleet, StandInRank0()).update("step-1", SPECS)
    seeds = {e.engine_id: e for e in fleet.engines().with_status("ACTIVE")}
    op = fleet.client.scale_out(num_replicas=3)

    def sending() -> str | None:
        busy = [e for e in seeds.values() if busy_sending(e.url)]
        return busy[0].engine_id if busy else None

    first = wait_until(sending, 30, "a seed to start sending")
    victim = seeds[first]
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    done = fleet.client.wait_for_operation("scale_out", op.request_id, STARTUP_TIMEOUT)
    assert done.status == "ACTIVE", done.raw
    fleet.track_children()
    other = next(e for e in seeds.values() if e.engine_id != first)
    assert send_count(other.url) >= 1, "the other seed sent the copy"
    new = [e for e in fleet.engines().engines if e.engine_id not in seeds]
    assert len(new) == 1 and new[0].status == "ACTIVE"
    # Its first start, copying from the killed seed, failed and was retried from the other one.
    assert "copy from the seed failed at startup" in fleet.stderr_tail(1_000_000)
    assert model_info(new[0].url)["weight_version"] == "step-1"
    # The killed seed comes back too, on a copy of step-1.
    wait_until(
        lambda: (e := fleet.engines().by_id(first)) is not None and e.status == "ACTIVE" and e.restarts == 1,
        STARTUP_TIMEOUT,
        f"{first} restarted",
    )
    fleet.track_children()


def fixed_round(sync: FixedGroupSync, rank0: StandInRank0, version: str) -> UpdateResult:
    """One update as AReaL sends it over its fixed group: bucket by bucket, each received before
    the next, then the end (AReaL's ``continue_generation``)."""
    assert sync.layout is not None
    for bucket in (SPECS[:2], SPECS[2:]):
        sync.send(version, bucket)
        rank0.broadcast(sync.layout, bucket)
        sync.wait_received()
    return sync.end()


def test_a_group_the_trainer_fixed_is_kept_and_engines_beyond_it_copy_each_version(fleet: ManagerHandle) -> None:
    """AReaL's layout: the trainer builds its group once, with a world size of its own. The
    manager fills it with the first engines, never rebuilds it, and an engine beyond it copies
    every new version from a member before it serves again."""
    op = fleet.client.scale_out(num_replicas=3)
    assert fleet.client.wait_for_operation("scale_out", op.request_id, STARTUP_TIMEOUT).status == "ACTIVE"
    rank0 = StandInRank0()
    port = free_port()

    def fixed(name: str, world_size: int) -> FixedGroupSync:
        return FixedGroupSync(fleet.client, group_name=name, master_address="127.0.0.1", master_port=port,
                              world_size=world_size, timeout=60)  # fmt: skip

    with pytest.raises(WeightSyncError, match="world_size 4"):
        fixed("too_big", 5).build()  # three engines hold three ranks: it says which world fits
    sync = fixed("update_weight_group", 3)
    layout = sync.build()
    joining = threading.Thread(target=rank0.join_group, args=(layout,))
    joining.start()
    sync.wait_joined()
    joining.join()
    members = {m.engine_id for m in layout.members}
    assert len(members) == 2 and layout.world_size == 3, layout
    assert {line["world_size"] for line in rank0.joined[0]} == {3}
    (beyond,) = [e for e in fleet.engines().engines if e.engine_id not in members]

    fixed_round(sync, rank0, "step-1")
    with Traffic(fleet.router_url).running() as during:
        wait_until(lambda: during.answered() >= 5, 60, "answers before the second update")
        result = fixed_round(sync, rank0, "step-2")
    assert result.update is not None and set(result.update.engines) == members, result.update.engines
    assert set(during.versions) <= {"step-1", "step-2"} and not during.errors, (during.versions, during.errors)
    wait_until(lambda: len(fleet.engines().with_status("ACTIVE")) == 3, STARTUP_TIMEOUT, "all three ACTIVE")
    for e in fleet.engines().engines:
        assert model_info(e.url)["weight_version"] == "step-2", e.engine_id
    # The engine beyond the group copied each version from a member; the group was never rebuilt.
    assert sum(send_count(m.url) for m in fleet.engines().engines if m.engine_id in members) == 2
    assert len(rank0.joined) == 1
    with Traffic(fleet.router_url, limit=30).running() as after:
        wait_until(lambda: after.answered() >= 30, 60, "answers after the update")
    assert set(after.versions) == {"step-2"}, after.versions

    # Scale-in takes the engine beyond the group, never a member.
    shrink = fleet.client.scale_in(num_replicas=2)
    assert fleet.client.wait_for_operation("scale_in", shrink.request_id, STARTUP_TIMEOUT).status == "COMPLETED"
    assert {e.engine_id for e in fleet.engines().engines} == members and beyond.engine_id not in members

    # A member killed: NCCL cannot take its new process into the formed group, so the next
    # update is refused with what to do, and a new group works.
    victim = fleet.engines().by_id(sorted(members)[1])
    assert victim is not None
    kill_and_wait_restarted(fleet, victim)
    with pytest.raises(WeightSyncError, match="lost members"):
        sync.send("step-3", SPECS[:2])
    assert fleet.client.weights().version == "step-2"
    again = fixed("update_weight_group_2", 3)
    layout = again.build()
    joining = threading.Thread(target=rank0.join_group, args=(layout,))
    joining.start()
    again.wait_joined()
    joining.join()
    assert fixed_round(again, rank0, "step-3").update is not None
    for e in fleet.engines().engines:
        assert model_info(e.url)["weight_version"] == "step-3", e.engine_id


def areal_run(fleet: ManagerHandle, versions: Sequence[int]) -> None:
    """One AReaL run (a fresh process: the adapter loaded anew) that builds its group and sends
    AReaL's ``versions``; each must be what the fleet then serves, under the adapter's name."""
    areal = load_example("examples/areal/elastic_rollout_areal.py")
    # AReaL itself is not installed here: the engine is built without its base class's state.
    engine = areal.ElasticSGLangEngine.__new__(areal.ElasticSGLangEngine)
    engine._pipeline, engine._engine, engine._group = areal._Pipeline(), object(), None
    rank0 = StandInRank0()
    parallel = SimpleNamespace(world_size=2, pp_size=1)  # rollout.backend=sglang:d2
    meta = SimpleNamespace(gen_allocation=SimpleNamespace(parallel=parallel), nccl_group_name="update_weight_group",
                           nccl_master_address="127.0.0.1", nccl_master_port=free_port(), version=None,
                           use_lora=False)  # fmt: skip
    joined = engine.init_weights_update_group(meta)

    def built() -> bool:
        resp = http("GET", fleet.control_url + "/rollout/weights/trainer_group")
        return resp.status == 200 and resp.json()["group_name"] == "update_weight_group"

    wait_until(built, 30, "the group built")
    layout = GroupLayout.from_json(fleet.client.trainer_group())
    rank0.join_group(layout)
    joined.result(timeout=60)
    assert layout.world_size == 3 and len(layout.members) == 2
    try:
        for version in versions:
            meta.version = version
            engine.pause_generation()
            for bucket in (SPECS[:2], SPECS[2:]):
                params = [SimpleNamespace(name=s.name, dtype=s.dtype, shape=s.shape) for s in bucket]
                fut = engine.update_weights_from_distributed(meta, params)
                rank0.broadcast(layout, bucket)
                fut.result(timeout=60)
            engine.continue_generation()
            name = areal._names.name(version, version - 1)
            assert fleet.client.weights().version == name
            for e in fleet.engines().engines:
                assert model_info(e.url)["weight_version"] == name, e.engine_id
    finally:
        engine._pipeline._stop.set()
    assert len(rank0.joined) == 1 and len(rank0.broadcasts) == 2 * len(versions)


def test_the_areal_adapter_moves_weights_over_xccl_in_areals_call_order(
    fleet: ManagerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/areal driven as AReaL's FSDPEngine drives its rollout engine (read at 4aef98d8,
    fsdp_engine.py:1377-1437 and 1506-1597): ``connect_engine`` builds the group once (world =
    rollout GPUs + 1) and joins as rank 0 while the engine's future runs; each update pauses,
    then per bucket ``fut = update_weights_from_distributed(meta, specs)``, the broadcast,
    ``fut.result()``, and ``continue_generation()`` at the end. A restarted AReaL that recovers
    from an older step numbers its versions from there again: its names continue the fleet's."""
    monkeypatch.setenv("ELASTIC_ROLLOUT_MANAGER", fleet.control_url)
    areal_run(fleet, (1, 2))
    assert fleet.client.weights().version == "2"
    # Recovered from the checkpoint of step 0 (version 1 is its next): "1" was served already.
    areal_run(fleet, (1, 2))
    assert fleet.client.weights().version == "4"


def test_a_trainer_restarted_mid_broadcast_builds_its_group_again_at_once(fleet: ManagerHandle) -> None:
    """A trainer that crashed after naming a bucket (its members wait in the receive for a rank
    0 that is gone) and starts again builds its group first. That build gives up the dead update
    at once, instead of a 409 `update_in_progress` until --weight-update-timeout-secs (300 s here)
    ran out; the members left waiting are restarted, and the new group takes a whole update."""
    rank0 = StandInRank0()

    def fixed(name: str) -> FixedGroupSync:
        return FixedGroupSync(fleet.client, group_name=name, master_address="127.0.0.1", master_port=free_port(),
                              world_size=3, timeout=60)  # fmt: skip

    def joined(sync: FixedGroupSync) -> None:
        layout = sync.build()
        joining = threading.Thread(target=rank0.join_group, args=(layout,))
        joining.start()
        sync.wait_joined()
        joining.join()

    crashed = fixed("update_weight_group")
    joined(crashed)
    crashed.send("step-1", SPECS[:2])  # ... and rank 0 dies before it broadcasts
    dead = crashed.update_id
    assert dead is not None

    again = fixed("update_weight_group")
    joined(again)
    gone = fleet.client.weight_update(dead)
    assert gone.status == "FAILED" and "new group" in (gone.error_message or ""), gone.raw
    assert fleet.client.weights().version == "default"
    assert fixed_round(again, rank0, "step-1").update is not None
    for e in fleet.engines().engines:
        assert model_info(e.url)["weight_version"] == "step-1", e.engine_id
