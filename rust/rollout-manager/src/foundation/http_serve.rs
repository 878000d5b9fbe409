//! Serving HTTP/1.1 with a header-read timeout.
//!
//! `axum::serve` gives hyper no timer, and without one hyper never times out a client that
//! opens a connection and sends its request headers a byte at a time (slowloris): each such
//! connection holds a task and a socket for ever. Here every connection gets hyper's
//! `header_read_timeout` (`--header-read-timeout-secs`, default 30): a request's headers must
//! arrive in that time, else the connection is closed. Bodies and long answers (streams) are not limited by it. On shutdown, connections
//! finish their request in flight and close.

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use axum::serve::Listener;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Serves `service` on `listener` until `stop` is cancelled, then waits for open connections to
/// finish their request in flight.
pub async fn serve<L, S>(listener: L, service: S, stop: CancellationToken, header_read_timeout: Duration)
where
    L: Listener,
    L::Io: Unpin,
    S: tower_service::Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let mut listener = listener;
    let connections = TaskTracker::new();
    loop {
        let (io, _) = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.cancelled() => break,
        };
        let service = service.clone();
        let stop = stop.clone();
        connections.spawn(async move {
            let hyper_service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                let mut service = service.clone();
                service.call(request.map(Body::new))
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(header_read_timeout);
            let conn = builder.serve_connection(TokioIo::new(io), hyper_service).with_upgrades();
            tokio::pin!(conn);
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(e) = result {
                        tracing::trace!(error = %e, "connection ended with an error");
                    }
                }
                _ = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    connections.close();
    connections.wait().await;
}

/// How much of a body over the limit is still read, and thrown away, so that a client still
/// writing it gets the 413 instead of a broken pipe (hyper closes a connection whose body was
/// left unread); a body announced or found bigger is cut off at once.
const DRAIN_LIMIT: usize = 16 * 1024 * 1024;
/// How long that reading may take.
const DRAIN_TIME: Duration = Duration::from_secs(10);

/// Middleware, outside every check: reads the whole request body (at most `limit` bytes)
/// before any check or handler sees the request, so that an answer given without looking at
/// the body (a 401 from the token check, a 404 for an unknown route, a 405) never closes the
/// connection under a client still writing it: Python's http.client writes the headers and the
/// body separately, and on the Unix API socket it got a broken pipe instead of the answer. For
/// routes whose bodies are small and read whole anyway (the control API, the router's fan-out
/// calls); over `limit` it is 413 `body_too_large`, given once the body is read to its end (up to
/// 16 MiB, for up to 10 s), for the same reason.
pub async fn read_body_first(
    axum::extract::State(limit): axum::extract::State<usize>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    use axum::response::IntoResponse;
    let (parts, body) = request.into_parts();
    let (status, code, message) = match read_within(body, limit).await {
        Ok(collected) => return next.run(Request::from_parts(parts, Body::from(collected))).await,
        Err(BodyError::TooBig) if limit >= 1 << 20 => (
            axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the request body is over this route's limit of {} MiB; send a smaller one", limit >> 20),
        ),
        Err(BodyError::TooBig) => (
            axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the request body is over this route's limit of {limit} bytes; send a smaller one"),
        ),
        Err(BodyError::Unreadable(e)) => {
            (axum::http::StatusCode::BAD_REQUEST, "invalid_body", format!("cannot read the request body: {e}"))
        }
    };
    (status, axum::Json(crate::foundation::error::error_body(code, &message))).into_response()
}

/// Why a body was not read whole.
enum BodyError {
    /// Over the limit (found by reading, or announced).
    TooBig,
    /// Not readable (a broken chunked encoding, a client gone mid-body).
    Unreadable(axum::Error),
}

/// The whole body if it is at most `limit` bytes. One over it is read on to its end and thrown
/// away, within [`DRAIN_LIMIT`] and [`DRAIN_TIME`], before it is refused.
async fn read_within(mut body: Body, limit: usize) -> Result<bytes::Bytes, BodyError> {
    use http_body::Body as _;
    use http_body_util::BodyExt;
    // A route whose own limit is above the drain limit still takes every body within it.
    let cap = DRAIN_LIMIT.max(limit);
    if body.size_hint().lower() > cap as u64 {
        return Err(BodyError::TooBig);
    }
    let mut kept = Vec::new();
    let mut seen = 0usize;
    let mut drain_until = None;
    loop {
        let frame = match drain_until {
            None => body.frame().await,
            Some(deadline) => match tokio::time::timeout_at(deadline, body.frame()).await {
                Ok(frame) => frame,
                Err(_) => return Err(BodyError::TooBig),
            },
        };
        let Some(frame) = frame else { break };
        let Ok(data) = frame.map_err(BodyError::Unreadable)?.into_data() else { continue };
        seen = seen.saturating_add(data.len());
        if seen <= limit {
            kept.extend_from_slice(&data);
        } else if seen > cap {
            return Err(BodyError::TooBig);
        } else if drain_until.is_none() {
            kept = Vec::new();
            drain_until = Some(tokio::time::Instant::now() + DRAIN_TIME);
        }
    }
    if seen > limit {
        Err(BodyError::TooBig)
    } else {
        Ok(bytes::Bytes::from(kept))
    }
}
