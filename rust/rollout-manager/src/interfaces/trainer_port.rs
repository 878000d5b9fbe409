//! `--trainer-port`: the fleet as one SGLang engine, for trainers that drive SGLang's
//! weight-sync routes themselves.
//!
//! slime moves weights by calling each engine's `/init_weights_update_group` once, then per
//! sync `/pause_generation`, `/flush_cache`, one `/update_weights_from_distributed` per bucket
//! while its rank 0 broadcasts, and `/continue_generation` (slime 624b824a,
//! `update_weight_from_distributed.py`, `sglang_engine.py`). It has no hook for another
//! updater, but it takes engines it did not launch (`--rollout-external-engine-addrs`), sizes
//! its group from their `/server_info` (`num_gpus`) and gives engine `i` the ranks after the
//! ones before it. Listed as its only engine, this port answers those routes for the whole
//! fleet, each as the manager's own operation:
//! - `/server_info`: an engine's, with `num_gpus` the ranks the fleet's engines hold, so the
//!   trainer's world is those ranks plus its rank 0.
//! - `/init_weights_update_group` (rank offset 1): builds a group whose layout the trainer fixed
//!   ([`crate::ops::trainer_group`]) and answers once the members joined it.
//! - `/update_weights_from_distributed`: the first bucket of a `weight_version` opens a trainer
//!   update on that group ([`crate::ops::trainer_update`]); each is answered once every member
//!   received it.
//! - `/continue_generation`: ends the open update; answered once the fleet serves the version.
//!   With none open, it answers the trainer's newest update when that failed since the trainer's
//!   last pause (timed out, aborted, or the manager restarted under it): 502, not a plain 200.
//! - `/update_weights_from_disk` (slime's disk transport): the manager's publish of that
//!   checkpoint under the trainer's `weight_version`, answered once the fleet serves it.
//! - `/pause_generation` gives the mode of the next update's pause (the manager pauses the
//!   members when the first bucket comes); `/flush_cache` is a no-op (the manager flushes each
//!   member when an update ends); `/destroy_weights_update_group` destroys the group.
//!
//! Answers keep SGLang's shapes (`{"success", "message"}`); a refusal adds our
//! `{"error": {"code", "message"}}` and an HTTP status that says whose fault it was. The
//! trainer's calls are taken one at a time.

use crate::adapters::dialect::Route;
use crate::foundation::error::ApiError;
use crate::foundation::records::{BroadcastStep, Bucket, FixedJoin};
use crate::interfaces::api::parse_body;
use crate::ops::manager::Manager;
use crate::ops::op_error::OpError;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rollout_core::ids::{UpdateId, VersionName};
use rollout_core::weights::WeightUpdateStatus;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// What the trainer has under way on this port.
struct Session {
    /// The update its buckets go to, opened by the first bucket of a version.
    open: Option<Open>,
    /// The mode of its last `/pause_generation` since an update ended.
    pause_mode: Option<String>,
    /// Whether a bucket may open an update: false once an update here failed or was given up
    /// mid-way, until the trainer starts a sync again (`/pause_generation`), ends it
    /// (`/continue_generation`) or builds a group. A bucket after a failed one would otherwise
    /// open the version again with only the remaining buckets, and the members would say that
    /// version while holding the old weights for the ones before.
    at_boundary: bool,
    /// When the trainer last paused (a sync's start, unix seconds): an update that ended
    /// before it is not the one a later `/continue_generation` ends.
    paused_at: Option<f64>,
}

impl Session {
    /// Drops the open update once it has ended without the trainer (it timed out, or failed
    /// while the trainer was away): the trainer is then mid-sync with nothing to send to.
    fn settle(&mut self, manager: &Manager) {
        let ended = self.open.as_ref().is_some_and(|open| {
            manager.fleet.lock().weights.updates().get(&open.update_id).is_none_or(|u| u.status().is_terminal())
        });
        if ended {
            self.open = None;
            self.at_boundary = false;
        }
    }

