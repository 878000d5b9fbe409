//! The data plane: an SGLang-compatible proxy in front of the fleet's ACTIVE engines.
//!
//! Every path other than the router's own health routes is forwarded unchanged (method, path,
//! query, body, end-to-end headers) to one engine chosen by the routing policy
//! (`rollout_core::routing`): `capacity` by default, `round_robin`, `least_requests` or
//! `session`, set by `--routing-policy` or per request with the `x-routing-policy` header.
//! Responses, server-sent-event streams included, are streamed back frame by frame as they
//! arrive, over pooled HTTP/1.1 connections to the engines.
//!
//! Version pinning: a request with `weight_version` in its body (`"v3"`, `{"exact_version":
//! "v3"}` or `{"min_version": "v3"}`) or an `x-weight-version` / `x-min-weight-version` header
//! only goes to engines serving an allowed version; if none does yet it waits up to
//! `--version-wait-secs` for one, then fails with 503 `version_unavailable`. The field is
//! removed before the body reaches the engine.
//!
//! Retries: a request that got no response from its engine (refused, reset, the engine died)
//! or a 503 is retried on another engine, up to [`MAX_ATTEMPTS`] engines, with a short backoff;
//! so is one whose engine is taken out of routing as failed (UNHEALTHY, FAILED) before it sent
//! response headers (`Fleet::unless_lost`: a hung engine holds no request past its detection);
//! nothing is retried once response headers were forwarded, so a client never sees two answers.
//!
//! Time: an engine's whole answer (headers and body, streams included) must end within
//! `--request-timeout-secs`; before the headers the client gets 504 `engine_timeout` (not
//! retried: the engine may be doing the work), after them the stream is cut. A hung or lying
//! engine therefore holds a request, and its in-flight count, for a bounded time. Response
//! bodies are streamed, never buffered, so their size costs the router no memory; fan-out
//! calls (`/abort_request`, `/flush_cache`) wait at most [`FAN_OUT_TIMEOUT`] for each engine.
//!
//! Each forwarded request counts in its engine's in-flight load (requests and estimated KV
//! tokens) until its response body ends: routing decisions and scale-in's drain both use it.
//!
//! Late binding (`--max-inflight-per-engine N`): an engine gets at most about N requests at
//! once (two requests deciding at the same instant may both take the last slot). The rest wait
//! in the router, FIFO, and each goes to the first engine with a free slot when one frees or an
//! engine joins. Work then never sits in one engine's queue while another, e.g. one a
//! scale-out just added, is idle. A request waits at most `--request-timeout-secs` for a slot,
//! then gets 503 `router_queue_timeout`.

mod affinity;
pub mod loads;
pub mod metrics;
mod peek;
pub mod smg;

use crate::error::error_body;
use crate::fleet::{Backend, InFlightGuard};
use crate::manager::Manager;
use affinity::Affinity;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use metrics::{ErrorKind, RouterMetrics};
use rollout_core::routing::{choose, Gate, Policy, VersionPin};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// Largest request body the router accepts (prompts with long contexts and images fit).
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// How long a fan-out call waits for each engine's answer.
pub const FAN_OUT_TIMEOUT: Duration = Duration::from_secs(10);

/// Most engines one request is tried on.
pub const MAX_ATTEMPTS: usize = 3;

type EngineClient = Client<HttpConnector, Full<Bytes>>;

pub struct RouterState {
    manager: Arc<Manager>,
    /// The manager's API token: a request's `Authorization` carrying it is for us, and is not
    /// forwarded to engines (an engine's own `--api-key` credential is).
    token: Option<Arc<str>>,
    client: EngineClient,
    rotor: AtomicUsize,
    affinity: Affinity,
    gate: Gate,
}

