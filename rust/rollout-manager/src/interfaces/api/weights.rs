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
use crate::foundation::error::{ApiError, ErrorBody};
use crate::foundation::records::TrainerGroup;
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

/// Body of `POST /rollout/weights/trainer_group`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BuildGroupRequest {
    /// 1 to 128 letters, digits, `_`, `-` or `.`.
    group_name: String,
    /// Where the trainer listens as rank 0.
    master_address: String,
    #[schema(minimum = 1, maximum = 65535)]
    master_port: u16,
    /// The trainer's rank 0 plus the engines' ranks.
    #[schema(minimum = 2)]
    world_size: u32,
    /// The collective backend: `nccl` (default) or `gloo` (engines on CPU).
    #[serde(default)]
    #[schema(value_type = Option<rollout_core::weights::GroupBackend>)]
    backend: Option<String>,
}

/// The backend a body names (`nccl` when none), or 400 `invalid_backend`.
fn backend(name: Option<&str>) -> Result<rollout_core::weights::GroupBackend, ApiError> {
    name.map_or(Ok(rollout_core::weights::GroupBackend::Nccl), |n| {
        rollout_core::weights::GroupBackend::parse(n)
            .map_err(|why| crate::ops::op_error::OpError::invalid("invalid_backend", why).into())
    })
}

/// Build a weight-update group the trainer fixes (its name and world size), as AReaL does.
///
/// Answers 202 at once; the members join in the background (`fixed.state`: joining, then
/// joined or failed) while the trainer joins as rank 0. A trainer update still running over a
/// group the trainer fixed is given up first (its trainer was restarted).
#[utoipa::path(post, path = "/rollout/weights/trainer_group", operation_id = "buildTrainerGroup",
    request_body = BuildGroupRequest,
    responses((status = 202, description = "The group; its members are joining", body = TrainerGroup),
              (status = 400, description = "Bad body, name or world size", body = ErrorBody),
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 409, description = "An update runs, or the world does not fit the fleet", body = ErrorBody)))]
pub(crate) async fn build_group(
    State(s): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<TrainerGroup>), ApiError> {
    let req: BuildGroupRequest = parse_body(&body)?;
    let build = crate::ops::trainer_group::BuildRequest {
        group_name: req.group_name,
        master_address: req.master_address,
        master_port: req.master_port,
        world_size: req.world_size,
        backend: backend(req.backend.as_deref())?,
    };
    let group = crate::ops::trainer_update::rebuild_group(&s.manager, build).await?;
    Ok((StatusCode::ACCEPTED, Json(group)))
}

/// The weight-update group the engines hold.
#[utoipa::path(get, path = "/rollout/weights/trainer_group", operation_id = "getTrainerGroup",
    responses((status = 200, description = "The group", body = TrainerGroup),
              (status = 404, description = "The engines hold no group", body = ErrorBody)))]
pub(crate) async fn trainer_group(State(s): State<ApiState>) -> Result<Json<TrainerGroup>, ApiError> {
    Ok(Json(crate::ops::trainer_group::current(&s.manager)?))
}

/// What `POST /rollout/weights/trainer_group/destroy` destroyed.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct GroupDestroyed {
    /// The group the engines left; null when they held none.
    destroyed: Option<TrainerGroup>,
}

/// Destroy the weight-update group on its members (the trainer destroys its side).
#[utoipa::path(post, path = "/rollout/weights/trainer_group/destroy", operation_id = "destroyTrainerGroup",
    responses((status = 200, description = "The group destroyed, if any", body = GroupDestroyed),
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 409, description = "An update uses the group", body = ErrorBody)))]
pub(crate) async fn destroy_group(State(s): State<ApiState>) -> Result<Json<GroupDestroyed>, ApiError> {
    let group = crate::ops::trainer_update::destroy_group(&s.manager).await?;
    Ok(Json(GroupDestroyed { destroyed: group }))
}

