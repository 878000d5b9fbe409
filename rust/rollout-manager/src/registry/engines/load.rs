//! The live load of one engine as the router counts it, shared by the registry's engine and
//! the data plane (which reads it without the registry lock).

use crate::foundation::slots::SlotQueue;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;

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
    /// The model name the engine serves under, once it is not the fleet's: SGLang renames its
    /// served model to the checkpoint's path on every `/update_weights_from_disk`
    /// (`tokenizer_manager.py`, `_update_model_path_info`, 0.5.23), so the router puts it in the
    /// OpenAI requests that name the fleet (`/v1/responses` refuses any other name with 404; a
    /// name with `:` would be read as base model and LoRA adapter). None: the fleet's name.
    served_as: std::sync::Mutex<Option<Arc<str>>>,
    /// Whether its streams carry only each event's new output (SGLang's
    /// `--incremental-streaming-output`, read from its `/server_info` once it is healthy): 0 not
    /// known, 1 no (each event has the output so far), 2 yes. The router then need not parse a
    /// stream's events to tell.
    streams_increments: std::sync::atomic::AtomicU8,
    /// The ranks its `/server_info` says it has (`tp_size x pp_size`); 0 not known.
    ranks: std::sync::atomic::AtomicU32,
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

    /// The engine serves its model under `name` now (the path of the checkpoint it loaded).
    pub fn serves_as(&self, name: &str) {
        *crate::foundation::locks::Locked::locked(&self.served_as) = Some(Arc::from(name));
    }

    /// Whether the engine's streams carry only each event's new output (None: not known).
    pub fn streams_increments(&self) -> Option<bool> {
        match self.streams_increments.load(Ordering::Relaxed) {
            1 => Some(false),
            2 => Some(true),
            _ => None,
        }
    }

    /// What the engine said of its streams (None: it did not say).
    pub fn set_streams_increments(&self, increments: Option<bool>) {
        let value = match increments {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        };
        self.streams_increments.store(value, Ordering::Relaxed);
    }

    /// The ranks the engine said it has (None: not known).
    pub fn ranks(&self) -> Option<u32> {
        Some(self.ranks.load(Ordering::Relaxed)).filter(|r| *r > 0)
    }

    /// What the engine said of its ranks (None: it did not say).
    pub fn set_ranks(&self, ranks: Option<u32>) {
        self.ranks.store(ranks.unwrap_or(0), Ordering::Relaxed);
    }

    /// The engine serves its model under the fleet's name (a new process).
    pub fn serves_as_fleet(&self) {
        *crate::foundation::locks::Locked::locked(&self.served_as) = None;
    }

    /// The name the engine serves its model under, when it is not the fleet's.
    pub fn served_as(&self) -> Option<Arc<str>> {
        crate::foundation::locks::Locked::locked(&self.served_as).clone()
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
