//! Restart from `--state-dir`: rebuild the registry from the store after the manager was
//! stopped or killed at any point.
//!
//! Expected flow, per kind of record:
//! - finished operations are kept as they were, history included;
//! - a scale-out that was in flight ends FAILED, and the engines it had not yet activated are
//!   rolled back (initial engines are started again instead: they must exist); the engines it
//!   had activated stay, and the error message names them. If it had activated all of them
//!   (the manager died between activating the engines and recording the operation's end), it
//!   ends ACTIVE instead, so an operation never reads FAILED while all its engines serve;
//! - a scale-in that was in flight finishes: its victims are removed, and it ends COMPLETED;
//! - a managed engine whose keeper still runs (`--reattach-grace-secs`) is re-adopted without a
//!   restart once the keeper's pid and process start time match the record, `/health` passes
//!   and it serves the fleet's weight version; engines to be dropped are stopped through it;
//! - any other managed engine that was serving (or had crashed) is started again on its GPUs
//!   with the fleet's weight version, through the same recovery path as a crash. Should its old
//!   process still run (same pid *and* start time), it is killed first, so no engine process
//!   exists without a record;
//! - a weight update that was in flight resumes under its id ([`crate::ops::weight_update::resume`])
//!   once its checkpoint is checked again ([`crate::ops::weight_update::check_resumable`]; a failed check
//!   ends it FAILED with the reason, and the fleet stays on its version). Re-adopted engines
//!   return to routing on the version they serve if it is the fleet's current one or the
//!   update's target; an engine the update had out of routing mid-turn (its load may still run
//!   in it, and it may still be paused, so SGLang's `/health` cannot pass: only its answering
//!   `/model_info` is checked) returns only through the resumed update's turn (load and verify the target), or,
//!   when the update cannot resume, is restarted on the current version;
//! - an external engine is kept, out of routing (UNHEALTHY) until a health probe passes;
//! - Ray mode: placements are restored with their agents; an engine whose agent still runs it
//!   (Status: same pid and start time) is re-adopted like a kept one; the others are started
//!   again through their agent (or wait for one); placements of dropped engines become desired
//!   absent so the shim releases them.

use crate::adapters::engine_host::Location;
use crate::foundation::host::process_start_ticks;
use crate::ops::manager::Manager;
use crate::ops::weight_update::TurnEngine;
use crate::registry::store::Snapshot;
use rollout_core::ids::{EngineId, UpdateId};
use rollout_core::restore::{self as plan, MidTurn};
use rollout_core::weights::EngineUpdateStatus;
use rollout_core::{EngineEvent, EngineOrigin, EngineStatus};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use crate::foundation::records::RESTARTING;

/// The fleet at start: rebuilt from the store when it holds engines ([`restore`]), else the
/// initial engines reserved (and the published version, and an update in flight, taken back).
/// Runs before any request is served, so no API call can race with it.
pub async fn start(manager: &Arc<Manager>, snapshot: Snapshot) {
    if snapshot.is_empty() {
        // A fleet with no engine left still remembers its published version.
        if let Some(mut weights) = snapshot.weights {
            let resumed = weights.resume_after_restart();
            manager.fleet.update(|inner| {
                inner.weights = weights;
            });
            crate::ops::weight_update::restage_if_missing(manager).await;
            if let Some(update_id) = resumed {
                match resumable(manager).await {
                    Ok(()) => {
                        let m = manager.clone();
                        manager.tasks.spawn(crate::ops::weight_update::resume(m, update_id, Vec::new(), Vec::new()));
                    }
                    Err(why) => manager.fleet.update(|inner| inner.weights.fail_running(&why.to_string())),
                }
            }
        }
        if let Err(e) = crate::ops::scaling::start_initial(manager) {
            tracing::error!(error = %e, "cannot reserve the initial engines");
        }
    } else {
        tracing::info!(engines = snapshot.engines.len(), "restoring the fleet from --state-dir");
        restore(manager, snapshot).await;
    }
}

