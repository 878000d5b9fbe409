//! The engines part of the registry: every engine with its runtime handles, and what they hold
//! of the local pool (GPUs, ports). It hands out engine ids in creation order and keeps the
//! GPU and port accounting equal to what its engines hold: an engine enters only through
//! [`Engines::add`] or [`Engines::restore`], leaves only through [`Engines::forget`], and
//! moves through its state machine only through [`Engines::event`].

mod load;
mod record;
pub use load::{EngineLoad, InFlightGuard};
#[cfg(test)]
pub(crate) use record::test_record;
pub use record::EngineRecord;

use crate::foundation::clock::unix_now;
use crate::foundation::host::EngineProcess;
use crate::foundation::slots::SlotQueue;
use rollout_core::ids::{EngineId, OpId};
use rollout_core::{EngineEvent, EngineOrigin, EngineStatus, GpuPool, IllegalTransition};
use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

/// The registry's engines, by id, and the local pool they draw from.
#[derive(Debug)]
pub struct Engines {
    map: BTreeMap<EngineId, Engine>,
    /// Shared by every engine's load: requests waiting for a slot (see [`EngineLoad`]).
    slot_freed: Arc<SlotQueue>,
    /// Whether engines' loads wake the slot queue (a per-engine in-flight cap is set).
    notify_slots: bool,
    next_seq: u64,
    gpus: GpuPool,
    ports_in_use: HashSet<u16>,
    /// Whether FAILED engines count towards the fleet's size: yes when they are restarted
    /// (`--restart-failed-engines`), since they come back; no otherwise.
    count_failed: bool,
}

/// Why the local pool cannot give an engine what it needs.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error(transparent)]
    Gpus(#[from] rollout_core::PlacementError),
    #[error("no free port: {0}")]
    NoPort(std::io::Error),
}

/// What a new engine is registered with ([`Engines::add`]); the part makes its record.
#[derive(Debug, Clone)]
pub struct Registration {
    /// Its first state: CREATING, or PENDING while Ray places it.
    pub status: EngineStatus,
    pub url: String,
    pub origin: EngineOrigin,
    pub model_name: String,
    /// Where its log goes (`<dir>/<engine_id>.log`); None for an external engine.
    pub log_dir: Option<PathBuf>,
    /// The operation that creates it.
    pub created_by: Option<OpId>,
}

impl Engines {
    pub(super) fn new(gpus: u32, slot_freed: Arc<SlotQueue>, notify_slots: bool, count_failed: bool) -> Self {
        Self {
            map: BTreeMap::new(),
            slot_freed,
            notify_slots,
            next_seq: 0,
            gpus: GpuPool::new(gpus),
            ports_in_use: HashSet::new(),
            count_failed,
        }
    }

    pub fn get(&self, engine_id: &str) -> Option<&Engine> {
        self.map.get(engine_id)
    }

    pub fn get_mut(&mut self, engine_id: &str) -> Option<&mut Engine> {
        self.map.get_mut(engine_id)
    }

    pub fn contains_key(&self, engine_id: &str) -> bool {
        self.map.contains_key(engine_id)
    }

    /// Every engine, by id.
    pub fn iter(&self) -> impl Iterator<Item = (&EngineId, &Engine)> {
        self.map.iter()
    }

    /// Every engine, in id order.
    pub fn values(&self) -> impl Iterator<Item = &Engine> {
        self.map.values()
    }

