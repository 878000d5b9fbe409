//! Periodic health probes of serving engines.
//!
//! Every `--health-check-interval-secs`, each ACTIVE or UNHEALTHY engine is probed at
//! `--health-check-endpoint`:
//! - after `--health-failure-threshold` consecutive failures an ACTIVE engine becomes
//!   UNHEALTHY and leaves routing;
//! - an UNHEALTHY engine whose probe passes comes back only once it serves the fleet's weight
//!   version and checksum (`/model_info`; loaded first if it does not), so a rejoining engine
//!   never serves stale weights. That check (a load can take minutes) runs in a task of its
//!   own, so the other engines are still probed meanwhile; the rejoining engine is not probed
//!   until it ends (SGLang's `/health` waits for a load), and is watched for liveness instead.
//!   One that missed a version from the trainer (no checkpoint to load) catches up as a
//!   restarted engine does: WEIGHT_SYNCING, restarted on a copy from an engine that serves it,
//!   or a member of the trainer's next update; an external one, which the manager cannot
//!   restart, stays UNHEALTHY and says why;
//! - a managed engine still failing after three times the threshold (alive but hung) is
//!   stopped and restarted through crash recovery (when `--restart-failed-engines`); external
//!   engines are only re-probed.
//!
//! - a failed probe of an engine whose scheduler still answers a control request
//!   (`/server_info`, which asks it for its internal state) is a pause (a trainer updating its
//!   weights), not counted for `--health-pause-grace-secs`. A hung scheduler does not answer it,
//!   so its failed probes count. (`/v1/loads` is no sign of life: SGLang 0.5.23 answers it from
//!   the last load snapshot in the HTTP process, also when the scheduler hangs.)
//!
//! Engines whose process exits are marked FAILED by the process watcher (`manager.rs`), which
//! also restarts them. Probe counters are kept under the registry lock without publishing a new
//! routing table; only status changes go through `Fleet::update`.

use crate::foundation::locks::Locked;
use crate::ops::manager::Manager;
use rollout_core::health::{counts, verdict as core_verdict, Incarnation, Probe, ProbePolicy, Verdict as CoreVerdict};
use rollout_core::ids::EngineId;
use rollout_core::{EngineEvent, EngineOrigin, EngineStatus};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Engines whose rejoin check (a task of its own) is running.
pub(crate) type Rejoining = Arc<Mutex<HashSet<EngineId>>>;

