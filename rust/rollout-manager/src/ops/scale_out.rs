//! Running one scale-out: every engine goes through its own pipeline (launch or connect ->
//! health check -> weight check -> READY) concurrently; the operation's status follows the
//! slowest engine still in the race; READY engines are activated together at the end.
//!
//! Outcome rules:
//! - all engines READY -> all activated, `ACTIVE`;
//! - an engine fails, policy `rollback_all` -> stop at once, roll back every engine, `FAILED`;
//! - an engine fails, policy `keep_partial` -> the others go on; at the end the READY ones are
//!   activated and the operation is `ACTIVE` with `failed_engines` and an `error_message`
//!   (`FAILED` if none is left);
//! - timeout -> like a failure of every engine not yet READY, under the same policy;
//! - cancel (any non-terminal state) or manager shutdown -> roll back everything.
//!
//! Rolled-back dynamic and external engines are removed (processes stopped, GPUs returned);
//! initial engines are stopped but stay listed as FAILED.

use crate::adapters::engine_api::EngineError;
use crate::foundation::records::FailedEngine;
use crate::ops::manager::Manager;
use futures::stream::{FuturesUnordered, StreamExt};
use rollout_core::ids::{EngineId, OpId};
use rollout_core::scale_out::{self as settle, End};
use rollout_core::{
    EngineEvent, EngineOrigin, EngineStatus, PartialSuccessPolicy, Phase, ScaleOutEvent, ScaleOutStatus,
};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Phase of the slowest engine still in the race.
fn slowest(inner: &crate::registry::fleet::FleetInner, racing: &[EngineId]) -> Option<Phase> {
    racing.iter().filter_map(|id| inner.engines.get(id).and_then(|e| Phase::of_engine(e.status()))).min()
}

/// Whether an engine still waits for its placement (Ray mode, PENDING_RESOURCES).
fn any_pending(inner: &crate::registry::fleet::FleetInner, racing: &[EngineId]) -> bool {
    racing.iter().any(|id| inner.engines.get(id).is_some_and(|e| e.status() == EngineStatus::Pending))
}

/// Moves the operation forward to the phase of its slowest engine still in the race. Takes the
/// write path (which wakes fleet watchers) only when there is something to move. The operation
/// stays PENDING while an engine waits for resources (Ray mode).
fn follow_slowest(manager: &Manager, request_id: &OpId, racing: &[EngineId], start: ScaleOutEvent) {
    let behind = {
        let inner = manager.fleet.lock();
        let status = inner.ops.scale_out(request_id).map(|op| op.status());
        let current = status.and_then(ScaleOutStatus::phase);
        let placed = status == Some(ScaleOutStatus::Pending) && !any_pending(&inner, racing);
        placed || matches!((slowest(&inner, racing), current), (Some(t), Some(c)) if c < t)
    };
    if behind {
        manager.fleet.update(|inner| {
            if !any_pending(inner, racing) {
                inner.ops.scale_out_started(request_id, start);
            }
            if let Some(target) = slowest(inner, racing) {
                inner.ops.scale_out_reached(request_id, target);
            }
        });
    }
}

/// Most times a scale-out places one engine again after its node was lost while it started
/// (Ray mode); the operation's deadline bounds the waits for a new node.
const MAX_PLACEMENTS: usize = 4;

/// Brings one engine from CREATING to READY. In Ray mode, an engine whose node is lost while it
/// starts is placed again on another node rather than failing the operation.
async fn bring_up(manager: &Arc<Manager>, id: &EngineId, cancel: &CancellationToken) -> Result<(), EngineError> {
    let mut placements = 1;
    loop {
        let result = bring_up_once(manager, id, cancel).await;
        match result {
            Err(e) if placements < MAX_PLACEMENTS && manager.place_again_after_node_loss(id, &e).await => {
                placements += 1;
            }
            other => return other,
        }
    }
}

async fn bring_up_once(manager: &Arc<Manager>, id: &EngineId, cancel: &CancellationToken) -> Result<(), EngineError> {
    let external = manager.fleet.lock().engines.get(id).is_some_and(|e| e.record().origin() == EngineOrigin::External);
    if external {
        manager.connect(id).await?;
        manager.wait_healthy(id, cancel).await?;
    } else {
        manager.launch_healthy(id, cancel).await?;
    }
    manager.fleet.update(|inner| inner.engines.event(id, EngineEvent::Healthy)).map_err(EngineError::Moved)?;
    manager.sync_weights(id, &[EngineEvent::WeightsSynced]).await?;
    Ok(())
}

/// Most external engines one scale-out brings up (connects, probes, checks) at the same time.
const EXTERNAL_BRING_UPS: usize = 64;

