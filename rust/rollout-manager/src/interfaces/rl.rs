//! The RL control plane of SMG (the SGLang router's successor), on the router port, so a
//! trainer written against SMG's `smg.rl` client finds the fleet's engines and calls them here:
//!
//! - `GET /v1/rl/workers`, `GET /v1/rl/workers/{id}`: every engine the manager holds, with its
//!   health, weight version, topology and the manager's status as labels;
//! - `GET|POST /v1/rl/workers/{id}/engine/{path}`: one engine; the answer is
//!   `{worker_id, url, status, latency_ms, body}` with the engine's own status and body;
//! - `GET|POST /v1/rl/engine/{path}?selector=...`: every engine the selector names, in parallel
//!   (at most [`FAN_OUT`] at once): `{results, failed, total, succeeded}`, 207 when any failed.
//!
//! What a path becomes is `rollout_core::rl::classify`: reads and request actions go to the
//! engine as they are; `pause_generation`/`continue_generation` are the manager's known pauses
//! ([`crate::ops::control_pause`]); `update_weights_from_disk` fanned out to every worker is
//! the manager's publish of that checkpoint ([`crate::ops::publish`]), answered per worker once
//! the update ended; any other path that changes weights is refused (403 `weights_managed`,
//! naming the manager's weight API), so nothing reaches an engine around the manager's
//! versions. Errors are SMG's `{"error": code, "message"}`.

use crate::ops::manager::Manager;
use crate::registry::fleet::Engine;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::{Json, Router};
use futures::StreamExt;
use rollout_core::ids::EngineId;
use rollout_core::rl::{EngineCall, Selectable, Selector};
use rollout_core::{EngineOrigin, EngineStatus};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Calls of one fan-out in flight at once.
pub const FAN_OUT: usize = 32;
/// How long one engine call may take (a weight reload behind a pause can be long).
const CALL_TIMEOUT: Duration = Duration::from_secs(600);
/// Largest request body taken (SGLang's admin bodies are small).
const BODY_LIMIT: usize = 16 << 20;
/// Marks a transport error that was the call's timeout.
const TIMED_OUT: &str = "timed out: ";
/// The version of this control plane's shapes, as SMG reports it.
const PROTOCOL_VERSION: u32 = 1;

#[derive(Clone)]
struct RlState {
    manager: Arc<Manager>,
    http: reqwest::Client,
}

/// The routes, ready to merge into the router port's own routes. `token`, when set, guards
/// every call but a GET of the worker list or of one worker (a call that only reads an engine
/// reaches it too, and some reads run work there, such as `health_generate`).
pub fn routes(manager: Arc<Manager>, token: Option<Arc<str>>) -> Router {
    let http = reqwest::Client::builder().pool_idle_timeout(Duration::from_secs(30)).build().unwrap_or_default();
    Router::new()
        .route("/v1/rl/workers", get(workers))
        .route("/v1/rl/workers/{id}", get(worker))
        .route("/v1/rl/workers/{id}/engine/{*path}", any(call_one))
        .route("/v1/rl/engine/{*path}", any(fan_out))
        .route("/v1/rl/workers/{id}/state", axum::routing::post(set_worker_state))
        .route("/v1/rl/state", axum::routing::post(set_fleet_state))
        .route("/v1/rl/workers/{id}/version", axum::routing::post(set_version))
        .route("/v1/rl/version", axum::routing::post(set_version_all))
        // The token is checked before the body is read.
        .layer(axum::middleware::from_fn_with_state(BODY_LIMIT, crate::foundation::http_serve::read_body_first))
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::from_fn_with_state(token, needs_token))
        .with_state(RlState { manager, http })
}

/// The token check of these routes (when the manager has one), answered in SMG's error shape.
async fn needs_token(
    State(token): State<Option<Arc<str>>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(token) = token else { return next.run(request).await };
    let path = request.uri().path();
    let listing = request.method() == Method::GET && (path == "/v1/rl/workers" || is_worker_path(path));
    if listing || crate::foundation::auth::carries_token(request.headers(), Some(&token)) {
        return next.run(request).await;
    }
    let mut answer = error(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "calls to engines through /v1/rl need Authorization: Bearer <token> (the manager's --api-token-file or ROLLOUT_MANAGER_API_TOKEN; smg.rl: RL(url, api_key=token))",
    );
    answer.headers_mut().insert("www-authenticate", axum::http::HeaderValue::from_static("Bearer"));
    answer
}

