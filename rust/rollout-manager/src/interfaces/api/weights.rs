//! `/rollout/weights*`: the fleet's version, publishing a new one, and update progress.
//!
//! - `GET /rollout/weights`: current version (path, checksum, source, since when), the update
//!   in flight with per-engine progress, each engine's version and checksum, and the history.
//! - `POST /rollout/weights/publish`: answers at once. The files' headers are checked here (400
//!   for a bad body, or a missing, empty or invalid checkpoint: nothing is published); then 202
//!   with an update in `CHECKSUMMING` while the files are hashed in the background
//!   ([`crate::ops::weight_update::checksum_then_run`]), or 202 with the running update when it
//!   publishes the same version from the same path (joined), or 200 with the earlier update when
//!   that version was published from that path before. 409: another update runs, or the version
//!   name is taken by another path or (given `checksum`) other bytes. A checksum that does not
//!   match, or a file that changes or vanishes while hashed, ends the update FAILED with nothing
//!   loaded.
//! - `GET /rollout/weights/updates[?status=]` and `GET /rollout/weights/updates/{id}`.

use super::{parse_body, status_filter, ApiState};
use crate::foundation::error::ApiError;
use crate::foundation::records::{BroadcastStep, Bucket};
use crate::ops::publish::Published;
use crate::registry::weights::UpdateRecord;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use rollout_core::ids::VersionName;
use rollout_core::weights::{UpdateStrategy, WeightUpdateStatus};
use serde::Deserialize;
use serde_json::{json, Value};

/// Entries of `history` in `GET /rollout/weights`.
const HISTORY: usize = 20;

pub fn routes() -> Router<ApiState> {
    Router::new()
        .route("/rollout/weights", get(weights))
        .route("/rollout/weights/publish", post(publish))
        .route("/rollout/weights/updates", get(list_updates))
        .route("/rollout/weights/updates/{id}", get(get_update))
        .route("/rollout/weights/trainer_updates", post(open_trainer_update))
        .route("/rollout/weights/updates/{id}/broadcast", post(start_broadcast))
        .route("/rollout/weights/updates/{id}/abort", post(abort_update))
        .route("/rollout/weights/trainer_group", get(trainer_group).post(build_group))
        .route("/rollout/weights/trainer_group/destroy", post(destroy_group))
}

/// Body of `POST /rollout/weights/trainer_group` (see [`crate::ops::trainer_group`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BuildGroupRequest {
    group_name: String,
    master_address: String,
    master_port: u16,
    world_size: u32,
}

async fn build_group(
    State(s): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let req: BuildGroupRequest = parse_body(&body)?;
    let build = crate::ops::trainer_group::BuildRequest {
        group_name: req.group_name,
        master_address: req.master_address,
        master_port: req.master_port,
        world_size: req.world_size,
    };
    let group = crate::ops::trainer_group::build(&s.manager, build)?;
    let out = serde_json::to_value(&group).map_err(|e| ApiError::internal("serialize", e.to_string()))?;
    Ok((StatusCode::ACCEPTED, Json(out)))
}

async fn trainer_group(State(s): State<ApiState>) -> Result<Json<Value>, ApiError> {
    let group = crate::ops::trainer_group::current(&s.manager)?;
    serde_json::to_value(&group).map(Json).map_err(|e| ApiError::internal("serialize", e.to_string()))
}

async fn destroy_group(State(s): State<ApiState>) -> Result<Json<Value>, ApiError> {
    let group = crate::ops::trainer_update::destroy_group(&s.manager).await?;
    Ok(Json(json!({"destroyed": group})))
}

/// Body of `POST /rollout/weights/trainer_updates` (see [`crate::ops::trainer_update`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerUpdateRequest {
    pub version: String,
    /// The tensors the trainer broadcasts, in broadcast order (SGLang's
    /// `/update_weights_from_distributed` fields); none when each `.../broadcast` names its
    /// bucket.
    #[serde(default)]
    pub names: Vec<String>,
    #[serde(default)]
    pub dtypes: Vec<String>,
    #[serde(default)]
    pub shapes: Vec<Vec<u64>>,
    pub master_address: String,
    pub master_port: u16,
    /// The group the trainer holds from its last update, if any (kept when the members did
    /// not change).
    #[serde(default)]
    pub group_name: Option<String>,
    #[serde(default)]
    pub group_prefix: Option<String>,
    /// `/pause_generation` mode: `retract` (default), `abort` or `in_place`.
    #[serde(default)]
    pub pause_mode: Option<String>,
    #[serde(default)]
    pub flush_cache: Option<bool>,
}