pub async fn run(
    manager: &Arc<Manager>,
    request_id: &OpId,
    ids: Vec<EngineId>,
    timeout: Duration,
    policy: PartialSuccessPolicy,
    cancel: CancellationToken,
) {
    let start = begin(manager, request_id, &ids);
    let deadline = tokio::time::Instant::now() + timeout;
    let (end, mut failed, racing) = race(manager, request_id, &ids, start, deadline, policy, &cancel).await;
    if let End::TimedOut = end {
        for id in racing {
            failed.push(FailedEngine {
                engine_id: id,
                url: String::new(),
                error: format!("not ready within {timeout:?}"),
            });
        }
    }
    let Settled { end, keep, concluded } =
        settle_and_activate(manager, request_id, &ids, end, policy, start, deadline, &cancel, &mut failed).await;

    let initial = manager
        .fleet
        .lock()
        .ops
        .scale_out(request_id)
        .is_some_and(|r| r.trigger() == crate::foundation::records::Trigger::Initial);
    let doomed: Vec<(EngineId, String)> = ids
        .iter()
        .filter(|id| !keep.contains(id))
        .map(|id| {
            let why = failed.iter().find(|f| &f.engine_id == id).map(|f| f.error.clone());
            (id.clone(), why.unwrap_or_else(|| "rolled back".into()))
        })
        .collect();
    futures::future::join_all(doomed.iter().map(|(id, why)| cleanup(manager, id, initial, why))).await;

    let event = settle::last_event(end, !keep.is_empty());
    if !concluded {
        let message = ending_message(end, event, timeout, ids.len(), &failed);
        manager.fleet.update(|inner| inner.ops.conclude_scale_out(request_id, start, event, message, &failed));
    }
    // The fleet needs its initial engines: those that failed are restarted like crashed ones.
    if initial && manager.config.restart_failed_engines && !matches!(end, End::ShuttingDown) {
        for (id, _) in doomed {
            let m = manager.clone();
            manager.tasks.spawn(async move { m.recover(&id, Duration::from_secs(1)).await });
        }
    }
}

/// The operation leaves PENDING (CREATING, or CONNECTING for external engines) unless its
/// engines still wait for placements; the event it started with.
fn begin(manager: &Manager, request_id: &OpId, ids: &[EngineId]) -> ScaleOutEvent {
    let external = manager
        .fleet
        .lock()
        .engines
        .values()
        .any(|e| ids.contains(e.record().engine_id()) && e.record().origin() == EngineOrigin::External);
    let start = if external { ScaleOutEvent::StartConnecting } else { ScaleOutEvent::StartCreating };
    manager.fleet.update(|inner| {
        if any_pending(inner, ids) {
            inner.ops.scale_out_waits_for_resources(request_id);
        } else if !inner.ops.scale_out_started(request_id, start) {
            tracing::info!(request_id = %request_id, "scale-out not started: cancelled before it started");
        }
    });
    start
}

/// Brings every engine up at once (external ones at most [`EXTERNAL_BRING_UPS`] at a time), the
/// operation's phase following the slowest, until all are up, one failed under rollback_all,
/// the deadline passed, or the operation was cancelled or the manager shuts down. How it ended
/// the engines that failed, and the ones still racing (not up when it ended).
async fn race(
    manager: &Arc<Manager>,
    request_id: &OpId,
    ids: &[EngineId],
    start: ScaleOutEvent,
    deadline: tokio::time::Instant,
    policy: PartialSuccessPolicy,
    cancel: &CancellationToken,
) -> (End, Vec<FailedEngine>, Vec<EngineId>) {
    let external = start == ScaleOutEvent::StartConnecting;
    let mut racing: Vec<EngineId> = ids.to_vec();
    let mut failed: Vec<FailedEngine> = Vec::new();
    // External engines are only connected to, so thousands can be attached in one operation;
    // at most EXTERNAL_BRING_UPS of them are brought up at once, so none times out waiting for
    // a CPU behind a thousand others (seen with 1,000 engines on 2 cores). Local engines are
    // bounded by the GPUs and all start at once.
    let limit =
        tokio::sync::Semaphore::new(if external { EXTERNAL_BRING_UPS } else { tokio::sync::Semaphore::MAX_PERMITS });
    let limit_ref = &limit;
    let mut pipelines: FuturesUnordered<_> = ids
        .iter()
        .map(|id| async move {
            let _permit = limit_ref.acquire().await.ok();
            (id.clone(), bring_up(manager, id, cancel).await)
        })
        .collect();
    let mut changes = manager.fleet.subscribe();
    let end = loop {
        tokio::select! {
            // Cancel and shutdown first: the pipelines see the same token and would otherwise
            // report the cancellation as an engine failure.
            biased;
            _ = cancel.cancelled() => break End::Cancelled,
            _ = manager.shutdown.cancelled() => break End::ShuttingDown,
            _ = tokio::time::sleep_until(deadline) => break End::TimedOut,
            Ok(()) = changes.changed() => follow_slowest(manager, request_id, &racing, start),
            next = pipelines.next() => match next {
                None => break End::Done,
                Some((id, result)) => {
                    if let Err(e) = result {
                        tracing::warn!(engine_id = %id, error = %e, request_id = %request_id, "engine failed during scale-out");
                        let url = manager.fleet.lock().engines.get(&id).map(|en| en.record().url().clone()).unwrap_or_default();
                        racing.retain(|r| r != &id);
                        failed.push(FailedEngine { engine_id: id, url, error: e.to_string() });
                        if policy == PartialSuccessPolicy::RollbackAll {
                            break End::RolledBack;
                        }
                    }
                    follow_slowest(manager, request_id, &racing, start);
                }
            },
        }
    };
    drop(pipelines);
    // A cancel that raced with the last pipeline still wins: nothing is active yet.
    let end = if cancel.is_cancelled() { End::Cancelled } else { end };
    (end, failed, racing)
}
/// How the operation settled: how it ended, the engines it keeps, and whether it already
/// recorded its end.
struct Settled {
    end: End,
    keep: Vec<EngineId>,
    concluded: bool,
}