/// `/v1/rl/workers/{id}` itself (not a call under it).
fn is_worker_path(path: &str) -> bool {
    path.strip_prefix("/v1/rl/workers/").is_some_and(|id| !id.is_empty() && !id.contains('/'))
}

fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (status, Json(json!({"error": code, "message": message.into()}))).into_response()
}

/// `{"control": "active" | "paused" | "asleep"}`, SMG's control-state write (its line B,
/// crates/rl `control.rs`): checked before the worker is looked up, as SMG does.
fn control_of(body: &Bytes) -> Result<&'static str, Box<Response>> {
    let value: Option<Value> = serde_json::from_slice(body).ok();
    match value.as_ref().and_then(|v| v.get("control")).and_then(Value::as_str) {
        Some("active") => Ok("continue_generation"),
        Some("paused") => Ok("pause_generation"),
        Some("asleep") => Err(Box::new(error(
            StatusCode::CONFLICT,
            "not_supported",
            "the manager does not put engines to sleep (release their memory); scale in to free GPUs \
             (POST /rollout/scale_in on the control port), or pause them with {\"control\": \"paused\"}",
        ))),
        _ => Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "invalid_body",
            "the body must be {\"control\": \"active\" | \"paused\" | \"asleep\"} (lowercase)",
        ))),
    }
}

/// `POST /v1/rl/workers/{id}/state`: `paused` is the manager's pause of that engine (out of
/// routing, known to health), `active` resumes it; answers the worker's row.
async fn set_worker_state(State(s): State<RlState>, Path(id): Path<String>, body: Bytes) -> Response {
    let path = match control_of(&body) {
        Ok(p) => p,
        Err(refused) => return *refused,
    };
    let Some((engine_id, url, _)) = all_workers(&s.manager).into_iter().find(|(eid, _, _)| eid.as_str() == id) else {
        return unknown_worker(&id);
    };
    if let Err((status, code, message)) = state_call(&s, &engine_id, &url, path).await {
        return error(status, code, message);
    }
    match all_workers(&s.manager).into_iter().find(|(eid, _, _)| *eid == engine_id) {
        Some((_, _, w)) => Json(w.json).into_response(),
        None => unknown_worker(&id),
    }
}

/// The manager's pause or resume of one engine; an engine that answers with an error is a
/// failure too (its state did not change).
async fn state_call(s: &RlState, id: &EngineId, url: &str, path: &'static str) -> Result<(), CallError> {
    let empty = Bytes::from_static(b"{}");
    let answer = call_engine(s, id, url, &Method::POST, path, None, &empty).await?;
    if (200..300).contains(&answer.status) {
        Ok(())
    } else {
        Err((StatusCode::BAD_GATEWAY, "upstream_error", format!("{id} answered {path} with HTTP {}", answer.status)))
    }
}

/// `POST /v1/rl/state?selector=`: the same for every worker the selector names that it applies
/// to (`paused`: those serving and not paused; `active`: those paused), all of them whatever
/// fails; answers the selected rows, with `failed: [{worker_id, error, message}]` and 207 when
/// any failed.
async fn set_fleet_state(State(s): State<RlState>, RawQuery(query): RawQuery, body: Bytes) -> Response {
    let path = match control_of(&body) {
        Ok(p) => p,
        Err(refused) => return *refused,
    };
    let (targets, _) = match selected(&s, query.as_deref()) {
        Ok(t) => t,
        Err(refused) => return *refused,
    };
    let ids: Vec<EngineId> = targets.iter().map(|(id, _, _)| id.clone()).collect();
    let label = |w: &Worker, k: &str| w.labels.get(k).map(String::as_str) == Some("true");
    let applies: Vec<(EngineId, String)> = targets
        .into_iter()
        .filter(|(_, _, w)| if path == "pause_generation" { label(w, "routable") } else { label(w, "paused") })
        .map(|(id, url, _)| (id, url))
        .collect();
    let s = &s;
    let failed: Vec<Value> = futures::stream::iter(applies)
        .map(|(id, url)| async move { (state_call(s, &id, &url, path).await, id) })
        .buffer_unordered(FAN_OUT)
        .filter_map(|(done, id)| async move {
            done.err().map(|(_, code, message)| json!({"worker_id": id, "error": code, "message": message}))
        })
        .collect()
        .await;
    let rows: Vec<Value> =
        all_workers(&s.manager).into_iter().filter(|(id, _, _)| ids.contains(id)).map(|(_, _, w)| w.json).collect();
    let status = if failed.is_empty() { StatusCode::OK } else { StatusCode::MULTI_STATUS };
    let body = json!({"protocol_version": PROTOCOL_VERSION, "total": rows.len(), "workers": rows, "failed": failed});
    (status, Json(body)).into_response()
}