    /// Gives up the open update, if any (a new group or a destroyed one: its rank 0 is gone).
    async fn abandon(&mut self, manager: &Arc<Manager>, why: &str) {
        self.settle(manager);
        if let Some(open) = self.open.take() {
            let reason = format!("the trainer port gave the update up: {why}");
            let _ = crate::ops::trainer_update::abort(manager, &open.update_id, &reason).await;
            tracing::warn!(update_id = %open.update_id, version = %open.version, %why, "trainer port: open update given up");
            self.at_boundary = false;
        }
    }
}

struct Open {
    update_id: UpdateId,
    version: VersionName,
    sent: u32,
}

struct Port {
    manager: Arc<Manager>,
    session: tokio::sync::Mutex<Session>,
}

type Shared = Arc<Port>;

/// The routes of the trainer port (token rules as the router's: every POST, and `/flush_cache`,
/// needs the token when one is configured).
pub fn routes(manager: Arc<Manager>, token: Option<Arc<str>>) -> Router {
    let session = Session { open: None, pause_mode: None, at_boundary: true, paused_at: None };
    let port = Arc::new(Port { manager, session: tokio::sync::Mutex::new(session) });
    Router::new()
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/health", get(health))
        .route("/health_generate", get(health))
        .route("/get_weight_version", get(weight_version))
        .route("/weight_version", get(weight_version))
        .route("/init_weights_update_group", post(init_group))
        .route("/destroy_weights_update_group", post(destroy_group))
        .route("/update_weights_from_distributed", post(update_from_distributed))
        .route("/update_weights_from_disk", post(update_from_disk))
        .route("/pause_generation", post(pause))
        .route("/continue_generation", post(continue_generation))
        .route("/flush_cache", get(flush_cache).post(flush_cache))
        .route("/post_process_weights", post(post_process_weights))
        .route("/weights_checker", post(weights_checker))
        .fallback(not_served)
        .with_state(port)
        .layer(axum::middleware::from_fn_with_state(token, crate::foundation::auth::require_token))
        .layer(axum::middleware::from_fn_with_state(
            crate::interfaces::api::BODY_LIMIT,
            crate::foundation::http_serve::read_body_first,
        ))
}

/// A refusal in SGLang's shape, with our code.
fn refuse(e: impl Into<ApiError>) -> Response {
    let e: ApiError = e.into();
    let message = e.to_string();
    let body = json!({"success": false, "message": message, "error": {"code": e.code(), "message": message}});
    (e.status(), Json(body)).into_response()
}

fn done(message: String) -> Response {
    Json(json!({"success": true, "message": message})).into_response()
}

/// The update failed on the engines (not the trainer's fault): 502 with its error.
fn failed(update_id: &UpdateId, version: &VersionName, why: Option<&str>) -> Response {
    let message = format!(
        "update {update_id} to {version} failed: {}; the fleet stays on the version it had (GET /rollout/weights/updates/{update_id} on the control port)",
        why.unwrap_or("no reason recorded")
    );
    let body = json!({"success": false, "message": message, "error": {"code": "update_failed", "message": message}});
    (StatusCode::BAD_GATEWAY, Json(body)).into_response()
}

async fn not_served(uri: axum::http::Uri) -> Response {
    refuse(ApiError::not_found(
        "not_a_trainer_route",
        format!(
            "{} is not served here: this port is the fleet as one SGLang engine for a trainer's weight sync \
             (/server_info, /init_weights_update_group, /update_weights_from_distributed, /update_weights_from_disk, \
             /pause_generation, /continue_generation, /flush_cache, /destroy_weights_update_group); send generation \
             to the router port",
            uri.path()
        ),
    ))
}

/// slime calls it around a sync only for `compressed-tensors` quantized models (restore the
/// weights before the buckets, quantize after): the manager's updates do not run those steps on
/// the members, so the sync is refused before its first bucket pauses anything.
async fn post_process_weights() -> Response {
    refuse(ApiError::bad_request(
        "quantized_sync_unsupported",
        "post_process_weights: a quantized (compressed-tensors) model's sync needs steps on every engine around the \
         buckets that the trainer port does not run; sync it from disk instead (slime: --update-weight-transport \
         disk, which the port publishes as a whole checkpoint)",
    ))
}

