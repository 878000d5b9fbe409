//! HTTP/1.1 connections from the router to engines, kept open between requests, and the
//! exchange of one request and its answer on them.
//!
//! One pool per engine address, and in it one stack of idle connections per data-plane thread
//! (the most recently used first): a connection is only used on the thread that opened it, so
//! a request handled there never wakes another thread (see [`set_thread_slot`]); the ones idle
//! longer than [`IDLE_TIMEOUT`] are closed when a connection is put back or taken. A request
//! takes one (or opens one), writes its head and body, reads the answer's head, and hands the
//! connection to the answer's body ([`EngineBody`]), which reads the rest from the socket as the
//! client's connection asks for it and puts the connection back once the body ended; a body
//! dropped early (client gone, a 503 retried elsewhere, a cut stream) closes its connection.
//!
//! Why not hyper's client connection: it runs each connection as a task of its own and passes
//! the request, the answer's head and every body frame between that task and the request's
//! through channels. The router's requests are small and many (RL rollouts), and those hand-offs
//! were ~7% of its CPU per proxied request (`benches/router_overhead.py`, benches/README.md).
//! Here the request's own task does the I/O; what the bytes mean (the request's encoding, the
//! answer's head parsed with `httparse`, what hyper uses, and the body's framing) is decided in
//! [`framing`], which does none. A connection is reused only after an HTTP/1.1 answer without
//! `connection: close` whose body was read exactly to its end.
//!
//! A pooled connection the engine closed meanwhile (its keep-alive timeout) is noticed when taken
//! (the socket is readable) or, in a race, when it ends before any byte of an answer; the request
//! is then sent again, once, on a new connection (a request whose answer had begun is never sent
//! again here; the router's own retries decide, see `router/mod.rs`).

use crate::foundation::locks::{Locked, RwLocked};
use axum::http::{Method, Response};
use bytes::{Buf, Bytes, BytesMut};
pub use framing::Outgoing;
use framing::{to_head, Framing, Head, Step, MAX_HEADERS};
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

mod framing;

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

/// How long an idle connection is kept: below the 5 s keep-alive of uvicorn, SGLang's HTTP
/// server, so that the engine rarely closes a connection the router still counts as idle.
const IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// Most idle connections kept per engine and data-plane thread (each holds a socket and a read
/// buffer of up to [`READ_SIZE`]).
const MAX_IDLE: usize = 1024;
/// Longest wait for a TCP connection to an engine.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest answer head (status line and headers) taken from an engine.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Room made in a connection's buffer before each read.
const READ_SIZE: usize = 16 * 1024;

/// Why no answer came back (before any of it reached the client).
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: io::Error },
    #[error("connecting to {0} timed out")]
    ConnectTimeout(String),
    #[error("the engine closed the connection before answering")]
    Closed,
    #[error("engine connection: {0}")]
    Io(#[from] io::Error),
    #[error("the engine's connection failed within its answer's head: {0}")]
    HeadCut(io::Error),
    #[error("the engine's answer is not valid HTTP/1.1: {0}")]
    Protocol(String),
}

impl SendError {
    /// Nothing of an answer arrived and the connection failed: on a pooled connection, the
    /// engine had closed it (the request is sent again on another).
    fn connection_gone(&self) -> bool {
        match self {
            SendError::Closed => true,
            SendError::Io(e) => matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionAborted
            ),
            _ => false,
        }
    }
}

/// An open connection to an engine and what was read from it but not used yet.
struct Conn {
    stream: TcpStream,
    buf: BytesMut,
}

impl Conn {
    /// Whether an idle connection can carry a request: nothing came on it since its last answer
    /// (an engine closing it makes it readable, with an end of file).
    fn still_open(&self) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match self.stream.poll_read_ready(&mut cx) {
            Poll::Pending => true,
            Poll::Ready(Err(_)) => false,
            // Readiness can be left over from the last answer's read; look at the socket.
            Poll::Ready(Ok(())) => {
                matches!(self.stream.try_read(&mut [0u8; 1]), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
            }
        }
    }

    /// Reads what the socket has into the buffer; `Ok(0)` at the end of the stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        self.buf.reserve(READ_SIZE);
        tokio_util::io::poll_read_buf(Pin::new(&mut self.stream), cx, &mut self.buf)
    }

    async fn fill(&mut self) -> io::Result<usize> {
        self.buf.reserve(READ_SIZE);
        self.stream.read_buf(&mut self.buf).await
    }
}