pub fn spawn_monitor(manager: &Arc<Manager>) {
    let m = manager.clone();
    manager.tasks.spawn(async move {
        let period = Duration::from_secs_f64(m.config.health_check_interval_secs);
        let mut ticker = tokio::time::interval(period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let rejoining = Rejoining::default();
        loop {
            tokio::select! {
                _ = ticker.tick() => probe_all(&m, &rejoining).await,
                _ = m.shutdown.cancelled() => return,
            }
        }
    });
}

/// What the monitor does after a probe, with what it needs to do it.
enum Verdict {
    /// Consecutive failures, and the last one's reason.
    TakeOut(u32, String),
    TryBack,
    Restart,
}

/// The start of `e` a probe is sent to (see [`Incarnation`]).
fn incarnation(e: &crate::registry::fleet::Engine) -> Incarnation {
    Incarnation { url: e.record().url().clone(), pid: e.record().pid(), restarts: e.record().restarts() }
}

pub(crate) async fn probe_all(manager: &Arc<Manager>, rejoining: &Rejoining) {
    let busy = rejoining.locked().clone();
    let targets: Vec<(EngineId, Incarnation)> = manager
        .fleet
        .lock()
        .engines
        .values()
        .filter(|e| matches!(e.status(), EngineStatus::Active | EngineStatus::Unhealthy))
        .filter(|e| !busy.contains(e.record().engine_id()))
        .map(|e| (e.record().engine_id().clone(), incarnation(e)))
        .collect();
    let results = probe(manager, &targets).await;
    let verdicts = judge(manager, results);
    for (id, verdict) in verdicts {
        act(manager, rejoining, id, verdict);
    }
}

/// What one round's probe of an engine found: the engine, the start probed, why it failed
/// (None: passed), and whether its scheduler answered control calls meanwhile (paused).
type Probed<'a> = (&'a EngineId, &'a Incarnation, Option<String>, bool);

/// Probes `targets` at once, each within `--health-check-timeout-secs`, and observes the
/// versions the ACTIVE ones report.
async fn probe<'a>(manager: &Arc<Manager>, targets: &'a [(EngineId, Incarnation)]) -> Vec<Probed<'a>> {
    let timeout = Duration::from_secs_f64(manager.config.health_check_timeout_secs);
    let endpoint = &manager.config.health_check_endpoint;
    // Only the status is read: the body of a probe (of any size) is never buffered, and
    // `timeout` bounds the wait for the headers. A failure keeps its reason for `last_error`.
    // Beside each probe, the version the engine reports (`/model_info`, answered by SGLang's
    // HTTP process): a trainer that updates the engines itself is seen within a round.
    // Bounded by the probe's own timeout, so a frozen engine does not lengthen the round.
    // Only ACTIVE engines: an UNHEALTHY one's version is checked when it tries to rejoin.
    // Each reading is stamped with what the registry knew when it was asked for, and applied
    // only if nothing moved since (see [`observe_versions`]).
    let (asked, weights_seq): (Vec<(EngineId, Incarnation, u64)>, u64) = {
        let inner = manager.fleet.lock();
        let asked = targets
            .iter()
            .filter_map(|(id, at)| {
                let e = inner.engines.get(id).filter(|e| e.status() == EngineStatus::Active)?;
                Some((id.clone(), at.clone(), e.transitions()))
            })
            .collect();
        (asked, inner.weights.next_seq())
    };
    let reported = futures::future::join_all(asked.into_iter().map(|(id, at, transitions)| async move {
        let served =
            tokio::time::timeout(timeout, manager.engine_api.model_info(&at.url)).await.ok().and_then(Result::ok);
        let text = |info: &serde_json::Value, k: &str| info.get(k).and_then(|v| v.as_str()).map(String::from);
        Reported {
            engine_id: id,
            at,
            transitions,
            served: served.map(|i| (text(&i, "weight_version"), text(&i, "weights_checksum"))),
        }
    }));
    let probed = futures::future::join_all(targets.iter().map(|(id, at)| async move {
        let health = manager.engine_api.probe(&at.url, endpoint, timeout);
        if manager.config.health_pause_grace_secs <= 0.0 {
            return (id, at, health.await, false);
        }
        // Then, only if it failed, whether the scheduler answers control calls: if it does,
        // generation is paused. Not at the same time: SGLang's health check passes on any message
        // of the scheduler's while it waits (http_server.py, 0.5.23), so a control answer would
        // make a paused engine's probe pass. A hung engine costs two timeouts per round.
        let failure = health.await;
        let scheduler = match failure {
            Some(_) => manager.engine_api.scheduler_answers(&at.url, timeout).await,
            None => false,
        };
        (id, at, failure, scheduler)
    }));
    let (results, reported) = tokio::join!(probed, reported);
    observe_versions(manager, &reported, weights_seq);
    results
}

