//! The fleet registry: every engine and every scale operation, behind one mutex.
//!
//! The mutex is a std `Mutex`: no `.await` ever happens while it is held, so it never blocks
//! the runtime for long. Every update publishes a copy-on-write [`RoutingTable`] (what the data
//! plane reads: routable backends, engines whose requests finish where they are, the version
//! order, whether an update runs; [`Fleet::routes`]), so the data plane never takes the
//! registry lock, and commits the change to the store after releasing the lock.

use crate::foundation::clock::unix_now;
use crate::foundation::host::EngineProcess;
use crate::foundation::locks::{Locked, RwLocked};
use crate::foundation::records::{EngineRecord, RunningOp, ScaleInRecord, ScaleOutRecord};
use crate::foundation::slots::SlotQueue;
use rollout_core::routing::QueueOrder;
use rollout_core::{EngineEvent, EngineStatus, GpuPool, IllegalTransition};
use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use tokio::sync::{watch, Notify};

/// What the router needs to know about one routable engine.
#[derive(Debug, Clone)]
pub struct Backend {
    pub engine_id: String,
    pub url: String,
    /// Host and port of `url`, for the router's connection pool.
    pub authority: String,
    pub weight_version: Option<String>,
    pub load: Arc<EngineLoad>,
}

/// Everything the data plane reads from the registry, published whole (copy-on-write) by every
/// [`Fleet::update`], so a request never takes the registry lock.
#[derive(Debug, Default)]
pub struct RoutingTable {
    /// The engines the router may send new requests to.
    pub backends: Vec<Backend>,
    /// Loads of engines out of routing whose requests still get their answer there
    /// ([`EngineStatus::keeps_its_requests`]).
    finishing: Vec<Arc<EngineLoad>>,
    /// Weight versions the fleet has served, oldest first (orders non-numeric versions for
    /// `min_version` pins).
    pub version_order: Arc<Vec<String>>,
    /// Whether a fleet weight update is in flight (engines may be out of routing for it).
    pub weights_updating: bool,
}

impl RoutingTable {
    /// Whether the engine owning `load` is routable in this table.
    pub fn is_routable(&self, load: &Arc<EngineLoad>) -> bool {
        self.backends.iter().any(|b| Arc::ptr_eq(&b.load, load))
    }

    /// Whether a request sent to the engine owning `load` can no longer expect an answer: the
    /// engine is neither routable nor out of routing in a state that keeps its requests (it
    /// failed its probes, exited, is being started again, or is gone).
    pub fn is_lost(&self, load: &Arc<EngineLoad>) -> bool {
        !self.is_routable(load) && !self.finishing.iter().any(|l| Arc::ptr_eq(l, load))
    }
}

/// Live load of one engine as the router sees it: requests and estimated KV tokens in flight
/// (exact, counted by the router), and the engine's last report of its KV pool (refreshed by
/// the load poller). A notification fires when the last in-flight request ends.
#[derive(Debug, Default)]
pub struct EngineLoad {
    /// Woken (one waiter) whenever a request ends; shared by every engine of a fleet, for the
    /// router's requests waiting on `--max-inflight-per-engine` (None without the cap: nothing
    /// waits, so the request path does not pay for it).
    slot_freed: Option<Arc<SlotQueue>>,
    count: AtomicUsize,
    est_tokens: AtomicU64,
    capacity: AtomicU64,
    reported_tokens: AtomicU64,
    /// Requests ever sent to this engine by the router.
    served: AtomicU64,
    /// Its automatic in-flight cap (`--max-inflight-per-engine auto`), set by the load poller
    /// from the engine's reports; 0 until the first.
    auto_cap: AtomicUsize,
    /// Requests it runs and its running limit, as last reported (0: not reported).
    running: AtomicU64,
    max_running: AtomicU64,
    idle: Notify,
    /// Bumped when the engine's movable requests should move to other engines (it drains for
    /// a scale-in); the router's moving requests watch it (`router::moving`).
    moves: tokio::sync::watch::Sender<u64>,
}

impl EngineLoad {
    /// A load whose ended requests wake the next waiter of `slot_freed`, if given.
    pub fn with_slot_notify(slot_freed: Option<Arc<SlotQueue>>) -> Self {
        Self { slot_freed, ..Self::default() }
    }

