//! The engines part of the registry: every engine with its runtime handles, and what they hold
//! of the local pool (GPUs, ports). It hands out engine ids in creation order and keeps the
//! GPU and port accounting equal to what its engines hold: an engine enters only through
//! [`Engines::add`] or [`Engines::restore`], leaves only through [`Engines::forget`], and
//! moves through its state machine only through [`Engines::event`].

use super::load::EngineLoad;
use crate::foundation::clock::unix_now;
use crate::foundation::host::EngineProcess;
use crate::foundation::records::EngineRecord;
use crate::foundation::slots::SlotQueue;
use rollout_core::{EngineEvent, EngineStatus, GpuPool, IllegalTransition};
use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

/// The registry's engines, by id, and the local pool they draw from.
#[derive(Debug)]
pub struct Engines {
    map: BTreeMap<String, Engine>,
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

/// The engine a new record is for: its id and creation order, from [`Engines::add`].
pub struct NewEngine {
    pub engine_id: String,
    pub seq: u64,
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
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Engine)> {
        self.map.iter()
    }

    /// Every engine, in id order.
    pub fn values(&self) -> impl Iterator<Item = &Engine> {
        self.map.values()
    }

    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.map.keys()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The rows the store keeps.
    pub(in crate::registry) fn rows(&self) -> &BTreeMap<String, Engine> {
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
    pub fn add(&mut self, held: Held, record: impl FnOnce(&NewEngine) -> EngineRecord) -> String {
        let new = NewEngine { engine_id: format!("engine_{}", self.next_seq), seq: self.next_seq };
        self.next_seq += 1;
        let record = record(&new);
        debug_assert_eq!(record.engine_id, new.engine_id);
        self.insert(new.seq, record, None, None, held);
        if let Some(e) = self.map.get_mut(&new.engine_id) {
            e.bringup = Some((tokio::time::Instant::now(), "create"));
        }
        new.engine_id
    }

    /// Puts back an engine read from the store after a restart, claiming the GPUs and port its
    /// record names when `claim` (local managed engines). Refuses, holding nothing, when they
    /// are not free.
    pub fn restore(
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
        self.map.insert(engine.record.engine_id.clone(), engine);
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
    pub fn fail(&mut self, engine_id: &str, error: Option<String>) -> bool {
        let Some(e) = self.map.get_mut(engine_id) else { return false };
        if error.is_some() {
            e.record.last_error = error;
        }
        // The machine refuses Fail exactly where it would change nothing.
        self.event(engine_id, EngineEvent::Fail).is_ok()
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