/// The data plane. `token`, when set, guards the fan-out routes (`/abort_request`,
/// `/flush_cache`), which act on every engine; generation needs none.
pub fn router(manager: Arc<Manager>, token: Option<Arc<str>>) -> Router {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(2)));
    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(1024)
        .build(connector);
    let state = Arc::new(RouterState {
        manager,
        token: token.clone(),
        client,
        rotor: AtomicUsize::new(0),
        affinity: Affinity::new(100_000),
        gate: Gate::default(),
    });
    Router::new()
        .route("/liveness", get(|| async { Json(serde_json::json!({"status": "ok"})) }))
        .route("/health", get(readiness))
        .route("/readiness", get(readiness))
        .route(
            "/abort_request",
            axum::routing::post(fan_out)
                .layer(axum::middleware::from_fn_with_state(token.clone(), crate::auth::require_token)),
        )
        .route(
            "/flush_cache",
            axum::routing::post(fan_out)
                .get(fan_out)
                .layer(axum::middleware::from_fn_with_state(token, crate::auth::require_token)),
        )
        .fallback(proxy)
        .with_state(state)
}

async fn readiness(State(state): State<Arc<RouterState>>) -> Response {
    let n = state.manager.fleet.routes().len();
    let status = if n > 0 { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = serde_json::json!({"status": if n > 0 {"ok"} else {"no_engines"}, "routable_engines": n});
    (status, Json(body)).into_response()
}

fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
            | "x-routing-policy"
            | "x-session-id"
            | "x-weight-version"
            | "x-min-weight-version"
    )
}

fn end_to_end(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (k, v) in headers {
        if !is_hop_by_hop(k) {
            out.append(k.clone(), v.clone());
        }
    }
    out
}

