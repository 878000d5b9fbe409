//! `/autoscaler/*` and `/rollout/pipeline`. Shapes follow the seed's examples, with extra
//! fields where they help; errors are `{"error": {"code", "message"}}` ([`ApiError`]).

use super::service::{metrics_view, Autoscaler, HistoryEntry, MetricsView};
use crate::foundation::error::{ApiError, ErrorBody};
use crate::interfaces::api::parse_body;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use rollout_core::autoscaler::{Action, Condition, Evaluation, Observation, PipelineReport, Signal};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub fn routes(autoscaler: Arc<Autoscaler>) -> Router {
    Router::new()
        .route("/autoscaler/status", get(status))
        .route("/autoscaler/enable", post(enable))
        .route("/autoscaler/conditions", get(conditions))
        .route("/autoscaler/health", get(health))
        .route("/autoscaler/scale_history", get(history))
        .route("/rollout/pipeline", post(pipeline_report).get(pipeline_reports))
        .with_state(autoscaler)
}

/// A request body; parsed strictly, as on every control route (see [`crate::interfaces::api::parse_body`]).
type Body = Result<Bytes, axum::extract::rejection::BytesRejection>;

/// A decision of the autoscaler.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = AutoscalerDecision)]
pub(crate) struct DecisionView {
    action: DecisionAction,
    /// Engines to add or remove (0 for `none`).
    delta: u32,
    reason: String,
    triggered_conditions: Vec<String>,
    signal: Signal,
    /// When it was made (Unix seconds).
    at: f64,
}

/// What a decision does.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub(crate) enum DecisionAction {
    ScaleOut,
    ScaleIn,
    None,
}

impl From<&Action> for DecisionAction {
    fn from(action: &Action) -> Self {
        match action {
            Action::ScaleOut { .. } => Self::ScaleOut,
            Action::ScaleIn { .. } => Self::ScaleIn,
            Action::None { .. } => Self::None,
        }
    }
}

fn decision_view(a: &Autoscaler, e: &Evaluation) -> DecisionView {
    let (delta, conditions) = match &e.action {
        Action::ScaleOut { delta, triggered_conditions, .. } | Action::ScaleIn { delta, triggered_conditions, .. } => {
            (*delta, triggered_conditions.clone())
        }
        Action::None { .. } => (0, Vec::new()),
    };
    DecisionView {
        action: (&e.action).into(),
        delta,
        reason: e.action.reason().to_string(),
        triggered_conditions: conditions,
        signal: e.signal,
        at: a.to_unix(e.at),
    }
}

/// `GET /autoscaler/status`.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = AutoscalerStatus)]
pub(crate) struct StatusView {
    /// The autoscaler acts on its decisions (it reads and decides either way).
    enabled: bool,
    /// Its task runs.
    running: bool,
    config_path: Option<String>,
    current_engines: u32,
    active_engines: u32,
    starting_engines: u32,
    min_engines: u32,
    max_engines: u32,
    /// `min_engines`, raised to the engines scale-in never removes.
    effective_min_engines: u32,
    /// `max_engines`, lowered to what the manager can hold.
    effective_max_engines: u32,
    last_scale_time: Option<f64>,
    last_scale_action: Option<String>,
    last_decision: Option<DecisionView>,
    /// Request ids of the operations it started that have not finished.
    pending_requests: Vec<String>,
    recent_metrics: MetricsView,
    signal: Option<Signal>,
    next_evaluation_in_secs: Option<f64>,
    /// What it learned an engine takes to become ready.
    expected_time_to_ready_secs: Option<f64>,
    /// The effective configuration (its YAML's fields, every one with its value).
    #[schema(value_type = Object)]
    config: rollout_core::autoscaler::AutoscalerConfig,
}

/// Whether the autoscaler acts, its bounds, last decision and recent metrics.
#[utoipa::path(get, path = "/autoscaler/status", operation_id = "autoscalerStatus",
    responses((status = 200, description = "The autoscaler", body = StatusView)))]
