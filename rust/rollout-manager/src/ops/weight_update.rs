//! Running one fleet update (see the module docs of [`crate::adapters::weights`] for the guarantees).
//!
//! Expected flow: a publish answers with the update CHECKSUMMING, and [`checksum_then_run`]
//! hashes the checkpoint (several files at once), checks it against the checksum the publish
//! expected, stages it (relay transport), and moves it to PENDING; nothing is loaded before.
//! Then the update turns UPDATING, and repeats until nothing is left:
//! 1. under the registry lock, pick the next wave ([`rollout_core::weights::next_wave`]): ACTIVE
//!    engines not yet on the target, at most the wave size; they leave routing at once
//!    (ACTIVE -> WEIGHT_SYNCING), so no new request (pinned or not) reaches them;
//! 2. each engine of the wave, concurrently: `rolling` waits for its in-flight requests to end
//!    (up to `--scale-in-drain-timeout`, then the load aborts what is left); `all_at_once` sends
//!    `/pause_generation` with the update's mode instead, and `/continue_generation` after;
//!    then `/update_weights_from_disk {model_path, weight_version}`, then `/model_info` must
//!    report the target version and checksum; then READY -> ACTIVE with the new version;
//! 3. when no wave is left and every READY or ACTIVE engine serves the target, the fleet
//!    version moves to it and the update is COMPLETED (engines still starting were synced to the
//!    target at WEIGHT_SYNCING, see [`crate::ops::manager::Manager::sync_weights`]).
//!
//! Errors: an engine that fails to load or verify is marked FAILED (out of routing) and the
//! update ends FAILED with its reason; then every engine on the failed version is restarted, and
//! failed engines are recovered, on the fleet's current checkpoint (external engines on the
//! failed version go UNHEALTHY instead, and rejoin once the health monitor has them load the
//! current version). An engine that leaves the fleet during its turn (scale-in) is SKIPPED.
//!
//! Restarts: a manager shutdown leaves the update in flight (its message says so); a manager
//! that stops in any way, crash and SIGKILL included, finds it in its store and resumes it
//! ([`resume`], started by [`crate::ops::restore`]): once the engines it kept have settled (re-adopted
//! ones checked against the current version *or* the target, restarted ones launched on the
//! target), the engines caught mid-turn finish their turn first, then the strategy goes on with
//! the engines still behind. Engines caught mid-turn never return to routing on what they
//! report at the restart (a load sent before the crash may still be running in them): their
//! turn loads and verifies the target again.

use crate::adapters::engine_api::{DiskLoad, EngineError};
use crate::ops::manager::Manager;
use crate::registry::weights::Staged;
use rollout_core::ids::{EngineId, UpdateId};
use rollout_core::weights::{next_wave, wave_size, EngineUpdateEvent, EngineView, UpdateStrategy, WeightVersion};
use rollout_core::{EngineEvent, EngineOrigin, EngineStatus};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// How one engine's turn ended.
pub(crate) enum Turn {
    Verified,
    Skipped,
    Failed(String),
}

/// An engine whose turn starts out of routing (WEIGHT_SYNCING): id, URL, in-flight counter.
pub type TurnEngine = (EngineId, String, Arc<crate::registry::fleet::EngineLoad>);

/// Why an update stopped before committing.
enum Stop {
    /// It failed, for this reason.
    Failed(String),
    /// The manager is shutting down: the update stays in flight for a restart to resume.
    Interrupted,
}