async fn open_trainer_update(
    State(s): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let req: TrainerUpdateRequest = parse_body(&body)?;
    let version = version_name(&req.version)?;
    let open = crate::ops::trainer_update::OpenRequest {
        version,
        tensors: Bucket { names: req.names, dtypes: req.dtypes, shapes: req.shapes },
        pause_mode: req.pause_mode.unwrap_or_else(|| "retract".into()),
        flush_cache: req.flush_cache.unwrap_or(true),
        master_address: req.master_address,
        master_port: req.master_port,
        group_name: req.group_name,
        group_prefix: req.group_prefix.unwrap_or_else(|| "elastic_rollout_weights".into()),
    };
    let record = crate::ops::trainer_update::open(&s.manager, open)?;
    let out = serde_json::to_value(&record).map_err(|e| ApiError::internal("serialize", e.to_string()))?;
    Ok((StatusCode::ACCEPTED, Json(out)))
}

/// The update id of a path; one that cannot be an id names no update.
fn update_id(raw: &str) -> Result<rollout_core::ids::UpdateId, ApiError> {
    rollout_core::ids::UpdateId::parse(raw).map_err(|_| crate::ops::trainer_update::unknown_update(raw).into())
}

/// Body of `POST /rollout/weights/updates/{id}/broadcast` for a bucketed update: the bucket
/// the trainer broadcasts next, and whether it is the last (`{"last": true}` alone ends the
/// update after the buckets sent). An update opened with its tensors takes no body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct BroadcastRequest {
    #[serde(default)]
    names: Vec<String>,
    #[serde(default)]
    dtypes: Vec<String>,
    #[serde(default)]
    shapes: Vec<Vec<u64>>,
    #[serde(default)]
    last: bool,
}

async fn start_broadcast(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    // An empty body parses as `{}`: no step (an update opened with its tensors).
    let req: BroadcastRequest = parse_body(&body)?;
    let bucket = Bucket { names: req.names, dtypes: req.dtypes, shapes: req.shapes };
    let named = bucket != Bucket::default();
    let step = (named || req.last).then(|| BroadcastStep { bucket: named.then_some(bucket), last: req.last });
    let record = crate::ops::trainer_update::start_broadcast(&s.manager, &update_id(&id)?, step).await?;
    serde_json::to_value(&record).map(Json).map_err(|e| ApiError::internal("serialize", e.to_string()))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AbortRequest {
    #[serde(default)]
    reason: Option<String>,
}

async fn abort_update(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let req: AbortRequest = parse_body(&body)?; // an empty body is `{}`: no reason given
    let reason = req.reason.unwrap_or_else(|| "no reason given".into());
    let reason: String = reason.chars().take(500).collect();
    let record = crate::ops::trainer_update::abort(&s.manager, &update_id(&id)?, &reason).await?;
    serde_json::to_value(&record).map(Json).map_err(|e| ApiError::internal("serialize", e.to_string()))
}

/// Body of `POST /rollout/weights/publish`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishRequest {
    pub version: String,
    pub path: String,
    #[serde(default = "default_strategy")]
    pub strategy: UpdateStrategy,
    #[serde(default)]
    pub max_unavailable: Option<u32>,
    /// Expected SHA-256 of the checkpoint; the publish is refused if the files differ.
    #[serde(default)]
    pub checksum: Option<String>,
    /// `/pause_generation` mode for `all_at_once`: `abort` (default), `retract` or `in_place`.
    #[serde(default)]
    pub pause_mode: Option<String>,
}

fn default_strategy() -> UpdateStrategy {
    UpdateStrategy::Rolling
}

/// The request's version name, checked here once (`rollout_core::ids::VersionName`).
fn version_name(v: &str) -> Result<VersionName, ApiError> {
    VersionName::parse(v).map_err(|e| ApiError::bad_request("invalid_version", e.to_string()))
}