    pub fn get(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    pub fn est_tokens(&self) -> u64 {
        self.est_tokens.load(Ordering::Relaxed)
    }

    /// Counts one request of `tokens` estimated KV tokens until the guard drops.
    pub fn enter(self: &Arc<Self>, tokens: u64) -> InFlightGuard {
        self.count.fetch_add(1, Ordering::AcqRel);
        self.served.fetch_add(1, Ordering::Relaxed);
        self.est_tokens.fetch_add(tokens, Ordering::Relaxed);
        InFlightGuard { load: self.clone(), tokens }
    }

    /// Like [`Self::enter`], but only while fewer than `cap` requests are in flight.
    pub fn try_enter(self: &Arc<Self>, tokens: u64, cap: usize) -> Option<InFlightGuard> {
        self.count.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < cap).then_some(n + 1)).ok()?;
        self.served.fetch_add(1, Ordering::Relaxed);
        self.est_tokens.fetch_add(tokens, Ordering::Relaxed);
        Some(InFlightGuard { load: self.clone(), tokens })
    }

    /// Records the engine's own report: KV pool size and tokens in use or queued.
    pub fn report(&self, capacity: u64, used: u64) {
        self.reported_tokens.store(used, Ordering::Relaxed);
        self.capacity.store(capacity, Ordering::Relaxed);
    }

    /// Records the engine's running requests and running limit (0 where not reported).
    pub fn report_running(&self, running: u64, max_running: u64) {
        self.running.store(running, Ordering::Relaxed);
        self.max_running.store(max_running, Ordering::Relaxed);
    }

    /// What the engine last reported, for its automatic cap.
    pub fn engine_report(&self) -> rollout_core::lengths::EngineReport {
        rollout_core::lengths::EngineReport {
            pool_tokens: self.capacity.load(Ordering::Relaxed),
            running: self.running.load(Ordering::Relaxed),
            max_running: self.max_running.load(Ordering::Relaxed),
        }
    }

    /// Sets the automatic in-flight cap.
    pub fn set_auto_cap(&self, cap: usize) {
        self.auto_cap.store(cap, Ordering::Relaxed);
    }

    /// The automatic in-flight cap; None before the load poller set one.
    pub fn auto_cap(&self) -> Option<usize> {
        Some(self.auto_cap.load(Ordering::Relaxed)).filter(|c| *c > 0)
    }

    /// A consistent-enough snapshot for a routing decision.
    pub fn snapshot(&self) -> rollout_core::routing::Load {
        rollout_core::routing::Load {
            in_flight: self.get() as u64,
            est_tokens: self.est_tokens(),
            capacity: self.capacity.load(Ordering::Relaxed),
            reported_tokens: self.reported_tokens.load(Ordering::Relaxed),
        }
    }

    /// Resolves once no request is in flight.
    /// Asks the router to move this engine's movable requests elsewhere.
    pub fn request_moves(&self) {
        self.moves.send_modify(|n| *n += 1);
    }

    /// Whether this engine's requests were asked to move.
    pub fn moves_requested(&self) -> bool {
        *self.moves.borrow() > 0
    }

    /// A watch of [`EngineLoad::request_moves`].
    pub fn move_signal(&self) -> tokio::sync::watch::Receiver<u64> {
        self.moves.subscribe()
    }

    pub async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.get() == 0 {
                return;
            }
            notified.await;
        }
    }
}

#[derive(Debug)]
pub struct InFlightGuard {
    load: Arc<EngineLoad>,
    tokens: u64,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.load.est_tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        if self.load.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.load.idle.notify_waiters();
        }
        if let Some(slot_freed) = &self.load.slot_freed {
            slot_freed.wake_next();
        }
    }
}