/// The verdicts of a round's probes: each counted on its engine (unless probed before a
/// restart, or paused within the grace), then judged by `rollout_core::health`.
fn judge(manager: &Manager, results: Vec<Probed<'_>>) -> Vec<(EngineId, Verdict)> {
    let policy = ProbePolicy {
        threshold: manager.config.health_failure_threshold,
        restart_failed: manager.config.restart_failed_engines,
    };
    let mut inner = manager.fleet.lock();
    let mut out = Vec::new();
    let now = tokio::time::Instant::now();
    for (id, at, failure, paused) in results {
        let Some(engine) = inner.engines.get_mut(id) else { continue };
        // Probed before a restart (or a move): says nothing about the engine there now.
        if incarnation(engine) != *at {
            continue;
        }
        if failure.is_some() && paused && engine.paused_by_control() {
            tracing::debug!(engine_id = %id, "health probe failed while a client paused the engine; not counted");
            manager.fleet.count_probe(crate::registry::fleet::ProbeResult::Paused);
            continue;
        }
        let probe = match (&failure, paused) {
            (None, _) => Probe::Passed,
            (Some(_), false) => Probe::Failed,
            (Some(_), true) => Probe::Paused { for_secs: engine.paused_for(now) },
        };
        if !matches!(probe, Probe::Paused { .. }) {
            engine.not_paused();
        }
        let counted = counts(probe, manager.config.health_pause_grace_secs);
        manager.fleet.count_probe(match counted {
            Some(true) => crate::registry::fleet::ProbeResult::Passed,
            Some(false) => crate::registry::fleet::ProbeResult::Failed,
            None => crate::registry::fleet::ProbeResult::Paused,
        });
        let Some(passed) = counted else {
            tracing::debug!(engine_id = %id, "health probe failed while the engine is paused; not counted");
            continue;
        };
        let managed = engine.record().origin() != EngineOrigin::External;
        let failures = engine.count_probe(passed);
        let verdict = match core_verdict(engine.status(), passed, failures, managed, policy) {
            Some(CoreVerdict::TakeOut) => Verdict::TakeOut(failures, failure.unwrap_or_default()),
            Some(CoreVerdict::TryBack) => Verdict::TryBack,
            Some(CoreVerdict::Restart) => Verdict::Restart,
            None => continue,
        };
        out.push((id.clone(), verdict));
    }
    hold_beyond_the_bound(manager, &mut inner, &mut out);
    out
}

/// Carries out one verdict: out of routing, a rejoin attempt (one at a time per engine), or a
/// restart.
fn act(manager: &Arc<Manager>, rejoining: &Rejoining, id: EngineId, verdict: Verdict) {
    match verdict {
        Verdict::TakeOut(failures, why) => {
            tracing::warn!(engine_id = %id, failures, reason = %why, "engine unhealthy; taken out of routing");
            manager.fleet.update(|inner| {
                if let Some(e) = inner.engines.get_mut(&id) {
                    e.set_last_error(Some(format!("{failures} consecutive failed health probes (last: {why})")));
                }
                if let Err(e) = inner.engines.event(&id, EngineEvent::ProbeFailed) {
                    // It left ACTIVE since the probe (drained, updating, failed): the verdict is moot.
                    tracing::debug!(engine_id = %id, error = %e, "probe verdict no longer applies");
                }
            });
        }
        // Back into routing only on the version it must serve (loaded now if needed).
        Verdict::TryBack => {
            if !rejoining.locked().insert(id.clone()) {
                return;
            }
            let (m, rejoining) = (manager.clone(), rejoining.clone());
            manager.tasks.spawn(async move {
                rejoin(&m, &id).await;
                rejoining.locked().remove(&id);
            });
        }
        Verdict::Restart => {
            tracing::warn!(engine_id = %id, "engine has failed its probes for too long; restarting it");
            let process = manager.fleet.update(|inner| {
                inner.engines.fail(&id, Some("hung: failed health probes; restarting".into()));
                inner.engines.get(&id).and_then(|e| e.process().cloned())
            });
            let m = manager.clone();
            manager.tasks.spawn(async move {
                if let Some(p) = process {
                    p.stop(m.shutdown_grace()).await;
                }
                m.recover(&id, Duration::ZERO).await;
            });
        }
    }
}

