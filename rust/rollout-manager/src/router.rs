//! The data plane: an SGLang-compatible proxy in front of the fleet's ACTIVE engines.
//!
//! Every path other than the router's own health routes is forwarded as-is (method, path,
//! query, body, end-to-end headers) to one routable engine, chosen round robin. Responses,
//! including server-sent-event streams, are streamed back as they arrive. A request that cannot
//! reach its engine (connection refused or reset before any response) is retried on the next
//! engine, at most once per engine; nothing is retried once a response has started.
//!
//! Each forwarded request is counted in its engine's in-flight gauge until the response body
//! ends, which is what scale-in's graceful drain waits on.

use crate::error::error_body;
use crate::fleet::{Backend, Fleet};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use futures::StreamExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Largest request body the router accepts (prompts with long contexts and images fit).
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// Most engines one request is tried on.
const MAX_ATTEMPTS: usize = 3;

pub struct RouterState {
    fleet: Arc<FleetHandle>,
    client: reqwest::Client,
    next: AtomicUsize,
}

/// The part of the manager the router needs: the routing table.
pub struct FleetHandle(pub Arc<crate::manager::Manager>);

impl FleetHandle {
    fn fleet(&self) -> &Fleet {
        &self.0.fleet
    }
}

pub fn router(manager: Arc<crate::manager::Manager>) -> Result<Router, reqwest::Error> {
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .pool_max_idle_per_host(256)
        .tcp_nodelay(true)
        .build()?;
    let state = Arc::new(RouterState { fleet: Arc::new(FleetHandle(manager)), client, next: AtomicUsize::new(0) });
    Ok(Router::new()
        .route("/liveness", get(|| async { Json(serde_json::json!({"status": "ok"})) }))
        .route("/health", get(readiness))
        .route("/readiness", get(readiness))
        .fallback(proxy)
        .with_state(state))
}

async fn readiness(State(state): State<Arc<RouterState>>) -> Response {
    let n = state.fleet.fleet().routes().len();
    let status = if n > 0 { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(serde_json::json!({"status": if n > 0 {"ok"} else {"no_engines"}, "routable_engines": n})))
        .into_response()
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
    )
}

fn end_to_end(headers: &HeaderMap) -> HeaderMap {
    headers.iter().filter(|(k, _)| !is_hop_by_hop(k)).map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn unavailable(code: &str, message: &str) -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, Json(error_body(code, message))).into_response()
}

async fn proxy(State(state): State<Arc<RouterState>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            return (
                StatusCode::PAYLOAD_TOO_LARGE,
                Json(error_body(
                    "body_too_large",
                    &format!("request body rejected: {e}; the limit is {MAX_BODY_BYTES} bytes"),
                )),
            )
                .into_response();
        }
    };
    let path = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/").to_string();
    let headers = end_to_end(&parts.headers);
    let routes = state.fleet.fleet().routes();
    if routes.is_empty() {
        return unavailable(
            "no_engine_available",
            "no ACTIVE engine can take this request; see GET /rollout/engines on the control port",
        );
    }
    let start = state.next.fetch_add(1, Ordering::Relaxed);
    let mut last_error = String::new();
    for attempt in 0..routes.len().min(MAX_ATTEMPTS) {
        let backend: &Backend = &routes[(start + attempt) % routes.len()];
        let guard = backend.load.enter();
        let sent = state
            .client
            .request(parts.method.clone(), format!("{}{}", backend.url, path))
            .headers(headers.clone())
            .body(body.clone())
            .send()
            .await;
        let resp = match sent {
            Ok(resp)
                if resp.status() == StatusCode::SERVICE_UNAVAILABLE && attempt + 1 < routes.len().min(MAX_ATTEMPTS) =>
            {
                tracing::warn!(engine_id = %backend.engine_id, "engine answered 503; retrying on another");
                last_error = format!("{}: 503", backend.engine_id);
                continue;
            }
            Ok(resp) => resp,
            Err(e) => {
                // No response came, so nothing reached the client: safe to try another engine.
                tracing::warn!(engine_id = %backend.engine_id, error = %e, "engine gave no response; retrying on another");
                last_error = format!("{}: {e}", backend.engine_id);
                continue;
            }
        };
        let mut builder = Response::builder().status(resp.status());
        if let Some(h) = builder.headers_mut() {
            *h = end_to_end(resp.headers());
            if let Ok(v) = backend.engine_id.parse() {
                h.insert("x-rollout-engine-id", v);
            }
        }
        // The guard lives as long as the body stream, so drains see streaming requests.
        let stream = futures::stream::unfold((resp.bytes_stream(), guard), |(mut s, g)| async move {
            s.next().await.map(|item| (item, (s, g)))
        });
        return builder.body(Body::from_stream(stream)).unwrap_or_else(|e| {
            (StatusCode::BAD_GATEWAY, Json(error_body("bad_engine_response", &e.to_string()))).into_response()
        });
    }
    (
        StatusCode::BAD_GATEWAY,
        Json(error_body(
            "no_engine_answered",
            &format!("no engine answered this request (last: {last_error}); see GET /rollout/engines"),
        )),
    )
        .into_response()
}
