//! The data plane: an SGLang-compatible proxy in front of the fleet's ACTIVE engines.
//!
//! The data plane (generation, tokenization, read-only information:
//! `rollout_core::routes`, an allow-list; every other path is refused with 403) is forwarded
//! unchanged (method, path, query, body, end-to-end headers) to one engine chosen by the
//! routing policy; the router serves its own routes (health, the fan-outs, a read-only
//! smg-style `/workers` list, `/v1/models` under the fleet's one name: `models`) itself. Routing policies (`rollout_core::routing`): `capacity` by default, `round_robin`, `least_requests` or
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
//! or a 503 is retried on another engine, up to [`MAX_ATTEMPTS`] sends, with a short backoff
//! (when every engine the request may use was tried, one of them again: a pinned request may
//! have a single candidate, and a dropped connection is not a dead engine);
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
//! The KV estimate is the prompt plus the output the router expects (`rollout_core::lengths`:
//! what answers of the same prompt or session showed, else the recent mean, never above the
//! budget). Every successful answer's `completion_tokens` (read from its body as it streams
//! by) is observed into that estimate, keyed by the request's session, else its prompt.
//!
//! Late binding (`--max-inflight-per-engine`, `auto` by default: each engine its own cap, set by
//! the load poller from the engine's pool and the learned size of requests; or a fixed N; 0
//! turns it off): an engine gets at most about its cap of requests at once (two requests
//! deciding at the same instant may both take the last slot). The rest wait in the router's
//! queue (`crate::slots`: by default session turns first, then the largest expected output;
//! `--queue-order fifo`: arrival order), and each goes to the first engine with a free slot
//! when one frees or an engine joins. Work then never sits in one engine's queue while another, e.g. one a
//! scale-out just added, is idle. A request waits at most `--request-timeout-secs` for a slot,
//! then gets 503 `router_queue_timeout`.

mod affinity;
pub mod metrics;
mod models;
mod moving;
mod peek;
mod pool;
mod table;
pub mod tail;
pub use pool::set_thread_slot;

use crate::error::error_body;
use crate::fleet::Fleet;
use crate::fleet::InFlightGuard;
use crate::http_serve::read_body_first;
use crate::slots::{Answer, Joining, SlotQueue, Ticket};
use affinity::Affinity;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::uri::{PathAndQuery, Scheme};
use axum::http::{HeaderMap, HeaderName, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use metrics::{ErrorKind, RouterMetrics};
use rollout_core::routes::Intent;
use rollout_core::routing::InflightCap;
use rollout_core::routing::{choose, Gate, Policy, VersionPin};
use rollout_core::ServeConfig;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use table::{Route, RouteCache};

/// Largest request body the router accepts (prompts with long contexts and images fit).
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// How long a fan-out call waits for each engine's answer.
pub const FAN_OUT_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest body of a fan-out call (`/abort_request`, `/flush_cache`).
const FAN_OUT_BODY_BYTES: usize = 1 << 20;

/// Most engines one request is tried on.
pub const MAX_ATTEMPTS: usize = 3;

/// The response header naming the engine that answered.
const ENGINE_ID_HEADER: HeaderName = HeaderName::from_static("x-rollout-engine-id");

type EngineClient = Client<HttpConnector, Full<Bytes>>;

pub struct RouterState {
    fleet: Arc<Fleet>,
    config: ServeConfig,
    metrics: Arc<RouterMetrics>,
    /// The manager's API token: a request's `Authorization` carrying it is for us, and is not
    /// forwarded to engines (an engine's own `--api-key` credential is).
    token: Option<Arc<str>>,
    client: EngineClient,
    /// Connections of the proxy's hot path, per engine address.
    pools: pool::Pools,
    rotor: AtomicUsize,
    affinity: Affinity,
    gate: Gate,
    routes: RouteCache,
    /// Movable requests running now, for the tail planner (`--move-tail`).
    tail: Arc<tail::Board>,
}

/// The data plane as served on the router port: the router's own routes go through an axum
/// `Router`; every other path (what is proxied, nearly every request) goes straight to
/// [`proxy`], without axum's route matching and boxing on the hot path.
#[derive(Clone)]
pub struct DataPlane {
    own: Router,
    state: Arc<RouterState>,
}

impl DataPlane {
    /// The tail planner (`router::tail`), to run until `stop`; it returns at once with
    /// `--move-tail false`.
    pub fn tail_planner(&self, stop: tokio_util::sync::CancellationToken) -> impl Future<Output = ()> + use<> {
        tail::run(self.state.clone(), stop)
    }
}

/// Paths the router answers itself (the routes of [`DataPlane::own`]).
const OWN_ROUTES: [&str; 7] =
    ["/liveness", "/health", "/readiness", "/abort_request", "/flush_cache", "/workers", "/metrics"];

fn is_own(path: &str) -> bool {
    OWN_ROUTES.contains(&path) || path.starts_with("/workers/")
}

impl tower_service::Service<Request> for DataPlane {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request) -> Self::Future {
        if is_own(request.uri().path()) {
            Box::pin(tower_service::Service::call(&mut self.own, request))
        } else {
            Box::pin(proxy_service(self.state.clone(), request))
        }
    }
}

async fn proxy_service(state: Arc<RouterState>, request: Request) -> Result<Response, std::convert::Infallible> {
    Ok(proxy(State(state), request).await)
}