/// slime calls it with `--check-weight-update-equal` (snapshot and reset at start, compare after
/// the first sync), a debugging check of one engine's weights that a fleet whose engines come
/// and go cannot answer as one engine.
async fn weights_checker() -> Response {
    refuse(ApiError::bad_request(
        "weights_checker_unsupported",
        "weights_checker: the fleet cannot answer one engine's weight snapshot and compare (engines come and go \
         between them); run without --check-weight-update-equal, or check one engine directly on its own URL",
    ))
}

/// An engine's `/server_info` with `num_gpus` the ranks the fleet holds: what a trainer sizes
/// its group from.
async fn server_info(State(p): State<Shared>) -> Response {
    let engines = crate::ops::trainer_group::candidates(&p.manager);
    let Some(first) = engines.first() else {
        return refuse(ApiError::unavailable(
            "no_engines",
            "no engine is ACTIVE yet; the fleet's ranks are known once one is (GET /rollout/engines on the control port)",
        ));
    };
    let ranks: u32 = engines.iter().map(|m| m.tp_size).sum();
    let got =
        p.manager.routes.get(&p.manager.http, &first.url, Route::ServerInfo, Duration::from_secs(10), 4 << 20).await;
    let mut info = match got.map(|(_, body)| serde_json::from_slice::<Value>(&body)) {
        Ok(Ok(Value::Object(m))) => m,
        Ok(_) => {
            return refuse(ApiError::unavailable(
                "engine_unavailable",
                format!("engine {} answered /server_info with no JSON object; try again", first.engine_id),
            ))
        }
        Err((name, e)) => {
            return refuse(ApiError::unavailable(
                "engine_unavailable",
                format!("engine {} did not answer {name}: {e}; try again", first.engine_id),
            ))
        }
    };
    let version = p.manager.fleet.lock().weights.current().version.to_string();
    info.insert("num_gpus".into(), json!(ranks));
    info.insert("weight_version".into(), json!(version));
    info.insert(
        "elastic_rollout".into(),
        json!({"engines": engines.len(), "ranks": ranks,
               "note": "the fleet as one engine: num_gpus is the ranks its engines hold; a weight-update group takes them from rank 1"}),
    );
    Json(Value::Object(info)).into_response()
}

async fn health(State(p): State<Shared>) -> Response {
    let n = p.manager.fleet.routes().backends.len();
    let status = if n > 0 { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(json!({"status": if n > 0 {"ok"} else {"no_engines"}, "routable_engines": n}))).into_response()
}

async fn weight_version(State(p): State<Shared>) -> Response {
    let version = p.manager.fleet.lock().weights.current().version.to_string();
    Json(json!({"weight_version": version})).into_response()
}

/// SGLang's `InitWeightsUpdateGroupReqInput`.
#[derive(Debug, Deserialize)]
struct InitGroup {
    master_address: String,
    master_port: u16,
    rank_offset: u32,
    world_size: u32,
    #[serde(default = "default_group")]
    group_name: String,
    #[serde(default = "default_backend")]
    backend: String,
}

fn default_group() -> String {
    "weight_update_group".into()
}

fn default_backend() -> String {
    "nccl".into()
}

