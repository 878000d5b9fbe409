//! One simulated engine (one `--instances` slot): its DP ranks, status, weight version,
//! pause state, metrics and faults. HTTP handlers hold an `Arc<Engine>`.
//!
//! The engine plays SGLang's front end (the tokenizer manager) too: it knows which rids are
//! open, forwards aborts to the schedulers as SGLang does, and pauses in two layers (new
//! requests wait in the front end in every mode; the schedulers stop only in `retract` and
//! `in_place` mode).

use crate::cli::Config;
use crate::faults::Faults;
use crate::generator::VersionInfo;
use crate::metrics::Metrics;
use crate::scheduler::{NewRequest, Rank, RankConfig, RankLoad, Update};
use crate::weights::WeightsInfo;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{mpsc, watch, Notify};

/// SGLang's `ServerStatus`, as reported by `/server_info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Starting = 0,
    Up = 1,
    ShuttingDown = 2,
    /// A health check timed out (SGLang's `ServerStatus.UnHealthy`); the next one that passes
    /// sets `Up` again. `/ready` is 503 meanwhile; generation is not refused.
    UnHealthy = 3,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Starting => "Starting",
            Status::Up => "Up",
            Status::ShuttingDown => "ShuttingDown",
            Status::UnHealthy => "UnHealthy",
        }
    }
}

/// `pause_generation` modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    Abort,
    Retract,
    InPlace,
}

impl PauseMode {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "abort" => Some(PauseMode::Abort),
            "retract" => Some(PauseMode::Retract),
            "in_place" => Some(PauseMode::InPlace),
            _ => None,
        }
    }
}

/// Wall-clock time in Unix seconds.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// State the scheduler loops and the HTTP handlers both read.
pub struct Shared {
    status: AtomicU8,
    version: RwLock<VersionInfo>,
    /// True while generation is paused; `/generate` handlers wait for it to turn false.
    paused: watch::Sender<bool>,
    /// True while the schedulers are paused (`pause_generation` mode `retract` or `in_place`,
    /// SGLang's `_engine_paused`): no step runs, and waiting requests do not keep a flush
    /// from happening. Mode `abort` pauses only the front end.
    scheduler_paused: AtomicBool,
    /// How many operations hold the scheduler busy (a seed waiting for and sending to a
    /// remote-instance receiver, which SGLang does inside the scheduler's event loop): no step
    /// runs and nothing the scheduler answers is answered meanwhile.
    blocked: watch::Sender<u32>,
    /// Set by the hang fault: nothing answers any more.
    hung: AtomicBool,
    /// Set (to when it happened, Unix seconds) by the scheduler-hang fault: the scheduler stops
    /// (no generation, no health check, no `/server_info`, whose internal state comes from the
    /// scheduler) while the HTTP process still answers what it serves alone (`/model_info`,
    /// `/v1/loads` from the last load snapshot).
    scheduler_hung_at: std::sync::Mutex<Option<f64>>,
    /// Woken whenever a rank may have become fully idle (for `/flush_cache?timeout=`).
    pub idle: Notify,

    /// Counts scheduler steps (and aborts) that sent output, on any DP rank (see
    /// [`Shared::note_output`]).
    outputs: watch::Sender<u64>,
}

impl Shared {
    pub fn new(version: &str) -> Self {
        Self {
            status: AtomicU8::new(Status::Starting as u8),
            version: RwLock::new(VersionInfo::new(version)),
            paused: watch::Sender::new(false),
            scheduler_paused: AtomicBool::new(false),
            blocked: watch::Sender::new(0),
            hung: AtomicBool::new(false),
            scheduler_hung_at: std::sync::Mutex::new(None),
            idle: Notify::new(),
            outputs: watch::Sender::new(0),
        }
    }

    pub fn status(&self) -> Status {
        match self.status.load(Ordering::Acquire) {
            0 => Status::Starting,
            1 => Status::Up,
            3 => Status::UnHealthy,
            _ => Status::ShuttingDown,
        }
    }

    pub fn set_status(&self, s: Status) {
        self.status.store(s as u8, Ordering::Release);
    }