pub(crate) async fn status(State(a): State<Arc<Autoscaler>>) -> Json<StatusView> {
    let now = a.now();
    let s = a.lock();
    let last = s.history.iter().rev().find(|h| !matches!(h.status.as_str(), "REJECTED" | "NOOP"));
    let pending = s.history.iter().filter(|h| h.completed_at.is_none()).filter_map(|h| h.request_id.clone()).collect();
    let c = &s.core.config;
    Json(StatusView {
        enabled: s.enabled,
        running: s.running,
        config_path: a.source.as_ref().map(|p| p.display().to_string()),
        current_engines: s.fleet.live_engines,
        active_engines: s.fleet.active_engines,
        starting_engines: s.fleet.starting_engines,
        min_engines: c.min_engines,
        max_engines: c.max_engines,
        effective_min_engines: c.min_engines.max(s.fleet.protected_engines),
        effective_max_engines: c.max_engines.min(a.manager.config.max_engines),
        last_scale_time: last.map(|h| h.triggered_at),
        last_scale_action: last.map(|h| h.action.clone()),
        last_decision: s.last_decision.as_ref().map(|e| decision_view(&a, e)),
        pending_requests: pending,
        recent_metrics: metrics_view(s.latest.as_ref().and_then(|e| e.metrics.as_ref())),
        signal: s.latest.as_ref().map(|e| e.signal),
        next_evaluation_in_secs: s.core.next_evaluation_in(now),
        expected_time_to_ready_secs: s.core.memory.expected_time_to_ready(),
        config: c.clone(),
    })
}

/// Body of `POST /autoscaler/enable`.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = AutoscalerEnableRequest)]
pub(crate) struct EnableRequest {
    enabled: bool,
}

/// What `POST /autoscaler/enable` answers.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = AutoscalerEnableResult)]
pub(crate) struct EnableResult {
    enabled: bool,
    message: String,
}

/// Turn acting on or off (the metrics are read either way).
#[utoipa::path(post, path = "/autoscaler/enable", operation_id = "autoscalerEnable", request_body = EnableRequest,
    responses((status = 200, description = "Done", body = EnableResult),
              (status = 400, description = "Bad body", body = ErrorBody)))]
pub(crate) async fn enable(State(a): State<Arc<Autoscaler>>, body: Body) -> Result<Json<EnableResult>, ApiError> {
    let req: EnableRequest = parse_body(&body)?;
    a.set_enabled(req.enabled);
    let word = if req.enabled { "enabled" } else { "disabled" };
    Ok(Json(EnableResult { enabled: req.enabled, message: format!("autoscaler {word}") }))
}

/// `GET /autoscaler/conditions`.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = AutoscalerConditions)]
pub(crate) struct ConditionsView {
    conditions: BTreeMap<String, Condition>,
    metrics: MetricsView,
    /// Each engine's load as the latest tick read it.
    engines: BTreeMap<String, EngineLoad>,
    #[serde(skip_serializing_if = "Option::is_none")]
    signal: Option<Signal>,
    evaluated_at: Option<f64>,
    decision: Option<DecisionView>,
}

/// An engine's load, or why it could not be read.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[serde(untagged)]
pub(crate) enum EngineLoad {
    Read { token_usage: f64, num_queue_reqs: f64, num_running_reqs: f64, gen_throughput: f64 },
    Missing { missing: String },
}

/// Every condition as of the latest metrics tick, each engine's load and the decision they
/// lead to.
#[utoipa::path(get, path = "/autoscaler/conditions", operation_id = "autoscalerConditions",
    responses((status = 200, description = "The conditions", body = ConditionsView)))]
pub(crate) async fn conditions(State(a): State<Arc<Autoscaler>>) -> Json<ConditionsView> {
    let s = a.lock();
    let Some(e) = s.latest.as_ref() else {
        return Json(ConditionsView {
            conditions: BTreeMap::new(),
            metrics: MetricsView::default(),
            engines: BTreeMap::new(),
            signal: None,
            evaluated_at: None,
            decision: None,
        });
    };
    let engines = s
        .core
        .window
        .latest_tick()
        .map(|t| {
            t.engines
                .iter()
                .map(|(id, o)| {
                    let v = match o {
                        Observation::Sample(x) => EngineLoad::Read {
                            token_usage: x.token_usage,
                            num_queue_reqs: x.num_queue_reqs,
                            num_running_reqs: x.num_running_reqs,
                            gen_throughput: x.gen_throughput,
                        },
                        Observation::Missing { missing } => EngineLoad::Missing { missing: missing.clone() },
                    };
                    (id.clone(), v)
                })
                .collect()
        })
        .unwrap_or_default();
    Json(ConditionsView {
        conditions: e.conditions.clone(),
        metrics: metrics_view(e.metrics.as_ref()),
        engines,
        signal: Some(e.signal),
        evaluated_at: Some(a.to_unix(e.at)),
        decision: Some(decision_view(&a, e)),
    })
}