/// Keeps the share of serving engines out of routing within `--health-max-unhealthy-fraction`
/// ([`rollout_core::health::takeouts_allowed`]), counting as out every engine out of routing
/// because it failed (UNHEALTHY, FAILED, restarting): when more fail their probes together than may
/// leave, those with the most failures in a row leave and the rest stay in routing, noted on
/// their record and counted as `held`, and are probed again next round.
fn hold_beyond_the_bound(
    manager: &Manager,
    inner: &mut crate::registry::fleet::FleetInner,
    verdicts: &mut Vec<(EngineId, Verdict)>,
) {
    let wanting = verdicts.iter().filter(|(_, v)| matches!(v, Verdict::TakeOut(..))).count();
    if wanting == 0 {
        return;
    }
    // Out because they failed: UNHEALTHY, FAILED, or starting again after a failure (not the
    // ones whose restart budget is spent: they would hold the bound for good).
    let failed_out = |e: &crate::registry::fleet::Engine| match e.status() {
        EngineStatus::Unhealthy => true,
        EngineStatus::Failed => e.record().log_tail().is_none(),
        _ => e.restarting(),
    };
    let (serving, out) = inner.engines.values().fold((0, 0), |(n, out), e| {
        let failed = failed_out(e);
        (n + usize::from(failed || e.status() == EngineStatus::Active), out + usize::from(failed))
    });
    let fraction = manager.config.health_max_unhealthy_fraction;
    let allowed = rollout_core::health::takeouts_allowed(serving, out, wanting, fraction);
    if allowed == wanting {
        return;
    }
    // The most failures in a row first (the longest silent), then the oldest engine.
    let mut order: Vec<(u32, u64, EngineId)> = verdicts
        .iter()
        .filter_map(|(id, v)| match v {
            Verdict::TakeOut(failures, _) => {
                Some((*failures, inner.engines.get(id).map_or(0, |e| e.seq()), id.clone()))
            }
            _ => None,
        })
        .collect();
    order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let held: HashSet<EngineId> = order.into_iter().skip(allowed).map(|(_, _, id)| id).collect();
    verdicts.retain(|(id, _)| !held.contains(id));
    for id in &held {
        manager.fleet.count_probe(crate::registry::fleet::ProbeResult::Held);
        if let Some(e) = inner.engines.get_mut(id) {
            e.set_last_error(Some(format!(
                "{} consecutive failed health probes, but kept in routing: {out} of {serving} engines are already \
                 out after failures, and at most a share of {fraction} may be (--health-max-unhealthy-fraction); \
                 probed again",
                e.probe_failures()
            )));
        }
    }
    tracing::warn!(held = ?held, out, serving, fraction,
        "engines failed their probes past the threshold but stay in routing: too many are out at once");
}

/// Brings an UNHEALTHY engine whose probe passed back into routing, on the version it must
/// serve (loaded now if needed). An engine that stops answering meanwhile stays UNHEALTHY, and
/// the next probes decide (back again, or a restart).
async fn rejoin(manager: &Arc<Manager>, id: &EngineId) {
    let Some(url) = manager.url_of(id) else { return };
    match missed_trainer_version(manager, id).await {
        Some((version, true)) => return rejoin_on_a_copy(manager, id, &version).await,
        Some((version, false)) => {
            let why = format!(
                "cannot rejoin: it missed weight version {version}, which came from the trainer and has no checkpoint, \
                 and an external engine is not restarted on a copy; load that version into it (or detach it and \
                 attach it after the trainer's next update)"
            );
            // Said once: its probes keep passing, so this runs every round.
            let known =
                manager.fleet.lock().engines.get(id).is_some_and(|en| *en.record().last_error() == Some(why.clone()));
            if !known {
                tracing::warn!(engine_id = %id, version, "external engine missed a trainer version; stays out of routing");
                manager.fleet.update(|inner| {
                    if let Some(en) = inner.engines.get_mut(id) {
                        en.set_last_error(Some(why));
                    }
                });
            }
            return;
        }
        None => {}
    }
    let synced = tokio::select! {
        synced = manager.sync_weights(id, &[EngineEvent::ProbeRecovered]) => synced,
        why = stops_answering(manager, &url) => Err(crate::adapters::engine_api::EngineError::Unresponsive(why)),
        () = manager.shutdown.cancelled() => return,
    };
    match synced {
        Ok(_) => tracing::info!(engine_id = %id, "engine healthy again; back in routing"),
        Err(e) => {
            tracing::warn!(engine_id = %id, error = %e, "engine answers but cannot rejoin routing");
            manager.fleet.update(|inner| {
                if let Some(en) = inner.engines.get_mut(id) {
                    en.set_last_error(Some(format!("cannot rejoin: {e}")));
                }
            });
        }
    }
}