pub async fn restore(manager: &Arc<Manager>, snapshot: Snapshot) {
    // Re-attach to live keepers first, so nothing adoptable gets killed below.
    let mut adopted = Vec::new();
    for stored in &snapshot.engines {
        let id = stored.record.engine_id();
        let at = if manager.ray() {
            let agent = snapshot.placements.iter().find(|p| &p.engine_id == id).and_then(|p| p.agent.as_ref());
            agent.map(|a| Location::Agent { agent_url: a.url.clone() })
        } else {
            stored
                .keeper_socket
                .as_ref()
                .map(|socket| Location::Local { url: stored.record.url().clone(), keeper_socket: Some(socket.clone()) })
        };
        let Some(at) = at else { continue };
        if stored.record.pid().is_none() {
            continue;
        }
        if let Some(process) = manager.host().status(id, &at, stored.record.pid(), stored.pid_start_ticks).await {
            adopted.push((id.clone(), process));
        }
    }
    let Rebuilt { keep, drop_live, resumed, mid_turn } = rebuild(manager, snapshot, &adopted);
    crate::ops::weight_update::restage_if_missing(manager).await;
    let resumed = match resumed {
        Some(id) => match resumable(manager).await {
            Ok(()) => Some(id),
            Err(why) => {
                tracing::warn!(update_id = %id, error = %why, "the interrupted weight update cannot resume; it ends FAILED");
                manager.fleet.update(|inner| inner.weights.fail_running(&why.to_string()));
                None
            }
        },
        None => None,
    };
    for (id, process) in drop_live {
        tracing::info!(engine_id = %id, pid = process.pid, "stopping a re-attached engine that was being removed");
        process.stop(manager.shutdown_grace()).await;
    }
    let mut readopts = Vec::new();
    let mut restarting = Vec::new();
    for (id, process) in keep {
        let m = manager.clone();
        match process {
            Some(p) => {
                // Caught mid-turn: its turn is the resumed update's (or, when the update cannot
                // resume, it is restarted: a load sent before the crash may still change it).
                let turn = plan::mid_turn(mid_turn.contains(&id), resumed.is_some());
                readopts.push(manager.tasks.spawn(async move { readopt(&m, &id, p, turn).await }));
            }
            None => {
                restarting.push(id.clone());
                manager.tasks.spawn(async move { m.recover(&id, Duration::ZERO).await });
            }
        }
    }
    if let Some(update_id) = resumed {
        let m = manager.clone();
        manager.tasks.spawn(crate::ops::weight_update::resume(m, update_id, readopts, restarting));
    }
}

/// What [`rebuild`] decided.
struct Rebuilt {
    keep: Keep,
    drop_live: DropLive,
    /// The weight update that was in flight, to resume.
    resumed: Option<UpdateId>,
    /// Engines that update had taken out of routing for their turn (WEIGHT_SYNCING, UPDATING).
    mid_turn: HashSet<EngineId>,
}

type Keep = Vec<(EngineId, Option<crate::foundation::host::EngineProcess>)>;
type DropLive = Vec<(EngineId, crate::foundation::host::EngineProcess)>;

fn rebuild(
    manager: &Arc<Manager>,
    snapshot: Snapshot,
    adopted: &[(EngineId, crate::foundation::host::EngineProcess)],
) -> Rebuilt {
    let ray = manager.ray();
    let (rebuilt, stale) = manager.fleet.update(|inner| {
        for p in &snapshot.placements {
            inner.placements.set(p.clone());
        }
        // Past every id and every revision a shim may have seen before the restart.
        if let Some(meta) = &snapshot.meta {
            if snapshot.weights.is_none() {
                // A store written before weights had their own record.
                inner.weights = crate::registry::fleet::WeightsState::new(&meta.weight_version);
            }
        }
        inner.engines.continue_after(snapshot.meta.as_ref().map_or(0, |m| m.next_seq));
        inner.placements.continue_after(snapshot.meta.as_ref().map_or(0, |m| m.placement_revision) + 1);
        let (resumed, mid_turn) = restore_weights(inner, &snapshot);
        let ends = end_interrupted_ops(inner, &snapshot);
        let mut rebuilt = Rebuilt { keep: Vec::new(), drop_live: Vec::new(), resumed, mid_turn };
        let mut stale = Vec::new();
        for stored in snapshot.engines {
            let id = stored.record.engine_id().clone();
            let live = adopted.iter().find(|(a, _)| a == &id).map(|(_, p)| p.clone());
            if live.is_none() && stored.record.origin() != EngineOrigin::External && !ray {
                // Not adoptable: a process still running under the recorded identity is ours.
                if let (Some(pid), Some(ticks)) = (stored.record.pid(), stored.pid_start_ticks) {
                    stale.push((id.clone(), pid, ticks));
                }
            }
            restore_engine(inner, stored, live, &ends, ray, &mut rebuilt);
        }
        release_orphan_placements(inner);
        (rebuilt, stale)
    });
    // Outside the registry's lock: a recorded process that still runs is stopped.
    for (id, pid, ticks) in stale {
        if process_start_ticks(pid) == Some(ticks) {
            tracing::warn!(engine_id = %id, pid, "a recorded engine process still runs; stopping it");
            let group = nix::unistd::Pid::from_raw(pid as i32);
            if let Err(e) = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL) {
                tracing::warn!(engine_id = %id, pid, error = %e, "could not stop the recorded engine process");
            }
        }
    }
    rebuilt
}

