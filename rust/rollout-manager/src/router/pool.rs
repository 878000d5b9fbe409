//! HTTP/1.1 connections from the router to engines, kept open between requests.
//!
//! One pool per engine address, and in it one stack of idle connections per data-plane thread
//! (the most recently used first): a connection's task runs on the thread that opened it, so a
//! request handled there never wakes another thread to use it (see [`set_thread_slot`]);
//! the ones idle longer than [`IDLE_TIMEOUT`] are closed when a connection is put back or taken.
//! A request takes one (or opens one), sends on it, and the connection goes back to the pool
//! when the response body has been read to its end; a response dropped early (client gone, a
//! 503 retried elsewhere, a cut stream) closes its connection instead, as it cannot be reused.
//!
//! This is what hyper-util's pooled client does, minus what the router does not need on its
//! hot path: a task spawned per request to return the connection, a race between the pool and
//! a lazily built connect future, and a pool key hashed from the URI per request. As there, a
//! request that could not be written because its pooled connection had been closed meanwhile
//! (an engine's keep-alive timeout) is sent again on another connection.

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

thread_local! {
    /// Which stack of idle connections this thread uses (0 unless set).
    static SLOT: Cell<usize> = const { Cell::new(0) };
}

/// Makes the calling thread use the `slot`-th stack of idle connections of every pool: each
/// data-plane thread (a runtime of its own) takes a different one, so that connections opened
/// on one thread are only used there.
pub fn set_thread_slot(slot: usize) {
    SLOT.with(|s| s.set(slot));
}

type Sender = SendRequest<Full<Bytes>>;

/// How long an idle connection is kept.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Most idle connections kept per engine.
const MAX_IDLE: usize = 1024;
/// Longest wait for a TCP connection to an engine.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Why no response came back (before any of it reached the client).
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: std::io::Error },
    #[error("connecting to {0} timed out")]
    ConnectTimeout(String),
    #[error("{0}")]
    Http(#[from] hyper::Error),
}

/// Idle connections to one engine address, per data-plane thread.
#[derive(Default)]
pub struct Pool {
    /// By thread slot; each oldest first, taken from the back.
    idle: Mutex<Vec<VecDeque<(Sender, Instant)>>>,
}

impl Pool {
    /// The most recently used idle connection of thread slot `slot` that is still open, if
    /// any. Connections closed by the engine or idle for too long are dropped on the way.
    fn take(&self, slot: usize) -> Option<Sender> {
        let mut stacks = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let idle = stacks.get_mut(slot)?;
        while let Some((sender, since)) = idle.pop_back() {
            if !sender.is_closed() && since.elapsed() < IDLE_TIMEOUT {
                return Some(sender);
            }
        }
        None
    }

    fn put(&self, slot: usize, sender: Sender) {
        if sender.is_closed() {
            return;
        }
        let now = Instant::now();
        let mut stacks = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if stacks.len() <= slot {
            stacks.resize_with(slot + 1, VecDeque::new);
        }
        let idle = &mut stacks[slot];
        // Connections left unused since a burst are closed, not kept until the engine drops them.
        while idle.front().is_some_and(|(_, since)| now.duration_since(*since) >= IDLE_TIMEOUT) {
            idle.pop_front();
        }
        if idle.len() < MAX_IDLE {
            idle.push_back((sender, now));
        }
    }
}

/// A connection lent to one request: back to its pool once the response was read to its end
/// ([`Lease::release`]), else closed when dropped.
pub struct Lease {
    sender: Option<Sender>,
    pool: Arc<Pool>,
    /// The thread slot it was taken for (where its connection's task runs).
    slot: usize,
}

impl Lease {
    /// The response body ended: the connection can carry another request.
    pub fn release(&mut self) {
        if let Some(sender) = self.sender.take() {
            self.pool.put(self.slot, sender);
        }
    }
}

/// The pools of every engine address the router sends to.
#[derive(Default)]
pub struct Pools {
    by_addr: RwLock<HashMap<String, Arc<Pool>>>,
}

impl Pools {
    /// The pool for `addr` (`host:port`); pools of addresses no longer routable are forgotten
    /// when a new one is made (their connections close once their last requests end).
    pub fn get(&self, addr: &str, fleet: &crate::fleet::Fleet) -> Arc<Pool> {
        if let Some(pool) = self.by_addr.read().unwrap_or_else(|e| e.into_inner()).get(addr) {
            return pool.clone();
        }
        let live = fleet.routes();
        let mut map = self.by_addr.write().unwrap_or_else(|e| e.into_inner());
        map.retain(|a, _| live.backends.iter().any(|b| b.authority == *a));
        map.entry(addr.to_string()).or_default().clone()
    }
}