async fn publish(
    State(s): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let req: PublishRequest = parse_body(&body)?;
    let version = version_name(&req.version)?;
    let pause_mode = req.pause_mode.clone().unwrap_or_else(|| "abort".into());
    if !matches!(pause_mode.as_str(), "abort" | "retract" | "in_place") {
        return Err(ApiError::bad_request(
            "invalid_pause_mode",
            format!("pause_mode {pause_mode:?} must be abort, retract or in_place"),
        ));
    }
    if req.max_unavailable == Some(0) {
        return Err(ApiError::bad_request("invalid_max_unavailable", "max_unavailable must be at least 1"));
    }
    if !std::path::Path::new(&req.path).is_absolute() {
        return Err(ApiError::bad_request(
            "invalid_path",
            format!("path {:?} must be absolute: engines resolve it from their own working directory", req.path),
        ));
    }
    let given = match &req.checksum {
        None => None,
        Some(c) if c.len() == 64 && c.bytes().all(|b| b.is_ascii_hexdigit()) => Some(c.to_ascii_lowercase()),
        Some(c) => {
            return Err(ApiError::bad_request(
                "invalid_checksum",
                format!("checksum {c:?} must be 64 hex digits (SHA-256, see docs/api.md for the rule), or left out"),
            ))
        }
    };
    let publish = crate::ops::publish::Publish {
        version,
        path: req.path,
        checksum: given,
        strategy: req.strategy,
        max_unavailable: req.max_unavailable,
        pause_mode,
    };
    Ok(match crate::ops::publish::publish(&s.manager, publish).await? {
        Published::Started(u) => (
            StatusCode::ACCEPTED,
            Json(json!({"update_id": u.update_id(), "status": u.status(), "version": u.version(), "checksum": null,
                        "message": u.message()})),
        ),
        Published::Joined(u) => {
            let message = format!(
                "update {} already publishes {} from this path ({}); this publish joins it",
                u.update_id(),
                u.version(),
                u.status()
            );
            let body = json!({"update_id": u.update_id(), "status": u.status(), "version": u.version(),
                              "checksum": u.checksum(), "message": message});
            (StatusCode::ACCEPTED, Json(body))
        }
        Published::Existing { update_id, status, version, checksum } => {
            let message = format!(
                "version {version} was already published from this path; nothing to do (its files are not hashed again)"
            );
            let body = json!({"update_id": update_id, "status": status, "version": version, "checksum": checksum,
                              "message": message});
            (StatusCode::OK, Json(body))
        }
    })
}

async fn weights(State(s): State<ApiState>) -> Json<Value> {
    // One lock for everything, so the engines and the fleet version are one consistent view.
    let inner = s.manager.fleet.lock();
    let w = &inner.weights;
    let mut listed: Vec<&crate::registry::fleet::Engine> = inner.engines.values().collect();
    listed.sort_by_key(|e| e.seq());
    let engines: Vec<Value> = listed
        .iter()
        .map(|e| {
            let r = &e.record();
            json!({"engine_id": r.engine_id(), "status": r.status(), "weight_version": r.weight_version(),
                   "weights_checksum": r.weights_checksum()})
        })
        .collect();
    let mut done: Vec<&UpdateRecord> = w.updates().values().collect();
    done.sort_by(|a, b| b.created_at().total_cmp(&a.created_at()));
    let history: Vec<Value> = done
        .iter()
        .take(HISTORY)
        .map(|u| {
            json!({"update_id": u.update_id(), "version": u.version(), "path": u.path(), "checksum": u.checksum(),
                   "strategy": u.strategy(), "status": u.status(), "published_at": u.created_at(),
                   "finished_at": u.finished_at(), "error_message": u.error_message(), "resumed": u.resumed(),
                   "source": u.source()})
        })
        .collect();
    let last_strategy = done.first().map(|u| u.strategy());
    Json(json!({
        "version": w.current().version,
        "path": w.current().path,
        "checksum": w.current().checksum,
        "source": w.source(),
        "since": w.current_since(),
        "update_id": w.current_update(),
        "strategy": last_strategy,
        "transport": s.manager.transport.name(),
        "update": w.running_update(),
        "engines": engines,
        "history": history,
    }))
}

#[derive(Deserialize)]
struct UpdateFilter {
    status: Option<String>,
}

async fn list_updates(State(s): State<ApiState>, Query(f): Query<UpdateFilter>) -> Result<Json<Value>, ApiError> {
    let wanted: Option<WeightUpdateStatus> = status_filter(f.status.as_deref())?;
    let inner = s.manager.fleet.lock();
    let mut updates: Vec<&UpdateRecord> =
        inner.weights.updates().values().filter(|u| wanted.is_none_or(|w| u.status() == w)).collect();
    updates.sort_by(|a, b| a.created_at().total_cmp(&b.created_at()));
    Ok(Json(json!({"updates": updates, "total": updates.len()})))
}

async fn get_update(State(s): State<ApiState>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let inner = s.manager.fleet.lock();
    let u = inner.weights.updates().get(id.as_str()).ok_or_else(|| {
        ApiError::not_found(
            "unknown_request",
            format!("no weight update with id {id}; list them with GET /rollout/weights/updates"),
        )
    })?;
    serde_json::to_value(u).map(Json).map_err(|e| ApiError::internal("serialize", e.to_string()))
}
