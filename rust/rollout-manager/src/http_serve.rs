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
