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
//! queue (`crate::foundation::slots`: by default session turns first, then the largest expected output;
//! `--queue-order fifo`: arrival order), and each goes to the first engine with a free slot
//! when one frees or an engine joins. Work then never sits in one engine's queue while another, e.g. one a
//! scale-out just added, is idle. A request waits at most `--request-timeout-secs` for a slot,
//! then gets 503 `router_queue_timeout`.

mod affinity;
mod answer;
mod headers;
pub mod metrics;
mod models;
mod moving;
mod peek;
mod pool;
mod proxy;
mod rids;
mod send;
mod table;
pub mod tail;
pub use pool::set_thread_slot;

use crate::foundation::error::error_body;
use crate::foundation::http_serve::read_body_first;
use crate::registry::fleet::Fleet;
use affinity::Affinity;
use axum::extract::{Request, State};
use axum::http::uri::{PathAndQuery, Scheme};
use axum::http::{HeaderName, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use bytes::Bytes;
use headers::to_engine;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use metrics::{ErrorKind, RouterMetrics};
use rollout_core::routing::InflightCap;
use rollout_core::routing::{Gate, VersionPin};
use rollout_core::ServeConfig;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
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
/// The answering engine's weight version, where SMG stamps it.
const VERSION_HEADER: HeaderName = HeaderName::from_static("x-smg-weight-version");

type EngineClient = Client<HttpConnector, Full<Bytes>>;

pub struct RouterState {
    fleet: Arc<Fleet>,
    config: ServeConfig,
    metrics: Arc<RouterMetrics>,
    /// The manager's API token: a request's `Authorization` carrying it is for us, and is not
    /// forwarded to engines (an engine's own `--api-key` credential is).
    token: Option<Arc<str>>,
    /// `--rl-version-policy`, parsed: what a request that names no version may run on.
    version_policy: Option<VersionPin>,
    client: EngineClient,
    /// Connections of the proxy's hot path, per engine address.
    pools: pool::Pools,
    rotor: AtomicUsize,
    affinity: Affinity,
    gate: Gate,
    routes: RouteCache,
    /// Movable requests running now, for the tail planner (`--move-tail`).
    tail: Arc<tail::Board>,
    /// The router's rids, and the requests a client may abort by rid (`router::rids`).
    rids: Arc<rids::Rids>,
    /// The fleet's model name (`--model-name`, else the startup `--model-path`): what OpenAI
    /// requests name, and what `/v1/models` shows.
    served_name: String,
    /// The port `--trainer-port` listens on, once bound: a trainer registering that endpoint
    /// (the fleet itself) as a worker is told it is already served.
    trainer_port: std::sync::OnceLock<u16>,
}

/// The data plane as served on the router port: the router's own routes go through an axum
/// `Router`; every other path (what is proxied, nearly every request) goes straight to
/// `proxy::proxy`, without axum's route matching and boxing on the hot path.
#[derive(Clone)]
pub struct DataPlane {
    own: Router,
    state: Arc<RouterState>,
}

impl DataPlane {
    /// The data plane with `routes` (paths under `/v1/rl/`, the RL control plane a higher
    /// layer serves) among its own.
    #[must_use]
    pub fn with_control_plane(self, routes: Router) -> Self {
        Self { own: self.own.merge(routes), state: self.state }
    }

    /// Tells the router where `--trainer-port` listens: a trainer registering that URL with
    /// `POST /workers` (the fleet itself) is told it is already served.
    pub fn trainer_port(&self, port: u16) {
        let _ = self.state.trainer_port.set(port);
    }

    /// The tail planner (`router::tail`), to run until `stop`; it returns at once with
    /// `--move-tail false`.
    pub fn tail_planner(&self, stop: tokio_util::sync::CancellationToken) -> impl Future<Output = ()> + use<> {
        tail::run(self.state.clone(), stop)
    }
}

/// Paths the router answers itself (the routes of [`DataPlane::own`]).
const OWN_ROUTES: [&str; 8] = [
    "/liveness",
    "/health",
    "/health_generate",
    "/readiness",
    "/abort_request",
    "/flush_cache",
    "/workers",
    "/metrics",
];

fn is_own(path: &str) -> bool {
    OWN_ROUTES.contains(&path) || path.starts_with("/workers/") || path.starts_with("/v1/rl/")
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
    Ok(proxy::proxy(State(state), request).await)
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
    // Checked by the config's validation; an unparsable one (not through it) is `any`.
    let version_policy =
        rollout_core::routing::VersionPolicy::parse(&config.rl_version_policy).ok().and_then(|p| p.pin());
    let served_name = crate::adapters::launch::served_model_name(&config);
    let state = Arc::new(RouterState {
        fleet,
        config,
        metrics,
        token: token.clone(),
        version_policy,
        client,
        pools: pool::Pools::default(),
        rotor: AtomicUsize::new(0),
        affinity: Affinity::new(100_000),
        gate: Gate::default(),
        routes: RouteCache::default(),
        tail: Arc::default(),
        rids: Arc::default(),
        served_name,
        trainer_port: std::sync::OnceLock::new(),
    });
    let own = Router::new()
        .route("/liveness", get(|| async { Json(serde_json::json!({"status": "ok"})) }))
        .route("/health", get(readiness))
        // Not forwarded: SGLang's health check waits on its scheduler, so an engine paused
        // meanwhile (a trainer's update) would time it out and mark itself UnHealthy. The
        // manager's own probes (`--health-check-endpoint`) keep only engines that pass them in
        // routing, so a routable engine is the fleet's answer.
        .route("/health_generate", get(readiness))
        .route("/readiness", get(readiness))
        .route(
            "/abort_request",
            axum::routing::post(fan_out)
                .layer(axum::middleware::from_fn_with_state(token.clone(), crate::foundation::auth::require_token))
                .layer(axum::middleware::from_fn_with_state(FAN_OUT_BODY_BYTES, read_body_first)),
        )
        .route(
            "/flush_cache",
            axum::routing::post(fan_out)
                .get(fan_out)
                .layer(axum::middleware::from_fn_with_state(token, crate::foundation::auth::require_token))
                .layer(axum::middleware::from_fn_with_state(FAN_OUT_BODY_BYTES, read_body_first)),
        )
        .route("/metrics", get(metrics_text))
        .route("/workers", get(workers).post(register_worker).fallback(workers_managed))
        .route("/workers/{*id}", axum::routing::any(workers_managed))
        .fallback(proxy::proxy)
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

/// `POST /workers`: the manager owns the list, so a registration is refused, except of the
/// trainer port itself. slime registers each engine it did not launch with its router
/// (`sglang_engine.py`, `_register_to_router`, and fails on an error), and with the trainer
/// port as its one engine that is the fleet, whose engines the router already serves.
async fn register_worker(State(state): State<Arc<RouterState>>, body: axum::body::Bytes) -> Response {
    let url = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("url").and_then(|u| u.as_str()).map(str::to_string));
    let ours = match (url.as_deref(), state.trainer_port.get()) {
        (Some(url), Some(&port)) => is_local_endpoint(url, port).await,
        _ => false,
    };
    if !ours {
        return workers_managed().await;
    }
    let n = state.fleet.routes().backends.len();
    let body = serde_json::json!({
        "status": "ok", "url": url,
        "message": format!("{} is this manager's trainer port, the fleet itself: its {n} routable engines are already served here", url.unwrap_or_default()),
    });
    Json(body).into_response()
}

/// Whether `url` is `http://host:port` with `port` the one given and a host that names this
/// machine (an address a socket here can bind). Names are looked up only for the trainer
/// port's number; the answer changes nothing either way.
async fn is_local_endpoint(url: &str, port: u16) -> bool {
    let Ok(parsed) = reqwest::Url::parse(url) else { return false };
    if parsed.scheme() != "http" || parsed.port() != Some(port) {
        return false;
    }
    let Some(host) = parsed.host_str().map(|h| h.trim_start_matches('[').trim_end_matches(']').to_string()) else {
        return false;
    };
    let Ok(Ok(addrs)) = tokio::time::timeout(Duration::from_secs(2), tokio::net::lookup_host((host, port))).await
    else {
        return false;
    };
    // Any of them: `localhost` may also name `::1` on a host without IPv6.
    addrs.into_iter().any(|a| std::net::UdpSocket::bind((a.ip(), 0)).is_ok())
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

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (status, Json(error_body(code, message))).into_response()
}

/// The routable engines `pin` allows right now, without waiting for one (see [`candidates`]).
fn candidates_now(state: &RouterState, pin: Option<&VersionPin>) -> Vec<Route> {
    let current = state.routes.current(&state.fleet, &state.pools);
    let history = &current.table.version_order;
    current.all.iter().filter(|b| pin.is_none_or(|p| p.allows(b.weight_version.as_deref(), history))).cloned().collect()
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
        Some(VersionPin::Latest) => "the newest (latest-only)".into(),
        Some(VersionPin::WithinLast(k)) => format!("among the newest {} (max-staleness:{k})", u64::from(*k) + 1),
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
    // An abort names requests by the rids their clients know; the engines run them under the
    // router's (router::rids), and the router ends those it follows part by part itself.
    let bodies = match path.path() {
        "/abort_request" => match state.rids.abort(&rollout_core::rids::abort_ask(&body)) {
            rids::Forward::AsIs => vec![body],
            rids::Forward::Rids(rids) => {
                rids.iter().map(|rid| Bytes::from(serde_json::json!({ "rid": rid }).to_string())).collect()
            }
            rids::Forward::Nothing => Vec::new(),
        },
        _ => vec![body],
    };
    let headers = to_engine(parts.headers, state.token.as_deref());
    let routes = state.routes.current(&state.fleet, &state.pools).all.clone();
    let client = &state.client;
    let sends = routes.iter().flat_map(|b| bodies.iter().map(move |body| (b, body)));
    let results = futures::future::join_all(sends.map(|(b, body)| {
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
    // An engine's worst answer stands for it.
    let mut worst: Vec<(rollout_core::ids::EngineId, u16)> = Vec::new();
    for (id, status) in results {
        match worst.iter_mut().find(|(e, _)| *e == id) {
            Some((_, s)) if (200..300).contains(s) => *s = status,
            Some(_) => {}
            None => worst.push((id, status)),
        }
    }
    let results = worst;
    let ok = results.iter().all(|(_, s)| (200..300).contains(s));
    let engines: serde_json::Map<String, serde_json::Value> =
        results.into_iter().map(|(id, s)| (id.to_string(), serde_json::json!(s))).collect();
    let status = if ok { StatusCode::OK } else { StatusCode::BAD_GATEWAY };
    (status, Json(serde_json::json!({"success": ok, "engines": engines}))).into_response()
}

/// The manager's own metrics, as on the control port (not an engine's: scrape engines through
/// the control API's service discovery, `GET /rollout/prometheus/targets`).
async fn metrics_text(State(state): State<Arc<RouterState>>) -> axum::response::Response {
    use axum::response::IntoResponse;
    let text = metrics::render(&state.fleet, &state.metrics);
    ([(axum::http::header::CONTENT_TYPE, crate::foundation::telemetry::CONTENT_TYPE)], text).into_response()
}

/// An engine's in-flight cap: the fixed one, or its own automatic one (the fallback until the
/// load poller set it).
fn engine_cap(cap: InflightCap, load: &crate::registry::fleet::EngineLoad) -> usize {
    match cap {
        InflightCap::Fixed(n) => n,
        InflightCap::Auto => load.auto_cap().unwrap_or(rollout_core::lengths::AUTO_CAP_UNREPORTED),
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

#[cfg(test)]
mod trainer_port_tests {
    use super::is_local_endpoint;

    #[tokio::test]
    async fn only_this_machines_address_on_the_trainer_port_is_ours() {
        assert!(is_local_endpoint("http://127.0.0.1:30001", 30001).await);
        assert!(is_local_endpoint("http://localhost:30001/", 30001).await);
        assert!(is_local_endpoint("http://[::1]:30001", 30001).await || std::net::UdpSocket::bind("[::1]:0").is_err());
        // Another port, scheme or machine (TEST-NET-1 is never assigned here), or no URL at all.
        assert!(!is_local_endpoint("http://127.0.0.1:30002", 30001).await);
        assert!(!is_local_endpoint("https://127.0.0.1:30001", 30001).await);
        assert!(!is_local_endpoint("http://192.0.2.7:30001", 30001).await);
        assert!(!is_local_endpoint("127.0.0.1:30001", 30001).await);
        assert!(!is_local_endpoint("http://127.0.0.1", 30001).await);
    }
}