async fn init_group(State(p): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let req: InitGroup = match parse_body(&body) {
        Ok(r) => r,
        Err(e) => return refuse(e),
    };
    if req.rank_offset != 1 {
        return refuse(OpError::invalid(
            "invalid_rank_offset",
            format!(
                "rank_offset {} must be 1: this port is the whole fleet as one engine holding ranks 1 to world_size - 1; \
                 list it as the trainer's only engine",
                req.rank_offset
            ),
        ));
    }
    let backend = match rollout_core::weights::GroupBackend::parse(&req.backend) {
        Ok(b) => b,
        Err(why) => return refuse(OpError::invalid("invalid_backend", why)),
    };
    let mut session = p.session.lock().await;
    // A trainer building a group mid-update was restarted: the open update's rank 0 is gone.
    session.abandon(&p.manager, "the trainer built a new group").await;
    let held = crate::ops::trainer_group::current(&p.manager)
        .ok()
        .filter(|g| g.group_name != req.group_name && matches!(g.fixed, Some(FixedJoin::Joined | FixedJoin::Joining)));
    if let Some(g) = held {
        return refuse(OpError::conflict(
            "group_held",
            format!(
                "the engines hold group {}; destroy it first (POST /destroy_weights_update_group). One group at a time: \
                 a trainer with one group per pipeline stage (slime with PP > 1) cannot use this port",
                g.group_name
            ),
        ));
    }
    let build = crate::ops::trainer_group::BuildRequest {
        group_name: req.group_name.clone(),
        master_address: req.master_address,
        master_port: req.master_port,
        world_size: req.world_size,
        backend,
    };
    if let Err(e) = crate::ops::trainer_update::rebuild_group(&p.manager, build).await {
        return refuse(e);
    }
    session.pause_mode = None;
    match crate::ops::trainer_group::wait_joined(&p.manager, &req.group_name).await {
        Ok(g) => match g.fixed {
            Some(FixedJoin::Joined) => {
                session.at_boundary = true;
                done(format!(
                "{} engines joined group {} as ranks 1 to {}",
                g.members.len(),
                g.group_name,
                g.world_size - 1
            ))
            }
            Some(FixedJoin::Failed { error }) => refuse(OpError::conflict(
                "group_failed",
                format!("the engines could not join group {}: {error}", g.group_name),
            )),
            _ => refuse(ApiError::unavailable(
                "join_timed_out",
                format!(
                    "the engines had not joined group {} within --weight-update-timeout-secs; did rank 0 join at {}:{}?",
                    g.group_name, g.master_address, g.master_port
                ),
            )),
        },
        Err(e) => refuse(e),
    }
}

#[derive(Debug, Deserialize)]
struct DestroyGroup {
    #[serde(default = "default_group")]
    group_name: String,
}

async fn destroy_group(State(p): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let req: DestroyGroup = match parse_body(&body) {
        Ok(r) => r,
        Err(e) => return refuse(e),
    };
    let mut session = p.session.lock().await;
    match crate::ops::trainer_group::current(&p.manager) {
        Ok(g) if g.group_name == req.group_name => {}
        _ => {
            return refuse(OpError::unknown(
                "unknown_group",
                format!("the engines hold no group named {}", req.group_name),
            ))
        }
    }
    session.abandon(&p.manager, "the trainer destroyed its group").await;
    match crate::ops::trainer_update::destroy_group(&p.manager).await {
        Ok(_) => done(format!("group {} destroyed on its members", req.group_name)),
        Err(e) => refuse(e),
    }
}

/// SGLang's `UpdateWeightsFromDistributedReqInput` (unknown fields are ignored, as SGLang does).
#[derive(Debug, Deserialize)]
struct UpdateFromDistributed {
    names: Vec<String>,
    dtypes: Vec<String>,
    shapes: Vec<Vec<u64>>,
    #[serde(default = "default_group")]
    group_name: String,
    #[serde(default)]
    weight_version: Option<String>,
    #[serde(default)]
    load_format: Option<String>,
    #[serde(default)]
    selector: Option<String>,
}

async fn update_from_distributed(State(p): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let mut session = p.session.lock().await;
    let answer = take_bucket(&p, &mut session, &body).await;
    if !answer.status().is_success() {
        // Whatever the trainer sends next, this sync is short of a bucket: it is given up, and
        // no bucket opens a version until the trainer starts a sync again.
        session.abandon(&p.manager, "a bucket was refused").await;
        session.at_boundary = false;
    }
    answer
}