    pub fn keys(&self) -> impl Iterator<Item = &EngineId> {
        self.map.keys()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The rows the store keeps.
    pub(in crate::registry) fn rows(&self) -> &BTreeMap<EngineId, Engine> {
        &self.map
    }

    /// The next creation order to hand out (what the store keeps across restarts).
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// After a restart: continue past every id the previous run handed out.
    pub fn continue_after(&mut self, next_seq: u64) {
        self.next_seq = self.next_seq.max(next_seq);
    }

    /// GPUs not held by any engine (local mode).
    pub fn free_gpus(&self) -> u32 {
        self.gpus.free()
    }

    pub fn total_gpus(&self) -> u32 {
        self.gpus.total()
    }

    /// Engines that count towards the fleet size: every one not being removed, except FAILED
    /// engines that will not be restarted.
    pub fn live_count(&self) -> u32 {
        self.map
            .values()
            .filter(|e| match e.record.status {
                EngineStatus::Removing | EngineStatus::Removed => false,
                EngineStatus::Failed => self.count_failed,
                _ => true,
            })
            .count() as u32
    }

    /// Adds an engine under the next id, built by `record` from that id, with a fresh load.
    /// `held` is what [`Engines::reserve_local`] reserved for it (nothing for external
    /// engines and in Ray mode); it is returned when the engine is forgotten.
    pub fn add(&mut self, held: Held, new: Registration) -> EngineId {
        let seq = self.next_seq;
        let engine_id = EngineId::of_seq(seq);
        self.next_seq += 1;
        let record = EngineRecord::new(engine_id.clone(), new, held.gpus.clone());
        self.insert(seq, record, None, None, held);
        if let Some(e) = self.map.get_mut(&engine_id) {
            e.bringup = Some((tokio::time::Instant::now(), "create"));
        }
        engine_id
    }

    /// Puts back an engine read from the store after a restart, claiming the GPUs and port its
    /// record names when `claim` (local managed engines). Refuses, holding nothing, when they
    /// are not free. An engine already under its id is forgotten first (what it held returned),
    /// also when the claim is then refused.
    pub fn restore(
        &mut self,
        seq: u64,
        record: EngineRecord,
        process: Option<EngineProcess>,
        keeper_socket: Option<PathBuf>,
        claim: bool,
    ) -> Result<(), PoolError> {
        self.forget(&record.engine_id);
        let mut held = Held::default();
        if claim {
            self.gpus.claim(&record.gpu_ids)?;
            held.gpus = record.gpu_ids.clone();
            held.port = rollout_core::EngineAddr::port_of(&record.url);
            if let Some(port) = held.port {
                self.ports_in_use.insert(port);
            }
        }
        self.next_seq = self.next_seq.max(seq + 1);
        self.insert(seq, record, process, keeper_socket, held);
        Ok(())
    }

    /// The one place an engine enters the registry, with a fresh load.
    fn insert(
        &mut self,
        seq: u64,
        record: EngineRecord,
        process: Option<EngineProcess>,
        keeper_socket: Option<PathBuf>,
        held: Held,
    ) {
        let load = Arc::new(EngineLoad::with_slot_notify(self.notify_slots.then(|| self.slot_freed.clone())));
        let engine = Engine {
            seq,
            pid_start_ticks: process.as_ref().and_then(|p| p.start_ticks),
            record,
            process,
            load,
            probe_failures: 0,
            paused_since: None,
            paused_by_control: false,
            bringup: None,
            copying_from: None,
            launched_on: None,
            awaiting_trainer: false,
            transitions: 0,
            up_since: None,
            stayed_up_secs: None,
            crash_streak: 0,
            restart_queued: false,
            keeper_socket,
            held,
        };
        self.map.insert(engine.record.engine_id.clone(), engine);
    }

    /// Reserves `gpus` GPUs and a port for a new local engine. `pick_port` asks the OS for a
    /// free port, given the ones the fleet already holds. On failure nothing stays reserved.
    pub fn reserve_local(
        &mut self,
        gpus: u32,
        pick_port: impl FnOnce(&HashSet<u16>) -> std::io::Result<u16>,
    ) -> Result<Held, PoolError> {
        let gpu_ids = self.gpus.allocate(gpus)?;
        match pick_port(&self.ports_in_use) {
            Ok(port) => {
                self.ports_in_use.insert(port);
                Ok(Held { gpus: gpu_ids, port: Some(port) })
            }
            Err(e) => {
                if let Err(err) = self.gpus.release(&gpu_ids) {
                    tracing::error!(%err, "GPU accounting mismatch releasing GPUs allocated just now");
                }
                Err(PoolError::NoPort(e))
            }
        }
    }

    /// Gives a local engine a new port (before a restart), returning the old one to the pool.
    /// Engines that hold no port of ours (external, Ray mode) are left as they are.
    pub fn move_port(
        &mut self,
        engine_id: &str,
        pick_port: impl FnOnce(&HashSet<u16>) -> std::io::Result<u16>,
        url_of: impl FnOnce(u16) -> String,
    ) -> std::io::Result<()> {
        if self.map.get(engine_id).is_none_or(|e| e.held.port.is_none()) {
            return Ok(());
        }
        let port = pick_port(&self.ports_in_use)?;
        self.ports_in_use.insert(port);
        if let Some(e) = self.map.get_mut(engine_id) {
            if let Some(old) = e.held.port.replace(port) {
                self.ports_in_use.remove(&old);
            }
            e.record.url = url_of(port);
        }
        Ok(())
    }

    /// Returns what an engine holds of the local pool (its GPUs and port); its record no
    /// longer names the GPUs afterwards. Holding nothing, it changes nothing.
    pub fn release_resources(&mut self, engine_id: &str) {
        let Some(e) = self.map.get_mut(engine_id) else { return };
        let held = std::mem::take(&mut e.held);
        if held == Held::default() {
            return;
        }
        e.record.gpu_ids.clear();
        if let Err(err) = self.gpus.release(&held.gpus) {
            tracing::error!(engine_id, %err, "GPU accounting mismatch on release");
        }
        if let Some(port) = held.port {
            self.ports_in_use.remove(&port);
        }
    }

    /// Forgets an engine, returning its GPUs and port first.
    pub fn forget(&mut self, engine_id: &str) -> Option<Engine> {
        self.release_resources(engine_id);
        self.map.remove(engine_id)
    }

    /// Moves an engine through its state machine; logs once; refuses illegal edges.
    pub fn event(&mut self, engine_id: &str, event: EngineEvent) -> Result<EngineStatus, IllegalTransition> {
        let Some(engine) = self.map.get_mut(engine_id) else {
            return Err(IllegalTransition {
                machine: "engine",
                state: format!("unknown engine {engine_id}"),
                event: format!("{event:?}"),
            });
        };
        let from = engine.record.status;
        let to = from.on(event)?;
        tracing::info!(engine_id, %from, %to, "engine");
        engine.record.status = to;
        engine.transitions += 1;
        engine.record.updated_at = unix_now();
        engine.record.is_healthy = matches!(to, EngineStatus::Active | EngineStatus::Draining | EngineStatus::Ready);
        // A client's pause ends when the manager takes the engine over: a weight update (which
        // continues it when done), a failure, a restart or its removal.
        let takes_over = matches!(event, EngineEvent::UpdateWeights)
            || matches!(
                to,
                EngineStatus::Failed
                    | EngineStatus::Removing
                    | EngineStatus::Removed
                    | EngineStatus::Pending
                    | EngineStatus::Creating
            );
        if takes_over && engine.paused_by_control {
            tracing::info!(engine_id, "the client's pause ends: the manager takes the engine over");
            engine.paused_by_control = false;
        }
        match to {
            EngineStatus::Active => {
                engine.up_since.get_or_insert_with(tokio::time::Instant::now);
            }
            EngineStatus::Failed => {
                engine.stayed_up_secs = engine.up_since.take().map(|t| t.elapsed().as_secs_f64());
            }
            _ => {}
        }
        match (event, to) {
            (EngineEvent::Restart, _) => {
                engine.restart_queued = false;
                engine.bringup = Some((tokio::time::Instant::now(), "restart"));
                engine.up_since = None;
                // A new process, judged afresh.
                engine.record.pid = None;
                engine.probe_failures = 0;
            }
            (_, EngineStatus::Active) => {
                if let Some((since, reason)) = engine.bringup.take() {
                    crate::foundation::telemetry::events()
                        .engine_startup_seconds
                        .with_label_values(&[reason])
                        .observe(since.elapsed().as_secs_f64());
                }
            }
            (_, EngineStatus::Failed | EngineStatus::Removing | EngineStatus::Removed) => {
                engine.bringup = None;
                engine.copying_from = None;
                engine.awaiting_trainer = false;
                engine.restart_queued = false;
            }
            _ => {}
        }
        if event == EngineEvent::Healthy {
            // A copy from a seed is over once the engine answers.
            engine.copying_from = None;
        }
        Ok(to)
    }

    /// A restarted manager found this FAILED engine gone and starts it again: it is marked so
    /// until its Restart edge. False (nothing marked) when it is unknown or not FAILED.
    pub fn queue_restart(&mut self, engine_id: &str) -> bool {
        match self.map.get_mut(engine_id).filter(|e| e.record.status == EngineStatus::Failed) {
            Some(e) => {
                e.restart_queued = true;
                true
            }
            None => false,
        }
    }

    /// Records `error` (when given) as the engine's last error and marks it FAILED if it can
    /// fail: `false` (the status unchanged) when it is unknown, already FAILED, or on its way
    /// out (REMOVING, REMOVED), where a failure changes nothing.
    pub fn fail(&mut self, engine_id: &str, error: Option<String>) -> bool {
        let Some(e) = self.map.get_mut(engine_id) else { return false };
        if error.is_some() {
            e.record.last_error = error;
        }
        // The machine refuses Fail exactly where it would change nothing.
        self.event(engine_id, EngineEvent::Fail).is_ok()
    }
}

/// An engine with its runtime handles. Read through its getters; changed only through the
/// named methods below (and the [`Engines`] part for its status, resources and identity).
#[derive(Debug)]
pub struct Engine {
    /// Creation order; scale-in removes the highest first (LIFO).
    seq: u64,
    record: EngineRecord,
    process: Option<EngineProcess>,
    load: Arc<EngineLoad>,
    /// Consecutive failed health probes.
    probe_failures: u32,
    /// Since when its probes have failed while its scheduler answered (a pause; see
    /// `rollout_core::health`); None once a probe passes or fails outright.
    paused_since: Option<tokio::time::Instant>,
    /// Paused through the RL control plane (`/v1/rl/.../pause_generation`) until it is
    /// continued there: out of routing, and its failed probes while its scheduler answers are
    /// not counted (a hung scheduler still is).
    paused_by_control: bool,
    /// Since when, and why ("create", "restart"), the engine is being brought up: observed as
    /// `rollout_engine_startup_seconds` when it becomes ACTIVE.
    bringup: Option<(tokio::time::Instant, &'static str)>,
    /// Identity of the process beside its pid (see [`crate::registry::store::StoredEngine`]).
    pid_start_ticks: Option<u64>,
    /// Socket of the engine's keeper, when engines outlive the manager.
    keeper_socket: Option<PathBuf>,
    /// The engine it copies its weights from while it starts (SGLang's remote-instance
    /// loading of a version the trainer broadcast); None once it is healthy.
    copying_from: Option<String>,
    /// Ray mode: the agent its latest process was launched through (the placement may since
    /// have been bound to another, when the node went away).
    launched_on: Option<String>,
    /// It runs, but no engine serves the fleet's version to copy it from and the version has
    /// no checkpoint: it waits out of routing (WEIGHT_SYNCING) for the trainer's next update,
    /// which includes it.
    awaiting_trainer: bool,
    /// How many state transitions it has made: a health round's reading of its weight version
    /// is applied only if none happened since the reading was asked for (a weight update moves
    /// the engine through WEIGHT_SYNCING, so an answer from before the update is stale).
    transitions: u64,
    /// Since when it has served (first ACTIVE since its last start); None before that.
    up_since: Option<tokio::time::Instant>,
    /// How long it served before it last failed (None: it never served since its start); read
    /// by the restart budget.
    stayed_up_secs: Option<f64>,
    /// Restarts in a row (`rollout_core::health::restart_decision`).
    crash_streak: u32,
    /// A restarted manager found it gone and starts it again: set from then until its restart
    /// begins (the Restart edge) or it leaves (Fail, Remove), so nobody mistakes it for an
    /// engine that stays FAILED.
    restart_queued: bool,
    /// What this engine holds of the fleet's local pool, returned when it is forgotten.
    held: Held,
}

impl Engine {
    /// Creation order; scale-in removes the highest first (LIFO).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// What the API shows of it (with its in-flight count filled in:
    /// [`Engine::record_now`]).
    pub fn record(&self) -> &EngineRecord {
        &self.record
    }