/// Decides and activates in one registry update, so an engine that died after READY is seen:
/// under rollback_all every engine must still be READY, under keep_partial each READY one is
/// kept and the others are recorded as failed. An engine READY on a version the fleet no
/// longer wants (an update began while it waited for the others) syncs again first, at most
/// [`MAX_RESYNCS`] times.
#[expect(clippy::too_many_arguments, reason = "the operation's whole context, passed on from `run`")]
async fn settle_and_activate(
    manager: &Arc<Manager>,
    request_id: &OpId,
    ids: &[EngineId],
    mut end: End,
    policy: PartialSuccessPolicy,
    start: ScaleOutEvent,
    deadline: tokio::time::Instant,
    cancel: &CancellationToken,
    failed: &mut Vec<FailedEngine>,
) -> Settled {
    let mut resyncs = 0;
    loop {
        if settle::may_keep(end, policy, !failed.is_empty()) && resyncs < MAX_RESYNCS {
            let stale = stale_ready(manager, ids);
            if !stale.is_empty() {
                resyncs += 1;
                end = resync(manager, &stale, deadline, cancel, failed, policy).await.unwrap_or(end);
                continue;
            }
        }
        let may_resync = resyncs < MAX_RESYNCS;
        if let Some((keep, concluded)) = activate(manager, request_id, ids, end, policy, start, failed, may_resync) {
            return Settled { end, keep, concluded };
        }
    }
}

/// The operation's closing message: why it ended as it did.
fn ending_message(
    end: End,
    event: ScaleOutEvent,
    timeout: Duration,
    engines: usize,
    failed: &[FailedEngine],
) -> Option<String> {
    match (end, event) {
        (End::Cancelled, _) => Some("cancelled by request; created engines were stopped".to_string()),
        (End::ShuttingDown, _) => Some("the manager shut down; created engines were stopped".to_string()),
        (_, ScaleOutEvent::Activated) => (!failed.is_empty())
            .then(|| format!("{} of {engines} engines failed and were removed (keep_partial)", failed.len())),
        _ => {
            let why = match end {
                End::TimedOut => format!("timed out after {timeout:?}"),
                _ => failed.iter().map(|f| format!("{}: {}", f.engine_id, f.error)).collect::<Vec<_>>().join("; "),
            };
            Some(format!("{why}; created engines were rolled back"))
        }
    }
}

/// Initial engines stay listed as FAILED; dynamic and external ones are removed.
async fn cleanup(manager: &Manager, engine_id: &EngineId, keep_listed: bool, reason: &str) {
    if keep_listed {
        manager.fail_engine(engine_id, reason).await;
    } else {
        manager.remove_engine(engine_id).await;
    }
}

/// Most rounds of syncing engines READY on a stale version again before the activation.
const MAX_RESYNCS: u32 = 5;

/// The operation's engines that are READY but do not serve the version the fleet wants now.
fn stale_ready(manager: &Manager, ids: &[EngineId]) -> Vec<EngineId> {
    let inner = manager.fleet.lock();
    let (want, _) = inner.weights.desired();
    ids.iter()
        .filter(|id| {
            inner.engines.get(id).is_some_and(|e| {
                e.status() == EngineStatus::Ready
                    && !want.served_by(e.record().weight_version().as_deref(), e.record().weights_checksum().as_deref())
            })
        })
        .cloned()
        .collect()
}