/// The stored weights state back in the registry: the update in flight to resume, and the
/// engines it had out of routing mid-turn.
fn restore_weights(
    inner: &mut crate::registry::fleet::FleetInner,
    snapshot: &Snapshot,
) -> (Option<UpdateId>, HashSet<EngineId>) {
    let mut mid_turn = HashSet::new();
    let Some(weights) = &snapshot.weights else { return (None, mid_turn) };
    inner.weights = weights.clone();
    let resumed = inner.weights.resume_after_restart();
    if let Some(u) = inner.weights.running_update() {
        mid_turn.extend(
            snapshot
                .engines
                .iter()
                .filter(|e| {
                    e.record.status() == EngineStatus::WeightSyncing
                        && u.engines()
                            .get(e.record.engine_id())
                            .is_some_and(|p| p.status() == EngineUpdateStatus::Updating)
                })
                .map(|e| e.record.engine_id().clone()),
        );
    }
    (resumed, mid_turn)
}

/// What the operations in flight at the restart leave to do with engines.
#[derive(Default)]
struct OpEnds {
    /// Engines of a failed scale-out that it had not activated.
    rolled_back: HashSet<EngineId>,
    /// Engines of a scale-in, which finishes.
    scale_in_victims: HashSet<EngineId>,
}

/// Ends the operations that were in flight (see the module docs) and puts every operation back.
fn end_interrupted_ops(inner: &mut crate::registry::fleet::FleetInner, snapshot: &Snapshot) -> OpEnds {
    let mut ends = OpEnds::default();
    for op in snapshot.scale_outs.clone() {
        let id = op.request_id().clone();
        let is_active = |id: &str| {
            snapshot.engines.iter().any(|e| e.record.engine_id() == id && e.record.status() == EngineStatus::Active)
        };
        let interrupted = (!op.status().is_terminal()).then(|| plan::interrupted_scale_out(op.engine_ids(), is_active));
        inner.ops.restore_scale_out(op);
        match interrupted {
            None => {}
            Some(plan::InterruptedScaleOut::Complete) => inner.ops.complete_scale_out_after_restart(&id),
            Some(plan::InterruptedScaleOut::Fail { kept, rolled_back }) => {
                let kept = if kept.is_empty() {
                    String::new()
                } else {
                    format!("; the engines it had activated were kept: {}", kept.join(", "))
                };
                let why = format!(
                    "the manager restarted while this operation was in flight; engines it had not activated were rolled back{kept}"
                );
                inner.ops.fail_scale_out_after_restart(&id, why);
                ends.rolled_back.extend(rolled_back);
            }
        }
    }
    for op in snapshot.scale_ins.clone() {
        let id = op.request_id().clone();
        let interrupted = !op.status().is_terminal();
        if interrupted {
            ends.scale_in_victims.extend(op.engine_ids().iter().cloned());
        }
        inner.ops.restore_scale_in(op);
        if interrupted {
            inner.ops.complete_scale_in_after_restart(&id);
        }
    }
    ends
}

/// One stored engine back in the registry as its fate says (`rollout_core::restore::fate`):
/// dropped, watched, adopted or to restart (then in `rebuilt.keep`).
fn restore_engine(
    inner: &mut crate::registry::fleet::FleetInner,
    stored: crate::registry::store::StoredEngine,
    live: Option<crate::foundation::host::EngineProcess>,
    ends: &OpEnds,
    ray: bool,
    rebuilt: &mut Rebuilt,
) {
    let record = stored.record;
    let id = record.engine_id().clone();
    let fate = plan::fate(plan::StoredEngine {
        status: record.status(),
        origin: record.origin(),
        live: live.is_some(),
        scale_in_victim: ends.scale_in_victims.contains(&id),
        rolled_back: ends.rolled_back.contains(&id),
    });
    let status = fate.restored_status();
    let record = match fate {
        plan::Fate::Drop => {
            tracing::info!(engine_id = %id, status = %status.unwrap_or(record.status()), "dropping engine after restart");
            if let Some(p) = live {
                rebuilt.drop_live.push((id, p));
            }
            return;
        }
        plan::Fate::Watch => {
            record.restored(status, false, Some("manager restarted; waiting for a passing health probe".into()))
        }
        plan::Fate::Adopt => record.restored(status, true, None),
        plan::Fate::Restart => record.restored(status, false, Some(RESTARTING.into())),
    };
    // Local managed engines take back their GPUs and port; in Ray mode Ray owns the GPUs
    // and the agent the port.
    let claim = !ray && fate != plan::Fate::Watch;
    match inner.engines.restore(stored.seq, record, live.clone(), stored.keeper_socket, claim) {
        Ok(()) if fate == plan::Fate::Watch => {}
        Ok(()) => {
            // Fate::Restart restores it FAILED, so the mark always takes.
            if fate == plan::Fate::Restart && !inner.engines.queue_restart(&id) {
                tracing::error!(engine_id = %id, "a restored engine to restart is not FAILED");
            }
            rebuilt.keep.push((id, live))
        }
        Err(e) => {
            tracing::error!(engine_id = %id, error = %e, "cannot claim the engine's GPUs after restart; dropping it");
            if let Some(p) = live {
                rebuilt.drop_live.push((id, p));
            }
        }
    }
}