    /// A copy of the record with the requests in flight now (the live count is kept beside it).
    pub fn record_now(&self) -> EngineRecord {
        let mut r = self.record.clone();
        r.in_flight = self.load.get();
        r
    }

    pub fn id(&self) -> &EngineId {
        &self.record.engine_id
    }

    /// The ranks it takes in a weight-update group: one per GPU the manager gave it, or, for an
    /// engine it did not launch, `tp_size x pp_size` from the engine's `/server_info` (1 until
    /// read).
    pub fn ranks(&self) -> u32 {
        match u32::try_from(self.record.gpu_ids.len()) {
            Ok(0) | Err(_) => self.load.ranks().unwrap_or(1),
            Ok(n) => n,
        }
    }

    pub fn status(&self) -> EngineStatus {
        self.record.status
    }

    pub fn url(&self) -> &str {
        &self.record.url
    }

    pub fn load(&self) -> &Arc<EngineLoad> {
        &self.load
    }

    /// Its process, when the manager started it (or adopted it after a restart).
    pub fn process(&self) -> Option<&EngineProcess> {
        self.process.as_ref()
    }

    /// Consecutive failed health probes.
    pub fn probe_failures(&self) -> u32 {
        self.probe_failures
    }

    /// The engine it copies its weights from while it starts, if any.
    pub fn copying_from(&self) -> Option<&str> {
        self.copying_from.as_deref()
    }