/// The fleet's version, if it came from the trainer (no checkpoint to load) and the engine
/// `id` does not serve it; with whether the manager may restart the engine (it is not external).
async fn missed_trainer_version(manager: &Arc<Manager>, id: &EngineId) -> Option<(String, bool)> {
    let (want, managed) = {
        let inner = manager.fleet.lock();
        let (want, path) = inner.weights.desired();
        let engine = inner.engines.get(id)?;
        if path.is_some() || !inner.weights.desired_from_trainer() {
            return None;
        }
        (want, engine.record().origin() != EngineOrigin::External)
    };
    let (found, checksum) = manager.served_weights(id).await.ok()?;
    (!want.served_by(found.as_deref(), checksum.as_deref())).then_some((want.version, managed))
}

/// An UNHEALTHY managed engine that answers again but missed a version from the trainer: out of
/// routing (WEIGHT_SYNCING), restarted on a copy from an engine that serves the version, or a
/// member of the trainer's next update (see `Manager::sync_weights`), then back into routing.
/// If that fails, it is failed and restarted like an engine whose process died.
async fn rejoin_on_a_copy(manager: &Arc<Manager>, id: &EngineId, version: &str) {
    if manager.fleet.update(|inner| inner.engines.event(id, EngineEvent::UpdateWeights)).is_err() {
        return; // no longer UNHEALTHY
    }
    tracing::info!(engine_id = %id, version, "engine answers again but missed the trainer's version; catching up");
    catch_up_out_of_routing(manager, id).await;
}

/// An engine out of routing (WEIGHT_SYNCING) on a version the fleet left: synced to the
/// fleet's version (copied from an engine that serves it, see `Manager::sync_weights`), then
/// back into routing. If that fails, it is failed and restarted like an engine whose process died.
pub(crate) async fn catch_up_out_of_routing(manager: &Arc<Manager>, id: &EngineId) {
    let synced = tokio::select! {
        synced = manager.sync_weights(id, &[EngineEvent::WeightsSynced, EngineEvent::Activated]) => synced,
        () = manager.shutdown.cancelled() => return,
    };
    match synced {
        Ok(_) => tracing::info!(engine_id = %id, "engine caught up; back in routing"),
        Err(e) => {
            tracing::warn!(engine_id = %id, error = %e, "catching up failed; restarting the engine");
            let process = manager.fleet.update(|inner| {
                inner.engines.fail(id, Some(format!("could not catch up with the fleet's weight version: {e}")));
                inner.engines.get(id).and_then(|en| en.process().cloned())
            });
            if let Some(p) = process {
                p.stop(manager.shutdown_grace()).await;
            }
            if manager.config.restart_failed_engines {
                manager.recover(id, Duration::ZERO).await;
            }
        }
    }
}