/// An engine with its runtime handles.
#[derive(Debug)]
pub struct Engine {
    /// Creation order; scale-in removes the highest first (LIFO).
    pub seq: u64,
    pub record: EngineRecord,
    pub process: Option<EngineProcess>,
    pub load: Arc<EngineLoad>,
    /// Consecutive failed health probes.
    pub probe_failures: u32,
    /// Since when its probes have failed while its scheduler answered (a pause; see
    /// `rollout_core::health`); None once a probe passes or fails outright.
    pub paused_since: Option<tokio::time::Instant>,
    /// Since when, and why ("create", "restart"), the engine is being brought up: observed as
    /// `rollout_engine_startup_seconds` when it becomes ACTIVE.
    pub bringup: Option<(tokio::time::Instant, &'static str)>,
    /// Identity of the process beside its pid (see [`crate::registry::store::StoredEngine`]).
    pub pid_start_ticks: Option<u64>,
    /// Socket of the engine's keeper, when engines outlive the manager.
    pub keeper_socket: Option<PathBuf>,
    /// The engine it copies its weights from while it starts (SGLang's remote-instance
    /// loading of a version the trainer broadcast); None once it is healthy.
    pub copying_from: Option<String>,
    /// It runs, but no engine serves the fleet's version to copy it from and the version has
    /// no checkpoint: it waits out of routing (WEIGHT_SYNCING) for the trainer's next update,
    /// which includes it.
    pub awaiting_trainer: bool,
    /// How many state transitions it has made: a health round's reading of its weight version
    /// is applied only if none happened since the reading was asked for (a weight update moves
    /// the engine through WEIGHT_SYNCING, so an answer from before the update is stale).
    pub transitions: u64,
    /// Since when it has served (first ACTIVE since its last start); None before that.
    pub up_since: Option<tokio::time::Instant>,
    /// How long it served before it last failed (None: it never served since its start); read
    /// by the restart budget.
    pub stayed_up_secs: Option<f64>,
    /// Restarts in a row (`rollout_core::health::restart_decision`).
    pub crash_streak: u32,
    /// What this engine holds of the fleet's local pool, returned when it is forgotten.
    held: Held,
}

/// GPUs and a port of the local pool held by one engine (none for external engines and in Ray
/// mode, where Ray and the agents own them).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Held {
    pub gpus: Vec<u32>,
    pub port: Option<u16>,
}

impl crate::registry::store::EngineRow for Engine {
    fn same_as(&self, w: &crate::registry::store::StoredEngine) -> bool {
        w.seq == self.seq
            && w.pid_start_ticks == self.pid_start_ticks
            && w.keeper_socket == self.keeper_socket
            && w.record == self.record
    }

    fn to_stored(&self) -> crate::registry::store::StoredEngine {
        crate::registry::store::StoredEngine {
            seq: self.seq,
            record: self.record.clone(),
            pid_start_ticks: self.pid_start_ticks,
            keeper_socket: self.keeper_socket.clone(),
        }
    }
}

/// The registry's state. Engines, operation records, weights and placements are read and
/// changed by the use cases under [`Fleet::update`]; the resource accounting (GPUs, ports), the
/// one-operation lock, engine creation order and the placement revision are private and change
/// only through the methods below, which keep them consistent with the engines.
#[derive(Debug)]
pub struct FleetInner {
    pub engines: BTreeMap<String, Engine>,
    /// Shared by every engine's load: requests waiting for a slot (see [`EngineLoad`]).
    slot_freed: Arc<SlotQueue>,
    /// Whether engines' loads wake the slot queue (a per-engine in-flight cap is set).
    notify_slots: bool,
    next_seq: u64,
    gpus: GpuPool,
    ports_in_use: HashSet<u16>,
    pub scale_outs: BTreeMap<String, ScaleOutRecord>,
    pub scale_ins: BTreeMap<String, ScaleInRecord>,
    /// Mutual exclusion: at most one scale operation runs.
    running: Option<RunningOp>,
    /// Published versions, the update in flight and its history.
    pub weights: crate::foundation::records::WeightsState,
    /// Whether FAILED engines count towards the fleet's size: yes when they are restarted
    /// (`--restart-failed-engines`), since they come back; no otherwise.
    count_failed: bool,
    /// Ray mode: the placement of every managed engine (and of removed ones until the shim says
    /// released), by engine id.
    pub placements: BTreeMap<String, rollout_core::Placement>,
    /// Bumped on every placement change; what `GET /rollout/placements?after=` waits on.
    placement_revision: u64,
}

/// The engine a new record is for: its id and creation order, from [`FleetInner::add_engine`].
pub struct NewEngine {
    pub engine_id: String,
    pub seq: u64,
}

impl FleetInner {
    /// Records that the placements changed (wakes long polls through the fleet's change signal).
    pub fn placements_changed(&mut self) {
        self.placement_revision += 1;
    }

    pub fn placement_revision(&self) -> u64 {
        self.placement_revision
    }

    /// After a restart: continue past every id and revision the previous run handed out.
    pub fn continue_after(&mut self, next_seq: u64, placement_revision: u64) {
        self.next_seq = self.next_seq.max(next_seq);
        self.placement_revision = self.placement_revision.max(placement_revision);
    }

