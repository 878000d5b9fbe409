"""The asyncio client (and the blocking one over the Unix socket) against a real manager:
engines, a scale-out waited for, a pipeline step report, a checkpoint published and waited for,
the error model, the token from ``ROLLOUT_MANAGER_API_TOKEN``, and ``--api-socket``."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _checkpoints import write_checkpoint
from _support import INITIAL_ENGINES, StartManager

from elastic_rollout import (
    TOKEN_ENV,
    AsyncRolloutClient,
    AutoscalerStatus,
    PublishResult,
    RolloutApiError,
    RolloutClient,
    RolloutConnectionError,
    StepReport,
    WeightsView,
)

#: A rolling update of the 2-engine sim fleet takes a few seconds; this is the deadline only.
UPDATE_TIMEOUT = 120.0
SCALE_TIMEOUT = 60.0


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short private directory: Unix socket paths are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="er-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_async_client_over_tcp_with_the_token_from_the_environment(
    start_fleet: StartManager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = tmp_path / "token"
    token.write_text("async-s3cret\n")
    token.chmod(0o600)
    fleet = start_fleet("--api-token-file", str(token))
    monkeypatch.setenv(TOKEN_ENV, "async-s3cret")

    async def main() -> None:
        # No token given: the client reads it from the environment.
        async with AsyncRolloutClient(fleet.control_url, timeout=10.0) as client:
            assert "s3cret" not in repr(client)
            view, weights, status = await asyncio.gather(client.engines(), client.weights(), client.autoscaler_status())
            assert len(view.with_status("ACTIVE")) == INITIAL_ENGINES
            assert isinstance(weights, WeightsView) and weights.version == "default" and weights.in_flight is None
            assert isinstance(status, AutoscalerStatus) and status.current_engines == INITIAL_ENGINES

            # The error model: status, code and message from the manager's JSON body.
            with pytest.raises(RolloutApiError) as caught:
                await client.scale_in(num_replicas=1)
            err = caught.value
            assert (err.status, err.code) == (400, "below_initial_engines"), err
            assert "initial engines" in err.message and err.body["error"]["code"] == err.code
            with pytest.raises(RolloutApiError) as caught:
                await client.post("/rollout/scale_out", {"num_replica": 3})  # a typo is refused
            assert (caught.value.status, caught.value.code) == (400, "invalid_body"), caught.value

            # A scale-out, waited for with asyncio sleeps.
            out = await client.scale_out(num_replicas=INITIAL_ENGINES + 1)
            assert out.request_id is not None and out.status not in (None, "NOOP"), out
            op = await client.wait_for_operation("scale_out", out.request_id, timeout=SCALE_TIMEOUT)
            assert op.status == "ACTIVE" and len(op.engine_ids) == 1, op
            grown = await client.wait_for_engines(INITIAL_ENGINES + 1, timeout=SCALE_TIMEOUT)
            assert grown.by_id(op.engine_ids[0]) is not None

            # A trainer step for the autoscaler.
            report = await client.report_step(1, 0.25, 0.0, 1.0, rollout_samples=8, next_step_samples=8)
            assert isinstance(report, StepReport) and report.accepted and report.step == 1, report
            assert report.decision is not None and report.decision.action, report

        # Without the token (an explicit empty one beats the environment): 401, the token unseen.
        async with AsyncRolloutClient(fleet.control_url, token="") as anonymous:
            assert (await anonymous.engines()).total_engines == INITIAL_ENGINES + 1  # reads stay open
            with pytest.raises(RolloutApiError) as caught:
                await anonymous.scale_out(num_replicas=INITIAL_ENGINES + 1)
            assert (caught.value.status, caught.value.code) == (401, "unauthorized")
        async with AsyncRolloutClient(fleet.control_url, token="wrong") as wrong:
            with pytest.raises(RolloutApiError) as caught:
                await wrong.scale_in(num_replicas=INITIAL_ENGINES)
            assert caught.value.status == 401 and "wrong" not in str(caught.value)

    asyncio.run(main())


def test_publish_and_wait_over_the_unix_socket(start_fleet: StartManager, tmp_path: Path, short_dir: Path) -> None:
    sock = str(short_dir / "api.sock")
    fleet = start_fleet("--api-socket", sock)
    checksum = write_checkpoint(tmp_path / "v1", seed=1)

    async def main() -> None:
        async with AsyncRolloutClient(uds=sock) as client:
            published = await client.publish_weights("v1", str(tmp_path / "v1"), max_unavailable=1)
            assert isinstance(published, PublishResult) and published.accepted, published
            assert published.update_id is not None and not published.status.startswith(("COMPLETED", "FAILED"))
            update = await client.wait_for_weight_update(published.update_id, timeout=UPDATE_TIMEOUT)
            assert update.status == "COMPLETED", update.error_message
            assert update.checksum == checksum and update.previous_version == "default"
            assert len(update.engines) == INITIAL_ENGINES
            assert {p.status for p in update.engines.values()} == {"VERIFIED"}, update.engines
            assert update.statuses[-1] == "COMPLETED"

            weights = await client.weights()
            assert (weights.version, weights.checksum, weights.in_flight) == ("v1", checksum, None)
            assert set(weights.engine_versions().values()) == {"v1"}
            assert weights.history[0].update_id == update.update_id and weights.history[0].status == "COMPLETED"

            # The same version, path and checksum again: 200 with the existing update.
            again = await client.publish_weights("v1", str(tmp_path / "v1"))
            assert not again.accepted and again.update_id == update.update_id and again.status == "COMPLETED"

            # A checkpoint that is not there: refused at once (400), or, where the manager hashes in
            # the background, an update that ends FAILED with the reason. Nothing is loaded.
            try:
                missing = await client.publish_weights("v2", str(tmp_path / "missing"))
            except RolloutApiError as err:
                assert err.status == 400 and err.code in ("invalid_checkpoint", "invalid_path"), err
            else:
                assert missing.update_id is not None
                failed = await client.wait_for_weight_update(missing.update_id, timeout=UPDATE_TIMEOUT)
                assert failed.status == "FAILED" and failed.error_message, failed
            assert (await client.weights()).version == "v1"

    asyncio.run(main())

    # The blocking client over the same socket.
    with RolloutClient(uds=sock) as client:
        assert client.weights().version == "v1"
        assert len(client.engines().with_status("ACTIVE")) == INITIAL_ENGINES
    # And nothing listens there once the manager is gone.
    fleet.process.terminate()
    fleet.process.wait(timeout=30)
    with pytest.raises(RolloutConnectionError) as caught, RolloutClient(uds=sock, timeout=5) as client:
        client.engines()
    assert caught.value.status == 0 and sock in str(caught.value)
