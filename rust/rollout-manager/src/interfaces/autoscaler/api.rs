//! `/autoscaler/*` and `/rollout/pipeline`. Shapes follow the seed's examples, with extra
//! fields where they help; errors are `{"error": {"code", "message"}}` ([`ApiError`]).

use super::service::{metrics_view, Autoscaler};
use crate::foundation::error::ApiError;
use crate::interfaces::api::parse_body;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use rollout_core::autoscaler::{Action, Evaluation, Observation, PipelineReport};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
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

fn decision_view(a: &Autoscaler, e: &Evaluation) -> Value {
    let (delta, conditions) = match &e.action {
        Action::ScaleOut { delta, triggered_conditions, .. } | Action::ScaleIn { delta, triggered_conditions, .. } => {
            (*delta, triggered_conditions.clone())
        }
        Action::None { .. } => (0, Vec::new()),
    };
    json!({
        "action": e.action.name(),
        "delta": delta,
        "reason": e.action.reason(),
        "triggered_conditions": conditions,
        "signal": e.signal,
        "at": a.to_unix(e.at),
    })
}

async fn status(State(a): State<Arc<Autoscaler>>) -> Json<Value> {
    let now = a.now();
    let s = a.lock();
    let last = s.history.iter().rev().find(|h| !matches!(h.status.as_str(), "REJECTED" | "NOOP"));
    let pending: Vec<&str> =
        s.history.iter().filter(|h| h.completed_at.is_none()).filter_map(|h| h.request_id.as_deref()).collect();
    let c = &s.core.config;
    Json(json!({
        "enabled": s.enabled,
        "running": s.running,
        "config_path": a.source.as_ref().map(|p| p.display().to_string()),
        "current_engines": s.fleet.live_engines,
        "active_engines": s.fleet.active_engines,
        "starting_engines": s.fleet.starting_engines,
        "min_engines": c.min_engines,
        "max_engines": c.max_engines,
        "effective_min_engines": c.min_engines.max(s.fleet.protected_engines),
        "effective_max_engines": c.max_engines.min(a.manager.config.max_engines),
        "last_scale_time": last.map(|h| h.triggered_at),
        "last_scale_action": last.map(|h| h.action.clone()),
        "last_decision": s.last_decision.as_ref().map(|e| decision_view(&a, e)),
        "pending_requests": pending,
        "recent_metrics": metrics_view(s.latest.as_ref().and_then(|e| e.metrics.as_ref())),
        "signal": s.latest.as_ref().map(|e| e.signal),
        "next_evaluation_in_secs": s.core.next_evaluation_in(now),
        "expected_time_to_ready_secs": s.core.memory.expected_time_to_ready(),
        "config": c,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EnableRequest {
    enabled: bool,
}

async fn enable(State(a): State<Arc<Autoscaler>>, body: Body) -> Result<Json<Value>, ApiError> {
    let req: EnableRequest = parse_body(&body)?;
    a.set_enabled(req.enabled);
    let word = if req.enabled { "enabled" } else { "disabled" };
    Ok(Json(json!({"enabled": req.enabled, "message": format!("autoscaler {word}")})))
}

async fn conditions(State(a): State<Arc<Autoscaler>>) -> Json<Value> {
    let s = a.lock();
    let Some(e) = s.latest.as_ref() else {
        return Json(json!({"conditions": {}, "metrics": {}, "engines": {}, "evaluated_at": null, "decision": null}));
    };
    let engines: serde_json::Map<String, Value> = s
        .core
        .window
        .latest_tick()
        .map(|t| {
            t.engines
                .iter()
                .map(|(id, o)| {
                    let v = match o {
                        Observation::Sample(x) => json!({
                            "token_usage": x.token_usage, "num_queue_reqs": x.num_queue_reqs,
                            "num_running_reqs": x.num_running_reqs, "gen_throughput": x.gen_throughput}),
                        Observation::Missing { missing } => json!({"missing": missing}),
                    };
                    (id.clone(), v)
                })
                .collect()
        })
        .unwrap_or_default();
    Json(json!({
        "conditions": e.conditions,
        "metrics": metrics_view(e.metrics.as_ref()),
        "engines": engines,
        "signal": e.signal,
        "evaluated_at": a.to_unix(e.at),
        "decision": decision_view(&a, e),
    }))
}

async fn health(State(a): State<Arc<Autoscaler>>) -> (StatusCode, Json<Value>) {
    let s = a.lock();
    let interval = s.core.config.metrics_interval_secs;
    let stale =
        s.collect.last_collect_at.is_none_or(|t| crate::foundation::clock::unix_now() - t > 3.0 * interval + 5.0);
    let status = match (s.running, s.collect.engines_missing > 0 || (stale && s.collect.ticks > 0)) {
        (false, _) => "stopped",
        (true, true) => "degraded",
        (true, false) => "ok",
    };
    let code = if s.running { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (
        code,
        Json(json!({
            "status": status,
            "enabled": s.enabled,
            "running": s.running,
            "last_collect_at": s.collect.last_collect_at,
            "engines_read": s.collect.engines_read,
            "engines_missing": s.collect.engines_missing,
            "errors": s.collect.errors,
            "ticks": s.collect.ticks,
            "evaluations": s.evaluations,
        })),
    )
}

async fn history(
    State(a): State<Arc<Autoscaler>>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    if let Some(k) = q.keys().find(|k| !matches!(k.as_str(), "limit" | "action")) {
        return Err(ApiError::bad_request(
            "invalid_query",
            format!("unknown query parameter {k:?}; use limit and action"),
        ));
    }
    let limit = match q.get("limit") {
        None => 100,
        Some(raw) => raw.parse::<usize>().ok().filter(|n| *n >= 1).ok_or_else(|| {
            ApiError::bad_request("invalid_limit", format!("limit {raw:?} must be a whole number >= 1"))
        })?,
    };
    let action = q.get("action").map(String::as_str);
    if let Some(a) = action.filter(|a| !matches!(*a, "scale_out" | "scale_in")) {
        return Err(ApiError::bad_request("invalid_action", format!("action {a:?} must be scale_out or scale_in")));
    }
    let s = a.lock();
    let matching: Vec<_> = s.history.iter().rev().filter(|h| action.is_none_or(|a| h.action == a)).collect();
    let total = matching.len();
    let history: Vec<_> = matching.into_iter().take(limit).collect();
    Ok(Json(json!({"history": history, "total_count": total, "action_filter": action, "limit": limit})))
}

async fn pipeline_report(State(a): State<Arc<Autoscaler>>, body: Body) -> Result<Json<Value>, ApiError> {
    let report: PipelineReport = parse_body(&body)?;
    report
        .validate()
        .map_err(|(field, message)| ApiError::bad_request("invalid_pipeline_report", format!("{field}: {message}")))?;
    let step = report.step;
    let e = a.report(report);
    let triggered = |n: &str| e.conditions.get(n).is_some_and(|c| c.triggered);
    Ok(Json(json!({
        "accepted": true,
        "step": step,
        "signal": e.signal,
        "trainer_starved": triggered("trainer_starved"),
        "rollout_throttled": triggered("rollout_throttled"),
        "rollout_short": triggered("rollout_short"),
        "decision": decision_view(&a, &e),
    })))
}

async fn pipeline_reports(State(a): State<Arc<Autoscaler>>) -> Json<Value> {
    let s = a.lock();
    let reports: Vec<Value> = s
        .core
        .pipeline
        .recent()
        .map(|r| {
            json!({"step": r.report.step, "trainer_wait_secs": r.report.trainer_wait_secs,
                   "rollout_throttled_secs": r.report.rollout_throttled_secs, "step_secs": r.report.step_secs,
                   "rollout_samples": r.report.rollout_samples, "next_step_samples": r.report.next_step_samples,
                   "demand_samples_per_sec": r.report.demand_rate(), "supply_samples_per_sec": r.report.supply_rate(),
                   "received_at": a.to_unix(r.at)})
        })
        .collect();
    Json(json!({"reports": reports, "policy": s.core.config.pipeline_policy}))
}