    /// The scale operation in progress, if any.
    pub fn running_op(&self) -> Option<&RunningOp> {
        self.running.as_ref()
    }

    /// Takes the one-operation lock for `op`; refuses (naming the holder) while another runs.
    pub fn begin_op(&mut self, op: RunningOp) -> Result<(), RunningOp> {
        match &self.running {
            Some(held) => Err(held.clone()),
            None => {
                self.running = Some(op);
                Ok(())
            }
        }
    }

    /// Frees the one-operation lock if `request_id` holds it.
    pub fn end_op(&mut self, request_id: &str) {
        if self.running.as_ref().is_some_and(|r| r.request_id == request_id) {
            self.running = None;
        }
    }

    /// GPUs not held by any engine (local mode).
    pub fn free_gpus(&self) -> u32 {
        self.gpus.free()
    }

    pub fn total_gpus(&self) -> u32 {
        self.gpus.total()
    }

    /// Adds an engine under the next id, built by `record` from that id, with a fresh load.
    /// `held` is what [`FleetInner::reserve_local`] reserved for it (nothing for external
    /// engines and in Ray mode); it is returned when the engine is forgotten.
    pub fn add_engine(&mut self, held: Held, record: impl FnOnce(&NewEngine) -> EngineRecord) -> String {
        let new = NewEngine { engine_id: format!("engine_{}", self.next_seq), seq: self.next_seq };
        self.next_seq += 1;
        let record = record(&new);
        debug_assert_eq!(record.engine_id, new.engine_id);
        self.insert(new.seq, record, None, None, held);
        if let Some(e) = self.engines.get_mut(&new.engine_id) {
            e.bringup = Some((tokio::time::Instant::now(), "create"));
        }
        new.engine_id
    }

    /// Puts back an engine read from the store after a restart, claiming the GPUs and port its
    /// record names when `claim` (local managed engines). Refuses, holding nothing, when they
    /// are not free.
    pub fn restore_engine(
        &mut self,
        seq: u64,
        record: EngineRecord,
        process: Option<EngineProcess>,
        keeper_socket: Option<PathBuf>,
        claim: bool,
    ) -> Result<(), String> {
        let mut held = Held::default();
        if claim {
            self.gpus.claim(&record.gpu_ids).map_err(|e| e.to_string())?;
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
            bringup: None,
            copying_from: None,
            awaiting_trainer: false,
            transitions: 0,
            up_since: None,
            stayed_up_secs: None,
            crash_streak: 0,
            keeper_socket,
            held,
        };
        self.engines.insert(engine.record.engine_id.clone(), engine);
    }