/// The data plane. `token`, when set, guards the fan-out routes (`/abort_request`,
/// `/flush_cache`), which act on every engine; generation needs none.
pub fn router(
    fleet: Arc<Fleet>,
    config: ServeConfig,
    metrics: Arc<RouterMetrics>,
    token: Option<Arc<str>>,
) -> DataPlane {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(2)));
    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(1024)
        .build(connector);
    let state = Arc::new(RouterState {
        fleet,
        config,
        metrics,
        token: token.clone(),
        client,
        pools: pool::Pools::default(),
        rotor: AtomicUsize::new(0),
        affinity: Affinity::new(100_000),
        gate: Gate::default(),
        routes: RouteCache::default(),
        tail: Arc::default(),
    });
    let own = Router::new()
        .route("/liveness", get(|| async { Json(serde_json::json!({"status": "ok"})) }))
        .route("/health", get(readiness))
        .route("/readiness", get(readiness))
        .route(
            "/abort_request",
            axum::routing::post(fan_out)
                .layer(axum::middleware::from_fn_with_state(token.clone(), crate::auth::require_token))
                .layer(axum::middleware::from_fn_with_state(FAN_OUT_BODY_BYTES, read_body_first)),
        )
        .route(
            "/flush_cache",
            axum::routing::post(fan_out)
                .get(fan_out)
                .layer(axum::middleware::from_fn_with_state(token, crate::auth::require_token))
                .layer(axum::middleware::from_fn_with_state(FAN_OUT_BODY_BYTES, read_body_first)),
        )
        .route("/metrics", get(metrics_text))
        .route("/workers", get(workers).fallback(workers_managed))
        .route("/workers/{*id}", axum::routing::any(workers_managed))
        .fallback(proxy)
        .with_state(state.clone());
    DataPlane { own, state }
}

/// `GET /workers` in the shape of smg's worker list, for trainers written against it (slime
/// lists the workers to abort each engine at the end of a rollout): the routable engines, each
/// with its URL and weight version.
async fn workers(State(state): State<Arc<RouterState>>) -> Response {
    let routes = state.fleet.routes();
    let list: Vec<serde_json::Value> = routes
        .backends
        .iter()
        .map(|b| {
            serde_json::json!({
                "id": b.engine_id, "url": b.url, "model_id": state.config.model_name,
                "worker_type": "regular", "connection_mode": "http", "is_healthy": true, "status": "Ready",
                "load": b.load.get(), "weight_version": b.weight_version,
            })
        })
        .collect();
    let body = serde_json::json!({
        "total": list.len(), "workers": list,
        "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": routes.backends.len()},
    });
    Json(body).into_response()
}

/// Changing the worker list through the router: refused, the manager owns it.
async fn workers_managed() -> Response {
    error(
        StatusCode::FORBIDDEN,
        "workers_managed",
        "this router's workers are the manager's ACTIVE engines; attach an engine with POST \
         /rollout/scale_out {\"engine_urls\": [...]} and detach it with POST /rollout/scale_in on the control port",
    )
}

async fn readiness(State(state): State<Arc<RouterState>>) -> Response {
    let n = state.fleet.routes().backends.len();
    let status = if n > 0 { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = serde_json::json!({"status": if n > 0 {"ok"} else {"no_engines"}, "routable_engines": n});
    (status, Json(body)).into_response()
}

/// Headers that are not forwarded: hop-by-hop ones (and any a `connection` header names), the
/// ones the proxy sets itself (`host`, `content-length`), `expect` (the router has read the whole
/// body already) and the router's own request headers.
const HOP_BY_HOP: [&str; 16] = [
    "connection",
    "proxy-connection",
    "expect",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "x-routing-policy",
    "x-session-id",
    "x-weight-version",
    "x-min-weight-version",
];

fn hop_by_hop_index(name: &HeaderName) -> Option<usize> {
    let name = name.as_str();
    HOP_BY_HOP.iter().position(|h| *h == name)
}

/// Removes the headers that are not forwarded, in place. One pass over the (few) names present
/// finds which to remove, so a request or response without any costs no lookup.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let mut found = 0u32;
    for name in headers.keys() {
        if let Some(i) = hop_by_hop_index(name) {
            found |= 1 << i;
        }
    }
    if found & 1 != 0 {
        // Headers the sender declared hop-by-hop in `connection` (RFC 9110 section 7.6.1). The
        // usual `keep-alive` and `close` name nothing more, so they cost no allocation.
        let named: Vec<HeaderName> = headers
            .get_all("connection")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|t| !t.eq_ignore_ascii_case("keep-alive") && !t.eq_ignore_ascii_case("close"))
            .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    while found != 0 {
        let i = found.trailing_zeros() as usize;
        found &= found - 1;
        headers.remove(HOP_BY_HOP[i]);
    }
}

/// The headers of a client's request as an engine gets them: end-to-end ones only, and never
/// this manager's own token.
fn to_engine(mut headers: HeaderMap, token: Option<&str>) -> HeaderMap {
    strip_hop_by_hop(&mut headers);
    if crate::auth::carries_token(&headers, token) {
        headers.remove("authorization");
    }
    headers
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (status, Json(error_body(code, message))).into_response()
}