/// Hashes a CHECKSUMMING update's checkpoint, stages it and runs the update. A checkpoint that
/// cannot be read, changes while hashed, or does not have the checksum the publish expected ends
/// the update FAILED with the reason, before any engine is touched. A shutdown stops the hashing
/// and leaves the update CHECKSUMMING; a restarted manager hashes it again.
pub async fn checksum_then_run(manager: Arc<Manager>, update_id: UpdateId) {
    let plan = manager.fleet.update(|inner| {
        let u = inner.weights.updates().get(&update_id)?;
        if u.status() != rollout_core::weights::WeightUpdateStatus::Checksumming {
            return None;
        }
        u.hashed_bytes().set(0);
        Some((u.version_record(), u.expected_checksum().clone(), u.hashed_bytes().counter()))
    });
    let Some((mut want, expected, progress)) = plan else { return };
    let path = want.path.clone().unwrap_or_default();
    let dir = std::path::PathBuf::from(&path);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop_hashing = stop.clone();
    let started = tokio::time::Instant::now();
    let mut hashing = tokio::task::spawn_blocking(move || {
        let ckpt = crate::adapters::weights::checkpoint::inspect(&dir)?;
        let checksum = crate::adapters::weights::checkpoint::hash(&ckpt, &progress, &stop_hashing)?;
        Ok::<_, crate::adapters::weights::checkpoint::CheckpointError>((ckpt, checksum))
    });
    let hashed = tokio::select! {
        joined = &mut hashing => joined,
        _ = manager.shutdown.cancelled() => {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let _ = hashing.await;
            manager.fleet.update(|inner| {
                inner.weights.tell(&update_id, |u| format!(
                    "interrupted by the manager's shutdown while hashing {}; a manager restarted on the same --state-dir hashes it again",
                    u.version()
                ));
            });
            return;
        }
    };
    let (ckpt, checksum) = match hashed {
        Ok(Ok(done)) => done,
        Ok(Err(e)) => {
            let why = format!("the checkpoint at {path} could not be hashed: {e}; nothing was loaded");
            return fail(&manager, &update_id, &want, &why).await;
        }
        Err(e) => return fail(&manager, &update_id, &want, &format!("the hashing task failed: {e}")).await,
    };
    tracing::info!(update_id = %update_id, version = %want.version, checksum, bytes = ckpt.total_bytes, files = ckpt.files.len(),
        seconds = started.elapsed().as_secs_f64(), "checkpoint hashed");
    if let Some(expected) = expected.filter(|e| *e != checksum) {
        let why = format!(
            "checksum {expected} given to the publish does not match the checkpoint's checksum {checksum} (SHA-256 of its files' sha256sum listing: the files changed, are incomplete, or the checksum was computed another way); nothing was loaded"
        );
        return fail(&manager, &update_id, &want, &why).await;
    }
    want.checksum = Some(checksum.clone());
    let engine_path = match manager.transport.stage(&want, &manager.weight_nodes()).await {
        Ok(p) => p,
        Err(e) => {
            let why = format!("could not stage the checkpoint: {e}; nothing was loaded");
            return fail(&manager, &update_id, &want, &why).await;
        }
    };
    let go = manager.fleet.update(|inner| {
        let engines = inner
            .engines
            .values()
            .filter(|e| e.status().is_routable())
            .map(|e| e.record().engine_id().clone())
            .collect();
        let staged = Staged {
            checksum: checksum.clone(),
            engine_path: engine_path.clone(),
            total_bytes: ckpt.total_bytes,
            files: ckpt.files.len(),
            engines,
        };
        inner.weights.checksummed(&update_id, staged)
    });
    if go {
        run(manager, update_id).await;
    }
}

/// Runs the update to its end. Never panics; every outcome is recorded on the update.
pub async fn run(manager: Arc<Manager>, update_id: UpdateId) {
    run_with(manager, update_id, Vec::new()).await;
}