/// Body of `POST /rollout/weights/trainer_updates`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TrainerUpdateRequest {
    /// A new version name: 1 to 128 letters, digits and `. _ - +`.
    pub version: String,
    /// The tensors the trainer broadcasts, in broadcast order (SGLang's
    /// `/update_weights_from_distributed` fields); leave out names, dtypes and shapes to send
    /// the tensors in buckets, each `.../broadcast` naming its own.
    #[serde(default)]
    pub names: Vec<String>,
    /// Torch dtype names (`bfloat16`, `float32`, ...).
    #[serde(default)]
    pub dtypes: Vec<String>,
    #[serde(default)]
    pub shapes: Vec<Vec<u64>>,
    /// Where the trainer listens as rank 0.
    pub master_address: String,
    #[schema(minimum = 1, maximum = 65535)]
    pub master_port: u16,
    /// The group the trainer holds from its last update, if any (kept when the members did
    /// not change).
    #[serde(default)]
    pub group_name: Option<String>,
    /// Prefix of a new group's name (default `elastic_rollout_weights`).
    #[serde(default)]
    pub group_prefix: Option<String>,
    /// `/pause_generation` mode: `retract` (default), `abort` or `in_place`.
    #[serde(default)]
    #[schema(value_type = Option<rollout_core::weights::PauseMode>)]
    pub pause_mode: Option<String>,
    /// Flush the engines' cache after the update (default true).
    #[serde(default)]
    pub flush_cache: Option<bool>,
    /// The collective backend of a new group: `nccl` (default) or `gloo` (engines on CPU).
    #[serde(default)]
    #[schema(value_type = Option<rollout_core::weights::GroupBackend>)]
    pub backend: Option<String>,
}

/// Open a weight update whose bytes the trainer broadcasts over NCCL.
///
/// Answers 202 with the update: the engines pause and join the group (`trainer.group_ready`),
/// then the trainer calls `.../broadcast` and sends. See docs/api.md for the handshake.
#[utoipa::path(post, path = "/rollout/weights/trainer_updates", operation_id = "openTrainerUpdate",
    request_body = TrainerUpdateRequest,
    responses((status = 202, description = "The update, opened", body = UpdateRecord),
              (status = 400, description = "Bad body or version", body = ErrorBody),
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 409, description = "Another update runs, or the version is taken", body = ErrorBody)))]
pub(crate) async fn open_trainer_update(
    State(s): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<UpdateRecord>), ApiError> {
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
        backend: backend(req.backend.as_deref())?,
    };
    let record = crate::ops::trainer_update::open(&s.manager, open)?;
    Ok((StatusCode::ACCEPTED, Json(record)))
}

/// The update id of a path; one that cannot be an id names no update.
fn update_id(raw: &str) -> Result<rollout_core::ids::UpdateId, ApiError> {
    rollout_core::ids::UpdateId::parse(raw).map_err(|_| crate::ops::trainer_update::unknown_update(raw).into())
}

/// Body of `POST /rollout/weights/updates/{id}/broadcast` for a bucketed update: the bucket
/// the trainer broadcasts next, and whether it is the last (`{"last": true}` alone ends the
/// update after the buckets sent). An update opened with its tensors takes no body.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BroadcastRequest {
    /// The bucket's tensors, in broadcast order.
    #[serde(default)]
    names: Vec<String>,
    #[serde(default)]
    dtypes: Vec<String>,
    #[serde(default)]
    shapes: Vec<Vec<u64>>,
    /// The trainer's last step: the engines are told the version and continue.
    #[serde(default)]
    last: bool,
}

/// The trainer is about to broadcast (a bucket, or the whole update): the engines receive.
///
/// Answers once the members are receiving; the trainer then broadcasts as rank 0.
#[utoipa::path(post, path = "/rollout/weights/updates/{id}/broadcast", operation_id = "startBroadcast",
    params(("id" = String, Path, description = "the update's update_id")),
    request_body = BroadcastRequest,
    responses((status = 200, description = "The update", body = UpdateRecord),
              (status = 400, description = "Bad body", body = ErrorBody),
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 404, description = "No such update", body = ErrorBody),
              (status = 409, description = "The update is not waiting for this step", body = ErrorBody)))]
