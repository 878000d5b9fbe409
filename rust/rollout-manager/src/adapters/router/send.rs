//! Sending one request to one engine: over the router's own pooled connections
//! (`router::pool`) where the engine's URL is a plain `host:port`, else through hyper-util's
//! client; the answer's body is either one of them ([`EngineBody`]).

use super::table::Route;
use super::{engine_uri, pool, RouterState};
use axum::http::uri::PathAndQuery;
use axum::http::{HeaderMap, Method};
use bytes::Bytes;
use http_body_util::Full;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Sends `body` to `route`'s engine and returns its answer once its head came (the body streams
/// as it is polled); the error says why no answer came.
pub(super) async fn send(
    state: &RouterState,
    route: &Route,
    method: &Method,
    path: &PathAndQuery,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<hyper::Response<EngineBody>, String> {
    // Engines with a plain host:port take the router's own pooled connections (origin-form
    // target, Host set there); any other URL, and CONNECT, goes through hyper-util's client.
    match (&route.host_header, &route.pool, method == Method::CONNECT) {
        (Some(host), Some(pool), false) => {
            let outgoing = pool::Outgoing { method, target: path.as_str(), host, headers, body };
            match pool::send(pool, &route.authority, &outgoing).await {
                Ok(r) => Ok(r.map(EngineBody::Direct)),
                Err(e) => Err(e.to_string()),
            }
        }
        _ => {
            let mut req = hyper::Request::new(Full::new(body.clone()));
            *req.method_mut() = method.clone();
            *req.headers_mut() = headers.clone();
            *req.uri_mut() =
                engine_uri(route, path).map_err(|e| format!("cannot address {path:?} on engine {}: {e}", route.url))?;
            match state.client.request(req).await {
                Ok(r) => Ok(r.map(EngineBody::Client)),
                Err(e) => Err(e.to_string()),
            }
        }
    }
}

/// An engine's answer body: from the router's own connections ([`pool::send`]), or from
/// hyper-util's client (engines whose URL is not a plain `host:port`).
pub(super) enum EngineBody {
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