/// Resumes an update after a manager restart. `readopts` are the re-adoption tasks of the
/// engines the restore kept alive (each answers the engine if it was caught mid-turn and now
/// waits in WEIGHT_SYNCING for the update); `restarting` are the engines it started again. The
/// update goes on once all of them have settled, so it neither commits before the fleet is
/// back nor takes an engine out of routing that re-adoption is still checking.
pub async fn resume(
    manager: Arc<Manager>,
    update_id: UpdateId,
    readopts: Vec<tokio::task::JoinHandle<Option<TurnEngine>>>,
    restarting: Vec<EngineId>,
) {
    let mut carry = Vec::new();
    for handle in readopts {
        tokio::select! {
            joined = handle => carry.extend(joined.ok().flatten()),
            _ = manager.shutdown.cancelled() => return,
        }
    }
    let mut changes = manager.fleet.subscribe();
    loop {
        let starting = {
            let inner = manager.fleet.lock();
            restarting.iter().any(|id| {
                inner.engines.get(id).is_some_and(|e| {
                    matches!(
                        e.status(),
                        EngineStatus::Creating | EngineStatus::HealthChecking | EngineStatus::WeightSyncing
                    ) || e.restart_queued()
                })
            })
        };
        if !starting {
            break;
        }
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = manager.shutdown.cancelled() => return,
        }
    }
    let checksumming = manager
        .fleet
        .lock()
        .weights
        .updates()
        .get(&update_id)
        .is_some_and(|u| u.status() == rollout_core::weights::WeightUpdateStatus::Checksumming);
    if checksumming {
        tracing::info!(update_id = %update_id, "resuming the weight update: hashing its checkpoint again");
        return checksum_then_run(manager, update_id).await;
    }
    tracing::info!(update_id = %update_id, mid_turn = ?carry.iter().map(|c| &c.0).collect::<Vec<_>>(), "resuming the weight update");
    run_with(manager, update_id, carry).await;
}

async fn run_with(manager: Arc<Manager>, update_id: UpdateId, carry: Vec<TurnEngine>) {
    let plan = manager.fleet.update(|inner| {
        let u = inner.weights.updating(&update_id)?;
        let want = WeightVersion {
            version: u.version().clone(),
            path: Some(u.path().clone()),
            checksum: u.checksum().clone(),
            published_seq: 0,
        };
        Some((want, u.engine_path().clone(), u.strategy(), u.max_unavailable(), u.pause_mode().clone()))
    });
    let Some((want, path, strategy, max_unavailable, pause_mode)) = plan else { return };
    let outcome = converge(&manager, &update_id, &want, &path, strategy, max_unavailable, &pause_mode, carry).await;
    match outcome {
        Ok(()) => {}
        Err(Stop::Failed(why)) => fail(&manager, &update_id, &want, &why).await,
        Err(Stop::Interrupted) => {
            tracing::info!(update_id = %update_id, version = %want.version, "weight update interrupted by the shutdown; left in flight");
            manager.fleet.update(|inner| {
                inner.weights.tell(&update_id, |u| format!(
                    "interrupted by the manager's shutdown while publishing {}; a manager restarted on the same --state-dir resumes it",
                    u.version()
                ));
            });
        }
    }
}

/// Waves until every serving engine is on `want`, then commits. `carry`: engines already out
/// of routing for their turn (caught mid-turn by a restart), taken first.
#[expect(clippy::too_many_arguments, reason = "the update's plan, plus the engines carried over a restart")]
async fn converge(
    manager: &Arc<Manager>,
    update_id: &UpdateId,
    want: &WeightVersion,
    path: &str,
    strategy: UpdateStrategy,
    max_unavailable: Option<u32>,
    pause_mode: &str,
    mut carry: Vec<TurnEngine>,
) -> Result<(), Stop> {
    let mut changes = manager.fleet.subscribe();
    loop {
        if manager.shutdown.is_cancelled() {
            return Err(Stop::Interrupted);
        }
        let wave = next_turns(manager, update_id, want, strategy, max_unavailable, std::mem::take(&mut carry));
        if wave.is_empty() {
            if commit(manager, update_id, want) {
                return Ok(());
            }
            // An engine that returned to routing on an older version (a restart racing the
            // publish) takes its turn next; wake on the next fleet change.
            tokio::select! {
                _ = changes.changed() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = manager.shutdown.cancelled() => {}
            }
            continue;
        }
        tracing::info!(update_id = %update_id, version = %want.version, engines = ?wave.iter().map(|w| &w.0).collect::<Vec<_>>(), "weight update wave");
        let turns = futures::future::join_all(
            wave.iter().map(|(id, url, load)| turn(manager, id, url, load, want, path, strategy, pause_mode)),
        )
        .await;
        // A turn cut short by the shutdown is not the engine's failure: a restart resumes it.
        let interrupted = manager.shutdown.is_cancelled();
        let mut failures = Vec::new();
        manager.fleet.update(|inner| {
            for ((id, _, _), result) in wave.iter().zip(&turns) {
                let w = &mut inner.weights;
                match result {
                    Turn::Verified => w.engine_turn(update_id, id, EngineUpdateEvent::Verified, None),
                    Turn::Skipped => {
                        let why = Some("left the fleet during its turn".into());
                        w.engine_turn(update_id, id, EngineUpdateEvent::Skip, why)
                    }
                    Turn::Failed(_) if interrupted => {}
                    Turn::Failed(why) => {
                        w.engine_turn(update_id, id, EngineUpdateEvent::Fail, Some(why.clone()));
                        failures.push(format!("{id}: {why}"));
                    }
                }
            }
        });
        if interrupted {
            return Err(Stop::Interrupted);
        }
        if !failures.is_empty() {
            return Err(Stop::Failed(failures.join("; ")));
        }
    }
}