    /// Ray mode: the agent its latest process was launched through.
    pub fn launched_on(&self) -> Option<&str> {
        self.launched_on.as_deref()
    }

    /// Ray mode: its process is being launched through the agent at `agent_url`.
    pub fn launching_on(&mut self, agent_url: &str) {
        self.launched_on = Some(agent_url.to_string());
    }

    /// Whether it waits out of routing for the trainer's next update.
    pub fn awaiting_trainer(&self) -> bool {
        self.awaiting_trainer
    }

    /// State transitions made so far (see the field).
    pub fn transitions(&self) -> u64 {
        self.transitions
    }

    pub fn pid_start_ticks(&self) -> Option<u64> {
        self.pid_start_ticks
    }

    pub fn keeper_socket(&self) -> Option<&PathBuf> {
        self.keeper_socket.as_ref()
    }

    /// What starting its process on this machine needs ([`LaunchFacts`]).
    pub fn launch_facts(&self) -> LaunchFacts {
        LaunchFacts {
            port: rollout_core::EngineAddr::port_of(&self.record.url).unwrap_or(0),
            gpu_ids: self.record.gpu_ids.clone(),
            log_path: self.record.log_path.clone().unwrap_or_default(),
            url: self.record.url.clone(),
        }
    }

    /// Whether a restarted manager is about to start it again (see [`Engines::queue_restart`]).
    pub fn restart_queued(&self) -> bool {
        self.restart_queued
    }