/// Idle connections to one engine address, per data-plane thread.
#[derive(Default)]
pub struct Pool {
    /// By thread slot; each oldest first, taken from the back.
    idle: Mutex<Vec<VecDeque<(Conn, Instant)>>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let idle: usize = self.idle.locked().iter().map(VecDeque::len).sum();
        f.debug_struct("Pool").field("idle", &idle).finish()
    }
}

impl Pool {
    /// The most recently used idle connection of thread slot `slot` that is still open, if
    /// any. Connections closed by the engine or idle for too long are dropped on the way.
    fn take(&self, slot: usize) -> Option<Conn> {
        let mut stacks = self.idle.locked();
        let idle = stacks.get_mut(slot)?;
        while let Some((conn, since)) = idle.pop_back() {
            if since.elapsed() < IDLE_TIMEOUT && conn.still_open() {
                return Some(conn);
            }
        }
        None
    }

    fn put(&self, slot: usize, conn: Conn) {
        let now = Instant::now();
        let mut stacks = self.idle.locked();
        if stacks.len() <= slot {
            stacks.resize_with(slot + 1, VecDeque::new);
        }
        let idle = &mut stacks[slot];
        // Connections left unused since a burst are closed, not kept until the engine drops them.
        while idle.front().is_some_and(|(_, since)| now.duration_since(*since) >= IDLE_TIMEOUT) {
            idle.pop_front();
        }
        if idle.len() < MAX_IDLE {
            idle.push_back((conn, now));
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
    pub fn get(&self, addr: &str, fleet: &crate::registry::fleet::Fleet) -> Arc<Pool> {
        if let Some(pool) = self.by_addr.read_locked().get(addr) {
            return pool.clone();
        }
        let live = fleet.routes();
        let mut map = self.by_addr.write_locked();
        map.retain(|a, _| live.backends.iter().any(|b| b.authority == *a));
        map.entry(addr.to_string()).or_default().clone()
    }
}

async fn connect(addr: &str) -> Result<Conn, SendError> {
    let stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(source)) => return Err(SendError::Connect { addr: addr.to_string(), source }),
        Err(_) => return Err(SendError::ConnectTimeout(addr.to_string())),
    };
    let _ = stream.set_nodelay(true);
    Ok(Conn { stream, buf: BytesMut::with_capacity(READ_SIZE) })
}

/// Sends `request` to `addr` on a pooled connection, or a new one, and returns the answer with
/// its head read; its body streams from the connection as it is polled.
pub async fn send(pool: &Arc<Pool>, addr: &str, request: &Outgoing<'_>) -> Result<Response<EngineBody>, SendError> {
    let slot = SLOT.with(Cell::get);
    let (head, body) = request.encode();
    let pooled = pool.take(slot);
    let reused = pooled.is_some();
    let mut conn = match pooled {
        Some(c) => c,
        None => connect(addr).await?,
    };
    match exchange(&mut conn, &head, body, request).await {
        Ok(answer) => Ok(answer.into_response(conn, pool.clone(), slot)),
        // The engine had closed this pooled connection before the request reached it: once
        // more, on a new connection (not another pooled one, which may be as stale).
        Err(e) if reused && e.connection_gone() => {
            let mut conn = connect(addr).await?;
            let answer = exchange(&mut conn, &head, body, request).await?;
            Ok(answer.into_response(conn, pool.clone(), slot))
        }
        Err(e) => Err(e),
    }
}

async fn exchange(conn: &mut Conn, head: &[u8], coalesced: bool, request: &Outgoing<'_>) -> Result<Head, SendError> {
    let head_request = request.method == Method::HEAD;
    let written = match conn.stream.write_all(head).await {
        Ok(()) if !coalesced => conn.stream.write_all(request.body).await,
        other => other,
    };
    if let Err(e) = written {
        // The engine may have answered before reading the whole request (a 413) and closed:
        // its answer, if it arrived, is the one to give; the connection is not reused.
        return match read_head(conn, head_request).await {
            Ok(mut answer) => {
                answer.reusable = false;
                Ok(answer)
            }
            Err(_) => Err(e.into()),
        };
    }
    read_head(conn, head_request).await
}