/// Takes the next wave out of routing and starts its turns: the carried engines still waiting
/// in WEIGHT_SYNCING (one that failed meanwhile is being recovered; one that left is gone), then,
/// unless a rolling update must first finish an interrupted wave, the next engines not on
/// `want` (`rollout_core::weights::next_wave`).
fn next_turns(
    manager: &Manager,
    update_id: &UpdateId,
    want: &WeightVersion,
    strategy: UpdateStrategy,
    max_unavailable: Option<u32>,
    carry: Vec<TurnEngine>,
) -> Vec<TurnEngine> {
    manager.fleet.update(|inner| {
        // Carried engines still waiting in WEIGHT_SYNCING (one that failed meanwhile is
        // being recovered; one that left is gone).
        let mut out: Vec<TurnEngine> = carry
            .into_iter()
            .filter(|(id, _, load)| {
                inner
                    .engines
                    .get(id)
                    .is_some_and(|e| e.status() == EngineStatus::WeightSyncing && Arc::ptr_eq(e.load(), load))
            })
            .collect();
        if strategy == UpdateStrategy::Rolling && !out.is_empty() {
            // The interrupted wave finishes before the next one starts.
            return out;
        }
        let mut engines: Vec<&crate::registry::fleet::Engine> = inner.engines.values().collect();
        engines.sort_by_key(|e| e.seq());
        let views: Vec<EngineView> = engines
            .iter()
            .map(|e| EngineView {
                engine_id: e.record().engine_id().clone(),
                serving: e.status() == EngineStatus::Active,
                on_target: want
                    .served_by(e.record().weight_version().as_deref(), e.record().weights_checksum().as_deref()),
            })
            .collect();
        let serving = views.iter().filter(|v| v.serving).count();
        let ids = next_wave(&views, wave_size(strategy, max_unavailable, serving));
        for id in ids {
            if inner.engines.event(&id, EngineEvent::UpdateWeights).is_err() {
                continue;
            }
            if let Some(e) = inner.engines.get(&id) {
                out.push((id.clone(), e.record().url().clone(), e.load().clone()));
            }
            inner.weights.engine_turn(update_id, &id, EngineUpdateEvent::Start, None);
        }
        out
    })
}