    /// Whether it is being started again after a failure (not yet serving).
    pub fn restarting(&self) -> bool {
        matches!(self.bringup, Some((_, "restart")))
    }

    /// A failed probe while its scheduler answered (a pause): how long it has been paused.
    pub fn paused_for(&mut self, now: tokio::time::Instant) -> f64 {
        let since = *self.paused_since.get_or_insert(now);
        now.duration_since(since).as_secs_f64()
    }

    /// A probe that passed or failed outright: any pause is over.
    pub fn not_paused(&mut self) {
        self.paused_since = None;
    }

    /// Whether it was paused through the RL control plane and not continued yet.
    pub fn paused_by_control(&self) -> bool {
        self.paused_by_control
    }

    /// Paused (true) or continued (false) through the RL control plane.
    pub fn set_paused_by_control(&mut self, paused: bool) {
        self.paused_by_control = paused;
    }

    /// Counts a health probe that counts (passed, or failed outside a pause); the failures in a
    /// row after it.
    pub fn count_probe(&mut self, passed: bool) -> u32 {
        self.probe_failures = if passed { 0 } else { self.probe_failures.saturating_add(1) };
        self.probe_failures
    }

    /// Why it failed or cannot serve, as the API shows it (`last_error`); None clears it.
    pub fn set_last_error(&mut self, why: Option<String>) {
        self.record.last_error = why;
    }

    /// What it waits for, when its status does not say (`detail`); None clears it.
    pub fn set_detail(&mut self, detail: Option<String>) {
        self.record.detail = detail;
    }

    /// The weights it serves, as it reports them (version and checksum together).
    pub fn set_weights(&mut self, version: Option<String>, checksum: Option<String>) {
        self.record.weight_version = version;
        self.record.weights_checksum = checksum;
    }

    /// Ray mode: an agent hosts its placement, on these GPUs of the agent's node.
    pub fn placed_on(&mut self, gpu_ids: Vec<u32>) {
        self.record.detail = None;
        self.record.gpu_ids = gpu_ids;
    }

    /// Its process started: its pid and identity, where it answers and where it logs.
    pub fn started(
        &mut self,
        process: EngineProcess,
        keeper_socket: Option<PathBuf>,
        url: String,
        log_path: Option<PathBuf>,
    ) {
        self.record.pid = Some(process.pid);
        self.pid_start_ticks = process.start_ticks;
        self.process = Some(process);
        self.keeper_socket = keeper_socket;
        self.record.url = url;
        if log_path.is_some() {
            self.record.log_path = log_path;
        }
        // A new process serves under the name it was started with (the fleet's).
        self.load.serves_as_fleet();
    }

