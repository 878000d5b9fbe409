//! The autoscaler service: one task owned by `manager.tasks` that, every
//! `metrics_interval_secs`, reads the ACTIVE engines, feeds the pure [`AutoscalerState`], and
//! every `evaluation_interval_secs` acts on its decision through the same scale functions as
//! `POST /rollout/scale_out` and `/rollout/scale_in` (so mutual exclusion, NOOPs and validation
//! apply to it as to a user; a refusal such as 409 is recorded in the history, never fatal).
//!
//! Expected flow: tick -> (fleet, engines) under the registry lock -> HTTP reads (no lock) ->
//! finished operations folded into the history -> `on_tick` -> maybe act. Cancelled with the
//! manager's shutdown token. The history (the last [`HISTORY_KEEP`] entries) is kept in memory
//! and written to `<state-dir>/autoscaler-history.json` (a temporary file renamed over it)
//! whenever an entry is added or finishes, so a restarted manager shows the same history and
//! starts with the time-to-ready it had learned. Cooldowns run on the autoscaler's own clock and
//! start afresh after a restart.

use super::collector::{fleet_state, Collector};
use crate::foundation::clock::unix_now;
use crate::foundation::locks::Locked;
use crate::ops::manager::Manager;
use crate::ops::op_error::OpError;
use crate::ops::scale_in::{self, ScaleInAnswer};
use crate::ops::scaling::{self, ScaleInRequest, ScaleOutRequest};
use rollout_core::autoscaler::{
    Action, AutoscalerConfig, AutoscalerState, Evaluation, FleetMetrics, FleetState, PipelineReport, Tick, TraceLine,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// How many history entries are kept.
pub const HISTORY_KEEP: usize = 1000;

/// The file the history is kept in, inside the state directory.
pub const HISTORY_FILE: &str = "autoscaler-history.json";

/// One operation the autoscaler started (or tried to), as `GET /autoscaler/scale_history`
/// shows it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(as = ScaleHistoryEntry)]
pub struct HistoryEntry {
    /// The scale API's request id; null when the API refused the request.
    pub request_id: Option<String>,
    pub action: String,
    /// The operation's status, kept up to date until it finishes (`ACTIVE`, `COMPLETED`,
    /// `FAILED`, `CANCELLED`, `NOOP`), or `REJECTED` when the API refused it.
    pub status: String,
    pub triggered_at: f64,
    pub completed_at: Option<f64>,
    pub from_engines: u32,
    pub to_engines: u32,
    pub delta: u32,
    pub reason: String,
    pub triggered_conditions: Vec<String>,
    #[schema(value_type = MetricsView)]
    pub metrics_snapshot: Value,
    pub error_message: Option<String>,
    /// `serving` or `pipeline`.
    pub signal: String,
    /// Triggered by this process (false for an entry read back after a restart, whose
    /// completion then teaches nothing about time to ready).
    #[serde(skip)]
    this_run: bool,
}

/// What the history file holds.
#[derive(Debug, Default, Serialize, Deserialize)]
struct HistoryFile {
    total_count: usize,
    history: VecDeque<HistoryEntry>,
}

impl HistoryEntry {
    fn finished(&self) -> bool {
        self.completed_at.is_some()
    }
}

/// The last read of the engines, for `/autoscaler/health`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CollectStatus {
    pub last_collect_at: Option<f64>,
    pub engines_read: u32,
    pub engines_missing: u32,
    /// Why each missing engine is missing.
    pub errors: BTreeMap<String, String>,
    pub ticks: u64,
}

/// Everything the task and the handlers share.
pub(super) struct Shared {
    pub core: AutoscalerState,
    pub enabled: bool,
    pub running: bool,
    /// The decision as of the latest tick (what `/autoscaler/conditions` shows).
    pub latest: Option<Evaluation>,
    /// The latest decision that was due (acted on when enabled).
    pub last_decision: Option<Evaluation>,
    pub fleet: FleetState,
    pub history: VecDeque<HistoryEntry>,
    pub total_count: usize,
    pub collect: CollectStatus,
    pub evaluations: u64,
    /// Trace lines waiting for the task to write them (pipeline reports from handlers).
    pub trace_backlog: Vec<TraceLine>,
}