/// One bucket of the trainer's (see the module docs); the caller holds the session.
async fn take_bucket(p: &Port, session: &mut Session, body: &Result<Bytes, BytesRejection>) -> Response {
    let req: UpdateFromDistributed = match parse_body(body) {
        Ok(r) => r,
        Err(e) => return refuse(e),
    };
    if let Some(f) = &req.load_format {
        return refuse(OpError::invalid(
            "invalid_load_format",
            format!("load_format {f:?}: the manager sends each member the named tensors as they are; leave it out"),
        ));
    }
    if req.selector.as_deref().is_some_and(|s| s != "all") {
        return refuse(OpError::invalid(
            "invalid_selector",
            "selector: only \"all\" (the model and any draft model together) is taken",
        ));
    }
    let Some(raw) = req.weight_version else {
        return refuse(OpError::invalid(
            "weight_version_required",
            "weight_version is required here: the manager names every version it serves (the pins, the metrics and \
             each answer's meta_info say it)",
        ));
    };
    let version = match VersionName::parse(&raw) {
        Ok(v) => v,
        Err(e) => return refuse(OpError::invalid("invalid_version", e.to_string())),
    };
    let bucket = Bucket { names: req.names, dtypes: req.dtypes, shapes: req.shapes };
    if let Err(e) = crate::ops::trainer_update::check_bucket(&bucket) {
        return refuse(e);
    }
    if let Err(e) = update_for(&p.manager, session, version, &req.group_name) {
        return refuse(e);
    }
    let Some(open) = session.open.as_mut() else { return refuse(OpError::internal("no_update", "no update open")) };
    let update_id = open.update_id.clone();
    let step = BroadcastStep { bucket: Some(bucket), last: false };
    if let Err(e) = crate::ops::trainer_update::start_broadcast(&p.manager, &update_id, Some(step)).await {
        let version = open.version.clone();
        session.open = None;
        return give_up(&p.manager, &update_id, &version, e).await;
    }
    open.sent += 1;
    let sent = open.sent;
    match crate::ops::trainer_update::wait_received(&p.manager, &update_id, sent).await {
        Ok(u) if u.status().is_terminal() => {
            let version = open.version.clone();
            session.open = None;
            failed(&update_id, &version, u.error_message().as_deref())
        }
        Ok(u) if u.trainer().as_ref().is_some_and(|t| t.buckets_received >= sent) => {
            done(format!("bucket {sent} of {} received by the members", open.version))
        }
        Ok(_) => refuse(ApiError::unavailable(
            "bucket_timed_out",
            format!(
                "the members had not received bucket {sent} within --weight-update-timeout-secs; the update ends FAILED \
                 when its own timeout passes"
            ),
        )),
        Err(e) => refuse(e),
    }
}