async fn connect(addr: &str) -> Result<Sender, SendError> {
    let stream = match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(source)) => return Err(SendError::Connect { addr: addr.to_string(), source }),
        Err(_) => return Err(SendError::ConnectTimeout(addr.to_string())),
    };
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    #[expect(
        clippy::disallowed_methods,
        reason = "owned by `sender`: hyper's connection driver ends when the sender is dropped or the peer closes"
    )]
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "engine connection ended");
        }
    });
    Ok(sender)
}

/// Sends `req` (origin-form URI, `Host` set) to `addr` on a pooled connection, or a new one.
pub async fn send(
    pool: &Arc<Pool>,
    addr: &str,
    mut req: hyper::Request<Full<Bytes>>,
) -> Result<(hyper::Response<hyper::body::Incoming>, Lease), SendError> {
    let slot = SLOT.with(Cell::get);
    loop {
        let (mut sender, reused) = match pool.take(slot) {
            Some(s) => (s, true),
            None => (connect(addr).await?, false),
        };
        // A pooled connection closed meanwhile is left for another; a fresh one that closed at
        // once gets its error from sending.
        if sender.ready().await.is_err() && reused {
            continue;
        }
        match sender.try_send_request(req).await {
            Ok(resp) => return Ok((resp, Lease { sender: Some(sender), pool: pool.clone(), slot })),
            Err(mut e) => match e.take_message() {
                // Not written: the pooled connection had been closed. Another one.
                Some(r) if reused => req = r,
                _ => return Err(e.into_error().into()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #![expect(clippy::disallowed_methods, reason = "test servers and tasks live as long as their test")]
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A minimal HTTP/1.1 server answering every request with `ok`, optionally with
    /// `connection: close`. Returns its address and the count of connections it accepted.
    async fn server(close: bool) -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    loop {
                        let Ok(n) = stream.read(&mut chunk).await else { return };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            buf.drain(..end + 4);
                            let head = if close { "connection: close\r\n" } else { "" };
                            let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n{head}\r\nok");
                            if stream.write_all(answer.as_bytes()).await.is_err() || close {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    fn get(addr: &str) -> hyper::Request<Full<Bytes>> {
        hyper::Request::builder().uri("/x").header("host", addr).body(Full::new(Bytes::new())).unwrap()
    }

    async fn round_trip(pool: &Arc<Pool>, addr: &str) {
        let (resp, mut lease) = send(pool, addr, get(addr)).await.unwrap();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok");
        lease.release();
    }

    #[tokio::test]
    async fn a_released_connection_carries_the_next_request() {
        let (addr, accepted) = server(false).await;
        let pool = Arc::new(Pool::default());
        for _ in 0..3 {
            round_trip(&pool, &addr).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn each_thread_slot_reuses_only_its_own_connections() {
        let (addr, accepted) = server(false).await;
        let pool = Arc::new(Pool::default());
        round_trip(&pool, &addr).await;
        // Another data-plane thread does not take the first one's connection: it opens its own.
        set_thread_slot(1);
        round_trip(&pool, &addr).await;
        round_trip(&pool, &addr).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        // Back on the first slot, its idle connection carries the request.
        set_thread_slot(0);
        round_trip(&pool, &addr).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_connection_the_engine_closes_is_not_reused() {
        let (addr, accepted) = server(true).await;
        let pool = Arc::new(Pool::default());
        for _ in 0..3 {
            round_trip(&pool, &addr).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn an_unreleased_connection_is_not_reused() {
        let (addr, accepted) = server(false).await;
        let pool = Arc::new(Pool::default());
        // The response is dropped unread (as when a client goes away): its connection closes.
        let (resp, lease) = send(&pool, &addr, get(&addr)).await.unwrap();
        drop((resp, lease));
        round_trip(&pool, &addr).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_refused_connection_is_an_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        let pool = Arc::new(Pool::default());
        let err = send(&pool, &addr, get(&addr)).await.err().unwrap();
        assert!(err.to_string().contains("cannot connect"), "{err}");
    }
}