pub(crate) async fn start_broadcast(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<UpdateRecord>, ApiError> {
    // An empty body parses as `{}`: no step (an update opened with its tensors).
    let req: BroadcastRequest = parse_body(&body)?;
    let bucket = Bucket { names: req.names, dtypes: req.dtypes, shapes: req.shapes };
    let named = bucket != Bucket::default();
    let step = (named || req.last).then(|| BroadcastStep { bucket: named.then_some(bucket), last: req.last });
    let record = crate::ops::trainer_update::start_broadcast(&s.manager, &update_id(&id)?, step).await?;
    Ok(Json(record))
}

/// Body of `POST /rollout/weights/updates/{id}/abort`.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AbortRequest {
    /// Why the trainer gives up (kept on the update; at most 500 characters are kept).
    #[serde(default)]
    reason: Option<String>,
}

/// The trainer gives a trainer update up: nothing is committed and the engines continue on
/// the version they served.
#[utoipa::path(post, path = "/rollout/weights/updates/{id}/abort", operation_id = "abortWeightUpdate",
    params(("id" = String, Path, description = "the update's update_id")),
    request_body = AbortRequest,
    responses((status = 200, description = "The update, FAILED", body = UpdateRecord),
              (status = 400, description = "Bad body", body = ErrorBody),
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 404, description = "No such update", body = ErrorBody),
              (status = 409, description = "The update already ended", body = ErrorBody)))]
pub(crate) async fn abort_update(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<UpdateRecord>, ApiError> {
    let req: AbortRequest = parse_body(&body)?; // an empty body is `{}`: no reason given
    let reason = req.reason.unwrap_or_else(|| "no reason given".into());
    let reason: String = reason.chars().take(500).collect();
    let record = crate::ops::trainer_update::abort(&s.manager, &update_id(&id)?, &reason).await?;
    Ok(Json(record))
}

/// Body of `POST /rollout/weights/publish`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PublishRequest {
    /// The version's name: 1 to 128 letters, digits and `. _ - +`, not `..`.
    #[schema(pattern = "^[A-Za-z0-9._+-]{1,128}$")]
    pub version: String,
    /// Absolute path of a directory of `*.safetensors` files.
    pub path: String,
    #[serde(default = "default_strategy")]
    #[schema(default = "rolling")]
    pub strategy: UpdateStrategy,
    /// `rolling`: engines updated together (default 25% of the fleet, at least 1).
    #[serde(default)]
    #[schema(minimum = 1)]
    pub max_unavailable: Option<u32>,
    /// Expected checksum of the checkpoint (SHA-256 of the shards' listing:
    /// `LC_ALL=C sha256sum -- *.safetensors | sha256sum`): the update ends FAILED, nothing
    /// loaded, if the files' differs.
    #[serde(default)]
    #[schema(pattern = "^[0-9A-Fa-f]{64}$")]
    pub checksum: Option<String>,
    /// `all_at_once`: the `/pause_generation` mode (default `abort`).
    #[serde(default)]
    #[schema(value_type = Option<rollout_core::weights::PauseMode>)]
    pub pause_mode: Option<String>,
}

fn default_strategy() -> UpdateStrategy {
    UpdateStrategy::Rolling
}

/// The request's version name, checked here once (`rollout_core::ids::VersionName`).
fn version_name(v: &str) -> Result<VersionName, ApiError> {
    VersionName::parse(v).map_err(|e| ApiError::bad_request("invalid_version", e.to_string()))
}