/// One engine's turn: drain or pause, load, verify, back into routing.
#[expect(clippy::too_many_arguments, reason = "the turn needs the engine, the version and the plan")]
async fn turn(
    manager: &Arc<Manager>,
    id: &EngineId,
    url: &str,
    load: &crate::registry::fleet::EngineLoad,
    want: &WeightVersion,
    path: &str,
    strategy: UpdateStrategy,
    pause_mode: &str,
) -> Turn {
    let work = async {
        // The engine's node may have joined after the publish: staged there first if so.
        let path = manager.weights_path_for(id, want, path).await?;
        let mut abort = false;
        if strategy == UpdateStrategy::Rolling {
            let drain = Duration::from_secs_f64(manager.config.scale_in_drain_timeout);
            abort = tokio::time::timeout(drain, load.wait_idle()).await.is_err();
        } else {
            manager.engine_api.control(url, "/pause_generation", json!({"mode": pause_mode})).await?;
        }
        // An `in_place` pause keeps its requests running: SGLang cannot flush the cache then
        // (their KV, and the prefixes cached before, stay from the old weights).
        let in_place = strategy == UpdateStrategy::AllAtOnce && pause_mode == "in_place";
        let load = DiskLoad {
            path: path.clone(),
            version: want.version.clone(),
            abort_all: abort,
            flush_cache: false,
            timeout: Duration::from_secs_f64(manager.config.weight_update_timeout_secs),
        };
        let loaded = manager.load_checkpoint(url, &load, !in_place).await;
        if strategy == UpdateStrategy::AllAtOnce {
            // Resume even after a failed load: SGLang keeps the old weights then.
            manager.engine_api.control(url, "/continue_generation", json!({})).await?;
        }
        loaded?;
        let (found, checksum) = manager.served_weights(id).await?;
        crate::adapters::engine_api::verify(want, found.as_deref(), checksum.as_deref())?;
        Ok::<_, EngineError>((found, checksum))
    };
    // Out of routing, the engine is not health-probed: an engine that hangs now (frozen, its
    // node stalled) would hold the update for --weight-update-timeout-secs. It is watched here.
    let result = tokio::select! {
        result = work => result,
        why = crate::ops::health::stops_answering(manager, url) => Err(EngineError::Unresponsive(why)),
    };
    finish_turn(manager, id, want, result).await
}

/// The end of one engine's turn in an update: verified, back into routing with the version it
/// reports; or failed, out of routing (FAILED, process stopped; the update's end restarts it);
/// or skipped when it left the fleet meanwhile.
pub(crate) async fn finish_turn(
    manager: &Arc<Manager>,
    id: &EngineId,
    want: &WeightVersion,
    result: Result<(Option<String>, Option<String>), EngineError>,
) -> Turn {
    let left = |inner: &crate::registry::fleet::FleetInner| {
        inner.engines.get(id).is_none_or(|e| matches!(e.status(), EngineStatus::Removing | EngineStatus::Removed))
    };
    match result {
        Ok((found, checksum)) => manager.fleet.update(|inner| {
            if let Some(e) = inner.engines.get_mut(id) {
                e.set_weights(found, checksum);
            }
            let back = inner
                .engines
                .event(id, EngineEvent::WeightsSynced)
                .and_then(|_| inner.engines.event(id, EngineEvent::Activated));
            match back {
                Ok(_) => Turn::Verified,
                Err(_) if left(inner) => Turn::Skipped,
                Err(e) => Turn::Failed(format!("verified but could not return to routing: {e}")),
            }
        }),
        Err(e) => {
            let why = e.to_string();
            let process = manager.fleet.update(|inner| {
                if left(inner) {
                    return None;
                }
                inner.engines.fail(id, Some(format!("weight update to {} failed: {why}", want.version)));
                Some(inner.engines.get(id).and_then(|en| en.process().cloned()))
            });
            match process {
                None => Turn::Skipped,
                Some(p) => {
                    tracing::warn!(engine_id = %id, error = %why, "engine failed its weight update; out of routing");
                    if let Some(p) = p {
                        p.stop(manager.shutdown_grace()).await;
                    }
                    Turn::Failed(why)
                }
            }
        }
    }
}

/// Moves the fleet version to `want` if every ACTIVE engine serves it. An engine READY on
/// another version (a scale-out's, waiting for the rest of its operation) does not hold the
/// commit: the scale-out syncs it again before it activates it (`scale_out::activate`).
pub(crate) fn commit(manager: &Manager, update_id: &UpdateId, want: &WeightVersion) -> bool {
    let committed = manager.fleet.update(|inner| {
        let behind = inner.engines.values().any(|e| {
            e.status() == EngineStatus::Active
                && !want.served_by(e.record().weight_version().as_deref(), e.record().weights_checksum().as_deref())
        });
        if behind {
            return false;
        }
        // Only a running update commits (one that failed meanwhile leaves the version alone).
        if !inner.weights.commit(update_id, want) {
            return false;
        }
        tracing::info!(update_id = %update_id, version = %want.version, "fleet weight version committed");
        true
    });
    if committed {
        retain_current(manager);
    }
    committed
}