    /// Sets `to` only if the status is `from` now (a health verdict never overrides a
    /// shutdown).
    pub fn transition(&self, from: Status, to: Status) {
        let _ = self.status.compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Called by a scheduler step (or abort) that sent output to a request's owner: what
    /// SGLang's tokenizer manager records as `last_receive_tstamp`.
    pub fn note_output(&self) {
        self.outputs.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver whose `changed()` resolves at the next scheduler output after this call.
    pub fn watch_outputs(&self) -> watch::Receiver<u64> {
        self.outputs.subscribe()
    }

    pub fn version(&self) -> VersionInfo {
        self.version.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub fn set_version(&self, v: &str) {
        *self.version.write().unwrap_or_else(PoisonError::into_inner) = VersionInfo::new(v);
    }

    pub fn is_paused(&self) -> bool {
        *self.paused.borrow()
    }

    pub fn set_paused(&self, p: bool) {
        self.paused.send_replace(p);
    }

    pub fn is_scheduler_paused(&self) -> bool {
        self.scheduler_paused.load(Ordering::Acquire)
    }

    pub fn set_scheduler_paused(&self, p: bool) {
        self.scheduler_paused.store(p, Ordering::Release);
    }

    pub fn is_blocked(&self) -> bool {
        *self.blocked.borrow() > 0
    }

    /// A receiver whose `changed()` resolves when a block begins or ends.
    pub fn watch_blocked(&self) -> watch::Receiver<u32> {
        self.blocked.subscribe()
    }

    /// Holds the schedulers busy until the guard is dropped (see `blocked`).
    pub fn block(self: &Arc<Self>) -> SchedulerBlock {
        self.blocked.send_modify(|n| *n += 1);
        SchedulerBlock(self.clone())
    }

    /// Resolves once no operation holds the schedulers busy.
    pub async fn wait_unblocked(&self) {
        let mut rx = self.blocked.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    /// Resolves once generation is not paused.
    pub async fn wait_unpaused(&self) {
        let mut rx = self.paused.subscribe();
        // The sender lives as long as `self`, so this only fails if we are being torn down.
        let _ = rx.wait_for(|p| !*p).await;
    }

    pub fn is_hung(&self) -> bool {
        self.hung.load(Ordering::Acquire)
    }

    pub fn set_hung(&self) {
        self.hung.store(true, Ordering::Release);
    }

    /// The scheduler stops for good (see `scheduler_hung_at`).
    pub fn set_scheduler_hung(&self) {
        let mut at = self.scheduler_hung_at.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        at.get_or_insert_with(unix_now);
    }

    pub fn is_scheduler_hung(&self) -> bool {
        self.scheduler_hung_at.lock().unwrap_or_else(std::sync::PoisonError::into_inner).is_some()
    }
}

/// The schedulers are busy with something else while this lives (see [`Shared::block`]).
pub struct SchedulerBlock(Arc<Shared>);

impl Drop for SchedulerBlock {
    fn drop(&mut self) {
        self.0.blocked.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// The model the server answers under, as SGLang's tokenizer manager holds it. A successful
/// `/update_weights_from_disk` sets `model_path` and `served_model_name` to the checkpoint's path
/// (even when `--served-model-name` was given: SGLang 0.5.23 `managers/tokenizer_manager.py:2365-2370`,
/// 0.5.8 :1375-1379, 0.5.12 :1554-1558) and `load_format` to the one it loaded with. `/model_info`
/// and `/v1/models` read these; `/server_info` depends on the release
/// ([`crate::api_profile::ServerArgsView`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub model_path: String,
    pub served_model_name: String,
    pub load_format: String,
}

impl Identity {
    /// The launch values.
    pub fn at_launch(cfg: &Config) -> Self {
        Self {
            model_path: cfg.model_path.clone(),
            served_model_name: cfg.served_model_name().to_string(),
            load_format: cfg.load_format.clone(),
        }
    }
}

/// Static facts about the served model, read once at startup.
#[derive(Debug, Clone, Default)]
pub struct ModelMeta {
    pub model_type: Option<String>,
    pub architectures: Option<Vec<String>>,
}

/// One simulated SGLang server.
pub struct Engine {
    pub cfg: Arc<Config>,
    /// Which `--instances` slot this is.
    pub instance: usize,
    pub port: u16,
    pub shared: Arc<Shared>,
    pub ranks: Vec<Arc<Rank>>,
    pub metrics: Metrics,
    pub faults: Faults,
    pub weights: Mutex<WeightsInfo>,
    pub model_meta: ModelMeta,
    /// Held shared by every in-flight `/generate`, exclusively by a weight update that is not
    /// run while paused (so the update waits for in-flight requests, like SGLang's
    /// `model_update_lock`).
    pub model_update_lock: Arc<tokio::sync::RwLock<()>>,
    /// `/generate` calls currently waiting for `continue_generation`.
    pub paused_waiters: AtomicUsize,
    /// Round-robin cursor for DP rank choice.
    next_rank: AtomicUsize,
    pub started_at: SystemTime,
    pub process_start: Instant,
    /// Seconds from process start until this engine became ready (0 until then).
    pub startup_secs: Mutex<f64>,
    /// Weight-update groups, the update session and remote-instance send groups.
    pub weight_sync: crate::weight_sync::WeightSync,
    /// Held while this engine sends its weights to a new instance: one send at a time.
    pub send_lock: tokio::sync::Mutex<()>,
    /// `/health` settings from SGLang's environment variables.
    pub health: crate::health::HealthSettings,
    /// The rids of open `/generate` calls (SGLang's `rid_to_state`), each with whether an abort
    /// was already forwarded for it.
    live: Mutex<HashMap<String, LiveState>>,
    /// A `/flush_cache?timeout=` is waiting for the schedulers to become idle.
    pub flush_pending: AtomicBool,
    /// What the server answers under now (see [`Identity`]).
    identity: RwLock<Identity>,
    /// `SGL_FORCE_SHUTDOWN` (read at startup): a shutdown signal ends the engine at once,
    /// without draining, as a signal to an unhealthy server does.
    pub force_shutdown: bool,
}

impl Engine {
    pub fn new(
        cfg: Arc<Config>,
        instance: usize,
        port: u16,
        weights: WeightsInfo,
        model_meta: ModelMeta,
        process_start: Instant,
    ) -> Self {
        let shared = Arc::new(Shared::new(&cfg.weight_version));
        let rank_cfg = RankConfig::from_config(&cfg);
        let ranks =
            (0..cfg.dp_size as usize).map(|i| Arc::new(Rank::new(i, rank_cfg.clone(), shared.clone()))).collect();
        Self {
            metrics: Metrics::new(&cfg),
            faults: Faults::new(cfg.crash_after_requests, cfg.hang_after_requests, cfg.slow_health),
            instance,
            port,
            shared,
            ranks,
            weights: Mutex::new(weights),
            model_meta,
            model_update_lock: Arc::new(tokio::sync::RwLock::new(())),
            paused_waiters: AtomicUsize::new(0),
            next_rank: AtomicUsize::new(0),
            started_at: SystemTime::now(),
            process_start,
            startup_secs: Mutex::new(0.0),
            weight_sync: Default::default(),
            send_lock: tokio::sync::Mutex::new(()),
            health: crate::health::HealthSettings::from_env(),
            live: Mutex::new(HashMap::new()),
            flush_pending: AtomicBool::new(false),
            identity: RwLock::new(Identity::at_launch(&cfg)),
            force_shutdown: env_flag("SGL_FORCE_SHUTDOWN"),
            cfg,
        }
    }

    /// Picks a DP rank: the requested one if valid, else round robin.
    pub fn pick_rank(&self, requested: Option<i64>) -> Arc<Rank> {
        let n = self.ranks.len().max(1);
        let i = requested
            .and_then(|r| usize::try_from(r).ok())
            .filter(|r| *r < n)
            .unwrap_or_else(|| self.next_rank.fetch_add(1, Ordering::Relaxed) % n);
        self.ranks[i % self.ranks.len()].clone()
    }

    /// Queues a request on a rank; the handle aborts it if dropped before it finishes.
    pub fn submit(&self, rank: Arc<Rank>, req: NewRequestParts, live: LiveRid) -> ReqHandle {
        let (tx, rx) = mpsc::unbounded_channel();
        rank.submit(NewRequest {
            rid: req.rid,
            prompt: req.prompt,
            gen: req.gen,
            stream: req.stream,
            stream_interval: req.stream_interval,
            tx,
        });
        ReqHandle { live, rx, done: false }
    }

    /// Records `rid` as open until the guard is dropped (SGLang's `rid_to_state` entry, made
    /// before the request waits for a pause to end).
    pub fn register_rid(self: &Arc<Self>, rid: &str) -> LiveRid {
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        live.entry(rid.to_string()).or_default().open += 1;
        LiveRid { engine: self.clone(), rid: rid.to_string() }
    }

    fn unregister_rid(&self, rid: &str) {
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(state) = live.get_mut(rid) {
            state.open -= 1;
            if state.open == 0 {
                live.remove(rid);
            }
        }
    }

    /// An abort by rid, as SGLang's front end forwards it (0.5.23
    /// `managers/tokenizer_manager.py:2241-2265`): only when `rid` is exactly the rid of an open
    /// request, and once per request; an empty rid is ignored. The schedulers then abort every
    /// request whose rid *starts with* it (`managers/scheduler.py:5675-5815`), see
    /// [`Rank::abort_where`]. Returns whether it was forwarded. Client disconnects come here too.
    pub fn abort_request(&self, rid: &str) -> bool {
        if rid.is_empty() {
            tracing::warn!(port = self.port, "Ignore abort_request with empty rid and abort_all=False");
            return false;
        }
        {
            let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
            match live.get_mut(rid) {
                Some(state) if !state.abort_sent => state.abort_sent = true,
                _ => return false,
            }
        }
        self.metrics.count_abort_call();
        for r in &self.ranks {
            r.abort_where(|other| other.starts_with(rid));
        }
        true
    }

    /// `abort_all`: every request in the schedulers, waiting or running.
    pub fn abort_all(&self) {
        self.metrics.count_abort_call();
        for r in &self.ranks {
            r.abort_where(|_| true);
        }
    }

    pub fn loads(&self) -> Vec<RankLoad> {
        self.ranks.iter().map(|r| r.load()).collect()
    }

    /// SGLang's `is_fully_idle` over every rank; waiting requests count unless the schedulers
    /// are paused (see [`Rank::is_fully_idle`]).
    pub fn is_fully_idle(&self, ignore_waiting: bool) -> bool {
        self.ranks.iter().all(|r| r.is_fully_idle(ignore_waiting))
    }

    /// The schedulers' `flush_cache` (0.5.23 `managers/scheduler.py:5518-5548`): empties every
    /// rank's prefix cache if all are fully idle, waiting requests ignored while the
    /// schedulers are paused; false (nothing flushed) otherwise. Its reply is a scheduler
    /// message (the health check hears it).
    pub fn flush_cache(&self) -> bool {
        let paused = self.shared.is_scheduler_paused();
        let flushed = self.is_fully_idle(paused) && self.ranks.iter().all(|r| r.flush_cache(paused));
        self.shared.note_output();
        flushed
    }

    /// Waits up to `timeout` until every rank is fully idle, waiting requests counted (the
    /// deferred flush of `managers/scheduler_components/flush_wrapper.py:22-64`). True if so.
    pub async fn wait_fully_idle(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.shared.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_fully_idle(false) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.is_fully_idle(false);
            }
        }
    }

    /// `pause_generation` (0.5.23 `managers/tokenizer_manager.py:2267-2280`,
    /// `managers/scheduler.py:5817-5932`). Every mode holds new `/generate` calls in the front
    /// end. `abort` aborts everything and answers once no request is in flight, looking once a
    /// second (scaled by `--time-scale`) and aborting again at each look; the schedulers keep
    /// running, so running requests end after one more step. `retract` and `in_place` pause
    /// the schedulers: `retract` first moves running requests back to the waiting queue and
    /// frees their KV, `in_place` leaves them where they are.
    pub async fn pause(&self, mode: PauseMode) {
        self.shared.set_paused(true);
        match mode {
            PauseMode::Abort => loop {
                self.abort_all();
                if self.model_update_lock.try_write().is_ok() {
                    break;
                }
                tokio::time::sleep(PAUSE_ABORT_LOOK.mul_f64(self.cfg.time_scale).max(Duration::from_millis(1))).await;
            },
            PauseMode::Retract => {
                self.shared.set_scheduler_paused(true);
                for r in &self.ranks {
                    r.retract_all();
                }
            }
            PauseMode::InPlace => self.shared.set_scheduler_paused(true),
        }
    }

    pub fn resume(&self) {
        self.shared.set_scheduler_paused(false);
        self.shared.set_paused(false);
        for r in &self.ranks {
            r.wake();
        }
    }

    pub fn weights(&self) -> WeightsInfo {
        self.weights.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub fn set_weights(&self, w: WeightsInfo) {
        *self.weights.lock().unwrap_or_else(PoisonError::into_inner) = w;
    }

    pub fn identity(&self) -> Identity {
        self.identity.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// After a successful disk update: the server now answers under the checkpoint's path.
    pub fn set_loaded_from(&self, model_path: &str, load_format: &str) {
        let mut id = self.identity.write().unwrap_or_else(PoisonError::into_inner);
        id.model_path = model_path.to_string();
        id.served_model_name = model_path.to_string();
        id.load_format = load_format.to_string();
    }

    /// Why a shutdown signal must end this engine at once instead of draining it, if it must:
    /// SGLang's tokenizer manager, on SIGTERM, skips the drain when the server is `UnHealthy`
    /// (a health check failed) or `SGL_FORCE_SHUTDOWN` is set (0.5.23
    /// `managers/tokenizer_manager.py:3508-3531`; 0.5.8 :2091-2105; 0.5.12 :2384-2398).
    pub fn force_exit_reason(&self) -> Option<&'static str> {
        if self.shared.status() == Status::UnHealthy {
            Some("Signal SIGTERM received while health check failed. Force exiting.")
        } else if self.force_shutdown {
            Some("Signal SIGTERM received while force shutdown flag set. Force exiting.")
        } else {
            None
        }
    }

    pub fn startup_secs(&self) -> f64 {
        *self.startup_secs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks the engine ready and logs SGLang's readiness line.
    pub fn mark_up(&self) {
        *self.startup_secs.lock().unwrap_or_else(PoisonError::into_inner) = self.process_start.elapsed().as_secs_f64();
        self.shared.set_status(Status::Up);
        tracing::info!(port = self.port, "The server is fired up and ready to roll!");
    }
}

/// A boolean environment variable as SGLang's `get_bool_env_var` reads it: `true` or `1` (any
/// case) is true; anything else, or unset, is false (0.5.23 `utils/common.py:1424-1440`).
fn env_flag(name: &str) -> bool {
    parse_env_flag(std::env::var(name).ok().as_deref())
}

fn parse_env_flag(value: Option<&str>) -> bool {
    matches!(value.map(str::to_ascii_lowercase).as_deref(), Some("true" | "1"))
}

/// How often `pause_generation` in `abort` mode looks whether requests are still in flight
/// (SGLang's `await asyncio.sleep(1.0)`); scaled by `--time-scale`.
const PAUSE_ABORT_LOOK: Duration = Duration::from_secs(1);

/// One open rid: how many open calls use it, and whether an abort was forwarded for it.
#[derive(Debug, Default)]
struct LiveState {
    open: usize,
    abort_sent: bool,
}

/// A rid recorded as open (see [`Engine::register_rid`]); dropping it forgets the rid.
pub struct LiveRid {
    engine: Arc<Engine>,
    rid: String,
}

impl Drop for LiveRid {
    fn drop(&mut self) {
        self.engine.unregister_rid(&self.rid);
    }
}

/// The parts of a request the API layer prepares.
pub struct NewRequestParts {
    pub rid: String,
    pub prompt: Vec<u32>,
    pub gen: crate::generator::GenState,
    pub stream: bool,
    /// The request's `sampling_params.stream_interval` (`None`: `--stream-interval`).
    pub stream_interval: Option<i64>,
}

/// A submitted request. Dropping it before it finished aborts the request (the client went
/// away), as SGLang does on disconnect.
pub struct ReqHandle {
    /// The request's rid, open while the handle lives.
    live: LiveRid,
    rx: mpsc::UnboundedReceiver<Update>,
    done: bool,
}

impl ReqHandle {
    /// Next update; `None` only if the scheduler went away.
    pub async fn recv(&mut self) -> Option<Update> {
        let u = self.rx.recv().await;
        if matches!(u, Some(Update::Finished(_)) | None) {
            self.done = true;
        }
        u
    }

    /// Waits for the final state, skipping token updates.
    pub async fn finish(mut self) -> Option<Box<crate::scheduler::Finished>> {
        loop {
            match self.recv().await? {
                Update::Finished(f) => return Some(f),
                Update::Tokens { .. } => {}
            }
        }
    }

    /// Lets the request run to its end with nobody waiting for it (the health check's request,
    /// which SGLang forgets without aborting it).
    /// (The scheduler ignores a closed channel: only the handle's drop aborts.)
    pub fn detach(mut self) {
        self.done = true;
    }
}

impl Drop for ReqHandle {
    /// The client went away before the answer: SGLang's front end aborts by the request's rid
    /// (`managers/tokenizer_manager.py:1968-1972, 2427-2437`), which reaches every request whose
    /// rid starts with it.
    fn drop(&mut self) {
        if !self.done {
            self.live.engine.abort_request(&self.live.rid);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn env_flags_read_like_sglang() {
        for (value, expected) in
            [(None, false), (Some("1"), true), (Some("TRUE"), true), (Some("true"), true), (Some("0"), false)]
        {
            assert_eq!(super::parse_env_flag(value), expected, "{value:?}");
        }
        for other in ["yes", "on", ""] {
            assert!(!super::parse_env_flag(Some(other)), "{other}");
        }
    }
}