/// What `POST /rollout/weights/publish` answers.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct PublishAccepted {
    update_id: Option<rollout_core::ids::UpdateId>,
    /// `CHECKSUMMING` for a new update (202); the running update's status when this publish
    /// joins it (202); the earlier update's when the version was published from this path
    /// before (200).
    status: String,
    version: String,
    /// Null while the update is CHECKSUMMING.
    checksum: Option<String>,
    message: String,
}

/// Publish a checkpoint directory as a new weight version.
///
/// Answers at once. The files' headers are checked here (400: nothing is published); then 202
/// with an update in `CHECKSUMMING` while the files are hashed, or 202 with the running update
/// when it publishes the same version from the same path, or 200 with the earlier update when
/// that version was published from that path before.
#[utoipa::path(post, path = "/rollout/weights/publish", operation_id = "publishWeights",
    request_body = PublishRequest,
    responses((status = 202, description = "A new update, or the running one it joins", body = PublishAccepted),
              (status = 200, description = "Already published from this path", body = PublishAccepted),
              (status = 400, description = "Bad body or checkpoint", body = ErrorBody),
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 409, description = "Another update runs, or the name is taken", body = ErrorBody)))]
pub(crate) async fn publish(
    State(s): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<PublishAccepted>), ApiError> {
    let req: PublishRequest = parse_body(&body)?;
    let version = version_name(&req.version)?;
    let pause_mode = req.pause_mode.clone().unwrap_or_else(|| "abort".into());
    if !rollout_core::weights::PauseMode::known(&pause_mode) {
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
            Json(PublishAccepted {
                update_id: Some(u.update_id().clone()),
                status: u.status().to_string(),
                version: u.version().clone(),
                checksum: None,
                message: u.message().clone(),
            }),
        ),
        Published::Joined(u) => {
            let message = format!(
                "update {} already publishes {} from this path ({}); this publish joins it",
                u.update_id(),
                u.version(),
                u.status()
            );
            let body = PublishAccepted {
                update_id: Some(u.update_id().clone()),
                status: u.status().to_string(),
                version: u.version().clone(),
                checksum: u.checksum().clone(),
                message,
            };
            (StatusCode::ACCEPTED, Json(body))
        }
        Published::Existing { update_id, status, version, checksum } => {
            let message = format!(
                "version {version} was already published from this path; nothing to do (its files are not hashed again)"
            );
            (StatusCode::OK, Json(PublishAccepted { update_id, status, version, checksum, message }))
        }
    })
}

/// `GET /rollout/weights`.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = Weights)]
pub(crate) struct WeightsView {
    /// The fleet's committed version.
    version: String,
    path: Option<String>,
    checksum: Option<String>,
    source: crate::foundation::records::VersionSource,
    /// When the version became the fleet's (Unix seconds).
    since: f64,
    update_id: Option<rollout_core::ids::UpdateId>,
    strategy: Option<UpdateStrategy>,
    /// How published checkpoints reach the engines: `disk` or `relay` (trainer updates bring
    /// their own bytes).
    transport: &'static str,
    /// The update in flight.
    update: Option<UpdateRecord>,
    engines: Vec<EngineWeights>,
    /// The latest updates, newest first.
    history: Vec<UpdateSummary>,
}

/// An engine's weights.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct EngineWeights {
    engine_id: rollout_core::ids::EngineId,
    status: rollout_core::EngineStatus,
    weight_version: Option<String>,
    weights_checksum: Option<String>,
}

/// An update in the history of `GET /rollout/weights`.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct UpdateSummary {
    update_id: rollout_core::ids::UpdateId,
    version: String,
    path: String,
    checksum: Option<String>,
    strategy: UpdateStrategy,
    status: WeightUpdateStatus,
    published_at: f64,
    finished_at: Option<f64>,
    error_message: Option<String>,
    /// Manager restarts the update went on through.
    resumed: u32,
    source: crate::foundation::records::UpdateSource,
}

/// The fleet's weight version, the update in flight, each engine's version and the history.
#[utoipa::path(get, path = "/rollout/weights", operation_id = "getWeights",
    responses((status = 200, description = "The fleet's weights", body = WeightsView)))]