/// Watches an engine out of routing (loading weights), which the monitor does not probe:
/// resolves once its HTTP server has failed three times `--health-failure-threshold`
/// liveness probes in a row (the bound after which the health monitor restarts a hung
/// engine), one every `--health-check-interval-secs`, each bounded by
/// `--health-check-timeout-secs`; with the last failure's reason. The probe is `/model_info`,
/// which SGLang's HTTP server answers while the scheduler loads weights (`/health` runs a
/// generation, which waits for the load).
pub(crate) async fn stops_answering(manager: &Manager, url: &str) -> String {
    let period = Duration::from_secs_f64(manager.config.health_check_interval_secs);
    let timeout = Duration::from_secs_f64(manager.config.health_check_timeout_secs);
    let limit = manager.config.health_failure_threshold.saturating_mul(3).max(1);
    let mut failures = 0;
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match manager.engine_api.probe(url, "/model_info", timeout).await {
            None => failures = 0,
            Some(why) => {
                failures += 1;
                if failures >= limit {
                    return format!("{failures} liveness probes failed in a row (last: {why})");
                }
            }
        }
    }
}

/// What an engine's `/model_info` said in a health round (`served`: its version and checksum,
/// None: no answer), for the start of the engine (`at`) and the number of state transitions it
/// had made (`transitions`) when the reading was asked for.
struct Reported {
    engine_id: EngineId,
    at: Incarnation,
    transitions: u64,
    served: Option<(Option<String>, Option<String>)>,
}

impl Reported {
    /// The reported version when the reading still describes the engine: the same start, still
    /// ACTIVE, and no transition since it was asked for. An engine the manager updated
    /// meanwhile went through WEIGHT_SYNCING, and what it said before that is stale.
    fn fresh<'a>(&'a self, e: &crate::registry::fleet::Engine) -> Option<&'a (Option<String>, Option<String>)> {
        let same =
            e.status() == EngineStatus::Active && e.transitions() == self.transitions && incarnation(e) == self.at;
        self.served.as_ref().filter(|_| same)
    }
}

/// The registry follows what serving engines report: an ACTIVE engine whose `/model_info`
/// names another version than its record (a trainer that calls SGLang itself) has its record
/// corrected, so pins and metrics see it; once every ACTIVE engine reports the same new
/// version and no update runs, it becomes the fleet's version
/// ([`rollout_core::catchup::observed_version`]), and engines that start later copy it.
/// Readings older than a change the manager made are dropped: an engine updated since, or any
/// change of the fleet's version since `weights_seq` was read.
fn observe_versions(manager: &Manager, reported: &[Reported], weights_seq: u64) {
    let changed = {
        let inner = manager.fleet.lock();
        reported.iter().any(|r| {
            inner
                .engines
                .get(&r.engine_id)
                .is_some_and(|e| r.fresh(e).is_some_and(|(version, _)| *e.record().weight_version() != *version))
        })
    };
    if !changed {
        return;
    }
    manager.fleet.update(|inner| {
        for r in reported {
            let Some(e) = inner.engines.get_mut(&r.engine_id) else { continue };
            let Some((version, checksum)) = r.fresh(e).cloned() else { continue };
            if *e.record().weight_version() == version {
                continue;
            }
            tracing::warn!(engine_id = %r.engine_id, recorded = ?e.record().weight_version(), reports = ?version,
                "engine reports another weight version than recorded (loaded without the manager); the registry follows it");
            e.set_weights(version, checksum);
        }
        if inner.weights.next_seq() != weights_seq {
            return;
        }
        if inner.weights.running().is_some() {
            return;
        }
        let mut active: Vec<&crate::registry::fleet::Engine> =
            inner.engines.values().filter(|e| e.status() == EngineStatus::Active).collect();
        active.sort_by_key(|e| e.seq());
        let serving: Vec<Option<&str>> = active.iter().map(|e| e.record().weight_version().as_deref()).collect();
        let known = inner.weights.seen_versions();
        let known: Vec<&str> = known.iter().map(String::as_str).collect();
        let Some(found) = rollout_core::catchup::observed_version(&inner.weights.current().version, &known, &serving)
        else {
            return;
        };
        let found = found.to_string();
        let ids: Vec<EngineId> = active.iter().map(|e| e.record().engine_id().clone()).collect();
        inner.weights.observe_trainer_version(&found, &ids);
    });
}