/// `GET /autoscaler/health`.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = AutoscalerHealth)]
pub(crate) struct HealthView {
    status: HealthStatus,
    enabled: bool,
    running: bool,
    last_collect_at: Option<f64>,
    engines_read: u32,
    engines_missing: u32,
    /// Why each engine missing from the last read is missing.
    errors: BTreeMap<String, String>,
    ticks: u64,
    evaluations: u64,
}

/// How the autoscaler fares: `ok`; `degraded` when an engine was not read or the reads are
/// stale; `stopped` when its task does not run.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub(crate) enum HealthStatus {
    Ok,
    Degraded,
    Stopped,
}

/// Whether the autoscaler task runs and every engine answered its last read (503 when it
/// does not run).
#[utoipa::path(get, path = "/autoscaler/health", operation_id = "autoscalerHealth",
    responses((status = 200, description = "Running", body = HealthView),
              (status = 503, description = "Stopped", body = HealthView)))]
pub(crate) async fn health(State(a): State<Arc<Autoscaler>>) -> (StatusCode, Json<HealthView>) {
    let s = a.lock();
    let interval = s.core.config.metrics_interval_secs;
    let stale =
        s.collect.last_collect_at.is_none_or(|t| crate::foundation::clock::unix_now() - t > 3.0 * interval + 5.0);
    let status = match (s.running, s.collect.engines_missing > 0 || (stale && s.collect.ticks > 0)) {
        (false, _) => HealthStatus::Stopped,
        (true, true) => HealthStatus::Degraded,
        (true, false) => HealthStatus::Ok,
    };
    let code = if s.running { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (
        code,
        Json(HealthView {
            status,
            enabled: s.enabled,
            running: s.running,
            last_collect_at: s.collect.last_collect_at,
            engines_read: s.collect.engines_read,
            engines_missing: s.collect.engines_missing,
            errors: s.collect.errors.clone(),
            ticks: s.collect.ticks,
            evaluations: s.evaluations,
        }),
    )
}

/// The query of `GET /autoscaler/scale_history`.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct HistoryQuery {
    /// At most this many entries (default 100).
    #[param(minimum = 1)]
    limit: Option<i64>,
    /// Only this action.
    #[param(inline)]
    action: Option<HistoryAction>,
}

impl HistoryQuery {
    /// Reads the query, naming the parameter that is wrong (read as a map, so an unknown one
    /// can be named too).
    fn parse(q: &HashMap<String, String>) -> Result<Self, ApiError> {
        if let Some(k) = q.keys().find(|k| !matches!(k.as_str(), "limit" | "action")) {
            return Err(ApiError::bad_request(
                "invalid_query",
                format!("unknown query parameter {k:?}; use limit and action"),
            ));
        }
        // An int64, as the document says (a larger number is refused, not taken as it reads).
        let limit = q
            .get("limit")
            .map(|raw| {
                raw.parse::<i64>().ok().filter(|n| *n >= 1).ok_or_else(|| {
                    ApiError::bad_request("invalid_limit", format!("limit {raw:?} must be a whole number >= 1"))
                })
            })
            .transpose()?;
        let action = q
            .get("action")
            .map(|raw| {
                HistoryAction::ALL.into_iter().find(|a| a.name() == raw).ok_or_else(|| {
                    ApiError::bad_request("invalid_action", format!("action {raw:?} must be scale_out or scale_in"))
                })
            })
            .transpose()?;
        Ok(Self { limit, action })
    }
}

/// The actions the autoscaler takes.
#[derive(Clone, Copy, utoipa::ToSchema)]
#[schema(rename_all = "snake_case")]
pub(crate) enum HistoryAction {
    ScaleOut,
    ScaleIn,
}

impl HistoryAction {
    const ALL: [Self; 2] = [Self::ScaleOut, Self::ScaleIn];

    fn name(self) -> &'static str {
        match self {
            Self::ScaleOut => "scale_out",
            Self::ScaleIn => "scale_in",
        }
    }
}

/// `GET /autoscaler/scale_history`.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = ScaleHistory)]
pub(crate) struct HistoryView {
    history: Vec<HistoryEntry>,
    /// Entries that match, before `limit`.
    total_count: usize,
    action_filter: Option<String>,
    limit: usize,
}