/// The headers of a client's request as an engine gets them: end-to-end ones only, and never
/// this manager's own token.
fn to_engine(headers: &HeaderMap, token: Option<&str>) -> HeaderMap {
    let mut out = end_to_end(headers);
    if crate::auth::carries_token(&out, token) {
        out.remove("authorization");
    }
    out
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (status, Json(error_body(code, message))).into_response()
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// The routable engines that satisfy `pin`, waiting up to `--version-wait-secs` for one.
async fn candidates(state: &RouterState, pin: Option<&VersionPin>) -> Result<Arc<Vec<Backend>>, Response> {
    let fleet = &state.manager.fleet;
    let wait = Duration::from_secs_f64(state.manager.config.version_wait_secs);
    let deadline = tokio::time::Instant::now() + wait;
    let mut changes = fleet.subscribe();
    loop {
        let routes = fleet.routes();
        let Some(pin) = pin else {
            if !routes.is_empty() {
                return Ok(routes);
            }
            // While a weight update has every engine out of routing (all_at_once), requests
            // wait for them like pinned ones do, instead of failing at once.
            if !fleet.weights_updating() {
                state.manager.router_metrics.error(ErrorKind::NoEngine);
                return Err(error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no_engine_available",
                    "no ACTIVE engine can take this request; see GET /rollout/engines on the control port",
                ));
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { break },
                _ = tokio::time::sleep_until(deadline) => break,
            }
            continue;
        };
        let history = fleet.version_history();
        let matching: Vec<Backend> =
            routes.iter().filter(|b| pin.allows(b.weight_version.as_deref(), &history)).cloned().collect();
        if !matching.is_empty() {
            return Ok(Arc::new(matching));
        }
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { break },
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    state.manager.router_metrics.error(ErrorKind::VersionUnavailable);
    let serving: Vec<String> = fleet.routes().iter().filter_map(|b| b.weight_version.clone()).collect();
    let wanted = match pin {
        Some(VersionPin::Exact(v)) => format!("exactly {v:?}"),
        Some(VersionPin::AtLeast(v)) => format!("at least {v:?}"),
        None => "any".into(),
    };
    Err(error(
        StatusCode::SERVICE_UNAVAILABLE,
        "version_unavailable",
        &format!(
            "no ACTIVE engine serves weight version {wanted} after waiting {wait:?}; engines serve {serving:?}. \
             Retry later, or relax the pin"
        ),
    ))
}

/// Engine routes that change an engine's weights or lifecycle. The manager owns those, so the
/// router does not forward them (one engine changed behind the manager's back would serve a
/// version the fleet does not know). `/abort_request` and `/flush_cache` are fanned out instead.
const ADMIN_ROUTES: [&str; 20] = [
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/update_weights_from_ipc",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weight_version",
    "/pause_generation",
    "/continue_generation",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/init_weights_send_group_for_remote_instance",
    "/send_weights_to_remote_instance",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/start_profile",
    "/stop_profile",
    "/pd_role_switch",
];

/// Sends the request to every routable engine (abort and cache flush concern them all) and
/// answers 200 when all succeeded, else 502, with each engine's status.
async fn fan_out(State(state): State<Arc<RouterState>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, 1 << 20).await else {
        return error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", "the body is limited to 1 MiB");
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    let routes = state.manager.fleet.routes();
    let client = &state.client;
    let results = futures::future::join_all(routes.iter().map(|b| {
        let mut req = hyper::Request::new(Full::new(body.clone()));
        *req.method_mut() = parts.method.clone();
        *req.headers_mut() = to_engine(&parts.headers, state.token.as_deref());
        let uri = Uri::try_from(format!("http://{}{}", b.authority, path));
        async move {
            let status = match uri {
                Ok(u) => {
                    *req.uri_mut() = u;
                    match tokio::time::timeout(FAN_OUT_TIMEOUT, client.request(req)).await {
                        Ok(Ok(r)) => r.status().as_u16(),
                        _ => 0,
                    }
                }
                Err(_) => 0,
            };
            (b.engine_id.clone(), status)
        }
    }))
    .await;
    let ok = results.iter().all(|(_, s)| (200..300).contains(s));
    let engines: serde_json::Map<String, serde_json::Value> =
        results.into_iter().map(|(id, s)| (id, serde_json::json!(s))).collect();
    let status = if ok { StatusCode::OK } else { StatusCode::BAD_GATEWAY };
    (status, Json(serde_json::json!({"success": ok, "engines": engines}))).into_response()
}

async fn proxy(State(state): State<Arc<RouterState>>, request: Request) -> Response {
    let metrics = &state.manager.router_metrics;
    metrics.requests.fetch_add(1, Ordering::Relaxed);
    if ADMIN_ROUTES.contains(&request.uri().path()) {
        metrics.error(ErrorKind::BadRequest);
        let msg = format!(
            "{} changes an engine's weights or lifecycle, which the manager owns; the router does not forward it. \
             Use the manager's control API (weights, scale) or call an engine directly",
            request.uri().path()
        );
        return error(StatusCode::FORBIDDEN, "admin_route", &msg);
    }
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            metrics.error(ErrorKind::BadRequest);
            let msg = format!("request body rejected: {e}; the limit is {MAX_BODY_BYTES} bytes");
            return error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", &msg);
        }
    };
    let policy = match header(&parts.headers, "x-routing-policy").map(str::parse::<Policy>) {
        None => state.manager.config.routing_policy,
        Some(Ok(p)) => p,
        Some(Err(e)) => {
            metrics.error(ErrorKind::BadRequest);
            return error(StatusCode::BAD_REQUEST, "invalid_routing_policy", &format!("x-routing-policy: {e}"));
        }
    };
    let pin_header = peek::pin_from_headers(
        header(&parts.headers, "x-weight-version"),
        header(&parts.headers, "x-min-weight-version"),
    );
    let session_header = header(&parts.headers, "x-session-id").or_else(|| header(&parts.headers, "x-smg-routing-key"));
    let info = match peek::peek(&body, session_header, pin_header) {
        Ok(info) => info,
        Err(e) => {
            metrics.error(ErrorKind::BadRequest);
            return error(StatusCode::BAD_REQUEST, "invalid_weight_version", &e.0);
        }
    };
    let body = if info.pin_in_body { peek::strip_pin(&body).map(Bytes::from).unwrap_or(body) } else { body };
    // capacity: a session key if the request has one, else its prompt (GRPO siblings);
    // session: the session key only.
    let session_key = info.session.as_deref().map(affinity::session_key);
    let affinity_key = match policy {
        Policy::Capacity => session_key.or(info.prompt_hash),
        Policy::Session => session_key,
        _ => None,
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    let headers = to_engine(&parts.headers, state.token.as_deref());
    let timeout = Duration::from_secs_f64(state.manager.config.request_timeout_secs);
    let mut tried: Vec<Arc<crate::fleet::EngineLoad>> = Vec::with_capacity(MAX_ATTEMPTS);
    let mut last_error = String::new();
    let cap = state.manager.config.max_inflight_per_engine;
    let queue_deadline = tokio::time::Instant::now() + timeout;
    for attempt in 0..MAX_ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(5 << attempt)).await;
        }
        let mut waiting: Option<QueuedGuard> = None;
        // Pick an engine and count the request on it (with a cap, only if it is under it).
        let picked = loop {
            // Each attempt reads the current table: engines may have left routing meanwhile.
            let routes = match candidates(&state, info.pin.as_ref()).await {
                Ok(r) => r,
                Err(resp) => return resp,
            };
            let mut open: Vec<usize> =
                (0..routes.len()).filter(|&i| !tried.iter().any(|t| Arc::ptr_eq(t, &routes[i].load))).collect();
            if open.is_empty() {
                break None;
            }
            if cap > 0 {
                open.retain(|&i| routes[i].load.get() < cap);
                // A new request queues behind waiting ones rather than take the slot freed for them.
                let behind = waiting.is_none() && metrics.queued.load(Ordering::Relaxed) > 0;
                if open.is_empty() || behind {
                    // Every engine is at its cap: wait here for a slot or a new engine. The 50 ms
                    // tick re-checks in case a wake-up went to a request that left meanwhile.
                    if waiting.is_none() {
                        waiting = Some(QueuedGuard::new(state.manager.router_metrics.clone()));
                    }
                    let mut changes = state.manager.fleet.subscribe();
                    tokio::select! {
                        _ = state.manager.fleet.slot_freed().notified() => {}
                        _ = changes.changed() => {}
                        _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                        _ = tokio::time::sleep_until(queue_deadline) => {
                            metrics.error(ErrorKind::QueueTimeout);
                            let msg = format!(
                                "every engine had --max-inflight-per-engine ({cap}) requests in flight for \
                                 --request-timeout-secs ({timeout:?}); retry later, add engines, or raise the limit"
                            );
                            return error(StatusCode::SERVICE_UNAVAILABLE, "router_queue_timeout", &msg);
                        }
                    }
                    continue;
                }
            }
            let loads: Vec<_> = open.iter().map(|&i| routes[i].load.snapshot()).collect();
            let affine = affinity_key
                .and_then(|k| state.affinity.get(k))
                .and_then(|id| open.iter().position(|&i| routes[i].engine_id.as_str() == &*id));
            let rotor = state.rotor.fetch_add(1, Ordering::Relaxed);
            let Some((pos, kept)) = choose(policy, &loads, info.tokens, affine, rotor, &state.gate) else {
                break None;
            };
            let index = open[pos];
            let guard = if cap > 0 {
                // Another request may have taken the last slot since the check: look again.
                let Some(guard) = routes[index].load.try_enter(info.tokens, cap) else { continue };
                guard
            } else {
                routes[index].load.enter(info.tokens)
            };
            break Some((routes, index, affine.is_some(), kept, guard));
        };
        drop(waiting);
        let Some((routes, index, had_affine, kept, guard)) = picked else { break };
        let backend = &routes[index];
        if had_affine {
            let counter = if kept { &metrics.affinity_kept } else { &metrics.affinity_moved };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        if let (Some(k), false) = (affinity_key, kept) {
            state.affinity.put(k, &backend.engine_id);
        }
        tried.push(backend.load.clone());
        if attempt > 0 {
            metrics.retries.fetch_add(1, Ordering::Relaxed);
        }
        // Counted first, then checked: a scale-in that took the engine out of routing before
        // this request was counted sees it in its drain; one that did after, we see here.
        if !state.manager.fleet.is_routable(&backend.load) {
            drop(guard);
            continue;
        }
        let uri = match Uri::try_from(format!("http://{}{}", backend.authority, path)) {
            Ok(u) => u,
            Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_path", &format!("cannot forward {path:?}: {e}")),
        };
        let mut req = hyper::Request::new(Full::new(body.clone()));
        *req.method_mut() = parts.method.clone();
        *req.uri_mut() = uri;
        *req.headers_mut() = headers.clone();
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + timeout;
        let Ok(answer) = tokio::time::timeout_at(
            deadline,
            state.manager.fleet.unless_lost(&backend.engine_id, &backend.load, state.client.request(req)),
        )
        .await
        else {
            metrics.error(ErrorKind::Timeout);
            tracing::warn!(engine_id = %backend.engine_id, ?timeout, "engine sent no response headers in time");
            let msg = format!(
                "engine {} did not answer within --request-timeout-secs ({timeout:?}); the request was not retried \
                 because the engine may still be working on it",
                backend.engine_id
            );
            return error(StatusCode::GATEWAY_TIMEOUT, "engine_timeout", &msg);
        };
        match answer {
            Ok(resp)
                if resp.status() == StatusCode::SERVICE_UNAVAILABLE && attempt + 1 < MAX_ATTEMPTS.min(routes.len()) =>
            {
                tracing::debug!(engine_id = %backend.engine_id, "engine answered 503; trying another");
                last_error = format!("{}: 503", backend.engine_id);
            }
            Ok(resp) => {
                metrics.first_byte.observe(started.elapsed());
                metrics.response(resp.status().as_u16());
                let (mut head, incoming) = resp.into_parts();
                let clean = end_to_end(&head.headers);
                head.headers = clean;
                if let Ok(v) = HeaderValue::from_str(&backend.engine_id) {
                    head.headers.insert("x-rollout-engine-id", v);
                }
                let tracked = Tracked {
                    inner: incoming,
                    _guard: guard,
                    started,
                    metrics: state.manager.router_metrics.clone(),
                    deadline: Box::pin(tokio::time::sleep_until(deadline)),
                    timeout,
                };
                return Response::from_parts(head, Body::new(tracked));
            }
            Err(e) => {
                tracing::warn!(engine_id = %backend.engine_id, error = %e, "engine gave no response; trying another");
                last_error = format!("{}: {e}", backend.engine_id);
            }
        }
    }
    metrics.error(ErrorKind::NoAnswer);
    let msg = format!("no engine answered this request (last: {last_error}); see GET /rollout/engines");
    error(StatusCode::BAD_GATEWAY, "no_engine_answered", &msg)
}

/// Counts a request in `rollout_router_queued_requests` while it waits for a slot.
struct QueuedGuard(Arc<RouterMetrics>);

impl QueuedGuard {
    fn new(metrics: Arc<RouterMetrics>) -> Self {
        metrics.queued.fetch_add(1, Ordering::Relaxed);
        Self(metrics)
    }
}

impl Drop for QueuedGuard {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An engine's response body on its way to the client: holds the engine's in-flight count until
/// the body ends (or the client goes away, or the deadline passes and the stream is cut), then
/// records the request's duration.
struct Tracked {
    inner: hyper::body::Incoming,
    _guard: InFlightGuard,
    started: Instant,
    metrics: Arc<RouterMetrics>,
    /// When the whole answer must have ended (`--request-timeout-secs` after it was sent).
    deadline: Pin<Box<tokio::time::Sleep>>,
    timeout: Duration,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.metrics.duration.observe(self.started.elapsed());
    }
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            self.metrics.error(ErrorKind::Timeout);
            tracing::warn!(timeout = ?self.timeout, "engine's answer did not end within --request-timeout-secs; cut");
            let cut = format!("the engine's answer did not end within --request-timeout-secs ({:?})", self.timeout);
            return Poll::Ready(Some(Err(cut.into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