    /// Its process is gone (exited, or stopped by the manager).
    pub fn process_gone(&mut self) {
        self.process = None;
    }

    /// Takes its process out (to stop it outside the registry lock, before it is started again
    /// in place). The record keeps the pid until the new process is recorded ([`Engine::started`]):
    /// a manager that dies in between still finds the process, or its keeper, from the store.
    pub fn take_process(&mut self) -> Option<EngineProcess> {
        self.process.take()
    }

    /// It starts by copying the weights of `seed`.
    pub fn copy_from(&mut self, seed: &str) {
        self.copying_from = Some(seed.to_string());
    }

    /// Its copy ended (it answers, or the copy failed).
    pub fn copy_over(&mut self) {
        self.copying_from = None;
    }

    /// Whether it waits out of routing for the trainer's next update, and what it says why.
    pub fn wait_for_trainer(&mut self, awaiting: bool, detail: Option<String>) {
        self.awaiting_trainer = awaiting;
        self.record.detail = detail;
    }

    /// It received the trainer's version it waited for.
    pub fn has_trainer_version(&mut self) {
        self.awaiting_trainer = false;
    }

    /// Whether recovery may restart it now (its crash streak and how long it stayed up against
    /// the budget), without changing anything.
    pub fn restart_decision(
        &self,
        budget: rollout_core::health::RestartBudget,
    ) -> rollout_core::health::RestartDecision {
        rollout_core::health::restart_decision(self.crash_streak, self.stayed_up_secs, budget)
    }

    /// Recovery restarts it as the `streak`-th restart in a row (from [`Engine::restart_decision`]).
    pub fn count_crash(&mut self, streak: u32) {
        self.crash_streak = streak;
        self.stayed_up_secs = None;
    }

    /// Recovery restarts it (counted in `restarts`, which the API and metrics show).
    pub fn count_restart(&mut self) {
        self.record.restarts += 1;
    }

    /// A restart that failed because its agent was lost does not count against its budget.
    pub fn forgive_one_crash(&mut self) {
        self.crash_streak = self.crash_streak.saturating_sub(1);
    }

    /// Its restart budget is spent: it stays FAILED with why, and its log's last lines. Whether
    /// it is the first time this was said.
    pub fn give_up(&mut self, detail: String, log_tail: Vec<String>) -> bool {
        let first = self.record.log_tail.is_none();
        self.record.detail = Some(detail);
        self.record.log_tail = Some(log_tail);
        first
    }
}

/// What starting a local engine's process needs to know of it, read in one step: the port it
/// listens on, its GPUs, its log and its URL. Read when the process starts, not kept from its
/// reservation: a restart moves the engine to a fresh port ([`Engines::move_port`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchFacts {
    pub port: u16,
    pub gpu_ids: Vec<u32>,
    pub log_path: PathBuf,
    pub url: String,
}

/// GPUs and a port of the local pool held by one engine (none for external engines and in Ray
/// mode, where Ray and the agents own them).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Held {
    pub gpus: Vec<u32>,
    pub port: Option<u16>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use record::test_record as record;
    use rollout_core::routing::QueueOrder;

    fn engines(gpus: u32, count_failed: bool) -> Engines {
        Engines::new(gpus, Arc::new(SlotQueue::new(QueueOrder::Fifo)), false, count_failed)
    }

    fn add(engines: &mut Engines, gpus: u32, port: u16) -> EngineId {
        let held = engines.reserve_local(gpus, |_| Ok(port)).unwrap();
        let new = Registration {
            status: EngineStatus::Creating,
            url: format!("http://127.0.0.1:{port}"),
            origin: EngineOrigin::Dynamic,
            model_name: "m".into(),
            log_dir: None,
            created_by: None,
        };
        engines.add(held, new)
    }

    #[test]
    fn ids_follow_creation_order_and_continue_past_a_previous_run() {
        let mut e = engines(4, true);
        assert_eq!((add(&mut e, 1, 1), add(&mut e, 1, 2)), (EngineId::of_seq(0), EngineId::of_seq(1)));
        assert_eq!((e.get("engine_0").unwrap().seq(), e.get("engine_1").unwrap().seq()), (0, 1));
        e.continue_after(7);
        assert_eq!(add(&mut e, 1, 3), "engine_7");
        e.continue_after(2);
        assert_eq!(add(&mut e, 0, 4), "engine_8", "never goes back");
        assert_eq!(e.next_seq(), 9);
    }

