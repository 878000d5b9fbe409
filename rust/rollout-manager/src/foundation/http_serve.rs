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

/// Middleware, outside every check: reads the whole request body (at most `limit` bytes)
/// before any check or handler sees the request, so that an answer given without looking at
/// the body (a 401 from the token check, a 404 for an unknown route, a 405) never closes the
/// connection under a client still writing it: Python's http.client writes the headers and the
/// body separately, and on the Unix API socket it got a broken pipe instead of the answer. For
/// routes whose bodies are small and read whole anyway (the control API, the router's fan-out
/// calls); over `limit` it is 413 `body_too_large`.
pub async fn read_body_first(
    axum::extract::State(limit): axum::extract::State<usize>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    use axum::response::IntoResponse;
    use http_body_util::BodyExt;
    let (parts, body) = request.into_parts();
    let (status, code, message) = match http_body_util::Limited::new(body, limit).collect().await {
        Ok(collected) => return next.run(Request::from_parts(parts, Body::from(collected.to_bytes()))).await,
        Err(e) if e.is::<http_body_util::LengthLimitError>() => (
            axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("{e}; the limit is {} MiB", limit >> 20),
        ),
        Err(e) => (axum::http::StatusCode::BAD_REQUEST, "invalid_body", format!("cannot read the request body: {e}")),
    };
    (status, axum::Json(crate::foundation::error::error_body(code, &message))).into_response()
}