/// The workers `?selector=` names, and how many workers are listed (one snapshot); SMG's errors
/// when there is no selector, it is bad, or it names none.
type Selected = (Vec<(EngineId, String, Worker)>, usize);

fn selected(s: &RlState, query: Option<&str>) -> Result<Selected, Box<Response>> {
    let (selector, _) = split_selector(query);
    let Some(text) = selector else {
        let message = format!("name the workers with ?selector=: {}", rollout_core::rl::SELECTOR_GRAMMAR);
        return Err(Box::new(error(StatusCode::BAD_REQUEST, "selector_required", message)));
    };
    let selector =
        Selector::parse(&text).map_err(|why| Box::new(error(StatusCode::BAD_REQUEST, "invalid_selector", why)))?;
    let listed = all_workers(&s.manager);
    let total = listed.len();
    let targets: Vec<(EngineId, String, Worker)> = listed.into_iter().filter(|(_, _, w)| selector.matches(w)).collect();
    if targets.is_empty() {
        let message = format!("selector {text:?} matches no worker; list them with GET /v1/rl/workers");
        return Err(Box::new(
            (StatusCode::BAD_REQUEST, Json(json!({"error": "no_workers_match", "message": message, "selector": text})))
                .into_response(),
        ));
    }
    Ok((targets, total))
}

/// `POST /v1/rl/workers/{id}/version` and `/v1/rl/version` (SMG's explicit version label): a
/// well-formed body is refused, since the manager reads each engine's version from the engine
/// itself and a label written here would say something the weights do not.
async fn set_version(Path(_id): Path<String>, body: Bytes) -> Response {
    version_refused(&body)
}

async fn set_version_all(body: Bytes) -> Response {
    version_refused(&body)
}

fn version_refused(body: &Bytes) -> Response {
    let value: Option<Value> = serde_json::from_slice(body).ok();
    let Some(version) = value.as_ref().and_then(|v| v.get("weight_version")).and_then(Value::as_str) else {
        return error(StatusCode::BAD_REQUEST, "invalid_body", "the body must be {\"weight_version\": \"<version>\"}");
    };
    if let Err(e) = rollout_core::ids::VersionName::parse(version) {
        return error(StatusCode::BAD_REQUEST, "invalid_version", e.to_string());
    }
    error(
        StatusCode::FORBIDDEN,
        "weights_managed",
        "the manager reads each engine's weight version from the engine itself (/model_info), so a label set \
         here would say something its weights do not; change the weights instead (update_weights_from_disk fanned \
         out to every worker, POST /rollout/weights/publish, or a trainer update)",
    )
}

/// One engine as the control plane shows it.
struct Worker {
    json: Value,
    labels: BTreeMap<String, String>,
}

impl Selectable for Worker {
    fn value(&self, key: &str) -> Option<String> {
        const FIELDS: [&str; 10] = [
            "id",
            "url",
            "base_url",
            "engine",
            "model_id",
            "worker_type",
            "connection_mode",
            "health",
            "weight_version",
            "role",
        ];
        if !FIELDS.contains(&key) {
            return self.labels.get(key).cloned();
        }
        match self.json.get(key)? {
            Value::String(s) => Some(s.clone()),
            Value::Null => None,
            other => Some(other.to_string()),
        }
    }
}