pub(crate) async fn weights(State(s): State<ApiState>) -> Json<WeightsView> {
    // One lock for everything, so the engines and the fleet version are one consistent view.
    let inner = s.manager.fleet.lock();
    let w = &inner.weights;
    let mut listed: Vec<&crate::registry::fleet::Engine> = inner.engines.values().collect();
    listed.sort_by_key(|e| e.seq());
    let engines = listed
        .iter()
        .map(|e| {
            let r = &e.record();
            EngineWeights {
                engine_id: r.engine_id().clone(),
                status: r.status(),
                weight_version: r.weight_version().clone(),
                weights_checksum: r.weights_checksum().clone(),
            }
        })
        .collect();
    let mut done: Vec<&UpdateRecord> = w.updates().values().collect();
    done.sort_by(|a, b| b.created_at().total_cmp(&a.created_at()));
    let history = done
        .iter()
        .take(HISTORY)
        .map(|u| UpdateSummary {
            update_id: u.update_id().clone(),
            version: u.version().clone(),
            path: u.path().clone(),
            checksum: u.checksum().clone(),
            strategy: u.strategy(),
            status: u.status(),
            published_at: u.created_at(),
            finished_at: u.finished_at(),
            error_message: u.error_message().clone(),
            resumed: u.resumed(),
            source: u.source(),
        })
        .collect();
    Json(WeightsView {
        version: w.current().version.clone(),
        path: w.current().path.clone(),
        checksum: w.current().checksum.clone(),
        source: w.source(),
        since: w.current_since(),
        update_id: w.current_update().clone(),
        strategy: done.first().map(|u| u.strategy()),
        transport: s.manager.transport.name(),
        update: w.running_update().cloned(),
        engines,
        history,
    })
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct UpdateFilter {
    /// Only updates in this status (any case).
    status: Option<String>,
}

/// Weight updates the manager remembers, oldest first.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = WeightUpdateList)]
pub(crate) struct UpdateList {
    updates: Vec<UpdateRecord>,
    total: usize,
}

/// Weight updates, oldest first.
#[utoipa::path(get, path = "/rollout/weights/updates", operation_id = "listWeightUpdates", params(UpdateFilter),
    responses((status = 200, description = "The updates", body = UpdateList),
              (status = 400, description = "Unknown status", body = ErrorBody)))]
pub(crate) async fn list_updates(
    State(s): State<ApiState>,
    Query(f): Query<UpdateFilter>,
) -> Result<Json<UpdateList>, ApiError> {
    let wanted: Option<WeightUpdateStatus> = status_filter(f.status.as_deref())?;
    let inner = s.manager.fleet.lock();
    let mut updates: Vec<UpdateRecord> =
        inner.weights.updates().values().filter(|u| wanted.is_none_or(|w| u.status() == w)).cloned().collect();
    updates.sort_by(|a, b| a.created_at().total_cmp(&b.created_at()));
    Ok(Json(UpdateList { total: updates.len(), updates }))
}

/// One weight update, with each engine's progress.
#[utoipa::path(get, path = "/rollout/weights/updates/{id}", operation_id = "getWeightUpdate",
    params(("id" = String, Path, description = "the update's update_id")),
    responses((status = 200, description = "The update", body = UpdateRecord),
              (status = 404, description = "No such update", body = ErrorBody)))]
pub(crate) async fn get_update(
    State(s): State<ApiState>,
    Path(id): Path<String>,
) -> Result<Json<UpdateRecord>, ApiError> {
    let inner = s.manager.fleet.lock();
    let u = inner.weights.updates().get(id.as_str()).ok_or_else(|| {
        ApiError::not_found(
            "unknown_request",
            format!("no weight update with id {id}; list them with GET /rollout/weights/updates"),
        )
    })?;
    Ok(Json(u.clone()))
}