    #[test]
    fn what_an_engine_holds_comes_back_when_it_is_forgotten() {
        let mut e = engines(4, true);
        let a = add(&mut e, 3, 30000);
        assert_eq!(e.free_gpus(), 1);
        let facts = e.get(&a).unwrap().launch_facts();
        assert_eq!((facts.port, facts.gpu_ids.len()), (30000, 3), "the record's URL names its port");
        assert!(e.reserve_local(2, |_| Ok(30001)).is_err(), "not enough GPUs");
        assert_eq!(e.free_gpus(), 1, "a refused reservation holds nothing");
        let no_port = e.reserve_local(1, |_| Err(std::io::Error::other("none")));
        assert!(matches!(no_port, Err(PoolError::NoPort(_))));
        assert_eq!(e.free_gpus(), 1, "GPUs taken before the port failed are given back");
        let ports_seen = std::cell::RefCell::new(HashSet::new());
        let held = e.reserve_local(1, |in_use| {
            *ports_seen.borrow_mut() = in_use.clone();
            Ok(30001)
        });
        assert!(ports_seen.borrow().contains(&30000), "the port picker sees the ports held");
        e.release_resources("nobody");
        drop(held);
        assert!(e.forget(&a).is_some());
        assert_eq!(e.free_gpus(), 3, "engine_0's 3 GPUs are back (the last reservation was never added)");
        assert!(e.forget(&a).is_none());
    }

    #[test]
    fn a_restored_engine_claims_what_its_record_names_or_is_refused() {
        let mut e = engines(2, true);
        let mut r = record("engine_4", "ACTIVE");
        r.gpu_ids = vec![0, 1];
        e.restore(4, r.clone(), None, None, true).unwrap();
        assert_eq!((e.free_gpus(), e.next_seq()), (0, 5));
        let mut other = record("engine_5", "ACTIVE");
        other.gpu_ids = vec![1];
        assert!(e.restore(5, other, None, None, true).is_err());
        assert!(!e.contains_key("engine_5"), "refused, it is not in the registry");
        e.restore(4, r, None, None, true).unwrap();
        assert_eq!(e.free_gpus(), 0, "restored again under its id: the old entry gave its GPUs back first");
        e.forget("engine_4");
        assert_eq!(e.free_gpus(), 2);
    }

    #[test]
    fn events_follow_the_state_machine_and_a_restart_is_judged_afresh() {
        let mut e = engines(1, true);
        let id = add(&mut e, 1, 1);
        assert!(e.event("nobody", EngineEvent::Fail).is_err());
        assert!(e.event(&id, EngineEvent::Drain).is_err(), "CREATING cannot drain");
        assert_eq!(e.get(&id).unwrap().transitions(), 0, "a refused edge changes nothing");
        e.get_mut(&id).unwrap().count_probe(false);
        assert!(e.fail(&id, Some("boom".into())));
        assert!(!e.fail(&id, Some("again".into())), "already FAILED");
        let failed = e.get(&id).unwrap();
        assert_eq!((failed.status(), failed.record().last_error.as_deref()), (EngineStatus::Failed, Some("again")));
        assert!(!failed.record().is_healthy);
        assert!(e.queue_restart(&id) && e.get(&id).unwrap().restart_queued());
        assert!(!e.queue_restart("nobody"));
        e.event(&id, EngineEvent::Restart).unwrap();
        let restarted = e.get(&id).unwrap();
        assert!(!restarted.restart_queued(), "the restart began");
        assert!(restarted.restarting());
        assert_eq!((restarted.probe_failures(), restarted.record().pid, restarted.transitions()), (0, None, 2));
        assert!(!e.queue_restart(&id), "only a FAILED engine is queued");
    }

    #[test]
    fn failed_engines_count_towards_the_size_only_when_they_come_back() {
        for (count_failed, want) in [(true, 2), (false, 1)] {
            let mut e = engines(0, count_failed);
            for (i, status) in ["ACTIVE", "FAILED", "REMOVING"].into_iter().enumerate() {
                e.restore(i as u64, record(&format!("engine_{i}"), status), None, None, false).unwrap();
            }
            assert_eq!(e.live_count(), want, "count_failed {count_failed}");
        }
    }
}