pub struct Autoscaler {
    pub(super) manager: Arc<Manager>,
    /// The router's counters (its queue length is a signal).
    router_metrics: Arc<crate::adapters::router::metrics::RouterMetrics>,
    /// The YAML it was started with; None: the defaults, disabled.
    pub(super) source: Option<PathBuf>,
    /// Zero of the autoscaler's clock (tokio time, so tests can pause it).
    started: tokio::time::Instant,
    /// A std Mutex: every critical section is plain data, never an `.await`.
    shared: Mutex<Shared>,
}

impl Autoscaler {
    /// `config` is None without `--autoscaler-config`: the defaults, disabled.
    pub fn new(
        manager: Arc<Manager>,
        router_metrics: Arc<crate::adapters::router::metrics::RouterMetrics>,
        config: Option<(PathBuf, AutoscalerConfig)>,
    ) -> Arc<Self> {
        let (source, config, enabled) = match config {
            Some((path, c)) => {
                let enabled = c.enabled;
                (Some(path), c, enabled)
            }
            None => (None, AutoscalerConfig::default(), false),
        };
        let saved = load_history(&manager.config.state_dir.join(HISTORY_FILE));
        let mut core = AutoscalerState::new(config);
        // Oldest first, so the newest times to ready are the ones kept.
        for h in saved.history.iter().filter(|h| h.action == "scale_out" && h.status == "ACTIVE") {
            if let Some(done) = h.completed_at.filter(|done| *done >= h.triggered_at) {
                core.memory.record_time_to_ready(done - h.triggered_at);
            }
        }
        Arc::new(Self {
            router_metrics,
            manager,
            source,
            started: tokio::time::Instant::now(),
            shared: Mutex::new(Shared {
                core,
                enabled,
                running: false,
                latest: None,
                last_decision: None,
                fleet: FleetState::default(),
                history: saved.history,
                total_count: saved.total_count,
                collect: CollectStatus::default(),
                evaluations: 0,
                trace_backlog: Vec::new(),
            }),
        })
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.locked()
    }

    /// Seconds on the autoscaler's clock.
    pub(super) fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// A time on the autoscaler's clock as Unix seconds.
    pub(super) fn to_unix(&self, t: f64) -> f64 {
        unix_now() - (self.now() - t)
    }

    pub fn config(&self) -> AutoscalerConfig {
        self.lock().core.config.clone()
    }

    pub fn set_enabled(&self, enabled: bool) {
        let mut s = self.lock();
        if s.enabled != enabled {
            tracing::info!(enabled, "autoscaler toggled");
        }
        s.enabled = enabled;
    }

    /// Records a trainer step (`POST /rollout/pipeline`) and decides on it at once (acting if
    /// enabled and it calls for an action); returns the evaluation.
    pub fn report(&self, report: PipelineReport) -> Evaluation {
        let (fleet, _) = fleet_state(&self.manager);
        let now = self.now();
        let mut s = self.lock();
        if !s.core.config.trace_file.is_empty() {
            s.trace_backlog.push(TraceLine {
                at: now,
                fleet: None,
                engines: None,
                pipeline: Some(report.clone()),
                router_queued: None,
            });
        }
        let decided = s.core.on_report(now, report, &fleet);
        let evaluation = decided.clone().unwrap_or_else(|| s.core.evaluate(&fleet, now));
        s.latest = Some(evaluation.clone());
        let act = match decided {
            Some(e) => {
                s.evaluations += 1;
                s.last_decision = Some(e);
                s.enabled
            }
            None => false,
        };
        drop(s);
        if act {
            self.act(evaluation.clone());
        }
        evaluation
    }

    /// Starts the task (owned by `manager.tasks`, ends on shutdown).
    pub fn spawn(self: &Arc<Self>) {
        let me = self.clone();
        self.manager.tasks.spawn(async move { me.run().await });
    }