fn worker_of(e: &Engine, model: &str) -> Worker {
    let r = e.record();
    let status = e.status();
    let routable = status.is_routable() && !e.paused_by_control();
    let origin = if r.origin() == EngineOrigin::External { "external" } else { "managed" };
    let labels: BTreeMap<String, String> = [
        ("status", status.to_string()),
        ("origin", origin.to_string()),
        ("paused", e.paused_by_control().to_string()),
        ("routable", routable.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    // SMG's worker states.
    let health = match status {
        EngineStatus::Active | EngineStatus::WeightSyncing => "ready",
        EngineStatus::Draining | EngineStatus::Removing | EngineStatus::Removed => "draining",
        EngineStatus::Pending | EngineStatus::Creating | EngineStatus::HealthChecking | EngineStatus::Ready => {
            "pending"
        }
        EngineStatus::Unhealthy => "not_ready",
        EngineStatus::Failed => "failed",
    };
    let json = json!({
        "id": r.engine_id(), "url": r.url(), "base_url": r.url(), "engine": "sglang", "engine_version": null,
        "model_id": model, "worker_type": "regular", "connection_mode": "http",
        "tp_size": e.ranks(), "dp_size": 1, "pp_size": 1, "dp_ranks": 1, "role": null,
        "health": health, "weight_version": r.weight_version(), "control_url": r.url(),
        "labels": labels,
        "control": if e.paused_by_control() { "paused" } else { "active" },
        "capabilities": {"pause_generation": true, "continue_generation": true, "weights": "manager"},
    });
    Worker { json, labels }
}

/// The engines the control plane shows: every one the manager holds but those being removed.
fn all_workers(manager: &Manager) -> Vec<(EngineId, String, Worker)> {
    let inner = manager.fleet.lock();
    let mut engines: Vec<&Engine> = inner
        .engines
        .values()
        .filter(|e| !matches!(e.status(), EngineStatus::Removing | EngineStatus::Removed))
        .collect();
    engines.sort_by_key(|e| e.seq());
    let model = &manager.config.model_name;
    engines
        .into_iter()
        .map(|e| (e.record().engine_id().clone(), e.record().url().clone(), worker_of(e, model)))
        .collect()
}

async fn workers(State(s): State<RlState>) -> Response {
    let list: Vec<Value> = all_workers(&s.manager).into_iter().map(|(_, _, w)| w.json).collect();
    Json(json!({"protocol_version": PROTOCOL_VERSION, "total": list.len(), "workers": list})).into_response()
}

async fn worker(State(s): State<RlState>, Path(id): Path<String>) -> Response {
    match all_workers(&s.manager).into_iter().find(|(eid, _, _)| eid.as_str() == id) {
        Some((_, _, w)) => Json(w.json).into_response(),
        None => unknown_worker(&id),
    }
}

fn unknown_worker(id: &str) -> Response {
    let message = format!("no worker {id}; list them with GET /v1/rl/workers");
    (StatusCode::NOT_FOUND, Json(json!({"error": "worker_not_found", "message": message, "id": id}))).into_response()
}

/// What one engine answered: its status, its body (JSON when it is JSON), and how long it took.
struct Answered {
    status: u16,
    body: Value,
    latency_ms: u64,
}

/// Sends `method path?query` with `body` to the engine at `url`.
async fn send(
    http: &reqwest::Client,
    url: &str,
    method: &Method,
    path: &str,
    query: Option<&str>,
    body: &Bytes,
) -> Result<Answered, String> {
    let started = Instant::now();
    let mut target = format!("{url}/{}", path.trim_start_matches('/'));
    if let Some(q) = query.filter(|q| !q.is_empty()) {
        target = format!("{target}?{q}");
    }
    let mut request = http.request(method.clone(), target).timeout(CALL_TIMEOUT);
    if !body.is_empty() {
        request = request.header("content-type", "application/json").body(body.clone());
    }
    let answer = request.send().await.map_err(|e| {
        let timeout = e.is_timeout();
        let why = crate::foundation::engine_http::describe(e);
        if timeout {
            format!("{TIMED_OUT}{why}")
        } else {
            why
        }
    })?;
    let status = answer.status().as_u16();
    let raw = crate::foundation::engine_http::read_capped(answer, BODY_LIMIT, CALL_TIMEOUT)
        .await
        .map_err(|e| format!("its answer could not be read: {e}"))?;
    let body = serde_json::from_slice(&raw).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&raw).into()));
    Ok(Answered { status, body, latency_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX) })
}