/// Placements whose engine is gone (removed, rolled back) become desired absent; the shim
/// releases them.
fn release_orphan_placements(inner: &mut crate::registry::fleet::FleetInner) {
    let engines = &inner.engines;
    inner.placements.change_each(|id, p| {
        let orphan = !engines.contains_key(id) && p.desired == rollout_core::Desired::Present;
        if orphan {
            p.unwant();
        }
        orphan
    });
}

/// Waits until the engine's HTTP server answers `/model_info` (the caller bounds the wait).
async fn wait_answering(
    manager: &Manager,
    engine_id: &EngineId,
) -> Result<(), crate::adapters::engine_api::EngineError> {
    let url = manager.url_of(engine_id).ok_or(crate::adapters::engine_api::EngineError::Cancelled)?;
    let mut backoff = Duration::from_millis(50);
    while manager.engine_api.probe(&url, "/model_info", Duration::from_secs(5)).await.is_some() {
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
    Ok(())
}

/// Takes a re-attached engine back into service: healthy and on the fleet's version (or the
/// running update's target) -> ACTIVE, no restart; otherwise it is stopped and recovered like a
/// crash. An engine caught mid-turn by the restart is handed to the resumed update instead
/// (answered here, waiting in WEIGHT_SYNCING), or restarted when the update cannot resume.
async fn readopt(
    manager: &Arc<Manager>,
    engine_id: &EngineId,
    process: crate::foundation::host::EngineProcess,
    turn: MidTurn,
) -> Option<TurnEngine> {
    manager.watch_exit(engine_id.clone(), process.clone());
    let checked = async {
        if turn == MidTurn::Restart {
            return Err(crate::adapters::engine_api::EngineError::NotSynced(
                "it was loading weights for an update that cannot resume".into(),
            ));
        }
        if turn == MidTurn::HandOver {
            // Its turn paused it, and the dead manager never continued it: SGLang's /health
            // (a generation) cannot pass until the resumed turn does. Alive is enough here.
            wait_answering(manager, engine_id).await?;
        } else {
            manager.wait_healthy(engine_id, &manager.shutdown).await?;
        }
        if turn == MidTurn::HandOver {
            return manager.fleet.update(|inner| {
                inner
                    .engines
                    .event(engine_id, EngineEvent::Healthy)
                    .map_err(crate::adapters::engine_api::EngineError::Moved)?;
                let e = inner.engines.get(engine_id).ok_or(crate::adapters::engine_api::EngineError::Cancelled)?;
                Ok(Some((engine_id.clone(), e.record().url().clone(), e.load().clone())))
            });
        }
        manager
            .sync_weights_keeping_current(
                engine_id,
                &[EngineEvent::Healthy, EngineEvent::WeightsSynced, EngineEvent::Activated],
            )
            .await
            .map(|_| None)
    };
    match tokio::time::timeout(Duration::from_secs(60), checked).await {
        Ok(Ok(handed)) => {
            if handed.is_some() {
                tracing::info!(
                    engine_id = %engine_id,
                    pid = process.pid,
                    "re-adopted engine without restart; it finishes its turn in the resumed weight update"
                );
            } else {
                tracing::info!(engine_id = %engine_id, pid = process.pid, "re-adopted engine without restart");
            }
            handed
        }
        outcome => {
            let why = match outcome {
                Ok(Err(e)) => e.to_string(),
                _ => "no answer within 60 s".to_string(),
            };
            tracing::warn!(engine_id = %engine_id, error = %why, "re-adopted engine is not usable; restarting it");
            manager.fleet.update(|inner| {
                inner.engines.fail(engine_id, Some(format!("after restart: {why}")));
            });
            process.stop(manager.shutdown_grace()).await;
            let m = manager.clone();
            let id = engine_id.clone();
            manager.tasks.spawn(async move { m.recover(&id, Duration::ZERO).await });
            None
        }
    }
}

/// Whether the update in flight can go on after the restart: a trainer update cannot (its
/// members are continued); a publish can once its checkpoint is checked (and staged) again.
pub async fn resumable(manager: &Manager) -> Result<(), crate::ops::weight_update::CannotResume> {
    crate::ops::trainer_update::check_resumable(manager).await?;
    crate::ops::weight_update::check_resumable(manager).await
}
