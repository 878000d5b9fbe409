//! The fleet registry: every engine, scale operation, weight update and placement, behind one
//! mutex, in four parts ([`Engines`], [`Operations`], [`WeightsState`], [`Placements`]) that
//! each own their records: private fields, changed only through methods that keep the part's
//! rules (see each module). A [`Fleet::update`] closure gets the parts, never a bare map.
//!
//! The mutex is a std `Mutex`: no `.await` ever happens while it is held, so it never blocks
//! the runtime for long. Every update publishes a copy-on-write [`RoutingTable`] (what the data
//! plane reads: routable backends, engines whose requests finish where they are, the version
//! order, whether an update runs; [`Fleet::routes`]), so the data plane never takes the
//! registry lock, and commits the change to the store after releasing the lock.

mod placements;

pub use crate::registry::engines::{
    Engine, EngineLoad, EngineRecord, Engines, Held, InFlightGuard, LaunchFacts, PoolError, Registration,
};
pub use crate::registry::operations::{Operations, ScaleInRecord, ScaleOutRecord, KEEP_OPERATIONS};
pub use crate::registry::weights::WeightsState;
pub use placements::Placements;

use crate::foundation::locks::{Locked, RwLocked};
use crate::foundation::slots::SlotQueue;
use rollout_core::routing::QueueOrder;
use rollout_core::EngineStatus;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use tokio::sync::watch;

/// The registry's state, in parts; each owns its records behind methods that keep its rules
/// ([`Engines`]: ids, the state machine, the local pool; [`Operations`]: the one-operation
/// lock; [`Placements`]: the revision). The use cases read and change it under
/// [`Fleet::update`].
#[derive(Debug)]
pub struct FleetInner {
    pub engines: Engines,
    pub ops: Operations,
    /// Published versions, the update in flight and its history.
    pub weights: WeightsState,
    /// Ray mode: where each managed engine runs.
    pub placements: Placements,
}

/// What the router needs to know about one routable engine.
#[derive(Debug, Clone)]
pub struct Backend {
    pub engine_id: rollout_core::ids::EngineId,
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
            engines: Engines::new(gpus, slot_freed.clone(), notify_slots, count_failed),
            ops: Operations::default(),
            weights: WeightsState::new(&weight_version),
            placements: Placements::default(),
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
        inner.ops.prune(KEEP_OPERATIONS);
        let staged = self.store.as_ref().and_then(|store| {
            let inner = &*inner;
            let (scale_outs, scale_ins) = inner.ops.rows();
            store.stage(crate::registry::store::Current {
                engines: inner.engines.rows(),
                scale_outs,
                scale_ins,
                placements: inner.placements.rows(),
                meta: crate::registry::store::Meta {
                    next_seq: inner.engines.next_seq(),
                    weight_version: inner.weights.current().version.clone(),
                    placement_revision: inner.placements.revision(),
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
            let status = e.status();
            if status.is_routable() && e.paused_by_control() {
                finishing.push(e.load().clone());
            } else if status.is_routable() {
                backends.push(Backend {
                    engine_id: e.record().engine_id().clone(),
                    authority: rollout_core::EngineAddr::parse(e.record().url())
                        .map(|a| a.authority())
                        .unwrap_or_default(),
                    url: e.record().url().clone(),
                    weight_version: e.record().weight_version().clone(),
                    load: e.load().clone(),
                });
            } else if status.keeps_its_requests() {
                finishing.push(e.load().clone());
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
            .filter(|e| e.status() == EngineStatus::Failed && e.record().log_tail().is_some())
            .count();
        given_up.with_label_values::<&str>(&[]).set(i64::try_from(crash_looping).unwrap_or(i64::MAX));
        for e in inner.engines.values() {
            engines.with_label_values(&[e.status().to_string()]).inc();
            if e.status() != EngineStatus::Removed {
                let id = e.record().engine_id().as_str();
                restarts.with_label_values(&[id]).set(i64::from(e.record().restarts()));
                if let Some(v) = &e.record().weight_version() {
                    versions.with_label_values(&[id, v.as_str()]).set(1);
                }
            }
        }
        fleet_version.with_label_values(&[inner.weights.current().version.as_str()]).set(1);
        for u in inner.weights.updates().values().filter(|u| !u.status().is_terminal()) {
            updates.with_label_values(&[u.status().to_string()]).inc();
        }
        let running = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        operations
            .with_label_values(&["scale_out"])
            .set(running(inner.ops.scale_outs().filter(|o| !o.status().is_terminal()).count()));
        operations
            .with_label_values(&["scale_in"])
            .set(running(inner.ops.scale_ins().filter(|o| !o.status().is_terminal()).count()));
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
            inner.engines.values().filter(|e| e.status() != EngineStatus::Removed).collect();
        engines.sort_by_key(|e| e.seq());
        engines.into_iter().map(Engine::record_now).collect()
    }
}

/// The store keeps an engine as its record and what a restarted manager needs to find its
/// process again.
impl crate::registry::store::EngineRow for Engine {
    fn same_as(&self, w: &crate::registry::store::StoredEngine) -> bool {
        w.seq == self.seq()
            && w.pid_start_ticks == self.pid_start_ticks()
            && w.keeper_socket.as_ref() == self.keeper_socket()
            && w.record == *self.record()
    }

    fn to_stored(&self) -> crate::registry::store::StoredEngine {
        crate::registry::store::StoredEngine {
            seq: self.seq(),
            record: self.record().clone(),
            pid_start_ticks: self.pid_start_ticks(),
            keeper_socket: self.keeper_socket().cloned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::registry::engines::test_record as record;

    #[test]
    fn the_routing_table_tells_lost_requests_from_finishing_ones() {
        let fleet = Fleet::new(1, "v0".into(), true, None, QueueOrder::Fifo, false);
        let load = fleet.update(|inner| {
            inner.engines.restore(0, record("e1", "ACTIVE"), None, None, false).unwrap();
            inner.engines.get("e1").unwrap().load().clone()
        });
        let table = fleet.routes();
        assert!(table.is_routable(&load) && !table.is_lost(&load));
        assert_eq!(table.backends[0].authority, "127.0.0.1:30000");
        assert_eq!(*table.version_order, vec!["v0".to_string()]);
        fleet.update(|inner| inner.engines.event("e1", rollout_core::EngineEvent::Drain).map(drop)).unwrap();
        let table = fleet.routes();
        assert!(!table.is_routable(&load) && !table.is_lost(&load), "a draining engine keeps its requests");
        fleet.update(|inner| inner.engines.event("e1", rollout_core::EngineEvent::Fail).map(drop)).unwrap();
        assert!(fleet.routes().is_lost(&load), "a failed engine's requests are lost");
        // Restarted with a new load: requests counted on the old one are lost.
        fleet.update(|inner| inner.engines.restore(0, record("e1", "DRAINING"), None, None, false)).unwrap();
        assert!(fleet.routes().is_lost(&load));
    }
}