/// Lets the transport drop staged copies the fleet no longer uses (on this machine now, on
/// the agents' nodes in the background).
fn retain_current(manager: &Manager) {
    let keep: Vec<String> = manager.fleet.lock().weights.current_engine_path().iter().cloned().collect();
    let on_agents = manager.transport.retain(&keep, &manager.weight_nodes());
    manager.tasks.spawn(on_agents);
}

/// Ends the update FAILED: the fleet stays on its current version; engines FAILED by the update
/// and engines already serving the failed version are restarted on the current checkpoint.
pub(crate) async fn fail(manager: &Arc<Manager>, update_id: &UpdateId, want: &WeightVersion, why: &str) {
    tracing::warn!(update_id = %update_id, version = %want.version, error = why, "weight update failed");
    let restart: Vec<(EngineId, Option<crate::foundation::host::EngineProcess>)> = manager.fleet.update(|inner| {
        inner.weights.fail(update_id, why);
        let current = inner.weights.current().clone();
        // Engines whose turn in this update failed (the update's own record of them).
        let failed_turns: std::collections::HashSet<EngineId> = inner
            .weights
            .updates()
            .get(update_id)
            .map(|u| {
                u.engines()
                    .iter()
                    .filter(|(_, e)| e.status() == rollout_core::weights::EngineUpdateStatus::Failed)
                    .map(|(id, _)| id.clone())
                    .collect()
            })
            .unwrap_or_default();
        let mut out = Vec::new();
        let ids: Vec<EngineId> = inner.engines.keys().cloned().collect();
        for id in ids {
            let Some(e) = inner.engines.get_mut(&id) else { continue };
            if e.record().origin() == EngineOrigin::External {
                // Not ours to restart: out of routing (UNHEALTHY) until the health monitor's
                // rejoin check has it load the current version again.
                let on_failed = e.status() == EngineStatus::Active
                    && !current
                        .served_by(e.record().weight_version().as_deref(), e.record().weights_checksum().as_deref());
                if on_failed {
                    e.set_last_error(Some(format!("serves {} from a failed update", want.version)));
                    crate::foundation::records::checked(inner.engines.event(&id, EngineEvent::ProbeFailed));
                }
                continue;
            }
            let failed_here = e.status() == EngineStatus::Failed && failed_turns.contains(&id);
            let on_failed = matches!(e.status(), EngineStatus::Ready | EngineStatus::Active)
                && !current.served_by(e.record().weight_version().as_deref(), e.record().weights_checksum().as_deref());
            if on_failed {
                e.set_last_error(Some(format!(
                    "serves {} from a failed update; restarting on {}",
                    want.version, current.version
                )));
                let process = e.process().cloned();
                crate::foundation::records::checked(inner.engines.event(&id, EngineEvent::Fail));
                out.push((id, process));
            } else if failed_here {
                out.push((id, None));
            }
        }
        out
    });
    retain_current(manager);
    for (id, process) in restart {
        let m = manager.clone();
        manager.tasks.spawn(async move {
            if let Some(p) = process {
                p.stop(m.shutdown_grace()).await;
            }
            if m.config.restart_failed_engines && !m.shutdown.is_cancelled() {
                m.recover(&id, Duration::ZERO).await;
            }
        });
    }
}

/// The answer when a new update finds another in flight. Publish and trainer updates check for
/// one first, with their own fuller answer, under the same lock; this is what
/// `WeightsState::start` refusing would say.
pub(crate) fn in_flight(running: &UpdateId) -> crate::ops::op_error::OpError {
    crate::ops::op_error::OpError::conflict(
        "update_in_progress",
        format!("update {running} is in flight; wait for it to end (GET /rollout/weights/updates/{running})"),
    )
}