/// The status of a use case's refusal: whose fault it was.
fn op_status(e: &crate::ops::op_error::OpError) -> StatusCode {
    match e.kind() {
        "invalid" => StatusCode::BAD_REQUEST,
        "unknown" => StatusCode::NOT_FOUND,
        "conflict" => StatusCode::CONFLICT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// Why one engine's call did not give an answer to pass on: an SMG error.
type CallError = (StatusCode, &'static str, String);

/// One engine's call, through the manager where the path is its own. Ok: what the engine
/// answered (its status may be an error); Err: the call did not happen (a refusal of the
/// manager's, or an engine that did not answer).
async fn call_engine(
    s: &RlState,
    id: &EngineId,
    url: &str,
    method: &Method,
    path: &str,
    query: Option<&str>,
    body: &Bytes,
) -> Result<Answered, CallError> {
    let unreachable = |e: String| match e.strip_prefix(TIMED_OUT) {
        Some(why) => (StatusCode::GATEWAY_TIMEOUT, "upstream_timeout", format!("{id} did not answer in time: {why}")),
        None => (StatusCode::BAD_GATEWAY, "upstream_unreachable", format!("{id} did not answer: {e}")),
    };
    let refused = |e: crate::ops::op_error::OpError| (op_status(&e), e.code(), e.to_string());
    // For the manager's steps: Ok only when the engine did it (2xx); else what it said, or why
    // it said nothing.
    let checked = async {
        match send(&s.http, url, method, path, query, body).await {
            Ok(a) if (200..300).contains(&a.status) => Ok(a),
            other => Err(other),
        }
    };
    let done = match rollout_core::rl::classify(method.as_str(), path) {
        EngineCall::Forward => return send(&s.http, url, method, path, query, body).await.map_err(unreachable),
        EngineCall::Refused { code, message } => return Err((StatusCode::FORBIDDEN, code, message)),
        EngineCall::FleetPublish => {
            return Err((
                StatusCode::FORBIDDEN,
                "weights_managed",
                format!(
                    "{path} on one engine would split the fleet's version; fan it out to every worker instead \
                     (POST /v1/rl/engine/{path}?selector=all): the manager then publishes it to the whole fleet"
                ),
            ))
        }
        EngineCall::Pause => crate::ops::control_pause::pause(&s.manager, id, checked).await,
        EngineCall::Continue => crate::ops::control_pause::resume(&s.manager, id, checked).await,
    };
    match done.map_err(refused)? {
        Ok(a) | Err(Ok(a)) => Ok(a),
        Err(Err(e)) => Err(unreachable(e)),
    }
}

async fn call_one(
    State(s): State<RlState>,
    Path((id, path)): Path<(String, String)>,
    method: Method,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    let Some((engine_id, url, _)) = all_workers(&s.manager).into_iter().find(|(eid, _, _)| eid.as_str() == id) else {
        return unknown_worker(&id);
    };
    match call_engine(&s, &engine_id, &url, &method, &path, query.as_deref(), &body).await {
        // The answer's status is the engine's, as SMG's.
        Ok(a) => {
            let status = StatusCode::from_u16(a.status).unwrap_or(StatusCode::BAD_GATEWAY);
            let body = json!({"worker_id": engine_id, "url": url, "status": a.status, "latency_ms": a.latency_ms, "body": a.body});
            (status, Json(body)).into_response()
        }
        Err((status, code, message)) => error(status, code, message),
    }
}

/// The query without `selector` (the rest goes to the engines).
fn split_selector(query: Option<&str>) -> (Option<String>, String) {
    let mut selector = None;
    let mut rest = Vec::new();
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("selector", v)) => {
                selector = Some(decode_query_value(v));
            }
            _ => rest.push(pair),
        }
    }
    (selector, rest.join("&"))
}