/// Syncs `stale` engines again (READY -> WEIGHT_SYNCING -> READY: loaded, or caught up from a
/// peer once the trainer's update committed), within the operation's deadline. A failure is
/// recorded in `failed`; answers the operation's new end when it was cut short.
async fn resync(
    manager: &Arc<Manager>,
    stale: &[EngineId],
    deadline: tokio::time::Instant,
    cancel: &CancellationToken,
    failed: &mut Vec<FailedEngine>,
    policy: PartialSuccessPolicy,
) -> Option<End> {
    tracing::info!(engines = ?stale, "engines READY on a version the fleet no longer wants; syncing them again");
    let syncing: Vec<EngineId> = manager.fleet.update(|inner| {
        stale.iter().filter(|id| inner.engines.event(id, EngineEvent::UpdateWeights).is_ok()).cloned().collect()
    });
    let work = futures::future::join_all(
        syncing
            .iter()
            .map(|id| async move { (id.clone(), manager.sync_weights(id, &[EngineEvent::WeightsSynced]).await) }),
    );
    let results = tokio::select! {
        biased;
        _ = cancel.cancelled() => return Some(End::Cancelled),
        _ = manager.shutdown.cancelled() => return Some(End::ShuttingDown),
        _ = tokio::time::sleep_until(deadline) => return Some(End::TimedOut),
        results = work => results,
    };
    for (id, result) in results {
        if let Err(e) = result {
            let url = manager.fleet.lock().engines.get(&id).map(|en| en.record().url().clone()).unwrap_or_default();
            failed.push(FailedEngine {
                engine_id: id,
                url,
                error: format!("syncing again to the fleet's version: {e}"),
            });
            if policy == PartialSuccessPolicy::RollbackAll {
                return Some(End::RolledBack);
            }
        }
    }
    None
}

/// Decides and activates in one registry update (see [`run`]): only engines READY on the
/// version the fleet wants. None when one is READY on another (the fleet's version moved since
/// [`stale_ready`] looked) and `may_resync`: the caller syncs it again first; without
/// `may_resync` such an engine counts as failed.
#[expect(clippy::too_many_arguments, reason = "the operation's plan and outcome so far")]
fn activate(
    manager: &Manager,
    request_id: &OpId,
    ids: &[EngineId],
    end: End,
    policy: PartialSuccessPolicy,
    start: ScaleOutEvent,
    failed: &mut Vec<FailedEngine>,
    may_resync: bool,
) -> Option<(Vec<EngineId>, bool)> {
    let may_keep = settle::may_keep(end, policy, !failed.is_empty());
    manager.fleet.update(|inner| {
        if !may_keep {
            return Some((Vec::new(), false));
        }
        let (want, _) = inner.weights.desired();
        let on_target = |e: &crate::registry::fleet::Engine| {
            want.served_by(e.record().weight_version().as_deref(), e.record().weights_checksum().as_deref())
        };
        let candidates: Vec<EngineId> =
            ids.iter().filter(|id| !failed.iter().any(|f| &f.engine_id == *id)).cloned().collect();
        let stale = |id: &EngineId| inner.engines.get(id).is_some_and(|e| e.status() == EngineStatus::Ready && !on_target(e));
        if may_resync && candidates.iter().any(stale) {
            return None;
        }
        let (ready, lost): (Vec<EngineId>, Vec<EngineId>) = candidates.into_iter().partition(|id| {
            inner.engines.get(id).is_some_and(|e| e.status() == EngineStatus::Ready && on_target(e))
        });
        for id in &lost {
            let (url, stale) = inner
                .engines
                .get(id)
                .map(|e| (e.record().url().clone(), e.status() == EngineStatus::Ready))
                .unwrap_or_default();
            let error = if stale {
                format!("the fleet's weight version kept moving while it waited; it is ready on another ({MAX_RESYNCS} syncs)")
            } else {
                "failed after it was ready".into()
            };
            failed.push(FailedEngine { engine_id: id.clone(), url, error });
        }
        if !settle::activate(policy, ready.len(), lost.len()) {
            return Some((Vec::new(), false));
        }
        for id in &ready {
            crate::foundation::records::checked(inner.engines.event(id, EngineEvent::Activated));
        }
        // Every engine made it: the operation ends in the same update, so nobody sees the new
        // engines ACTIVE while the operation still holds the one-operation lock.
        let concluded = ready.len() == ids.len();
        if concluded {
            inner.ops.conclude_scale_out(request_id, start, ScaleOutEvent::Activated, None, failed);
        }
        Some((ready, concluded))
    })
}