    async fn run(self: Arc<Self>) {
        let config = self.config();
        self.lock().running = true;
        let period = Duration::from_secs_f64(config.metrics_interval_secs);
        // A read never takes longer than the interval, but gets at least a second.
        let timeout = period.clamp(Duration::from_secs(1), Duration::from_secs(10));
        let mut ticker = tokio::time::interval(period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut collector = Collector::default();
        let mut trace = open_trace(&config.trace_file).await;
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = self.manager.shutdown.cancelled() => break,
            }
            // A read in progress is abandoned at shutdown (nothing is half-applied: the state is
            // only touched after the reads, without an await).
            let lines = tokio::select! {
                lines = self.step(&mut collector, timeout) => lines,
                _ = self.manager.shutdown.cancelled() => break,
            };
            if let Some(file) = trace.as_mut() {
                for line in lines {
                    let mut text = serde_json::to_string(&line).unwrap_or_default();
                    text.push('\n');
                    if let Err(e) = file.write_all(text.as_bytes()).await {
                        tracing::warn!(error = %e, path = %config.trace_file, "cannot write the autoscaler trace; stopping it");
                        trace = None;
                        break;
                    }
                }
            }
        }
        self.lock().running = false;
    }

    /// One tick: read, fold in finished operations, decide, maybe act. Returns trace lines.
    async fn step(&self, collector: &mut Collector, timeout: Duration) -> Vec<TraceLine> {
        let (_, engines) = fleet_state(&self.manager);
        let at = self.now();
        let tick = collector.collect(&self.manager, &self.router_metrics, &engines, timeout, at).await;
        let (fleet, _) = fleet_state(&self.manager);
        let progress = self.operations_progress();
        let now = self.now();
        let mut s = self.lock();
        for (request_id, status, error, terminal) in progress {
            if terminal {
                self.finish(&mut s, &request_id, status, error, now);
            } else if let Some(entry) = s.history.iter_mut().find(|h| h.request_id.as_deref() == Some(&request_id)) {
                entry.status = status;
            }
        }
        record_collect(&mut s.collect, &tick, self.to_unix(at));
        let mut trace = std::mem::take(&mut s.trace_backlog);
        if !s.core.config.trace_file.is_empty() {
            trace.push(TraceLine {
                at: tick.at,
                fleet: Some(fleet.clone()),
                engines: Some(tick.engines.clone()),
                pipeline: None,
                router_queued: (tick.router_queued > 0.0).then_some(tick.router_queued),
            });
        }
        let due = s.core.on_tick(tick, &fleet);
        let latest = due.clone().unwrap_or_else(|| s.core.evaluate(&fleet, now));
        s.latest = Some(latest);
        s.fleet = fleet;
        let Some(evaluation) = due else { return trace };
        crate::foundation::telemetry::events()
            .autoscaler_decisions
            .with_label_values(&[evaluation.action.name(), evaluation.action.reason_code().as_str()])
            .inc();
        s.evaluations += 1;
        s.last_decision = Some(evaluation.clone());
        let act = s.enabled && !matches!(evaluation.action, Action::None { .. });
        drop(s);
        if act {
            self.act(evaluation);
        }
        trace
    }

    /// Status of every unfinished operation of the history (id, status, error, terminal), read
    /// under the registry lock (never while holding ours).
    fn operations_progress(&self) -> Vec<(String, String, Option<String>, bool)> {
        let pending: Vec<(String, String)> = self
            .lock()
            .history
            .iter()
            .filter(|h| !h.finished())
            .filter_map(|h| h.request_id.clone().map(|id| (id, h.action.clone())))
            .collect();
        if pending.is_empty() {
            return Vec::new();
        }
        let inner = self.manager.fleet.lock();
        let lost = |id: String| {
            let why = "the manager no longer knows this operation (it was pruned from the store)";
            (id, "UNKNOWN".to_string(), Some(why.to_string()), true)
        };
        pending
            .into_iter()
            .map(|(id, action)| {
                let found = if action == "scale_out" {
                    inner
                        .ops
                        .scale_out(&id)
                        .map(|r| (r.status().to_string(), r.error_message().clone(), r.status().is_terminal()))
                } else {
                    inner
                        .ops
                        .scale_in(&id)
                        .map(|r| (r.status().to_string(), r.error_message().clone(), r.status().is_terminal()))
                };
                match found {
                    Some((status, error, terminal)) => (id, status, error, terminal),
                    None => lost(id),
                }
            })
            .collect()
    }

    fn finish(&self, s: &mut Shared, request_id: &str, status: String, error: Option<String>, now: f64) {
        let Some(entry) = s.history.iter_mut().find(|h| h.request_id.as_deref() == Some(request_id)) else { return };
        let completed = unix_now();
        entry.completed_at = Some(completed);
        entry.error_message = error.or(entry.error_message.take());
        // Time to ready as the history shows it (and as a restart reads it back).
        let took = (completed - entry.triggered_at).max(0.0);
        let (action, fresh) = (entry.action.clone(), entry.this_run);
        tracing::info!(request_id, action, status, "autoscaler operation finished");
        let ready = status == "ACTIVE";
        entry.status = status;
        s.core.on_finished(&action, now, now, false);
        if ready && fresh {
            s.core.memory.record_time_to_ready(took);
        }
        self.save(s);
    }

    /// Writes the history file (best effort: a failure is logged, the history stays in memory).
    fn save(&self, s: &Shared) {
        let path = self.manager.config.state_dir.join(HISTORY_FILE);
        let file = HistoryFile { total_count: s.total_count, history: s.history.clone() };
        let result = serde_json::to_vec(&file).map_err(std::io::Error::other).and_then(|bytes| {
            let tmp = path.with_extension("json.tmp");
            std::fs::write(&tmp, bytes)?;
            std::fs::rename(&tmp, &path)
        });
        if let Err(e) = result {
            tracing::warn!(error = %e, path = %path.display(), "cannot write the autoscaler history");
        }
    }

    /// Calls the scale API and records the outcome.
    fn act(&self, evaluation: Evaluation) {
        let (name, delta, from, to, reason, conditions) = match &evaluation.action {
            Action::ScaleOut { delta, from_engines, to_engines, reason, triggered_conditions } => {
                ("scale_out", delta, from_engines, to_engines, reason, triggered_conditions)
            }
            Action::ScaleIn { delta, from_engines, to_engines, reason, triggered_conditions } => {
                ("scale_in", delta, from_engines, to_engines, reason, triggered_conditions)
            }
            Action::None { .. } => return,
        };
        let model_name = self.manager.config.model_name.clone();
        let num_replicas = i64::from(*to);
        let result = if name == "scale_out" {
            let req = ScaleOutRequest {
                model_name,
                num_replicas,
                engine_urls: Vec::new(),
                timeout_secs: None,
                trigger: crate::foundation::records::Trigger::Autoscaler,
            };
            scaling::scale_out(&self.manager, req)
        } else {
            let req = ScaleInRequest {
                model_name,
                num_replicas,
                engine_urls: Vec::new(),
                force: false,
                timeout_secs: None,
                dry_run: false,
            };
            match scale_in::scale_in(&self.manager, req) {
                Ok(ScaleInAnswer::Accepted(a)) => Ok(a),
                Ok(ScaleInAnswer::DryRun(_)) => {
                    Err(OpError::internal("unexpected_dry_run", "scale-in answered a dry run"))
                }
                Err(e) => Err(e),
            }
        };
        let unix = unix_now();
        let mut entry = HistoryEntry {
            request_id: None,
            action: name.to_string(),
            status: String::new(),
            triggered_at: unix,
            completed_at: None,
            from_engines: *from,
            to_engines: *to,
            delta: *delta,
            reason: reason.clone(),
            triggered_conditions: conditions.clone(),
            metrics_snapshot: serde_json::to_value(metrics_view(evaluation.metrics.as_ref())).unwrap_or_default(),
            error_message: None,
            signal: serde_json::to_value(evaluation.signal)
                .ok()
                .and_then(|v| v.as_str().map(String::from))
                .unwrap_or_default(),
            this_run: true,
        };
        let mut s = self.lock();
        match result {
            Ok(accepted) => {
                tracing::info!(request_id = %accepted.request_id, action = name, from, to, reason = %reason, "autoscaler scaling");
                entry.request_id = Some(accepted.request_id.to_string());
                if accepted.status == crate::ops::scaling::AcceptedStatus::Noop {
                    entry.completed_at = Some(unix);
                    entry.error_message = Some(accepted.message);
                } else {
                    s.core.memory.pending = true;
                }
                entry.status = accepted.status.to_string();
            }
            Err(e) => {
                tracing::warn!(action = name, code = e.code(), error = %e, "the scale API refused the autoscaler");
                entry.status = "REJECTED".into();
                entry.completed_at = Some(unix);
                entry.error_message = Some(format!("{} ({}): {e}", e.code(), e.kind()));
            }
        }
        s.history.push_back(entry);
        s.total_count += 1;
        while s.history.len() > HISTORY_KEEP {
            s.history.pop_front();
        }
        self.save(&s);
    }
}