/// The router's own request headers (each one's first value), read in one pass over the few
/// headers a request has rather than one hashed lookup per name.
#[derive(Default)]
struct OwnHeaders<'a> {
    routing_policy: Option<&'a str>,
    weight_version: Option<&'a str>,
    min_weight_version: Option<&'a str>,
    session_id: Option<&'a str>,
    smg_routing_key: Option<&'a str>,
    partial_rollout: Option<&'a str>,
}

impl<'a> OwnHeaders<'a> {
    fn of(headers: &'a HeaderMap) -> Self {
        let mut own = Self::default();
        let mut seen = 0u8;
        for (name, value) in headers {
            let (bit, slot) = match name.as_str() {
                "x-routing-policy" => (1, &mut own.routing_policy),
                "x-weight-version" => (2, &mut own.weight_version),
                "x-min-weight-version" => (4, &mut own.min_weight_version),
                "x-session-id" => (8, &mut own.session_id),
                "x-smg-routing-key" => (16, &mut own.smg_routing_key),
                "x-partial-rollout" => (32, &mut own.partial_rollout),
                _ => continue,
            };
            // The first value counts (as `HeaderMap::get`); one that is not text counts as absent.
            if seen & bit == 0 {
                seen |= bit;
                *slot = value.to_str().ok();
            }
        }
        own
    }
}

/// The routable engines that satisfy `pin`, waiting up to `--version-wait-secs` for one.
async fn candidates(state: &RouterState, pin: Option<&VersionPin>) -> Result<Arc<Vec<Route>>, Response> {
    let fleet = &state.fleet;
    let wait = Duration::from_secs_f64(state.config.version_wait_secs);
    let deadline = tokio::time::Instant::now() + wait;
    // Subscribed to table changes only once a wait is needed (then the table is read again,
    // so no change between the first read and the subscription is missed).
    let mut changes: Option<tokio::sync::watch::Receiver<u64>> = None;
    loop {
        let current = state.routes.current(fleet, &state.pools);
        let found = match pin {
            None => !current.all.is_empty(),
            Some(pin) => {
                let history = &current.table.version_order;
                let matching: Vec<Route> =
                    current.all.iter().filter(|b| pin.allows(b.weight_version.as_deref(), history)).cloned().collect();
                if !matching.is_empty() {
                    return Ok(Arc::new(matching));
                }
                false
            }
        };
        if found {
            return Ok(current.all.clone());
        }
        // While a weight update has every engine out of routing (all_at_once), requests
        // wait for them like pinned ones do, instead of failing at once.
        if pin.is_none() && !current.table.weights_updating {
            state.metrics.error(ErrorKind::NoEngine);
            return Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "no_engine_available",
                "no ACTIVE engine can take this request; see GET /rollout/engines on the control port",
            ));
        }
        let Some(rx) = changes.as_mut() else {
            changes = Some(fleet.subscribe());
            continue;
        };
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { break },
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    state.metrics.error(ErrorKind::VersionUnavailable);
    let serving: Vec<String> = fleet.routes().backends.iter().filter_map(|b| b.weight_version.clone()).collect();
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

fn load_addr(load: &Arc<crate::fleet::EngineLoad>) -> usize {
    Arc::as_ptr(load) as usize
}

/// A `/generate` request that may move while it runs (`--move-on-drain`, a prompt of ids: see
/// `rollout_core::moves::Movable`), with the body to send (given a `rid` if it had none) and
/// that `rid`; other requests as they are.
fn movable_request(
    state: &RouterState,
    method: &Method,
    path: &str,
    body: Bytes,
    partial_rollout: bool,
) -> (Bytes, Option<(serde_json::Value, rollout_core::moves::Movable, String)>) {
    let moves = state.config.move_on_drain || state.config.move_tail || partial_rollout;
    if !moves || method != Method::POST || path != "/generate" {
        return (body, None);
    }
    // Only bodies with a prompt of ids or text are parsed whole.
    if !body.windows(11).any(|w| w == b"\"input_ids\"") && !body.windows(6).any(|w| w == b"\"text\"") {
        return (body, None);
    }
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(&body) else { return (body, None) };
    let Some(movable) = rollout_core::moves::Movable::of(&value) else { return (body, None) };
    movable.prepare(&mut value);
    let rid = match &movable.rid {
        Some(rid) if !movable.text => return (body, Some((value, movable.clone(), rid.clone()))),
        Some(rid) => rid.clone(),
        None => {
            let rid = moving::new_rid();
            value["rid"] = serde_json::json!(rid);
            rid
        }
    };
    match serde_json::to_vec(&value) {
        Ok(b) => (Bytes::from(b), Some((value, movable, rid))),
        Err(_) => (body, None),
    }
}

/// The path and query of a client's request, as forwarded (`/` when it has none).
fn path_and_query(uri: &Uri) -> PathAndQuery {
    uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"))
}

/// The URI of `path` on an engine: built from parts when the engine's authority was parsed
/// once (no string is formatted or parsed per request), else from its URL's text.
fn engine_uri(backend: &Route, path: &PathAndQuery) -> Result<Uri, axum::http::Error> {
    match &backend.uri_authority {
        Some(authority) => {
            Uri::builder().scheme(Scheme::HTTP).authority(authority.clone()).path_and_query(path.clone()).build()
        }
        None => Ok(Uri::try_from(format!("http://{}{}", backend.authority, path))?),
    }
}