    /// Reserves `gpus` GPUs and a port for a new local engine. `pick_port` asks the OS for a
    /// free port, given the ones the fleet already holds. On failure nothing stays reserved.
    pub fn reserve_local(
        &mut self,
        gpus: u32,
        pick_port: impl FnOnce(&HashSet<u16>) -> std::io::Result<u16>,
    ) -> Result<Held, String> {
        let gpu_ids = self.gpus.allocate(gpus).map_err(|e| e.to_string())?;
        match pick_port(&self.ports_in_use) {
            Ok(port) => {
                self.ports_in_use.insert(port);
                Ok(Held { gpus: gpu_ids, port: Some(port) })
            }
            Err(e) => {
                if let Err(err) = self.gpus.release(&gpu_ids) {
                    tracing::error!(%err, "GPU accounting mismatch releasing GPUs allocated just now");
                }
                Err(format!("no free port: {e}"))
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
        if self.engines.get(engine_id).is_none_or(|e| e.held.port.is_none()) {
            return Ok(());
        }
        let port = pick_port(&self.ports_in_use)?;
        self.ports_in_use.insert(port);
        if let Some(e) = self.engines.get_mut(engine_id) {
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
        let Some(e) = self.engines.get_mut(engine_id) else { return };
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
    pub fn forget_engine(&mut self, engine_id: &str) -> Option<Engine> {
        self.release_resources(engine_id);
        self.engines.remove(engine_id)
    }

    /// Moves an engine through its state machine; logs once; refuses illegal edges.
    pub fn engine_event(&mut self, engine_id: &str, event: EngineEvent) -> Result<EngineStatus, IllegalTransition> {
        let Some(engine) = self.engines.get_mut(engine_id) else {
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
                engine.bringup = Some((tokio::time::Instant::now(), "restart"));
                engine.up_since = None;
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
            }
            _ => {}
        }
        if event == EngineEvent::Healthy {
            // A copy from a seed is over once the engine answers.
            engine.copying_from = None;
        }
        Ok(to)
    }

    /// Records `error` (when given) as the engine's last error and marks it FAILED if it can
    /// fail: `false` (the status unchanged) when it is unknown, already FAILED, or on its way
    /// out (REMOVING, REMOVED), where a failure changes nothing.
    pub fn fail_engine(&mut self, engine_id: &str, error: Option<String>) -> bool {
        let Some(e) = self.engines.get_mut(engine_id) else { return false };
        if error.is_some() {
            e.record.last_error = error;
        }
        // The machine refuses Fail exactly where it would change nothing.
        self.engine_event(engine_id, EngineEvent::Fail).is_ok()
    }

    /// Forgets the oldest finished operations beyond `keep` of each kind, so a long run (an
    /// autoscaler acting for days) holds a bounded history in memory and in the store.
    pub fn prune_operations(&mut self, keep: usize) {
        fn prune<R>(ops: &mut BTreeMap<String, R>, keep: usize, finished: impl Fn(&R) -> bool, at: impl Fn(&R) -> f64) {
            if ops.len() <= keep {
                return;
            }
            let mut done: Vec<(f64, String)> =
                ops.iter().filter(|(_, r)| finished(r)).map(|(k, r)| (at(r), k.clone())).collect();
            done.sort_by(|a, b| a.0.total_cmp(&b.0));
            let excess = ops.len() - keep;
            for (_, k) in done.into_iter().take(excess) {
                ops.remove(&k);
            }
        }
        prune(&mut self.scale_outs, keep, |r| r.status.is_terminal(), |r| r.created_at);
        prune(&mut self.scale_ins, keep, |r| r.status.is_terminal(), |r| r.created_at);
    }

    /// Engines that count towards the fleet size: every one not being removed, except FAILED
    /// engines that will not be restarted.
    pub fn live_count(&self) -> u32 {
        self.engines
            .values()
            .filter(|e| match e.record.status {
                EngineStatus::Removing | EngineStatus::Removed => false,
                EngineStatus::Failed => self.count_failed,
                _ => true,
            })
            .count() as u32
    }
}

/// Finished operations of each kind kept in memory and in the store.
pub const KEEP_OPERATIONS: usize = 1000;

pub struct Fleet {
    inner: Mutex<FleetInner>,
    /// Durable copy of the registry; every update is committed before [`Fleet::update`] returns.
    store: Option<crate::registry::store::Store>,
    routes: RwLock<Arc<RoutingTable>>,
    /// Bumped on every change, so waiters can wake without polling.
    changes: watch::Sender<u64>,
    /// Registry changes the store could not commit (`rollout_store_write_failures_total`).
    store_failures: AtomicU64,
    /// Health probes by what they found: passed, failed, paused (`rollout_health_probes_total`).
    probes: [AtomicU64; 4],
    slot_freed: Arc<SlotQueue>,
}

/// What a health probe found, for `rollout_health_probes_total`.
#[derive(Debug, Clone, Copy)]
pub enum ProbeResult {
    Passed = 0,
    Failed = 1,
    /// Failed while the engine's scheduler answered: generation paused (not counted).
    Paused = 2,
    /// Failed past the threshold, but kept in routing: the share of serving engines out of
    /// routing was at `--health-max-unhealthy-fraction` (probed again next round).
    Held = 3,
}

impl Fleet {
    pub fn new(
        gpus: u32,
        weight_version: String,
        count_failed: bool,
        store: Option<crate::registry::store::Store>,
        queue_order: QueueOrder,
        notify_slots: bool,
    ) -> Self {
        let slot_freed = Arc::new(SlotQueue::new(queue_order));
        let inner = FleetInner {
            engines: BTreeMap::new(),
            slot_freed: slot_freed.clone(),
            notify_slots,
            next_seq: 0,
            gpus: GpuPool::new(gpus),
            ports_in_use: HashSet::new(),
            scale_outs: BTreeMap::new(),
            scale_ins: BTreeMap::new(),
            running: None,
            weights: crate::foundation::records::WeightsState::new(&weight_version),
            count_failed,
            placements: BTreeMap::new(),
            placement_revision: 0,
        };
        Self {
            inner: Mutex::new(inner),
            store,
            routes: RwLock::new(Arc::new(RoutingTable::default())),
            changes: watch::channel(0).0,
            store_failures: AtomicU64::new(0),
            probes: Default::default(),
            slot_freed,
        }
    }

    /// Wakes one waiter whenever any engine's request ends.
    pub fn slot_queue(&self) -> &Arc<SlotQueue> {
        &self.slot_freed
    }

    /// Locks the registry. A poisoned lock (a panic while held) is recovered: every mutation
    /// leaves the registry consistent before any call that could panic.
    pub fn lock(&self) -> MutexGuard<'_, FleetInner> {
        self.inner.locked()
    }

    /// Runs `f` under the lock, republishes the routing table, persists the change and wakes
    /// waiters. The table is replaced before the lock is released, so tables are published in
    /// the order of the updates that made them (a slow update can never put back an engine a
    /// later one took out of routing). The change is staged for the store under the lock and
    /// committed after it is released ([`crate::registry::store::Store::commit_through`], which writes
    /// the changes of concurrent updates together, in the order they were staged), before this
    /// returns: what the caller does next (start a process, answer a request) happens only once
    /// the change that led to it is durable, and nobody waits for the disk holding the lock.
    pub fn update<R>(&self, f: impl FnOnce(&mut FleetInner) -> R) -> R {
        let mut inner = self.lock();
        let out = f(&mut inner);
        inner.prune_operations(KEEP_OPERATIONS);
        let staged = self.store.as_ref().and_then(|store| {
            let inner = &*inner;
            store.stage(crate::registry::store::Current {
                engines: &inner.engines,
                scale_outs: &inner.scale_outs,
                scale_ins: &inner.scale_ins,
                placements: &inner.placements,
                meta: crate::registry::store::Meta {
                    next_seq: inner.next_seq,
                    weight_version: inner.weights.current.version.clone(),
                    placement_revision: inner.placement_revision,
                },
                weights: &inner.weights,
            })
        });
        let table = self.table_of(&inner);
        *self.routes.write_locked() = Arc::new(table);
        drop(inner);
        if let (Some(store), Some(seq)) = (&self.store, staged) {
            if let Err(e) = store.commit_through(seq) {
                self.store_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "cannot persist the fleet state; it will be retried on the next change");
            }
        }
        self.changes.send_modify(|v| *v += 1);
        out
    }

    /// The routing table of the registry as it is now.
    fn table_of(&self, inner: &FleetInner) -> RoutingTable {
        let mut backends = Vec::new();
        let mut finishing = Vec::new();
        for e in inner.engines.values() {
            let status = e.record.status;
            if status.is_routable() {
                backends.push(Backend {
                    engine_id: e.record.engine_id.clone(),
                    authority: rollout_core::EngineAddr::parse(&e.record.url)
                        .map(|a| a.authority())
                        .unwrap_or_default(),
                    url: e.record.url.clone(),
                    weight_version: e.record.weight_version.clone(),
                    load: e.load.clone(),
                });
            } else if status.keeps_its_requests() {
                finishing.push(e.load.clone());
            }
        }
        let order = inner.weights.version_order();
        let previous = self.routes();
        let version_order =
            if *previous.version_order == order { previous.version_order.clone() } else { Arc::new(order) };
        RoutingTable { backends, finishing, version_order, weights_updating: inner.weights.loading_update().is_some() }
    }

    /// Runs `request` (a request sent to `engine_id`, whose load is `load`, up to its response
    /// headers) unless the engine is lost first ([`RoutingTable::is_lost`]); then the request is
    /// dropped, which closes its connection, and the error says so. The router retries such a
    /// request on another engine, so a client whose request sat on a hung engine gets its answer
    /// from a healthy one as soon as the health probes take the hung one out, instead of waiting
    /// for its restart.
    pub async fn unless_lost<T, E: std::fmt::Display>(
        &self,
        load: &Arc<EngineLoad>,
        request: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, String> {
        let mut changes = self.subscribe();
        tokio::pin!(request);
        loop {
            tokio::select! {
                answer = &mut request => return answer.map_err(|e| e.to_string()),
                changed = changes.changed() => {
                    if changed.is_err() {
                        return request.await.map_err(|e| e.to_string());
                    }
                    if self.routes().is_lost(load) {
                        return Err("the engine left routing (failed health probes or exited) before answering".into());
                    }
                }
            }
        }
    }

    /// The routing table: what the data plane may use now.
    pub fn routes(&self) -> Arc<RoutingTable> {
        self.routes.read_locked().clone()
    }

    pub fn store(&self) -> Option<&crate::registry::store::Store> {
        self.store.as_ref()
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    pub fn count_probe(&self, result: ProbeResult) {
        self.probes[result as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// The fleet's metrics as read now: engines by status, restarts and weight version per
    /// engine, the fleet's version, running operations and updates, store write failures,
    /// health probes (what the alerts of deploy/prometheus/ watch). Engines that are gone have
    /// no series.
    pub fn metric_families(&self) -> Vec<prometheus::proto::MetricFamily> {
        use crate::foundation::telemetry::{counter_vec, gauge_vec};
        use prometheus::core::Collector;
        use rollout_core::weights::WeightUpdateStatus;
        const STATUSES: [EngineStatus; 11] = EngineStatus::ALL;
        let engines = gauge_vec("rollout_engines", "Engines in the registry, by status.", &["status"]);
        for status in STATUSES {
            engines.with_label_values(&[status.to_string()]).set(0);
        }
        let restarts = gauge_vec(
            "rollout_engine_restarts",
            "Times the manager restarted the engine (crash, hang, manager restart).",
            &["engine_id"],
        );
        let versions = gauge_vec(
            "rollout_engine_weight_version_info",
            "The weight version each engine serves (always 1; the version is the label).",
            &["engine_id", "version"],
        );
        let fleet_version = gauge_vec(
            "rollout_weight_version_info",
            "The fleet's weight version: what every routable engine serves once no update runs (always 1).",
            &["version"],
        );
        let updates = gauge_vec(
            "rollout_weight_updates_running",
            "Weight updates in flight, by status (at most one).",
            &["status"],
        );
        for status in [WeightUpdateStatus::Checksumming, WeightUpdateStatus::Pending, WeightUpdateStatus::Updating] {
            updates.with_label_values(&[status.to_string()]).set(0);
        }
        let operations = gauge_vec("rollout_operations_running", "Scale operations in flight, by kind.", &["kind"]);
        let given_up = gauge_vec(
            "rollout_engines_crash_looping",
            "Engines left FAILED because their restart budget is spent (--restart-budget).",
            &[],
        );
        let inner = self.lock();
        let crash_looping = inner
            .engines
            .values()
            .filter(|e| e.record.status == EngineStatus::Failed && e.record.log_tail.is_some())
            .count();
        given_up.with_label_values::<&str>(&[]).set(i64::try_from(crash_looping).unwrap_or(i64::MAX));
        for e in inner.engines.values() {
            engines.with_label_values(&[e.record.status.to_string()]).inc();
            if e.record.status != EngineStatus::Removed {
                let id = e.record.engine_id.as_str();
                restarts.with_label_values(&[id]).set(i64::from(e.record.restarts));
                if let Some(v) = &e.record.weight_version {
                    versions.with_label_values(&[id, v.as_str()]).set(1);
                }
            }
        }
        fleet_version.with_label_values(&[inner.weights.current.version.as_str()]).set(1);
        for u in inner.weights.updates.values().filter(|u| !u.status.is_terminal()) {
            updates.with_label_values(&[u.status.to_string()]).inc();
        }
        let running = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        operations
            .with_label_values(&["scale_out"])
            .set(running(inner.scale_outs.values().filter(|o| !o.status.is_terminal()).count()));
        operations
            .with_label_values(&["scale_in"])
            .set(running(inner.scale_ins.values().filter(|o| !o.status.is_terminal()).count()));
        drop(inner);
        let store = counter_vec(
            "rollout_store_write_failures_total",
            "Registry changes the state store could not commit.",
            &[],
        );
        store.with_label_values::<&str>(&[]).inc_by(self.store_failures.load(Ordering::Relaxed));
        let probes = counter_vec(
            "rollout_health_probes_total",
            "Health probes of serving engines, by result (paused: failed while the engine's scheduler \
             answered, not counted against it; held: failed past the threshold but kept in routing by \
             --health-max-unhealthy-fraction).",
            &["result"],
        );
        for (result, n) in ["passed", "failed", "paused", "held"].iter().zip(&self.probes) {
            probes.with_label_values(&[*result]).inc_by(n.load(Ordering::Relaxed));
        }
        let mut out = Vec::new();
        for c in [&engines, &restarts, &versions, &fleet_version, &updates, &operations, &given_up] {
            out.extend(c.collect());
        }
        out.extend(store.collect());
        out.extend(probes.collect());
        out
    }

    /// Snapshot of every engine not yet removed, oldest first.
    pub fn engine_records(&self) -> Vec<EngineRecord> {
        let inner = self.lock();
        let mut engines: Vec<&Engine> =
            inner.engines.values().filter(|e| e.record.status != EngineStatus::Removed).collect();
        engines.sort_by_key(|e| e.seq);
        engines
            .into_iter()
            .map(|e| {
                let mut r = e.record.clone();
                r.in_flight = e.load.get();
                r
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rollout_core::ScaleOutStatus;

    fn engine(id: &str, status: &str) -> Engine {
        let record = serde_json::json!({
            "engine_id": id, "url": "http://127.0.0.1:30000/", "status": status, "is_healthy": true,
            "origin": "initial", "model_name": "m", "weight_version": "v0", "gpu_ids": [0], "pid": null,
            "started_at": 1.0, "updated_at": 1.0, "log_path": null, "in_flight": 0, "last_error": null,
            "created_by": null, "restarts": 0,
        });
        Engine {
            seq: 0,
            record: serde_json::from_value(record).unwrap(),
            process: None,
            load: Arc::new(EngineLoad::default()),
            probe_failures: 0,
            paused_since: None,
            bringup: None,
            copying_from: None,
            awaiting_trainer: false,
            transitions: 0,
            up_since: None,
            stayed_up_secs: None,
            crash_streak: 0,
            pid_start_ticks: None,
            keeper_socket: None,
            held: Held::default(),
        }
    }

    #[test]
    fn the_routing_table_tells_lost_requests_from_finishing_ones() {
        let fleet = Fleet::new(1, "v0".into(), true, None, QueueOrder::Fifo, false);
        let load = fleet.update(|inner| {
            let e = engine("e1", "ACTIVE");
            let load = e.load.clone();
            inner.engines.insert("e1".into(), e);
            load
        });
        let table = fleet.routes();
        assert!(table.is_routable(&load) && !table.is_lost(&load));
        assert_eq!(table.backends[0].authority, "127.0.0.1:30000");
        assert_eq!(*table.version_order, vec!["v0".to_string()]);
        fleet.update(|inner| inner.engine_event("e1", EngineEvent::Drain).map(drop)).unwrap();
        let table = fleet.routes();
        assert!(!table.is_routable(&load) && !table.is_lost(&load), "a draining engine keeps its requests");
        fleet.update(|inner| inner.engine_event("e1", EngineEvent::Fail).map(drop)).unwrap();
        assert!(fleet.routes().is_lost(&load), "a failed engine's requests are lost");
        // Restarted with a new load: requests counted on the old one are lost.
        fleet.update(|inner| inner.engines.insert("e1".into(), engine("e1", "DRAINING")));
        assert!(fleet.routes().is_lost(&load));
    }

    #[test]
    fn prunes_only_the_oldest_finished_operations() {
        let fleet = Fleet::new(1, "v".into(), true, None, QueueOrder::Fifo, false);
        fleet.update(|inner| {
            for i in 0..5 {
                let now = i as f64;
                let status = if i == 0 { ScaleOutStatus::Pending } else { ScaleOutStatus::Active };
                inner.scale_outs.insert(
                    format!("op{i}"),
                    ScaleOutRecord {
                        request_id: format!("op{i}"),
                        status,
                        model_name: "default".into(),
                        num_replicas: 1,
                        engine_urls: vec![],
                        engine_ids: vec![],
                        failed_engines: vec![],
                        created_at: now,
                        updated_at: now,
                        error_message: None,
                        weight_version: None,
                        message: String::new(),
                        trigger: crate::foundation::records::Trigger::User,
                        history: vec![],
                    },
                );
            }
            inner.prune_operations(3);
            let mut left: Vec<_> = inner.scale_outs.keys().cloned().collect();
            left.sort();
            // The running op0 stays although it is the oldest; op1 and op2 go.
            assert_eq!(left, vec!["op0", "op3", "op4"]);
        });
    }
}