/// Reads the history file; a missing file is an empty history, a damaged one is logged and
/// set aside (renamed `.bad`) so the manager still starts.
fn load_history(path: &std::path::Path) -> HistoryFile {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return HistoryFile::default(),
        Err(e) => {
            tracing::warn!(error = %e, path = %path.display(), "cannot read the autoscaler history; starting empty");
            return HistoryFile::default();
        }
    };
    match serde_json::from_slice::<HistoryFile>(&bytes) {
        Ok(mut f) => {
            while f.history.len() > HISTORY_KEEP {
                f.history.pop_front();
            }
            f.total_count = f.total_count.max(f.history.len());
            f
        }
        Err(e) => {
            let aside = path.with_extension("json.bad");
            tracing::warn!(error = %e, path = %path.display(), aside = %aside.display(), "damaged autoscaler history set aside; starting empty");
            let _ = std::fs::rename(path, &aside);
            HistoryFile::default()
        }
    }
}

fn record_collect(c: &mut CollectStatus, tick: &Tick, at_unix: f64) {
    c.last_collect_at = Some(at_unix);
    c.ticks += 1;
    c.errors.clear();
    c.engines_read = 0;
    c.engines_missing = 0;
    for (id, o) in &tick.engines {
        match o {
            rollout_core::autoscaler::Observation::Sample(_) => c.engines_read += 1,
            rollout_core::autoscaler::Observation::Missing { missing } => {
                c.engines_missing += 1;
                c.errors.insert(id.clone(), missing.clone());
            }
        }
    }
}