/// Reads and parses the answer's head (skipping interim 1xx answers).
async fn read_head(conn: &mut Conn, head_request: bool) -> Result<Head, SendError> {
    let mut any = false;
    loop {
        if !conn.buf.is_empty() {
            any = true;
            let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut parsed = httparse::Response::new(&mut slots);
            match parsed.parse(&conn.buf) {
                Ok(httparse::Status::Complete(len)) => {
                    let head = to_head(&parsed, head_request)?;
                    conn.buf.advance(len);
                    match head {
                        Some(head) => return Ok(head),
                        None => continue, // an interim answer (100 Continue, 103 Early Hints)
                    }
                }
                Ok(httparse::Status::Partial) if conn.buf.len() > MAX_HEAD_BYTES => {
                    return Err(SendError::Protocol(format!("answer head over {MAX_HEAD_BYTES} bytes")));
                }
                Ok(httparse::Status::Partial) => {}
                Err(e) => return Err(SendError::Protocol(e.to_string())),
            }
        }
        let n = match conn.fill().await {
            Ok(n) => n,
            // Part of an answer came: the engine got the request; not a stale connection.
            Err(e) if any => return Err(SendError::HeadCut(e)),
            Err(e) => return Err(e.into()),
        };
        if n == 0 {
            return Err(if any {
                SendError::Protocol("the engine closed the connection within the answer's head".into())
            } else {
                SendError::Closed
            });
        }
    }
}

impl Head {
    fn into_response(self, conn: Conn, pool: Arc<Pool>, slot: usize) -> Response<EngineBody> {
        let mut body = EngineBody { conn: Some(conn), pool, slot, framing: self.framing, reusable: self.reusable };
        if body.framing == Framing::Length(0) {
            body.finish();
        }
        let mut response = Response::new(body);
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers;
        response
    }
}

/// An engine's answer body, read from its connection as it is polled. The connection goes back
/// to its pool when the body ended exactly (and the engine keeps it open); dropped before, it
/// closes.
pub struct EngineBody {
    conn: Option<Conn>,
    pool: Arc<Pool>,
    slot: usize,
    framing: Framing,
    reusable: bool,
}

impl EngineBody {
    /// The body ended: its connection goes back to the pool if it can carry another request.
    fn finish(&mut self) {
        self.framing = Framing::Done;
        if let Some(conn) = self.conn.take() {
            if self.reusable && conn.buf.is_empty() {
                self.pool.put(self.slot, conn);
            }
        }
    }

    fn fail(&mut self, message: String) -> Poll<Option<Result<http_body::Frame<Bytes>, io::Error>>> {
        self.framing = Framing::Done;
        self.conn = None;
        Poll::Ready(Some(Err(io::Error::new(io::ErrorKind::InvalidData, message))))
    }
}

