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
use crate::foundation::error::{ApiError, ErrorBody};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use rollout_core::ids::EngineId;
use rollout_core::{AgentBinding, Placement};
use serde::Deserialize;
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

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct ListQuery {
    /// A revision seen before: answer once the placements changed after it (a long poll).
    #[param(minimum = 0)]
    after: Option<u64>,
    /// How long a long poll waits at most (default 0, at most 60).
    #[param(minimum = 0, maximum = 60)]
    wait_secs: Option<f64>,
}

/// Every placement and the revision they are at.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct PlacementList {
    /// Grows with every change to the placements.
    revision: u64,
    placements: Vec<Placement>,
}

fn snapshot(s: &ApiState) -> PlacementList {
    let inner = s.manager.fleet.lock();
    PlacementList { revision: inner.placements.revision(), placements: inner.placements.values().cloned().collect() }
}

/// Ray mode: every engine placement (a long poll with `after` and `wait_secs`).
#[utoipa::path(get, path = "/rollout/placements", operation_id = "listPlacements", params(ListQuery),
    responses((status = 200, description = "The placements", body = PlacementList),
              (status = 400, description = "Bad query", body = ErrorBody)))]
pub(crate) async fn list(
    State(s): State<ApiState>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<PlacementList>, ApiError> {
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
    let body = snapshot(&s);
    let Some(after) = q.after.filter(|a| *a >= body.revision) else { return Ok(Json(body)) };
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
    Ok(Json(snapshot(&s)))
}

/// Body of `POST /rollout/placements/{engine_id}/bind`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BindRequest {
    /// The agent's base URL, `http://<node_ip>:<port>`.
    agent_url: String,
    /// Ray's id of the agent's node.
    #[serde(default)]
    node_id: String,
    /// GPU ids Ray assigned to the engine's bundle, as Ray reports them.
    #[serde(default)]
    gpu_ids: Vec<String>,
}

/// The engine id of a placement path; one that cannot be an id names no placement.
fn placement_id(raw: &str) -> Result<EngineId, ApiError> {
    EngineId::parse(raw).map_err(|_| crate::ops::placements::unknown(raw).into())
}

/// Ray mode: the shim binds the agent that hosts the engine.
///
/// The engine leaves PENDING and is launched through that agent. Idempotent for the same
/// agent; 409 when another agent that still answers is bound (a dead one is replaced).
#[utoipa::path(post, path = "/rollout/placements/{id}/bind", operation_id = "bindPlacement",
    params(("id" = String, Path, description = "the placement's engine_id")),
    request_body = BindRequest,
    responses((status = 200, description = "The placement, bound", body = Placement),
              (status = 400, description = "Bad body, agent URL or GPU ids", body = ErrorBody),
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 404, description = "No such placement", body = ErrorBody),
              (status = 409, description = "Not Ray mode, or another live agent is bound", body = ErrorBody)))]
pub(crate) async fn bind(
    State(s): State<ApiState>,
    Path(engine_id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Placement>, ApiError> {
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
    Ok(Json(crate::ops::placements::bind(&s.manager, &placement_id(&engine_id)?, binding).await?))
}

/// Body of `POST /rollout/placements/{engine_id}/lost`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct LostRequest {
    /// The agent that is gone; a report about an agent not bound to the placement changes
    /// nothing.
    agent_url: String,
    /// For people (at most 500 characters are kept).
    #[serde(default)]
    reason: String,
}

/// What `POST /rollout/placements/{id}/lost` answers: the placement, and whether the report
/// unbound it.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = LostPlacement)]
pub(crate) struct LostAnswer {
    #[serde(flatten)]
    placement: Placement,
    /// The reported agent was bound and is no longer (false: it was not bound; nothing changed).
    unbound: bool,
}

/// Ray mode: the shim reports the placement's agent gone (its host actor or node died).
///
/// The placement goes back to PENDING_RESOURCES and its engine is recovered through the next
/// agent bound.
#[utoipa::path(post, path = "/rollout/placements/{id}/lost", operation_id = "reportAgentLost",
    params(("id" = String, Path, description = "the placement's engine_id")),
    request_body = LostRequest,
    responses((status = 200, description = "The placement", body = LostAnswer),
              (status = 400, description = "Bad body", body = ErrorBody),
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 404, description = "No such placement", body = ErrorBody),
              (status = 409, description = "Not Ray mode", body = ErrorBody)))]
pub(crate) async fn lost(
    State(s): State<ApiState>,
    Path(engine_id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<LostAnswer>, ApiError> {
    crate::ops::placements::ray_only(&s.manager)?;
    let req: LostRequest = super::parse_body(&body)?;
    let reason = if req.reason.trim().is_empty() { "reported by the Ray shim" } else { req.reason.trim() };
    let reason: String = reason.chars().take(500).collect();
    let engine_id = placement_id(&engine_id)?;
    let (placement, unbound) = crate::ops::placements::lost(&s.manager, &engine_id, &req.agent_url, &reason)?;
    Ok(Json(LostAnswer { placement, unbound }))
}

/// What `POST /rollout/placements/{id}/released` answers.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct Released {
    engine_id: String,
    /// Always true: the manager forgot the placement.
    released: bool,
}

/// Ray mode: the shim removed the placement group of a placement desired absent; the manager
/// forgets it.
#[utoipa::path(post, path = "/rollout/placements/{id}/released", operation_id = "releasePlacement",
    params(("id" = String, Path, description = "the placement's engine_id")),
    responses((status = 200, description = "Forgotten", body = Released),
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 404, description = "No such placement", body = ErrorBody),
              (status = 409, description = "Not Ray mode, or the placement is still wanted", body = ErrorBody)))]
pub(crate) async fn released(
    State(s): State<ApiState>,
    Path(engine_id): Path<String>,
) -> Result<Json<Released>, ApiError> {
    crate::ops::placements::ray_only(&s.manager)?;
    crate::ops::placements::released(&s.manager, &placement_id(&engine_id)?)?;
    Ok(Json(Released { engine_id, released: true }))
}
