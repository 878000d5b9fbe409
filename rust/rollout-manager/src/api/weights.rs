//! `/rollout/weights*`: the fleet's version, publishing a new one, and update progress.
//!
//! - `GET /rollout/weights`: current version (path, checksum, source, since when), the update
//!   in flight with per-engine progress, each engine's version and checksum, and the history.
//! - `POST /rollout/weights/publish`: 202 with an `update_id` (200 with the existing one when the
//!   same version, path and checksum were published before). 400: bad body, missing or invalid
//!   checkpoint, or a given checksum that does not match; 409: another update runs, or the version
//!   name was published with other bytes.
//! - `GET /rollout/weights/updates[?status=]` and `GET /rollout/weights/updates/{id}`.

use super::{parse_body, status_filter, ApiState};
use crate::clock::unix_now;
use crate::error::ApiError;
use crate::records::Transition;
use crate::records::{EngineUpdate, UpdateRecord};
use crate::weights::checkpoint;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use rollout_core::weights::{check_publish, PublishCheck, UpdateStrategy, WeightUpdateStatus, WeightVersion};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// Entries of `history` in `GET /rollout/weights`.
const HISTORY: usize = 20;

pub fn routes() -> Router<ApiState> {
    Router::new()
        .route("/rollout/weights", get(weights))
        .route("/rollout/weights/publish", post(publish))
        .route("/rollout/weights/updates", get(list_updates))
        .route("/rollout/weights/updates/{id}", get(get_update))
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

fn check_version_name(v: &str) -> Result<(), ApiError> {
    // Versions name directories (relay staging), so no separators and no `..`.
    let ok = !v.is_empty()
        && v.len() <= 128
        && !v.contains("..")
        && v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '+'));
    if ok {
        return Ok(());
    }
    Err(ApiError::bad_request(
        "invalid_version",
        format!("version {v:?} must be 1 to 128 letters, digits and . _ - + (no '..')"),
    ))
}

async fn publish(
    State(s): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let req: PublishRequest = parse_body(&body)?;
    check_version_name(&req.version)?;
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
    let dir = std::path::PathBuf::from(&req.path);
    let info = tokio::task::spawn_blocking(move || checkpoint::read(&dir))
        .await
        .map_err(|e| ApiError::internal("checksum_task", e.to_string()))?
        .map_err(|e| ApiError::bad_request("invalid_checkpoint", format!("{e}; nothing was published")))?;
    if let Some(given) = &req.checksum {
        if !given.eq_ignore_ascii_case(&info.checksum) {
            return Err(ApiError::bad_request(
                "checksum_mismatch",
                format!(
                    "checksum {given} does not match the checkpoint's SHA-256 {} (the files changed or are incomplete); nothing was published",
                    info.checksum
                ),
            ));
        }
    }
    let version = WeightVersion {
        version: req.version.clone(),
        path: Some(req.path.clone()),
        checksum: Some(info.checksum.clone()),
        published_seq: 0,
    };

    let manager = &s.manager;
    // Decide under the lock first (cheap), then stage outside it, then record.
    let decided = {
        let inner = manager.fleet.lock();
        decide(&inner.weights, &req.version, &req.path, &info.checksum)?
    };
    if let Some(existing) = decided {
        return Ok((StatusCode::OK, Json(existing)));
    }
    let nodes = manager.weight_nodes();
    let engine_path = manager
        .transport
        .stage(&version, &nodes)
        .await
        .map_err(|e| ApiError::unavailable("stage_failed", format!("{e}; nothing was published")))?;
    let update_id = uuid::Uuid::new_v4().to_string();
    let answer = manager.fleet.update(|inner| -> Result<Value, ApiError> {
        // Checked again: another publish may have won the race while we staged.
        if let Some(existing) = decide(&inner.weights, &req.version, &req.path, &info.checksum)? {
            return Ok(existing);
        }
        let now = unix_now();
        let engines: BTreeMap<String, EngineUpdate> = inner
            .engines
            .values()
            .filter(|e| e.record.status.is_routable())
            .map(|e| {
                (
                    e.record.engine_id.clone(),
                    EngineUpdate {
                        status: rollout_core::weights::EngineUpdateStatus::Pending,
                        error: None,
                        started_at: None,
                        finished_at: None,
                    },
                )
            })
            .collect();
        let record = UpdateRecord {
            update_id: update_id.clone(),
            version: req.version.clone(),
            path: req.path.clone(),
            checksum: info.checksum.clone(),
            engine_path: engine_path.clone(),
            previous_version: inner.weights.current.version.clone(),
            strategy: req.strategy,
            max_unavailable: req.max_unavailable,
            pause_mode: pause_mode.clone(),
            transport: manager.transport.name().to_string(),
            status: WeightUpdateStatus::Pending,
            engines,
            created_at: now,
            updated_at: now,
            finished_at: None,
            error_message: None,
            message: format!(
                "publishing {} ({} files, {} bytes) to the fleet, {}",
                req.version,
                info.files.len(),
                info.total_bytes,
                req.strategy
            ),
            history: vec![Transition { status: "PENDING".into(), at: now }],
            resumed: 0,
        };
        let out = json!({
            "update_id": update_id,
            "status": "PENDING",
            "version": req.version,
            "checksum": info.checksum,
            "message": record.message,
        });
        inner.weights.updates.insert(update_id.clone(), record);
        inner.weights.running = Some(update_id.clone());
        inner.weights.prune();
        Ok(out)
    })?;
    if answer.get("update_id").and_then(|v| v.as_str()) != Some(update_id.as_str()) {
        return Ok((StatusCode::OK, Json(answer)));
    }
    let m = manager.clone();
    manager.tasks.spawn(crate::weight_update::run(m, update_id));
    Ok((StatusCode::ACCEPTED, Json(answer)))
}