impl http_body::Body for EngineBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        loop {
            let Some(conn) = this.conn.as_mut() else { return Poll::Ready(None) };
            // What the buffer holds now decides; only when it cannot, more is read.
            match this.framing.step(&mut conn.buf) {
                Step::Data(data) => {
                    if this.framing == Framing::Length(0) {
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(http_body::Frame::data(data))));
                }
                Step::Again => continue,
                Step::End => {
                    this.finish();
                    return Poll::Ready(None);
                }
                Step::Invalid(why) => return this.fail(why.into()),
                Step::More => {}
            }
            match conn.poll_fill(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => {
                    this.framing = Framing::Done;
                    this.conn = None;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Ok(0)) => {
                    if this.framing == Framing::UntilClose {
                        this.framing = Framing::Done;
                        this.conn = None;
                        return Poll::Ready(None);
                    }
                    return this.fail("the engine closed the connection before the end of its answer".into());
                }
                Poll::Ready(Ok(_)) => {}
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.framing, Framing::Done | Framing::Length(0))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self.framing {
            Framing::Length(n) => http_body::SizeHint::with_exact(n),
            Framing::Done => http_body::SizeHint::with_exact(0),
            _ => http_body::SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![expect(clippy::disallowed_methods, reason = "test servers and tasks live as long as their test")]
    use super::*;
    use axum::http::{HeaderMap, HeaderValue, StatusCode};
    use http_body_util::BodyExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// What a test server does with one request: the answer's pieces (each written and flushed
    /// on its own, so the client reads them apart), then whether it closes the connection.
    struct Reply {
        pieces: Vec<Vec<u8>>,
        close: bool,
    }

    fn reply(text: &str) -> Reply {
        Reply { pieces: vec![text.as_bytes().to_vec()], close: false }
    }

    /// An HTTP/1.1 server that answers each request with `answer(request number on its
    /// connection, raw request)`. Returns its address and the count of connections accepted.
    async fn server<F>(answer: F) -> (String, Arc<AtomicUsize>)
    where
        F: Fn(usize, &[u8]) -> Reply + Send + Sync + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        let answer = Arc::new(answer);
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let answer = answer.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    let mut served = 0;
                    loop {
                        // One whole request: its head, then content-length bytes of body.
                        let request = loop {
                            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                                let len = head
                                    .lines()
                                    .find_map(|l| l.strip_prefix("content-length: "))
                                    .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                                if buf.len() >= end + 4 + len {
                                    break buf.drain(..end + 4 + len).collect::<Vec<u8>>();
                                }
                            }
                            let Ok(n) = stream.read(&mut chunk).await else { return };
                            if n == 0 {
                                return;
                            }
                            buf.extend_from_slice(&chunk[..n]);
                        };
                        let Reply { pieces, close } = answer(served, &request);
                        served += 1;
                        for piece in pieces {
                            if stream.write_all(&piece).await.is_err() {
                                return;
                            }
                            let _ = stream.flush().await;
                            tokio::time::sleep(Duration::from_millis(2)).await;
                        }
                        if close {
                            return;
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    fn ok_server() -> impl Fn(usize, &[u8]) -> Reply {
        |_, _| reply("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    }

    async fn request(
        pool: &Arc<Pool>,
        addr: &str,
        method: Method,
        body: &str,
    ) -> Result<(StatusCode, Vec<u8>), String> {
        let host = HeaderValue::from_str(addr).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        let body = Bytes::from(body.to_string());
        let outgoing = Outgoing { method: &method, target: "/x?y=1", host: &host, headers: &headers, body: &body };
        let resp = send(pool, addr, &outgoing).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok((status, body.to_vec()))
    }

    async fn round_trip(pool: &Arc<Pool>, addr: &str) -> Vec<u8> {
        let (status, body) = request(pool, addr, Method::POST, "{}").await.unwrap();
        assert_eq!(status, StatusCode::OK);
        body
    }

    #[tokio::test]
    async fn a_connection_whose_answer_was_read_carries_the_next_request() {
        let (addr, accepted) = server(ok_server()).await;
        let pool = Arc::new(Pool::default());
        for _ in 0..3 {
            assert_eq!(round_trip(&pool, &addr).await, b"ok");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn the_request_is_written_as_http_1_1_with_its_length() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let (addr, _) = server(move |_, raw: &[u8]| {
            log.lock().unwrap().push(String::from_utf8(raw.to_vec()).unwrap());
            reply("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        })
        .await;
        let pool = Arc::new(Pool::default());
        request(&pool, &addr, Method::POST, "{\"a\":1}").await.unwrap();
        request(&pool, &addr, Method::GET, "").await.unwrap();
        request(&pool, &addr, Method::POST, "").await.unwrap();
        let seen = seen.lock().unwrap();
        assert_eq!(
            seen[0],
            format!("POST /x?y=1 HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n{{\"a\":1}}")
        );
        assert_eq!(seen[1], format!("GET /x?y=1 HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\r\n"));
        assert!(seen[2].ends_with("content-length: 0\r\n\r\n"), "{}", seen[2]);
    }

    #[tokio::test]
    async fn a_large_body_is_written_whole() {
        let (addr, _) = server(|_, raw: &[u8]| {
            let n = raw.len();
            Reply {
                pieces: vec![
                    format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{n}", n.to_string().len()).into_bytes()
                ],
                close: false,
            }
        })
        .await;
        let pool = Arc::new(Pool::default());
        let body = "x".repeat(framing::COALESCE_BYTES * 3);
        let (_, answer) = request(&pool, &addr, Method::POST, &body).await.unwrap();
        let total: usize = String::from_utf8(answer).unwrap().parse().unwrap();
        assert!(total > body.len(), "the server saw {total} bytes");
    }

    #[tokio::test]
    async fn a_chunked_answer_is_decoded_across_reads_and_its_connection_reused() {
        let (addr, accepted) = server(|_, _| Reply {
            pieces: vec![
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n".to_vec(),
                b"6;ext=1\r\ndata: ".to_vec(),
                b"\r\n".to_vec(),
                b"b".to_vec(),
                b"\r\nhello worl".to_vec(),
                b"d\r\n0\r\nx-trailer: t\r\n".to_vec(),
                b"\r\n".to_vec(),
            ],
            close: false,
        })
        .await;
        let pool = Arc::new(Pool::default());
        for _ in 0..2 {
            assert_eq!(round_trip(&pool, &addr).await, b"data: hello world");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_streamed_answer_arrives_piece_by_piece() {
        // Each chunk reaches the caller as it comes, before the answer ends (server-sent events).
        let (addr, _) = server(|_, _| Reply {
            pieces: vec![
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n".to_vec(),
                b"6\r\nsecond\r\n0\r\n\r\n".to_vec(),
            ],
            close: false,
        })
        .await;
        let pool = Arc::new(Pool::default());
        let host = HeaderValue::from_str(&addr).unwrap();
        let (headers, body) = (HeaderMap::new(), Bytes::new());
        let outgoing = Outgoing { method: &Method::GET, target: "/", host: &host, headers: &headers, body: &body };
        let mut resp = send(&pool, &addr, &outgoing).await.unwrap();
        let first = resp.body_mut().frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&first[..], b"first");
        let second = resp.body_mut().frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&second[..], b"second");
        assert!(resp.body_mut().frame().await.is_none());
    }

    #[tokio::test]
    async fn a_length_answer_split_across_reads_is_whole() {
        let (addr, _) = server(|_, _| Reply {
            pieces: vec![
                b"HTTP/1.1 200 OK\r\ncontent-le".to_vec(),
                b"ngth: 10\r\n\r\n0123".to_vec(),
                b"456789".to_vec(),
            ],
            close: false,
        })
        .await;
        let pool = Arc::new(Pool::default());
        assert_eq!(round_trip(&pool, &addr).await, b"0123456789");
    }

    #[tokio::test]
    async fn an_answer_without_length_ends_when_the_engine_closes_and_is_not_reused() {
        let (addr, accepted) = server(|_, _| Reply {
            pieces: vec![b"HTTP/1.1 200 OK\r\n\r\nuntil".to_vec(), b" close".to_vec()],
            close: true,
        })
        .await;
        let pool = Arc::new(Pool::default());
        for _ in 0..2 {
            assert_eq!(round_trip(&pool, &addr).await, b"until close");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn answers_without_a_body_end_at_their_head() {
        let (addr, accepted) = server(|n, _| match n {
            // 100 Continue first, then a 204; a HEAD answer's length describes no body here.
            0 => Reply {
                pieces: vec![b"HTTP/1.1 100 Continue\r\n\r\n".to_vec(), b"HTTP/1.1 204 No Content\r\n\r\n".to_vec()],
                close: false,
            },
            _ => reply("HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n"),
        })
        .await;
        let pool = Arc::new(Pool::default());
        assert_eq!(request(&pool, &addr, Method::POST, "{}").await.unwrap(), (StatusCode::NO_CONTENT, vec![]));
        assert_eq!(request(&pool, &addr, Method::HEAD, "").await.unwrap(), (StatusCode::OK, vec![]));
        assert_eq!(request(&pool, &addr, Method::HEAD, "").await.unwrap(), (StatusCode::OK, vec![]));
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_connection_the_engine_closes_is_not_reused() {
        let (addr, accepted) = server(|_, _| Reply {
            pieces: vec![b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok".to_vec()],
            close: true,
        })
        .await;
        let pool = Arc::new(Pool::default());
        for _ in 0..3 {
            round_trip(&pool, &addr).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn an_idle_connection_the_engine_closed_is_replaced() {
        // As an engine's keep-alive timeout does: the connection closes after the answer, with
        // no `connection: close` to say so beforehand.
        let (addr, accepted) = server(|_, _| Reply {
            pieces: vec![b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec()],
            close: true,
        })
        .await;
        let pool = Arc::new(Pool::default());
        for _ in 0..3 {
            assert_eq!(round_trip(&pool, &addr).await, b"ok");
            // The close reaches the pooled connection before the next request is sent.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_request_the_engine_dropped_on_a_pooled_connection_is_sent_on_a_new_one() {
        // The race the idle check cannot see: the engine closes the connection as the request
        // arrives on it, answering nothing.
        let (addr, accepted) = server(|n, _| match n {
            0 => reply("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
            _ => Reply { pieces: vec![], close: true },
        })
        .await;
        let pool = Arc::new(Pool::default());
        assert_eq!(round_trip(&pool, &addr).await, b"ok");
        assert_eq!(round_trip(&pool, &addr).await, b"ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_request_is_sent_again_at_most_once_and_then_on_a_new_connection() {
        // Every connection answers its first request and drops the next unanswered.
        let requests = Arc::new(AtomicUsize::new(0));
        let seen = requests.clone();
        let (addr, accepted) = server(move |n, _| {
            seen.fetch_add(1, Ordering::SeqCst);
            match n {
                0 => reply("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
                _ => Reply { pieces: vec![], close: true },
            }
        })
        .await;
        let pool = Arc::new(Pool::default());
        // Three connections in the pool at once.
        let (a, b, c) = tokio::join!(round_trip(&pool, &addr), round_trip(&pool, &addr), round_trip(&pool, &addr));
        assert_eq!((a, b, c), (b"ok".to_vec(), b"ok".to_vec(), b"ok".to_vec()));
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        // One pooled connection is tried, then a new one (not the other pooled ones).
        assert_eq!(round_trip(&pool, &addr).await, b"ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 4);
        // 3 answered, 1 dropped on the pooled connection, 1 answered on the new one.
        assert_eq!(requests.load(Ordering::SeqCst), 5);
    }

    #[tokio::test]
    async fn a_connection_cut_within_an_answer_is_not_sent_again() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf).await;
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
                let _ = stream.read(&mut buf).await;
                // The second request: part of a head, then a reset.
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\n").await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                let _ = stream.set_zero_linger();
                drop(stream);
            }
        });
        let pool = Arc::new(Pool::default());
        assert_eq!(round_trip(&pool, &addr).await, b"ok");
        let err = request(&pool, &addr, Method::POST, "{}").await.unwrap_err();
        assert!(err.contains("within") && err.contains("head"), "{err}");
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn an_answer_given_before_the_whole_body_was_read_reaches_the_caller() {
        // An engine that refuses a large body from its head (413) and closes without reading it.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut buf = [0u8; 1024];
                let _ = stream.read(&mut buf).await;
                let _ = stream.write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 3\r\n\r\nbig").await;
                let _ = stream.shutdown().await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        let pool = Arc::new(Pool::default());
        let body = "x".repeat(32 << 20);
        let (status, answer) = request(&pool, &addr, Method::POST, &body).await.unwrap();
        assert_eq!((status, &answer[..]), (StatusCode::PAYLOAD_TOO_LARGE, &b"big"[..]));
    }

    #[tokio::test]
    async fn a_fresh_connection_closed_without_an_answer_is_an_error() {
        let (addr, _) = server(|_, _| Reply { pieces: vec![], close: true }).await;
        let pool = Arc::new(Pool::default());
        let err = request(&pool, &addr, Method::POST, "{}").await.unwrap_err();
        assert!(err.contains("closed the connection before answering"), "{err}");
    }

    #[tokio::test]
    async fn each_thread_slot_reuses_only_its_own_connections() {
        let (addr, accepted) = server(ok_server()).await;
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
    async fn an_answer_dropped_before_its_end_closes_its_connection() {
        let (addr, accepted) = server(ok_server()).await;
        let pool = Arc::new(Pool::default());
        // The answer is dropped unread (as when a client goes away): its connection closes.
        let host = HeaderValue::from_str(&addr).unwrap();
        let (headers, body) = (HeaderMap::new(), Bytes::new());
        let outgoing = Outgoing { method: &Method::GET, target: "/", host: &host, headers: &headers, body: &body };
        drop(send(&pool, &addr, &outgoing).await.unwrap());
        round_trip(&pool, &addr).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn invalid_answers_are_errors_and_not_reused() {
        let pool = Arc::new(Pool::default());
        for (raw, expect) in [
            ("HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok", "two different content-length"),
            ("HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n", "content-length"),
            ("HTTP/1.1 200 OK\r\ncontent-length: +2\r\n\r\nok", "content-length"),
            ("NOT HTTP\r\n\r\n", "not valid HTTP/1.1"),
            ("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "invalid chunk size"),
            ("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nokXX", "not followed by CRLF"),
        ] {
            let (addr, _) = server(move |_, _| Reply { pieces: vec![raw.as_bytes().to_vec()], close: false }).await;
            let err = request(&pool, &addr, Method::POST, "{}").await.unwrap_err();
            assert!(err.contains(expect), "{raw:?}: {err}");
        }
    }

    #[tokio::test]
    async fn an_answer_cut_short_is_an_error() {
        let (addr, _) = server(|_, _| Reply {
            pieces: vec![b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc".to_vec()],
            close: true,
        })
        .await;
        let pool = Arc::new(Pool::default());
        let err = request(&pool, &addr, Method::POST, "{}").await.unwrap_err();
        assert!(err.contains("before the end of its answer"), "{err}");
    }

    #[tokio::test]
    async fn a_refused_connection_is_an_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        let pool = Arc::new(Pool::default());
        let err = request(&pool, &addr, Method::GET, "").await.unwrap_err();
        assert!(err.contains("cannot connect"), "{err}");
    }
}