/// Why the weight update in flight cannot go on after a manager restart (it then ends FAILED
/// with this as its error).
#[derive(Debug, thiserror::Error)]
pub enum CannotResume {
    #[error(
        "a trainer update cannot resume after a manager restart (the trainer's broadcast was cut); the trainer updates again"
    )]
    TrainerUpdate,
    #[error("cannot resume after a manager restart: the checkpoint is no longer usable ({0})")]
    CheckpointUnusable(String),
    #[error("cannot resume after a manager restart: the checkpoint at {path} changed (SHA-256 {now} now, {published} published)")]
    CheckpointChanged { path: String, now: String, published: String },
    #[error("cannot resume after a manager restart: {0}")]
    Staging(String),
}

/// After a restart, before any engine is re-adopted: checks that the running update's target can
/// still be loaded, and stages it again where its staged copy is gone. Err: why not (the
/// checkpoint directory vanished or changed, or staging failed); the caller fails the update.
pub async fn check_resumable(manager: &crate::ops::manager::Manager) -> Result<(), CannotResume> {
    // An update still CHECKSUMMING loaded nothing and staged nothing: it is simply hashed again.
    let Some((update_id, want, engine_path)) = ({
        let inner = manager.fleet.lock();
        inner.weights.loading_update().map(|u| (u.update_id().clone(), u.version_record(), u.engine_path().clone()))
    }) else {
        return Ok(());
    };
    let path = want.path.clone().unwrap_or_default();
    let dir = std::path::PathBuf::from(&path);
    let info = tokio::task::spawn_blocking(move || crate::adapters::weights::checkpoint::read(&dir))
        .await
        .map_err(|e| CannotResume::CheckpointUnusable(format!("the check did not finish: {e}")))?
        .map_err(|e| CannotResume::CheckpointUnusable(e.to_string()))?;
    if want.checksum.as_deref() != Some(info.checksum.as_str()) {
        return Err(CannotResume::CheckpointChanged {
            path,
            now: info.checksum,
            published: want.checksum.unwrap_or_else(|| "-".into()),
        });
    }
    if manager.ray() || std::path::Path::new(&engine_path).exists() {
        // On agents' nodes the copy is checked (and staged if missing) before each load.
        return Ok(());
    }
    tracing::warn!(update_id = %update_id, version = %want.version, path = %engine_path, "the update's staged copy is gone; staging it again");
    let staged = manager
        .transport
        .stage(&want, &[crate::adapters::weights::transport::Node::Local])
        .await
        .map_err(|e| CannotResume::Staging(e.to_string()))?;
    manager.fleet.update(|inner| inner.weights.restaged_update(&update_id, staged));
    Ok(())
}

/// After a restart in local mode: when the current version's engine copy is gone (a reboot
/// emptied the relay's `/dev/shm`), stages it again from the published directory before any
/// engine launches on it. (Engines on agents check their own node when they load it, as every
/// engine does: [`crate::ops::manager::Manager::weights_path_for`].)
pub async fn restage_if_missing(manager: &crate::ops::manager::Manager) {
    if manager.ray() {
        return;
    }
    let (current, engine_path) = {
        let inner = manager.fleet.lock();
        (inner.weights.current().clone(), inner.weights.current_engine_path().clone())
    };
    let Some(engine_path) = engine_path else { return };
    if current.path.is_none() || std::path::Path::new(&engine_path).exists() {
        return;
    }
    tracing::warn!(version = %current.version, path = %engine_path, "the current version's engine copy is gone; staging it again");
    match manager.transport.stage(&current, &[crate::adapters::weights::transport::Node::Local]).await {
        Ok(path) => manager.fleet.update(|inner| {
            inner.weights.restaged(&current.version, path);
        }),
        Err(e) => tracing::error!(error = %e, "cannot stage the current version again; engines cannot start on it"),
    }
}