/// Ok(Some(answer)): already published (idempotent); Ok(None): go ahead; Err: 409.
fn decide(
    w: &crate::records::WeightsState,
    version: &str,
    path: &str,
    checksum: &str,
) -> Result<Option<Value>, ApiError> {
    match check_publish(&w.known_versions(), version, path, checksum) {
        PublishCheck::Same => {
            let existing = w
                .updates
                .values()
                .filter(|u| u.version == version && u.status != WeightUpdateStatus::Failed)
                .max_by(|a, b| a.created_at.total_cmp(&b.created_at));
            let (id, status) = existing.map_or((Value::Null, "COMPLETED".to_string()), |u| {
                (json!(u.update_id), u.status.to_string())
            });
            Ok(Some(json!({
                "update_id": id,
                "status": status,
                "version": version,
                "checksum": checksum,
                "message": format!("version {version} with this checksum was already published; nothing to do"),
            })))
        }
        PublishCheck::Conflict(why) => Err(ApiError::conflict("version_conflict", why)),
        PublishCheck::New => match w.running_update() {
            Some(u) => Err(ApiError::conflict(
                "update_in_progress",
                format!(
                    "update {} to {} is in progress; wait for it to finish (GET /rollout/weights/updates/{}), then publish again",
                    u.update_id, u.version, u.update_id
                ),
            )),
            None => Ok(None),
        },
    }
}

async fn weights(State(s): State<ApiState>) -> Json<Value> {
    // One lock for everything, so the engines and the fleet version are one consistent view.
    let inner = s.manager.fleet.lock();
    let w = &inner.weights;
    let mut listed: Vec<&crate::fleet::Engine> = inner.engines.values().collect();
    listed.sort_by_key(|e| e.seq);
    let engines: Vec<Value> = listed
        .iter()
        .map(|e| {
            let r = &e.record;
            json!({"engine_id": r.engine_id, "status": r.status, "weight_version": r.weight_version,
                   "weights_checksum": r.weights_checksum})
        })
        .collect();
    let mut done: Vec<&UpdateRecord> = w.updates.values().collect();
    done.sort_by(|a, b| b.created_at.total_cmp(&a.created_at));
    let history: Vec<Value> = done
        .iter()
        .take(HISTORY)
        .map(|u| {
            json!({"update_id": u.update_id, "version": u.version, "path": u.path, "checksum": u.checksum,
                   "strategy": u.strategy, "status": u.status, "published_at": u.created_at,
                   "finished_at": u.finished_at, "error_message": u.error_message, "resumed": u.resumed})
        })
        .collect();
    let last_strategy = done.first().map(|u| u.strategy);
    Json(json!({
        "version": w.current.version,
        "path": w.current.path,
        "checksum": w.current.checksum,
        "source": w.source,
        "since": w.current_since,
        "update_id": w.current_update,
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
        inner.weights.updates.values().filter(|u| wanted.is_none_or(|w| u.status == w)).collect();
    updates.sort_by(|a, b| a.created_at.total_cmp(&b.created_at));
    Ok(Json(json!({"updates": updates, "total": updates.len()})))
}

async fn get_update(State(s): State<ApiState>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let inner = s.manager.fleet.lock();
    let u = inner.weights.updates.get(&id).ok_or_else(|| {
        ApiError::not_found(
            "unknown_request",
            format!("no weight update with id {id}; list them with GET /rollout/weights/updates"),
        )
    })?;
    serde_json::to_value(u).map(Json).map_err(|e| ApiError::internal("serialize", e.to_string()))
}