/// Where the trainer's bucket of `version` goes: the update open on the port for it, or a new
/// one on the group the port built (at a sync's start only).
fn update_for(
    manager: &Arc<Manager>,
    session: &mut Session,
    version: VersionName,
    group_name: &str,
) -> Result<(), OpError> {
    session.settle(manager);
    let group = match crate::ops::trainer_group::current(manager) {
        Ok(g) if g.group_name == group_name && g.fixed.is_some() => g,
        _ => {
            return Err(OpError::conflict(
                "unknown_group",
                format!(
                    "the engines hold no group named {} built on this port; POST /init_weights_update_group first",
                    group_name
                ),
            ))
        }
    };
    if let Some(open) = &session.open {
        if open.version != version {
            return Err(OpError::conflict(
                "update_open",
                format!(
                    "the update to {} is still open; POST /continue_generation ends it before buckets of {version}",
                    open.version
                ),
            ));
        }
    } else if !session.at_boundary {
        return Err(OpError::conflict(
            "sync_not_started",
            format!(
                "the last update on this port failed or was given up mid-way, so this bucket cannot start {version}: \
                 the buckets before it would be missing. Start the sync again (POST /pause_generation, then every \
                 bucket from the first)"
            ),
        ));
    } else {
        let req = crate::ops::trainer_update::OpenRequest {
            version: version.clone(),
            tensors: Bucket::default(),
            pause_mode: session.pause_mode.clone().unwrap_or_else(|| "retract".into()),
            flush_cache: true,
            master_address: group.master_address.clone(),
            master_port: group.master_port,
            group_name: Some(group.group_name.clone()),
            group_prefix: "elastic_rollout_weights".into(),
            backend: group.backend,
        };
        match crate::ops::trainer_update::open(manager, req) {
            Ok(record) => {
                session.open = Some(Open { update_id: record.update_id().clone(), version, sent: 0 });
                session.at_boundary = false;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A step the manager refused: the update is given up (aborted where it still runs), so no
/// member keeps part of a version, and the refusal is answered.
async fn give_up(manager: &Arc<Manager>, update_id: &UpdateId, version: &VersionName, e: OpError) -> Response {
    let running = manager.fleet.lock().weights.updates().get(update_id).is_some_and(|u| !u.status().is_terminal());
    if running {
        let reason = format!("the trainer port gave the update up: {e}");
        let _ = crate::ops::trainer_update::abort(manager, update_id, &reason).await;
    }
    tracing::warn!(%update_id, %version, error = %e, "trainer port: a step was refused; the update is given up");
    refuse(e)
}

/// How long `/update_weights_from_disk` waits for the fleet to serve the checkpoint (the files
/// are hashed, then every engine loads them); the update itself runs on past it.
const DISK_WAIT: Duration = Duration::from_secs(3600);

/// SGLang's `/update_weights_from_disk`, which slime's disk transport calls on each engine it
/// knows between its pause and its continue: here the manager's publish of that checkpoint to
/// the whole fleet under the trainer's `weight_version`, answered once the fleet serves it (an
/// engine answers once it loaded it). After a `/pause_generation` every engine is paused in that
/// mode and loads at once, as the trainer's own engines would; without one, the engines load one
/// at a time while the others serve (SGLang's engine waits for its requests in flight, unless
/// `abort_all_requests`).
async fn update_from_disk(State(p): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let req: crate::ops::publish::FromDisk = match parse_body(&body) {
        Ok(r) => r,
        Err(e) => return refuse(e),
    };
    let mut session = p.session.lock().await;
    session.settle(&p.manager);
    if let Some(open) = &session.open {
        return refuse(OpError::conflict(
            "update_open",
            format!(
                "the update to {} over the trainer's group is still open; POST /continue_generation ends it before a \
                 checkpoint is loaded",
                open.version
            ),
        ));
    }
    use rollout_core::weights::UpdateStrategy;
    let (strategy, mode) = match session.pause_mode.clone() {
        Some(mode) => (UpdateStrategy::AllAtOnce, mode),
        None if req.abort_all_requests => (UpdateStrategy::AllAtOnce, "abort".to_string()),
        None => (UpdateStrategy::Rolling, "abort".to_string()),
    };
    let publish = match req.publish(strategy, mode) {
        Ok(publish) => publish,
        Err(e) => return refuse(e),
    };
    let version = publish.version.clone();
    match crate::ops::publish::publish_and_wait(&p.manager, publish, DISK_WAIT).await {
        Ok(crate::ops::publish::Waited::Update(u)) if u.status() == WeightUpdateStatus::Completed => Json(json!({
            "success": true, "message": format!("the fleet serves {version}"), "num_paused_requests": 0,
            "weight_version": version, "update_id": u.update_id(),
        }))
        .into_response(),
        Ok(crate::ops::publish::Waited::Update(u)) if u.status().is_terminal() => {
            failed(u.update_id(), &version, u.error_message().as_deref())
        }
        Ok(crate::ops::publish::Waited::Update(u)) => refuse(ApiError::unavailable(
            "update_timed_out",
            format!(
                "update {} to {version} had not ended within {}s; see GET /rollout/weights/updates/{} on the control port",
                u.update_id(),
                DISK_WAIT.as_secs(),
                u.update_id()
            ),
        )),
        Ok(crate::ops::publish::Waited::Before { update_id, status }) => Json(json!({
            "success": true, "num_paused_requests": 0, "weight_version": version, "update_id": update_id,
            "message": format!("version {version} was published from this path before ({status}); the fleet serves it"),
        }))
        .into_response(),
        Err(e) => refuse(e),
    }
}

/// SGLang's `PauseGenerationReqInput`.
#[derive(Debug, Deserialize)]
struct Pause {
    #[serde(default = "default_pause_mode")]
    mode: String,
}

fn default_pause_mode() -> String {
    "abort".into()
}

async fn pause(State(p): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let req: Pause = match parse_body(&body) {
        Ok(r) => r,
        Err(e) => return refuse(e),
    };
    if !rollout_core::weights::PauseMode::known(&req.mode) {
        return refuse(OpError::invalid(
            "invalid_pause_mode",
            format!("mode {:?} must be abort, retract or in_place", req.mode),
        ));
    }
    let mut session = p.session.lock().await;
    session.settle(&p.manager);
    session.pause_mode = Some(req.mode);
    session.at_boundary = true;
    session.paused_at = Some(crate::foundation::clock::unix_now());
    Json(json!({"message": "Generation paused successfully.", "status": "ok",
                "note": "the members are paused in this mode when the first bucket of the next update comes"}))
    .into_response()
}

/// Ends the open update (if any): the members get the version, continue, and are verified;
/// answered once the fleet serves it.
async fn continue_generation(State(p): State<Shared>) -> Response {
    let mut session = p.session.lock().await;
    session.settle(&p.manager);
    session.pause_mode = None;
    session.at_boundary = true;
    let Some(open) = session.open.as_ref() else {
        // Nothing open here: the update this ends, if any, failed while the trainer was away
        // (it timed out, was aborted, or the manager restarted under it). Its outcome is the
        // answer, so the trainer never takes the fleet for being on a version it is not on.
        if let Some((update_id, version, why)) = failed_since(&p.manager, session.paused_at) {
            return failed(&update_id, &version, why.as_deref());
        }
        return Json(json!({"message": "Generation continued successfully.", "status": "ok"})).into_response();
    };
    let (update_id, version) = (open.update_id.clone(), open.version.clone());
    // A continue retried after its connection dropped: the end may have been sent already.
    let sent = p
        .manager
        .fleet
        .lock()
        .weights
        .updates()
        .get(&update_id)
        .and_then(|u| u.trainer().as_ref().map(|t| t.last_sent));
    if sent != Some(true) {
        let step = BroadcastStep { bucket: None, last: true };
        if let Err(e) = crate::ops::trainer_update::start_broadcast(&p.manager, &update_id, Some(step)).await {
            session.open = None;
            return give_up(&p.manager, &update_id, &version, e).await;
        }
    }
    // The end is sent: the update finishes by itself from here, whether or not this answer is
    // read. The session keeps it until it has ended, so a continue retried after a dropped
    // connection waits for the same end (and `settle` drops it once ended).
    let ended = crate::ops::trainer_update::wait_ended(&p.manager, &update_id).await;
    if ended.as_ref().is_ok_and(|u| u.status().is_terminal()) {
        session.open = None;
    }
    match ended {
        Ok(u) if u.status() == WeightUpdateStatus::Completed => Json(json!({
            "message": "Generation continued successfully.", "status": "ok", "weight_version": version,
            "update_id": update_id,
        }))
        .into_response(),
        Ok(u) if u.status().is_terminal() => failed(&update_id, &version, u.error_message().as_deref()),
        Ok(_) => refuse(ApiError::unavailable(
            "update_timed_out",
            format!(
                "update {update_id} to {version} had not ended within --weight-update-timeout-secs; see GET /rollout/weights/updates/{update_id}"
            ),
        )),
        Err(e) => refuse(e),
    }
}

/// The newest trainer update, when it ended without its version (FAILED) after the trainer's
/// last pause (`paused_at`; any time when this port has seen none, as after a restart).
fn failed_since(manager: &Manager, paused_at: Option<f64>) -> Option<(UpdateId, VersionName, Option<String>)> {
    let fleet = manager.fleet.lock();
    let newest = fleet
        .weights
        .updates()
        .values()
        .filter(|u| u.trainer().is_some())
        .max_by(|a, b| a.created_at().total_cmp(&b.created_at()))?;
    let ended_after_pause = newest.finished_at().is_some_and(|t| paused_at.is_none_or(|p| t >= p));
    if newest.status() != WeightUpdateStatus::Failed || !ended_after_pause {
        return None;
    }
    let version = VersionName::parse(newest.version()).ok()?;
    Some((newest.update_id().clone(), version, newest.error_message().clone()))
}

async fn flush_cache() -> Response {
    (StatusCode::OK, "Cache flushed (the manager flushes each engine's cache when an update ends).\n").into_response()
}