/// The fleet's metrics as the latest complete read gave them: empty (`{}`) before the first.
/// The seed's `recent_metrics` names first.
#[derive(Debug, Clone, Default, Serialize, utoipa::ToSchema)]
#[schema(as = AutoscalerMetrics)]
pub struct MetricsView {
    /// Engines that answered the read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_engines: Option<u32>,
    /// Mean KV-cache usage over the engines, 0..1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub avg_token_usage: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_queue_reqs: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_token_usage: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_running_reqs: Option<f64>,
    /// Generated tokens per second, the fleet's sum.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gen_throughput: Option<f64>,
    /// Seconds, over the requests that finished since the read before; null without any.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<f64>)]
    pub queue_time_p95: Option<Option<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<f64>)]
    pub ttft_p95: Option<Option<f64>>,
}

/// The fleet metrics as the API shows them.
pub fn metrics_view(m: Option<&FleetMetrics>) -> MetricsView {
    match m {
        None => MetricsView::default(),
        Some(m) => MetricsView {
            num_engines: Some(m.num_engines),
            avg_token_usage: Some(m.avg_token_usage),
            total_queue_reqs: Some(m.total_queue_reqs),
            max_token_usage: Some(m.max_token_usage),
            total_running_reqs: Some(m.total_running_reqs),
            gen_throughput: Some(m.gen_throughput),
            queue_time_p95: Some(m.queue_time_p95),
            ttft_p95: Some(m.ttft_p95),
        },
    }
}

async fn open_trace(path: &str) -> Option<tokio::fs::File> {
    if path.is_empty() {
        return None;
    }
    match tokio::fs::OpenOptions::new().create(true).append(true).open(path).await {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!(error = %e, path, "cannot open the autoscaler trace_file; no trace is written");
            None
        }
    }
}