/// A query value with `+` and `%XX` decoded (a bad escape is kept as it is).
fn decode_query_value(v: &str) -> String {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn fan_out(
    State(s): State<RlState>,
    Path(path): Path<String>,
    method: Method,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    let (text, rest) = split_selector(query.as_deref());
    let (targets, total_listed) = match selected(&s, query.as_deref()) {
        Ok(t) => t,
        Err(refused) => return *refused,
    };
    let targets: Vec<(EngineId, String)> = targets.into_iter().map(|(id, url, _)| (id, url)).collect();
    let call = rollout_core::rl::classify(method.as_str(), &path);
    if let EngineCall::Refused { code, message } = call {
        return error(StatusCode::FORBIDDEN, code, message);
    }
    let text = text.unwrap_or_default();
    if call == EngineCall::FleetPublish {
        return publish_to_fleet(&s, &text, targets, total_listed, &body).await;
    }
    let (s, method, path, rest, body) = (&s, &method, path.as_str(), rest.as_str(), &body);
    let answers: Vec<(EngineId, String, Result<Answered, CallError>)> = futures::stream::iter(targets)
        .map(|(id, url)| async move {
            let answer = call_engine(s, &id, &url, method, path, Some(rest), body).await;
            (id, url, answer)
        })
        .buffer_unordered(FAN_OUT)
        .collect()
        .await;
    fan_out_answer(answers)
}

/// `update_weights_from_disk` fanned out to every worker: the manager publishes the checkpoint
/// as the fleet's next version (all at once: a trainer sends it inside `paused()`), waits until
/// the update ended, and answers each worker's part in the fan-out's shape. A selector that
/// leaves out a worker is refused (a version is the fleet's), as is a body the publish cannot
/// take; nothing is published then.
async fn publish_to_fleet(
    s: &RlState,
    selector: &str,
    targets: Vec<(EngineId, String)>,
    listed: usize,
    body: &Bytes,
) -> Response {
    if targets.len() != listed {
        let message = format!(
            "selector {selector:?} names {} of the {listed} workers; a weight version is the whole fleet's, so \
             update_weights_from_disk goes to every worker (selector=all): the manager publishes it to all of them",
            targets.len()
        );
        return error(StatusCode::CONFLICT, "partial_weight_update", message);
    }
    let req: crate::ops::publish::FromDisk = match serde_json::from_slice(if body.is_empty() { b"{}" } else { body }) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_body", format!("update_weights_from_disk: {e}")),
    };
    let refused = |e: crate::ops::op_error::OpError| error(op_status(&e), e.code(), e.to_string());
    let pause_mode = if req.abort_all_requests { "abort" } else { "retract" };
    let publish = match req.publish(rollout_core::weights::UpdateStrategy::AllAtOnce, pause_mode.into()) {
        Ok(p) => p,
        Err(e) => return refused(e),
    };
    let (started, version) = (Instant::now(), publish.version.clone());
    match crate::ops::publish::publish_and_wait(&s.manager, publish, CALL_TIMEOUT).await {
        Ok(crate::ops::publish::Waited::Update(record)) => {
            fan_out_answer(ended_answers(targets, &record, &version, started))
        }
        Ok(crate::ops::publish::Waited::Before { update_id, status }) => {
            // Published before from this path: each worker serves it already (or loads it when
            // it is back), as a second SGLang load of the same files would leave it.
            let why =
                format!("version {version} was published from this path before ({status}); nothing to load again");
            fan_out_answer(published_answers(targets, None, &why, started, update_id.as_ref()))
        }
        Err(e) => refused(e),
    }
}

