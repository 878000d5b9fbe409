//! One simulated engine (one `--instances` slot): its DP ranks, status, weight version,
//! pause state, metrics and faults. HTTP handlers hold an `Arc<Engine>`.

use crate::cli::Config;
use crate::faults::Faults;
use crate::generator::VersionInfo;
use crate::metrics::Metrics;
use crate::scheduler::{NewRequest, Rank, RankConfig, RankLoad, Update};
use crate::weights::WeightsInfo;
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
    /// Set by the hang fault: nothing answers any more.
    hung: AtomicBool,
    /// Set (to when it happened, Unix seconds) by the scheduler-hang fault: the scheduler stops
    /// (no generation, no health check, no `/server_info`, whose internal state comes from the
    /// scheduler) while the HTTP process still answers what it serves alone (`/model_info`,
    /// `/v1/loads` from the last load snapshot).
    scheduler_hung_at: std::sync::Mutex<Option<f64>>,
    /// Woken whenever a rank runs out of running and (non-retracted) queued requests.
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
    pub health: HealthSettings,
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
            health: HealthSettings::from_env(),
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
    pub fn submit(&self, rank: Arc<Rank>, req: NewRequestParts) -> ReqHandle {
        let (tx, rx) = mpsc::unbounded_channel();
        let key = rank.submit(NewRequest { rid: req.rid, prompt: req.prompt, gen: req.gen, stream: req.stream, tx });
        ReqHandle { rank, key, rx, done: false }
    }

    pub fn abort_all(&self, message: &str) -> usize {
        self.ranks.iter().map(|r| r.abort_all(message)).sum()
    }

    pub fn abort_rid(&self, rid: &str, message: &str) -> usize {
        self.ranks.iter().map(|r| r.abort_rid(rid, message)).sum()
    }

    pub fn loads(&self) -> Vec<RankLoad> {
        self.ranks.iter().map(|r| r.load()).collect()
    }

    /// Flushes every rank's prefix cache; false (nothing flushed) if any request is queued or
    /// running (see [`Rank::flush_cache`]).
    fn can_flush(&self) -> bool {
        let paused = self.shared.is_paused();
        self.ranks.iter().all(|r| r.can_flush(paused))
    }

    pub fn flush_cache(&self) -> bool {
        if !self.can_flush() {
            return false;
        }
        let paused = self.shared.is_paused();
        self.ranks.iter().all(|r| r.flush_cache(paused))
    }

    /// Waits up to `timeout` until the cache can be flushed (no running or queued requests
    /// apart from retracted ones). True if it can.
    pub async fn wait_flushable(&self, timeout: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.shared.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.can_flush() {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.can_flush();
            }
        }
    }

    pub fn pause(&self, mode: PauseMode) {
        self.shared.set_paused(true);
        match mode {
            PauseMode::Abort => {
                self.abort_all("Abort by pause_generation");
            }
            PauseMode::Retract => {
                for r in &self.ranks {
                    r.retract_all();
                }
            }
            PauseMode::InPlace => {}
        }
    }

    pub fn resume(&self) {
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

/// SGLang's health-check settings, read from the environment at startup as SGLang reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthSettings {
    /// `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` (default true; `true/1/yes/y`,
    /// `false/0/no/n`, any case; another value warns and keeps the default): false makes
    /// `/health` (not `/health_generate`) answer 200 without a generation.
    pub generation: bool,
    /// `SGLANG_HEALTH_CHECK_TIMEOUT`: integer wall-clock seconds (default 20; never scaled by
    /// `--time-scale`); 0 or less fails every check at once. SGLang refuses to start on a
    /// value that is not an integer; the simulator warns and keeps 20.
    pub timeout_secs: i64,
}

impl HealthSettings {
    pub const DEFAULT_TIMEOUT_SECS: i64 = 20;

    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok();
        Self::parse(
            var("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION").as_deref(),
            var("SGLANG_HEALTH_CHECK_TIMEOUT").as_deref(),
        )
    }

    pub fn parse(generation: Option<&str>, timeout: Option<&str>) -> Self {
        let generation = match generation.map(str::to_ascii_lowercase).as_deref() {
            None | Some("true" | "1" | "yes" | "y") => true,
            Some("false" | "0" | "no" | "n") => false,
            Some(other) => {
                tracing::warn!(value = other, "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is not a boolean; using true");
                true
            }
        };
        let timeout_secs = match timeout.map(|t| t.trim().parse::<i64>()) {
            None => Self::DEFAULT_TIMEOUT_SECS,
            Some(Ok(t)) => t,
            Some(Err(_)) => {
                tracing::warn!(value = timeout, "SGLANG_HEALTH_CHECK_TIMEOUT is not an integer; using 20");
                Self::DEFAULT_TIMEOUT_SECS
            }
        };
        Self { generation, timeout_secs }
    }
}

