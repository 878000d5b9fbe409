//! The placements API of Ray mode (docs/ray.md): how the manager's placement decisions reach the
//! Ray shim and how the shim reports back.
//!
//! - `GET /rollout/placements?after=<revision>&wait_secs=<n>`: every placement and the current
//!   revision; a long poll when `after` is the current revision (up to `wait_secs`, at most 60).
//! - `POST /rollout/placements/{engine_id}/bind`: an agent now hosts the engine's placement. The
//!   engine leaves PENDING and is launched through that agent. Idempotent for the same agent;
//!   409 when another agent that still answers is bound (a dead one is replaced, and the engine
//!   is recovered through the new one).
//! - `POST /rollout/placements/{engine_id}/lost`: the agent bound to the placement is gone (its
//!   host actor or node died). The placement goes back to PENDING_RESOURCES and its engine is
//!   recovered through the next agent bound. A report naming an agent not bound is ignored.
//! - `POST /rollout/placements/{engine_id}/released`: the shim removed the placement group of a
//!   placement that is desired absent; the manager forgets it.
//!
//! The handlers parse and answer; what each report does is `crate::ops::placements`.

use super::ApiState;
use crate::foundation::error::ApiError;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use rollout_core::ids::EngineId;
use rollout_core::AgentBinding;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Duration;

/// Longest long poll.
pub const MAX_WAIT_SECS: f64 = 60.0;

pub fn routes() -> Router<ApiState> {
    Router::new()
        .route("/rollout/placements", get(list))
        .route("/rollout/placements/{engine_id}/bind", post(bind))
        .route("/rollout/placements/{engine_id}/lost", post(lost))
        .route("/rollout/placements/{engine_id}/released", post(released))
}

#[derive(Deserialize)]
struct ListQuery {
    after: Option<u64>,
    wait_secs: Option<f64>,
}

fn snapshot(s: &ApiState) -> (u64, Value) {
    let inner = s.manager.fleet.lock();
    let placements: Vec<&rollout_core::Placement> = inner.placements.values().collect();
    (inner.placements.revision(), json!({ "revision": inner.placements.revision(), "placements": placements }))
}

async fn list(
    State(s): State<ApiState>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(q) = query.map_err(|e| {
        ApiError::bad_request(
            "invalid_query",
            format!("{e}; use ?after=<revision>&wait_secs=<seconds>, both non-negative numbers"),
        )
    })?;
    let wait = q.wait_secs.unwrap_or(0.0);
    if !(wait.is_finite() && (0.0..=MAX_WAIT_SECS).contains(&wait)) {
        return Err(ApiError::bad_request(
            "invalid_wait_secs",
            format!("wait_secs {wait} must be between 0 and {MAX_WAIT_SECS} seconds"),
        ));
    }
    let mut changes = s.manager.fleet.subscribe();
    let (revision, body) = snapshot(&s);
    let Some(after) = q.after.filter(|a| *a >= revision) else { return Ok(Json(body)) };
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(wait);
    loop {
        tokio::select! {
            r = changes.changed() => if r.is_err() { break },
            () = tokio::time::sleep_until(deadline) => break,
            () = s.manager.shutdown.cancelled() => break,
        }
        if s.manager.fleet.lock().placements.revision() > after {
            break;
        }
    }
    Ok(Json(snapshot(&s).1))
}

/// Body of `POST /rollout/placements/{engine_id}/bind`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BindRequest {
    agent_url: String,
    #[serde(default)]
    node_id: String,
    #[serde(default)]
    gpu_ids: Vec<String>,
}

/// A placement as JSON.
fn placement_json(p: &rollout_core::Placement) -> Result<Json<Value>, ApiError> {
    serde_json::to_value(p).map(Json).map_err(|e| ApiError::internal("serialize", e.to_string()))
}

/// The engine id of a placement path; one that cannot be an id names no placement.
fn placement_id(raw: &str) -> Result<EngineId, ApiError> {
    EngineId::parse(raw).map_err(|_| crate::ops::placements::unknown(raw).into())
}

async fn bind(
    State(s): State<ApiState>,
    Path(engine_id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    crate::ops::placements::ray_only(&s.manager)?;
    let req: BindRequest = super::parse_body(&body)?;
    let agent_url = crate::ops::scaling::validate_engine_url(&req.agent_url).map_err(|_| {
        ApiError::bad_request(
            "invalid_agent_url",
            format!("agent_url {:?} must be the agent's base URL, http://<node_ip>:<port>", req.agent_url),
        )
    })?;
    if req.gpu_ids.iter().any(|g| g.is_empty() || !g.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')) {
        return Err(ApiError::bad_request(
            "invalid_gpu_ids",
            format!("gpu_ids {:?} must be GPU ids as Ray reports them (e.g. [\"0\", \"1\"])", req.gpu_ids),
        ));
    }
    let per_engine = s.manager.config.rollout_num_gpus_per_engine as usize;
    if !req.gpu_ids.is_empty() && req.gpu_ids.len() != per_engine {
        return Err(ApiError::bad_request(
            "invalid_gpu_ids",
            format!("gpu_ids has {} ids but an engine takes {per_engine} GPUs", req.gpu_ids.len()),
        ));
    }
    let binding = AgentBinding { url: agent_url, node_id: req.node_id, gpu_ids: req.gpu_ids };
    placement_json(&crate::ops::placements::bind(&s.manager, &placement_id(&engine_id)?, binding).await?)
}

/// Body of `POST /rollout/placements/{engine_id}/lost`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LostRequest {
    agent_url: String,
    #[serde(default)]
    reason: String,
}

async fn lost(
    State(s): State<ApiState>,
    Path(engine_id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    crate::ops::placements::ray_only(&s.manager)?;
    let req: LostRequest = super::parse_body(&body)?;
    let reason = if req.reason.trim().is_empty() { "reported by the Ray shim" } else { req.reason.trim() };
    let reason: String = reason.chars().take(500).collect();
    let engine_id = placement_id(&engine_id)?;
    let (placement, unbound) = crate::ops::placements::lost(&s.manager, &engine_id, &req.agent_url, &reason)?;
    let mut answer = placement_json(&placement)?;
    if let Some(obj) = answer.0.as_object_mut() {
        obj.insert("unbound".into(), json!(unbound));
    }
    Ok(answer)
}

async fn released(State(s): State<ApiState>, Path(engine_id): Path<String>) -> Result<Json<Value>, ApiError> {
    crate::ops::placements::ray_only(&s.manager)?;
    crate::ops::placements::released(&s.manager, &placement_id(&engine_id)?)?;
    Ok(Json(json!({ "engine_id": engine_id, "released": true })))
}