/// Each worker's part once the publish's update is over: its own outcome when the update
/// completed, the update's error for all when it failed, a timeout for all when it had not ended.
fn ended_answers(
    targets: Vec<(EngineId, String)>,
    record: &crate::registry::weights::UpdateRecord,
    version: &rollout_core::ids::VersionName,
    started: Instant,
) -> Vec<(EngineId, String, Result<Answered, CallError>)> {
    let update_id = record.update_id();
    let all_failed = |status: StatusCode, code: &'static str, message: String| {
        targets.iter().map(|(id, url)| (id.clone(), url.clone(), Err((status, code, message.clone())))).collect()
    };
    match record.status() {
        rollout_core::weights::WeightUpdateStatus::Completed => {
            let why = format!("serves version {version}");
            published_answers(targets, Some(record), &why, started, Some(update_id))
        }
        status if status.is_terminal() => {
            let error = record.error_message().clone().unwrap_or_else(|| "no reason recorded".into());
            let message =
                format!("update {update_id} to {version} is {status}: {error}; the fleet stays on its version");
            all_failed(StatusCode::BAD_GATEWAY, "update_failed", message)
        }
        _ => {
            let message = format!(
                "update {update_id} to {version} had not ended within {}s; GET /rollout/weights/updates/{update_id} on the control port",
                CALL_TIMEOUT.as_secs()
            );
            all_failed(StatusCode::GATEWAY_TIMEOUT, "upstream_timeout", message)
        }
    }
}

/// Each worker's part of a publish that went through: 200 when it verified the version, 202
/// when it was not serving (it starts on the version when it is back), and a failure when its
/// own part failed (it is restarted on the fleet's version).
fn published_answers(
    targets: Vec<(EngineId, String)>,
    record: Option<&crate::registry::weights::UpdateRecord>,
    why: &str,
    started: Instant,
    update_id: Option<&rollout_core::ids::UpdateId>,
) -> Vec<(EngineId, String, Result<Answered, CallError>)> {
    use rollout_core::weights::EngineUpdateStatus;
    let latency_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    targets
        .into_iter()
        .map(|(id, url)| {
            let part = record.and_then(|r| r.engines().get(&id));
            let answer = match part.map(|p| (p.status(), p.error().clone())) {
                Some((EngineUpdateStatus::Failed, error)) => Err((
                    StatusCode::BAD_GATEWAY,
                    "update_failed",
                    format!(
                        "{id} failed to load it ({}); it leaves routing and is restarted on the fleet's version",
                        error.unwrap_or_default()
                    ),
                )),
                Some((EngineUpdateStatus::Verified, _)) | None if record.is_none() => Ok(Answered {
                    status: 200,
                    body: json!({"success": true, "message": why, "update_id": update_id}),
                    latency_ms,
                }),
                Some((EngineUpdateStatus::Verified, _)) => Ok(Answered {
                    status: 200,
                    body: json!({"success": true, "message": format!("{id} {why}"), "update_id": update_id}),
                    latency_ms,
                }),
                _ => Ok(Answered {
                    status: 202,
                    body: json!({"success": true, "update_id": update_id,
                                 "message": format!("{id} was not serving; it starts on this version when it is back")}),
                    latency_ms,
                }),
            };
            (id, url, answer)
        })
        .collect()
}

/// `{results, failed, total, succeeded}`: every answer in `results` and each non-2xx or
/// unanswered call in `failed`; 200 when nothing failed, else 207.
fn fan_out_answer(mut answers: Vec<(EngineId, String, Result<Answered, CallError>)>) -> Response {
    answers.sort_by(|a, b| a.0.cmp(&b.0));
    let total = answers.len();
    let mut results = serde_json::Map::new();
    let mut failed = Vec::new();
    let mut succeeded = 0usize;
    for (id, url, answer) in answers {
        match answer {
            Ok(a) => {
                if (200..300).contains(&a.status) {
                    succeeded += 1;
                } else {
                    failed.push(json!({"worker_id": id, "url": url, "status": a.status, "error": "upstream_error",
                                       "message": format!("HTTP {}", a.status)}));
                }
                results.insert(
                    id.to_string(),
                    json!({"url": url, "status": a.status, "latency_ms": a.latency_ms, "body": a.body}),
                );
            }
            Err((status, code, message)) => {
                let status = if code.starts_with("upstream_") { Value::Null } else { json!(status.as_u16()) };
                failed.push(json!({"worker_id": id, "url": url, "status": status, "error": code, "message": message}));
            }
        }
    }
    let status = if failed.is_empty() { StatusCode::OK } else { StatusCode::MULTI_STATUS };
    (status, Json(json!({"results": results, "failed": failed, "total": total, "succeeded": succeeded})))
        .into_response()
}