/// Sends the request to every routable engine (abort and cache flush concern them all) and
/// answers 200 when all succeeded, else 502, with each engine's status.
async fn fan_out(State(state): State<Arc<RouterState>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, FAN_OUT_BODY_BYTES).await else {
        return error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", "the body is limited to 1 MiB");
    };
    let path = path_and_query(&parts.uri);
    let headers = to_engine(parts.headers, state.token.as_deref());
    let routes = state.routes.current(&state.fleet, &state.pools).all.clone();
    let client = &state.client;
    let results = futures::future::join_all(routes.iter().map(|b| {
        let mut req = hyper::Request::new(Full::new(body.clone()));
        *req.method_mut() = parts.method.clone();
        *req.headers_mut() = headers.clone();
        let uri = engine_uri(b, &path);
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
    let metrics = &state.metrics;
    metrics.request();
    // Fail closed: only the data plane is forwarded (rollout_core::routes).
    match rollout_core::routes::intent(request.method().as_str(), request.uri().path()) {
        Intent::Forward => {}
        Intent::WrongMethod(allowed) => {
            metrics.error(ErrorKind::BadRequest);
            let msg = format!("{} takes {}, not {}", request.uri().path(), allowed.join(" or "), request.method());
            let mut resp = error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", &msg);
            if let Ok(v) = axum::http::HeaderValue::from_str(&allowed.join(", ")) {
                resp.headers_mut().insert(axum::http::header::ALLOW, v);
            }
            return resp;
        }
        Intent::Refuse(why) => {
            metrics.error(ErrorKind::BadRequest);
            return error(StatusCode::FORBIDDEN, why.code(), &why.message(request.uri().path()));
        }
    }
    if models::is_models_path(request.uri().path()) {
        return models::answer(&state, request).await;
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
    let own = OwnHeaders::of(&parts.headers);
    let policy = match own.routing_policy.map(str::parse::<Policy>) {
        None => state.config.routing_policy,
        Some(Ok(p)) => p,
        Some(Err(e)) => {
            metrics.error(ErrorKind::BadRequest);
            return error(StatusCode::BAD_REQUEST, "invalid_routing_policy", &format!("x-routing-policy: {e}"));
        }
    };
    let partial_rollout = match own.partial_rollout.map(str::trim) {
        None => state.config.partial_rollout,
        Some(v) if v.eq_ignore_ascii_case("true") => true,
        Some(v) if v.eq_ignore_ascii_case("false") => false,
        Some(v) => {
            metrics.error(ErrorKind::BadRequest);
            let msg = format!("x-partial-rollout: {v:?} is not true or false");
            return error(StatusCode::BAD_REQUEST, "invalid_partial_rollout", &msg);
        }
    };
    let pin_header = peek::pin_from_headers(own.weight_version, own.min_weight_version);
    let session_header = own.session_id.or(own.smg_routing_key);
    let info = match peek::peek(&body, session_header, pin_header) {
        Ok(info) => info,
        Err(e) => {
            metrics.error(ErrorKind::BadRequest);
            return error(StatusCode::BAD_REQUEST, "invalid_weight_version", &e.0);
        }
    };
    let body = if info.pin_in_body { peek::strip_pin(&body).map(Bytes::from).unwrap_or(body) } else { body };
    // A `/generate` request that can move to another engine while it runs (router::moving)
    // gets a `rid` to be aborted by, if it has none.
    let (body, mut movable) = movable_request(&state, &parts.method, parts.uri.path(), body, partial_rollout);
    // capacity: a session key if the request has one, else its prompt (GRPO siblings);
    // session: the session key only.
    let session_key = info.session.as_deref().map(affinity::session_key);
    // What learned lengths are keyed by: the session, else the prompt (GRPO siblings).
    let class = session_key.or(info.prompt_hash);
    let queue = state.fleet.slot_queue().clone();
    let budget = info.output_budget;
    let tokens = info.tokens_expecting(queue.lengths(|l| l.expected(class, budget)));
    let affinity_key = match policy {
        Policy::Capacity => session_key.or(info.prompt_hash),
        Policy::Session => session_key,
        _ => None,
    };
    let path = path_and_query(&parts.uri);
    let method = parts.method;
    let headers = to_engine(parts.headers, state.token.as_deref());
    let timeout = Duration::from_secs_f64(state.config.request_timeout_secs);
    // Engines already tried, by the address of their load (as in `Arc::ptr_eq`).
    let mut tried = [0usize; MAX_ATTEMPTS];
    let mut last_error = String::new();
    let cap_mode = state.config.max_inflight_per_engine;
    let capped = cap_mode.enabled();
    let queue_deadline = tokio::time::Instant::now() + timeout;
    for attempt in 0..MAX_ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(5 << attempt)).await;
        }
        // This request's place in the router's queue while every engine is at its cap.
        let mut queued: Option<(Ticket, QueuedGuard)> = None;
        // Pick an engine and count the request on it (with a cap, only if it is under it).
        let picked = loop {
            // Each attempt reads the current table: engines may have left routing meanwhile.
            let routes = match candidates(&state, info.pin.as_ref()).await {
                Ok(r) => r,
                Err(resp) => return resp,
            };
            // A retry goes to an engine not tried yet; once every candidate has been tried
            // (a pinned request may have only one), to any of them again: it may have recovered.
            let tried_before = &tried[..attempt];
            let all_tried = routes.iter().all(|b| tried_before.contains(&load_addr(&b.load)));
            let skip = if all_tried { &[][..] } else { tried_before };
            let mut untried = 0;
            let mut open: Vec<usize> = Vec::with_capacity(routes.len());
            for (i, b) in routes.iter().enumerate() {
                if !skip.contains(&load_addr(&b.load)) {
                    untried += 1;
                    if !capped || b.load.get() < engine_cap(cap_mode, &b.load) {
                        open.push(i);
                    }
                }
            }
            if untried == 0 {
                break None;
            }
            if capped {
                // A new request queues behind waiting ones rather than take a slot freed for them.
                let behind = queued.is_none() && metrics.queued.get() > 0;
                if open.is_empty() || behind {
                    let (ticket, _) = queued.get_or_insert_with(|| {
                        let joining = Joining { class, budget, session: info.session.is_some() };
                        (queue.join(joining), QueuedGuard::new(state.metrics.clone()))
                    });
                    if !open.is_empty() {
                        // Room, but others wait: the head of the queue (maybe this request) takes it.
                        queue.wake_next();
                    } else if (info.pin.is_some() || attempt > 0) && room_elsewhere(&state, cap_mode) {
                        // The free slot is on an engine this request may not use: pass it on.
                        ticket.pass_on();
                    }
                    // Wait for a slot (this request's turn), or, at the head of the queue, for a
                    // new engine or the 50 ms tick, in case a wake-up went astray.
                    let mut changes = state.fleet.subscribe();
                    loop {
                        tokio::select! {
                            () = ticket.woken() => break,
                            changed = changes.changed() => if changed.is_err() || ticket.is_head() { break },
                            () = tokio::time::sleep(Duration::from_millis(50)) => if ticket.is_head() { break },
                            () = tokio::time::sleep_until(queue_deadline) => {
                                metrics.error(ErrorKind::QueueTimeout);
                                let msg = format!(
                                    "every engine had its --max-inflight-per-engine ({cap_mode}) requests in flight for \
                                     --request-timeout-secs ({timeout:?}); retry later, add engines, or raise the limit"
                                );
                                return error(StatusCode::SERVICE_UNAVAILABLE, "router_queue_timeout", &msg);
                            }
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
            let Some((pos, kept)) = choose(policy, &loads, tokens, affine, rotor, &state.gate) else {
                break None;
            };
            let index = open[pos];
            let guard = if capped {
                // Another request may have taken the last slot since the check: look again.
                let cap = engine_cap(cap_mode, &routes[index].load);
                let Some(guard) = routes[index].load.try_enter(tokens, cap) else { continue };
                guard
            } else {
                routes[index].load.enter(tokens)
            };
            // Counted first, then checked: a scale-in or weight update that took the engine out
            // of routing before this request was counted sees it in its drain; one that did
            // after, we see here, and pick again from the new table (not a failed attempt).
            if !state.fleet.routes().is_routable(&routes[index].load) {
                drop(guard);
                continue;
            }
            if capped
                && queued.take().is_some()
                && (open.len() > 1 || routes[index].load.get() < engine_cap(cap_mode, &routes[index].load))
            {
                // More than one slot was free (an engine joined): the next in line takes one.
                state.fleet.slot_queue().wake_next();
            }
            break Some((routes, index, affine.is_some(), kept, guard));
        };
        drop(queued);
        let Some((routes, index, had_affine, kept, guard)) = picked else { break };
        let learn = Learn::start(&queue, class, budget, info.prompt_tokens);
        let backend = &routes[index];
        if had_affine {
            metrics.affinity(kept);
        }
        if let (Some(k), false) = (affinity_key, kept) {
            state.affinity.put(k, &backend.engine_id);
        }
        tried[attempt] = load_addr(&backend.load);
        if attempt > 0 {
            metrics.retry();
        }
        // Engines with a plain host:port take the router's own pooled connections (origin-form
        // target, Host set there); any other URL, and CONNECT, goes through hyper-util's client.
        let sent = match (&backend.host_header, &backend.pool, method == Method::CONNECT) {
            (Some(host), Some(pool), false) => {
                let (method, path, headers, body) = (&method, &path, &headers, &body);
                let authority = backend.authority.as_str();
                futures::future::Either::Left(async move {
                    let outgoing = pool::Outgoing { method, target: path.as_str(), host, headers, body };
                    match pool::send(pool, authority, &outgoing).await {
                        Ok(r) => Ok(r.map(EngineBody::Direct)),
                        Err(e) => Err(e.to_string()),
                    }
                })
            }
            _ => {
                let mut req = hyper::Request::new(Full::new(body.clone()));
                *req.method_mut() = method.clone();
                *req.headers_mut() = headers.clone();
                match engine_uri(backend, &path) {
                    Ok(u) => *req.uri_mut() = u,
                    Err(e) => {
                        return error(StatusCode::BAD_REQUEST, "invalid_path", &format!("cannot forward {path:?}: {e}"))
                    }
                }
                let client = &state.client;
                futures::future::Either::Right(async move {
                    match client.request(req).await {
                        Ok(r) => Ok(r.map(EngineBody::Client)),
                        Err(e) => Err(e.to_string()),
                    }
                })
            }
        };
        let started = Instant::now();
        // One timer bounds the whole answer: it first bounds the wait for the headers, then
        // goes with the body (Tracked) to bound the rest.
        let mut deadline = Box::pin(tokio::time::sleep(timeout));
        // A successful answer is held until its first body frame: an engine that dies between
        // its headers and its first byte (SGLang sends a stream's headers before the prefill)
        // gave the client nothing yet, so the request is retried like one that got no answer.
        // A movable request's answer is followed by router::moving, which continues it on
        // another engine if its engine dies at any point: its headers are not held.
        let hold = movable.is_none();
        let sent = async move {
            let resp = sent.await?;
            if !hold || !resp.status().is_success() {
                return Ok((resp, None));
            }
            let (parts, mut body) = resp.into_parts();
            match http_body_util::BodyExt::frame(&mut body).await {
                Some(Err(e)) => Err(format!("the engine's answer broke before its first byte: {e}")),
                first => Ok((Response::from_parts(parts, body), first.and_then(Result::ok))),
            }
        };
        let sent = state.fleet.unless_lost(&backend.load, sent);
        // On the tail planner's board while it runs (router::tail).
        let on_board = movable.as_ref().filter(|_| state.config.move_tail).map(|(_, m, _)| {
            let request = tail::Request {
                class,
                budget,
                prompt: info.prompt_tokens,
                session: info.session.is_some(),
                ready: moving::ready(m, &Default::default()),
            };
            state.tail.enter(backend.load.clone(), request)
        });
        // A movable request whose engine is asked to shed its requests before it answered is
        // aborted there (router::moving continues it elsewhere).
        let aborted = std::sync::atomic::AtomicBool::new(false);
        let abort_when_asked = async {
            match &movable {
                // A streamed text prompt cannot move before its ids came back (with its first event).
                Some((_, m, rid)) if moving::ready(m, &Default::default()) => {
                    let asked = moving::Asked { may_cross: partial_rollout, tail: on_board.as_ref() };
                    moving::abort_when_asked(&state, backend, &headers, rid, asked, &aborted).await
                }
                _ => std::future::pending().await,
            }
        };
        let answer = tokio::select! {
            biased;
            answer = sent => answer,
            () = abort_when_asked => unreachable!("never resolves"),
            () = deadline.as_mut() => {
                metrics.error(ErrorKind::Timeout);
                tracing::warn!(engine_id = %backend.engine_id, ?timeout, "engine sent no response headers in time");
                let msg = format!(
                    "engine {} did not answer within --request-timeout-secs ({timeout:?}); the request was not retried \
                     because the engine may still be working on it",
                    backend.engine_id
                );
                return error(StatusCode::GATEWAY_TIMEOUT, "engine_timeout", &msg);
            }
        };
        match answer {
            Ok((resp, _))
                if resp.status() == StatusCode::SERVICE_UNAVAILABLE && attempt + 1 < MAX_ATTEMPTS.min(routes.len()) =>
            {
                tracing::debug!(engine_id = %backend.engine_id, "engine answered 503; trying another");
                last_error = format!("{}: 503", backend.engine_id);
            }
            Ok((resp, first)) => {
                metrics.first_byte.observe(started.elapsed());
                let (mut head, incoming) = resp.into_parts();
                strip_hop_by_hop(&mut head.headers);
                if let Some(v) = &backend.id_header {
                    head.headers.insert(ENGINE_ID_HEADER, v.clone());
                }
                // Only a successful answer's length is learned (the others just end).
                let learn = (head.status == StatusCode::OK).then_some(learn);
                // (The attempt ends here whatever the status: the request is not needed again.)
                if let (Some((value, m, rid)), StatusCode::OK) = (movable.take(), head.status) {
                    // The body may change (joined after a move).
                    head.headers.remove(axum::http::header::CONTENT_LENGTH);
                    let request = moving::Request {
                        learn,
                        started,
                        state: state.clone(),
                        headers: headers.clone(),
                        path: path.clone(),
                        body: value,
                        movable: m,
                        rid,
                        pin: info.pin.clone(),
                        may_cross: partial_rollout,
                        tokens,
                        timeout,
                        tail: on_board,
                    };
                    let part = moving::Part {
                        engine_id: backend.engine_id.clone(),
                        route: backend.clone(),
                        guard: Some(guard),
                        body: incoming,
                        first,
                        aborted: aborted.load(std::sync::atomic::Ordering::Acquire),
                    };
                    if request.movable.stream {
                        metrics.response(head.status.as_u16());
                        return Response::from_parts(head, moving::body(request, part));
                    }
                    let answer = match moving::whole(request, part).await {
                        // (Its length goes with it: hyper writes it from the body's exact size.)
                        Ok(bytes) => Response::from_parts(head, Body::from(bytes)),
                        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                            metrics.error(ErrorKind::Timeout);
                            error(StatusCode::GATEWAY_TIMEOUT, "engine_timeout", &e.to_string())
                        }
                        Err(e) => error(StatusCode::BAD_GATEWAY, "engine_lost", &e.to_string()),
                    };
                    metrics.response(answer.status().as_u16());
                    return answer;
                }
                metrics.response(head.status.as_u16());
                let sse = head
                    .headers
                    .get(axum::http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.starts_with("text/event-stream"));
                let tracked = Tracked {
                    learn,
                    inner: incoming,
                    first,
                    sse,
                    partial: bytes::BytesMut::new(),
                    engine_id: backend.engine_id.clone(),
                    closed: false,
                    ended: false,
                    _guard: guard,
                    started,
                    metrics: state.metrics.clone(),
                    deadline,
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

/// The manager's own metrics, as on the control port (not an engine's: scrape engines through
/// the control API's service discovery, `GET /rollout/prometheus/targets`).
async fn metrics_text(State(state): State<Arc<RouterState>>) -> axum::response::Response {
    use axum::response::IntoResponse;
    let text = metrics::render(&state.fleet, &state.metrics);
    ([(axum::http::header::CONTENT_TYPE, crate::telemetry::CONTENT_TYPE)], text).into_response()
}

/// Whether some routable engine is under its cap (one a pinned or retried request may not use).
fn room_elsewhere(state: &RouterState, cap: InflightCap) -> bool {
    state.fleet.routes().backends.iter().any(|b| b.load.get() < engine_cap(cap, &b.load))
}

/// An engine's in-flight cap: the fixed one, or its own automatic one (the fallback until the
/// load poller set it).
fn engine_cap(cap: InflightCap, load: &crate::fleet::EngineLoad) -> usize {
    match cap {
        InflightCap::Fixed(n) => n,
        InflightCap::Auto => load.auto_cap().unwrap_or(rollout_core::lengths::AUTO_CAP_UNREPORTED),
    }
}

/// A request sent to an engine, as the length estimator follows it: started when sent, ended
/// when dropped, with the answer's token counts if [`Learn::answered`] read them to its end.
struct Learn {
    queue: Arc<SlotQueue>,
    class: Option<u64>,
    budget: u64,
    prompt: u64,
    /// When it was sent, on the estimator's clock.
    at: f64,
    usage: peek::Usage,
    answered: bool,
}

impl Learn {
    fn start(queue: &Arc<SlotQueue>, class: Option<u64>, budget: u64, prompt: u64) -> Self {
        let at = queue.started(class);
        Self { queue: queue.clone(), class, budget, prompt, at, usage: peek::Usage::default(), answered: false }
    }
}

impl Drop for Learn {
    fn drop(&mut self) {
        let answer = match (self.answered, self.usage.completion_tokens) {
            (true, Some(output)) => {
                Some(Answer { budget: self.budget, prompt: self.usage.prompt_tokens.unwrap_or(self.prompt), output })
            }
            _ => None,
        };
        self.queue.ended(self.class, self.at, answer);
    }
}

/// Counts a request in `rollout_router_queued_requests` while it waits for a slot.
pub(super) struct QueuedGuard(Arc<RouterMetrics>);

impl QueuedGuard {
    pub(super) fn new(metrics: Arc<RouterMetrics>) -> Self {
        metrics.queued.inc();
        Self(metrics)
    }
}

impl Drop for QueuedGuard {
    fn drop(&mut self) {
        self.0.queued.dec();
    }
}

/// An engine's response body on its way to the client: holds the engine's in-flight count until
/// the body ends (or the client goes away, or the deadline passes and the stream is cut), then
/// records the request's duration.
struct Tracked {
    /// Learned lengths: the answer's token counts, observed when it ends.
    learn: Option<Learn>,
    inner: EngineBody,
    /// The body's first frame, read before the headers were forwarded (see [`proxy`]).
    first: Option<http_body::Frame<Bytes>>,
    /// A server-sent-event stream: cut, it ends with an error event the client can read.
    sse: bool,
    /// Of a stream, the bytes of an event not yet complete (forwarded once its `\n\n` came):
    /// the client only ever sees whole events, so the error event of a cut never lands in
    /// the middle of one.
    partial: bytes::BytesMut,
    engine_id: String,
    /// The stream was cut and its error event sent: nothing follows.
    closed: bool,
    /// The body was read to its end.
    ended: bool,
    _guard: InFlightGuard,
    started: Instant,
    metrics: Arc<RouterMetrics>,
    /// When the whole answer must have ended (`--request-timeout-secs` after it was sent).
    deadline: Pin<Box<tokio::time::Sleep>>,
    timeout: Duration,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.ended || http_body::Body::is_end_stream(&self.inner) {
            if let Some(l) = &mut self.learn {
                l.answered = true;
            }
        }
        self.metrics.duration.observe(self.started.elapsed());
    }
}

impl Tracked {
    /// Ends an answer the router cannot complete: a stream gets a last event in SGLang's own
    /// in-stream error shape (`data: {"error": {message, type, code, retryable}}`, then
    /// `data: [DONE]`), which clients already read; any other body is cut with an error, which
    /// closes the client's connection before the end of the body.
    fn cut(&mut self, why: String, kind: &str, code: u16) -> Result<http_body::Frame<Bytes>, axum::BoxError> {
        if !self.sse {
            return Err(why.into());
        }
        self.closed = true;
        self.ended = false;
        let event = serde_json::json!({
            "error": {"message": format!("{why}; the output so far is incomplete, send the request again"),
                      "type": kind, "code": code, "retryable": true}
        });
        Ok(http_body::Frame::data(Bytes::from(format!("data: {event}\n\ndata: [DONE]\n\n"))))
    }
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        if self.closed || self.ended {
            return Poll::Ready(None);
        }
        loop {
            let polled = match self.first.take() {
                Some(first) => Poll::Ready(Some(Ok(first))),
                None => Pin::new(&mut self.inner).poll_frame(cx),
            };
            let Poll::Ready(frame) = polled else { break };
            self.ended = frame.is_none();
            if let (Some(learn), Some(Ok(f))) = (self.learn.as_mut(), frame.as_ref()) {
                if let Some(data) = f.data_ref() {
                    learn.usage.scan(data);
                }
            }
            if let Some(Err(e)) = &frame {
                let why = format!("engine {} stopped in the middle of its answer ({e})", self.engine_id);
                tracing::warn!(engine_id = %self.engine_id, error = %e, "engine's answer was cut");
                return Poll::Ready(Some(self.cut(why, "engine_lost", 502)));
            }
            if !self.sse {
                return Poll::Ready(frame);
            }
            match frame {
                // The end: what is left of an unterminated event goes as it is.
                None if !self.partial.is_empty() => {
                    return Poll::Ready(Some(Ok(http_body::Frame::data(self.partial.split().freeze()))));
                }
                None => return Poll::Ready(None),
                Some(Ok(f)) => match f.into_data() {
                    Ok(data) => {
                        if let Some(events) = whole_events(&mut self.partial, data) {
                            return Poll::Ready(Some(Ok(http_body::Frame::data(events))));
                        }
                    }
                    Err(other) => return Poll::Ready(Some(Ok(other))),
                },
                Some(Err(_)) => unreachable!("handled above"),
            }
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            self.metrics.error(ErrorKind::Timeout);
            tracing::warn!(timeout = ?self.timeout, "engine's answer did not end within --request-timeout-secs; cut");
            let cut = format!("the engine's answer did not end within --request-timeout-secs ({:?})", self.timeout);
            return Poll::Ready(Some(self.cut(cut, "engine_timeout", 504)));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && (self.closed || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let rest = self.inner.size_hint();
        let Some(n) = self.first.as_ref().and_then(|f| f.data_ref()).map(|d| d.len() as u64) else { return rest };
        // The upper bound first: a lower bound above the current upper one panics.
        let mut hint = http_body::SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(n));
        }
        hint.set_lower(rest.lower().saturating_add(n));
        hint
    }
}

/// The whole events of a stream so far: `data` after what `partial` holds, up to the last
/// event's end (`\n\n`); the rest stays in `partial`. None while no event is complete. A
/// frame of whole events with nothing held (nearly every frame) passes without a copy.
fn whole_events(partial: &mut bytes::BytesMut, data: Bytes) -> Option<Bytes> {
    if partial.is_empty() && data.ends_with(b"\n\n") {
        return Some(data);
    }
    partial.extend_from_slice(&data);
    let end = partial.windows(2).rposition(|w| w == b"\n\n")? + 2;
    Some(partial.split_to(end).freeze())
}

/// An engine's answer body: from the router's own connections ([`pool::send`]), or from
/// hyper-util's client (engines whose URL is not a plain `host:port`).
enum EngineBody {
    Direct(pool::EngineBody),
    Client(hyper::body::Incoming),
}

impl http_body::Body for EngineBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        match self.get_mut() {
            EngineBody::Direct(b) => Pin::new(b).poll_frame(cx).map(|f| f.map(|r| r.map_err(Into::into))),
            EngineBody::Client(b) => Pin::new(b).poll_frame(cx).map(|f| f.map(|r| r.map_err(Into::into))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            EngineBody::Direct(b) => b.is_end_stream(),
            EngineBody::Client(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            EngineBody::Direct(b) => b.size_hint(),
            EngineBody::Client(b) => b.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_is_forwarded_in_whole_events() {
        let mut partial = bytes::BytesMut::new();
        let whole = Bytes::from_static(b"data: {\"a\": 1}\n\n");
        assert_eq!(whole_events(&mut partial, whole.clone()), Some(whole));
        assert_eq!(whole_events(&mut partial, Bytes::from_static(b"data: {\"b\"")), None);
        assert_eq!(
            whole_events(&mut partial, Bytes::from_static(b": 2}\n\ndata: {\"c")),
            Some(Bytes::from_static(b"data: {\"b\": 2}\n\n"))
        );
        assert_eq!(&partial[..], b"data: {\"c");
        assert_eq!(
            whole_events(&mut partial, Bytes::from_static(b"\": 3}\n\ndata: [DONE]\n\n")),
            Some(Bytes::from_static(b"data: {\"c\": 3}\n\ndata: [DONE]\n\n"))
        );
        assert!(partial.is_empty());
    }

    #[test]
    fn hop_by_hop_headers_and_the_ones_connection_names_are_not_forwarded() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, x-private"),
            ("x-private", "1"),
            ("proxy-connection", "keep-alive"),
            ("expect", "100-continue"),
            ("transfer-encoding", "chunked"),
            ("content-length", "5"),
            ("host", "router"),
            ("x-session-id", "s"),
            ("content-type", "application/json"),
            ("authorization", "Bearer engine-key"),
        ] {
            h.append(HeaderName::from_static(k), v.parse().unwrap());
        }
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["authorization", "content-type"]);
    }
}