/// Operations the autoscaler started, most recent first.
#[utoipa::path(get, path = "/autoscaler/scale_history", operation_id = "autoscalerScaleHistory",
    params(HistoryQuery),
    responses((status = 200, description = "The history", body = HistoryView),
              (status = 400, description = "Bad query", body = ErrorBody)))]
pub(crate) async fn history(
    State(a): State<Arc<Autoscaler>>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Json<HistoryView>, ApiError> {
    let query = HistoryQuery::parse(&q)?;
    let limit = query.limit.and_then(|n| usize::try_from(n).ok()).unwrap_or(100);
    let action = query.action.map(HistoryAction::name);
    let s = a.lock();
    let matching: Vec<_> = s.history.iter().rev().filter(|h| action.is_none_or(|a| h.action == a)).collect();
    let total_count = matching.len();
    let history = matching.into_iter().take(limit).cloned().collect();
    Ok(Json(HistoryView { history, total_count, action_filter: action.map(str::to_string), limit }))
}

/// What `POST /rollout/pipeline` answers.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct PipelineAccepted {
    accepted: bool,
    step: u64,
    signal: Signal,
    trainer_starved: bool,
    rollout_throttled: bool,
    rollout_short: bool,
    decision: DecisionView,
}

/// The RL signal: one trainer step's wait for rollout data and rollout's wait on staleness.
#[utoipa::path(post, path = "/rollout/pipeline", operation_id = "reportPipelineStep", request_body = PipelineReport,
    responses((status = 200, description = "Taken, with the decision it leads to", body = PipelineAccepted),
              (status = 400, description = "Bad body", body = ErrorBody)))]
pub(crate) async fn pipeline_report(
    State(a): State<Arc<Autoscaler>>,
    body: Body,
) -> Result<Json<PipelineAccepted>, ApiError> {
    let report: PipelineReport = parse_body(&body)?;
    report
        .validate()
        .map_err(|(field, message)| ApiError::bad_request("invalid_pipeline_report", format!("{field}: {message}")))?;
    let step = report.step;
    let e = a.report(report);
    let triggered = |n: &str| e.conditions.get(n).is_some_and(|c| c.triggered);
    Ok(Json(PipelineAccepted {
        accepted: true,
        step,
        signal: e.signal,
        trainer_starved: triggered("trainer_starved"),
        rollout_throttled: triggered("rollout_throttled"),
        rollout_short: triggered("rollout_short"),
        decision: decision_view(&a, &e),
    }))
}

/// `GET /rollout/pipeline`.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = PipelineReports)]
pub(crate) struct ReportsView {
    reports: Vec<ReportView>,
    /// The pipeline policy of the autoscaler's configuration.
    #[schema(value_type = Object)]
    policy: rollout_core::autoscaler::PipelinePolicy,
}

/// A trainer step as it was reported, and the rates it gives.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ReportView {
    step: u64,
    trainer_wait_secs: f64,
    rollout_throttled_secs: f64,
    step_secs: f64,
    rollout_samples: Option<u64>,
    next_step_samples: Option<u64>,
    demand_samples_per_sec: Option<f64>,
    supply_samples_per_sec: Option<f64>,
    /// When the manager received it (Unix seconds).
    received_at: f64,
}

/// The latest trainer steps reported.
#[utoipa::path(get, path = "/rollout/pipeline", operation_id = "listPipelineReports",
    responses((status = 200, description = "The reports and the policy", body = ReportsView)))]
pub(crate) async fn pipeline_reports(State(a): State<Arc<Autoscaler>>) -> Json<ReportsView> {
    let s = a.lock();
    let reports = s
        .core
        .pipeline
        .recent()
        .map(|r| ReportView {
            step: r.report.step,
            trainer_wait_secs: r.report.trainer_wait_secs,
            rollout_throttled_secs: r.report.rollout_throttled_secs,
            step_secs: r.report.step_secs,
            rollout_samples: r.report.rollout_samples,
            next_step_samples: r.report.next_step_samples,
            demand_samples_per_sec: r.report.demand_rate(),
            supply_samples_per_sec: r.report.supply_rate(),
            received_at: a.to_unix(r.at),
        })
        .collect();
    Json(ReportsView { reports, policy: s.core.config.pipeline_policy.clone() })
}