/// How the health request itself ended, when it ended before any scheduler output.
enum HealthProbe {
    /// `--zero-cost`: generation answers without a scheduler, so this counts as output.
    Answered,
    /// The server began shutting down while the request waited for `continue_generation`.
    ShuttingDown,
}

impl Engine {
    /// SGLang's `health_generate` once the server is up: sends a 1-token generation
    /// (`input_ids [0]`, temperature 0, rid `HEALTH_CHECK_<uuid>`, not counted in metrics or
    /// by the request faults) through the `/generate` path (it waits while generation is
    /// paused and for a weight update holding the model lock), and passes as soon as any DP
    /// rank's scheduler sends output after the call, its own or another request's. Fails after
    /// `SGLANG_HEALTH_CHECK_TIMEOUT` wall-clock seconds. Runs in a task of its own, so a client
    /// that gives up first does not stop it: a failure marks the server `UnHealthy` (as in
    /// SGLang) and a later pass marks it `Up` again.
    pub async fn health_generate(self: &Arc<Self>) -> bool {
        let engine = self.clone();
        let check = tokio::spawn(async move { engine.run_health_check().await });
        check.await.unwrap_or(false)
    }

    async fn run_health_check(self: Arc<Self>) -> bool {
        let timeout = self.health.timeout_secs;
        let mut outputs = self.shared.watch_outputs();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(u64::try_from(timeout).unwrap_or(0));
        let probe = async {
            if self.shared.is_scheduler_hung() {
                return std::future::pending::<HealthProbe>().await;
            }
            self.shared.wait_unpaused().await;
            if self.shared.status() == Status::ShuttingDown {
                return HealthProbe::ShuttingDown;
            }
            let _guard = self.model_update_lock.clone().read_owned().await;
            if self.cfg.zero_cost {
                return HealthProbe::Answered;
            }
            let params = crate::sampling::RawSamplingParams {
                max_new_tokens: Some(Some(1)),
                temperature: Some(0.0),
                ..Default::default()
            }
            .validate();
            if let Ok(params) = params {
                let prompt = vec![0];
                let gen = crate::generator::GenState::new(&prompt, &params, 0, 1, 0.0);
                let rid = format!("HEALTH_CHECK_{}", uuid::Uuid::new_v4().simple());
                let handle = self.submit(self.pick_rank(None), NewRequestParts { rid, prompt, gen, stream: false });
                // Its output (or an abort) is what `outputs` hears; the handle aborts the
                // request if the check ends first.
                let _ = handle.finish().await;
            }
            std::future::pending::<HealthProbe>().await
        };
        let passed = timeout > 0
            && tokio::select! {
                changed = outputs.changed() => changed.is_ok(),
                end = probe => matches!(end, HealthProbe::Answered),
                () = tokio::time::sleep_until(deadline) => false,
            };
        if passed {
            self.shared.transition(Status::UnHealthy, Status::Up);
        } else if self.shared.status() != Status::ShuttingDown {
            tracing::error!(
                port = self.port,
                "Health check failed. Server couldn't get a response from detokenizer for last {timeout} seconds."
            );
            self.shared.transition(Status::Up, Status::UnHealthy);
        }
        passed
    }
}

/// The parts of a request the API layer prepares.
pub struct NewRequestParts {
    pub rid: String,
    pub prompt: Vec<u32>,
    pub gen: crate::generator::GenState,
    pub stream: bool,
}

/// A submitted request. Dropping it before it finished aborts the request (the client went
/// away), as SGLang does on disconnect.
pub struct ReqHandle {
    rank: Arc<Rank>,
    key: u64,
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
}

impl Drop for ReqHandle {
    fn drop(&mut self) {
        if !self.done {
            self.rank.abort(self.key, "The client disconnected.");
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
