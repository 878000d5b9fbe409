//! A node-local receiver: accepts versions from upstream, writes them under its destination
//! root and forwards every chunk to the next hop of the chain while writing.
//!
//! Expected flow of one connection:
//! 1. `HELLO` (magic, protocol version, token, version name, the rest of the route) ->
//!    `WELCOME`, or `ERROR` naming what was wrong;
//! 2. `MANIFEST` (validated: names, limits, order); the next hop is connected (see
//!    [`crate::chain`]) and the local copy started (see [`crate::sink`]);
//! 3. `CHUNK`s in manifest order: each is sequence-checked and CRC-checked, then forwarded and
//!    written; `END`;
//! 4. the local copy is verified and published, the next hop's results are awaited, and one
//!    `RESULT` frame goes upstream: this hop first, then every hop behind it.
//!
//! Errors: a corrupted or out-of-order chunk fails this hop (and the hops behind it, which get
//! `ERROR` and discard what they have); this hop keeps reading to `END` so the sender learns
//! exactly which receivers failed and retries only those. A connection that breaks leaves
//! nothing behind. Cancelling the receiver aborts every connection and removes their partial
//! directories.

use crate::chain::{Downstream, Timeouts};
use crate::manifest::Manifest;
use crate::protocol::{
    error_frame, json_frame, parse_hello, read_frame_within, Chunk, Hello, HopResult, Kind, Transport, Welcome,
    WireError, MAX_ROUTE, PROTOCOL_VERSION,
};
use crate::sink::{remove_stale_partials, InProgress, Sequencer, Sink};
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How a receiver behaves.
#[derive(Debug, Clone)]
pub struct ReceiverOptions {
    /// When set, `HELLO` must carry this token.
    pub token: Option<String>,
    /// Connect timeout towards the next hop.
    pub connect_timeout: Duration,
    /// Longest wait for any one frame, and for the next hop's result after `END`.
    pub io_timeout: Duration,
    /// CUDA device used by the NCCL transport (feature `nccl`).
    pub nccl_device: usize,
}

impl Default for ReceiverOptions {
    fn default() -> Self {
        ReceiverOptions {
            token: None,
            connect_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(120),
            nccl_device: 0,
        }
    }
}

/// Shared by every connection of one receiver.
#[derive(Debug)]
pub(crate) struct Context {
    pub dest: PathBuf,
    pub opts: ReceiverOptions,
    pub in_progress: InProgress,
}

impl Context {
    pub fn timeouts(&self) -> Timeouts {
        Timeouts { connect: self.opts.connect_timeout, io: self.opts.io_timeout }
    }
}

/// A bound receiver, not yet serving.
pub struct Receiver {
    listener: TcpListener,
    ctx: Arc<Context>,
}

/// A receiver running as a tokio task, owned by this handle: [`ReceiverHandle::shutdown`]
/// stops it and waits; dropping the handle stops it too (the task is aborted, which aborts
/// every connection task and removes their partial directories), so no task outlives it.
pub struct ReceiverHandle {
    addr: SocketAddr,
    cancel: CancellationToken,
    /// `None` only after `shutdown` took it.
    task: Option<tokio::task::JoinHandle<()>>,
}

impl ReceiverHandle {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, aborts every transfer (their partial directories are removed) and
    /// waits for the task.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for ReceiverHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Receiver {
    /// Binds `addr` and prepares `dest_root` (created if missing; partial directories left by
    /// a crashed run are removed).
    pub async fn bind(addr: impl ToSocketAddrs, dest_root: impl Into<PathBuf>) -> io::Result<Receiver> {
        let dest: PathBuf = dest_root.into();
        std::fs::create_dir_all(&dest)?;
        remove_stale_partials(&dest);
        let listener = TcpListener::bind(addr).await?;
        Ok(Receiver {
            listener,
            ctx: Arc::new(Context { dest, opts: ReceiverOptions::default(), in_progress: InProgress::default() }),
        })
    }

    pub fn with_options(mut self, opts: ReceiverOptions) -> Receiver {
        self.ctx = Arc::new(Context { dest: self.ctx.dest.clone(), opts, in_progress: InProgress::default() });
        self
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub fn dest_root(&self) -> &Path {
        &self.ctx.dest
    }

    /// Runs as a tokio task until [`ReceiverHandle::shutdown`] or the handle is dropped.
    pub fn spawn(self) -> io::Result<ReceiverHandle> {
        let addr = self.local_addr()?;
        let cancel = CancellationToken::new();
        let task = tokio::spawn(self.run(cancel.clone()));
        Ok(ReceiverHandle { addr, cancel, task: Some(task) })
    }

    /// Serves connections until `cancel` fires; then aborts and joins every connection task.
    pub async fn run(self, cancel: CancellationToken) {
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let ctx = self.ctx.clone();
                        conns.spawn(async move {
                            if let Err(e) = serve(stream, &ctx).await {
                                tracing::warn!(%peer, error = %e, "relay connection failed");
                            }
                        });
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        conns.shutdown().await;
    }
}

/// Sends `ERROR` (best effort) and returns the error.
async fn refuse(wr: &mut TcpStream, e: WireError) -> WireError {
    let _ = wr.write_all(&error_frame(e.to_string())).await;
    let _ = wr.shutdown().await;
    e
}

async fn serve(mut stream: TcpStream, ctx: &Context) -> Result<(), WireError> {
    stream.set_nodelay(true)?;
    let io_timeout = ctx.opts.io_timeout;
    let hello_frame = read_frame_within(&mut stream, io_timeout, "hello").await?;
    let hello = match hello_frame.expect(Kind::Hello, "HELLO").and_then(|f| parse_hello(&f)) {
        Ok(h) => h,
        Err(e) => return Err(refuse(&mut stream, e).await),
    };
    if let Err(e) = check_hello(&hello, ctx) {
        return Err(refuse(&mut stream, e).await);
    }
    match hello.transport {
        Transport::Tcp => serve_tcp(stream, hello, ctx).await,
        #[cfg(feature = "nccl")]
        Transport::Nccl => crate::nccl::serve_receiver(stream, hello, ctx).await,
        #[cfg(not(feature = "nccl"))]
        Transport::Nccl => Err(refuse(
            &mut stream,
            WireError::Peer("this receiver was built without the `nccl` feature; use the tcp transport".into()),
        )
        .await),
    }
}

fn check_hello(hello: &Hello, ctx: &Context) -> Result<(), WireError> {
    if let Some(want) = &ctx.opts.token {
        let ok = hello.token.as_deref().is_some_and(|t| constant_time_eq(t.as_bytes(), want.as_bytes()));
        if !ok {
            return Err(WireError::Peer("unauthorized: the relay token is missing or wrong".into()));
        }
    }
    if hello.route.len() > MAX_ROUTE {
        return Err(WireError::Malformed {
            what: "hello",
            reason: format!("route of {} hops exceeds the limit of {MAX_ROUTE}", hello.route.len()),
        });
    }
    if let Some(p) = crate::protocol::name_problem(&hello.version) {
        return Err(WireError::Malformed { what: "version name", reason: p });
    }
    Ok(())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads and validates `MANIFEST`.
pub(crate) async fn read_manifest(
    stream: &mut TcpStream,
    hello: &Hello,
    ctx: &Context,
) -> Result<(Manifest, bytes::Bytes), WireError> {
    let f = read_frame_within(stream, ctx.opts.io_timeout, "manifest").await?.expect(Kind::Manifest, "MANIFEST")?;
    let m: Manifest = f.json("manifest")?;
    m.validate().map_err(|e| WireError::Malformed { what: "manifest", reason: e.to_string() })?;
    if m.version != hello.version {
        return Err(WireError::Malformed {
            what: "manifest",
            reason: format!("manifest is for version {:?}, hello named {:?}", m.version, hello.version),
        });
    }
    Ok((m, f.raw))
}

async fn serve_tcp(mut stream: TcpStream, hello: Hello, ctx: &Context) -> Result<(), WireError> {
    // A hint only: whether the copy is reused is decided against the manifest (`Sink::open`).
    let already = crate::sink::final_dir(&ctx.dest, &hello.version).is_dir();
    let welcome = Welcome { protocol: PROTOCOL_VERSION, already_present: already };
    stream.write_all(&json_frame(Kind::Welcome, &welcome)).await?;
    let (manifest, manifest_raw) = match read_manifest(&mut stream, &hello, ctx).await {
        Ok(m) => m,
        Err(e) => return Err(refuse(&mut stream, e).await),
    };
    let mut sink = match Sink::open(&ctx.dest, &manifest, &ctx.in_progress) {
        Ok(s) => s,
        Err(e) => return Err(refuse(&mut stream, WireError::Peer(e)).await),
    };
    let mut next = Downstream::open(hello.route.clone(), &hello, manifest_raw, ctx.timeouts()).await;
    tracing::info!(
        version = hello.version,
        files = manifest.files.len(),
        bytes = manifest.total_bytes(),
        hops_behind = hello.route.len(),
        already_present = sink.already_present(),
        "receiving version"
    );

    let mut seq = Sequencer::new(&manifest);
    // Set once the incoming stream is known bad; from then on frames are only drained to `END`.
    let mut stream_bad: Option<String> = None;
    // False once the local writer stopped (its reason comes out of `Sink::finish`); chunks
    // are still forwarded.
    let mut writing = true;
    loop {
        let f = read_frame_within(&mut stream, ctx.opts.io_timeout, "the next chunk").await?.check_error()?;
        match f.kind {
            Kind::Chunk if stream_bad.is_some() => {}
            Kind::Chunk => {
                let chunk = Chunk::parse(&f)?;
                let problem = if let Err(e) = seq.accept(chunk.file, chunk.offset, chunk.data.len()) {
                    Some(e)
                } else if !chunk.verify() {
                    Some(format!(
                        "corrupted chunk: file {} offset {} ({} bytes) fails its CRC-32",
                        chunk.file,
                        chunk.offset,
                        chunk.data.len()
                    ))
                } else {
                    None
                };
                if let Some(p) = problem {
                    tracing::warn!(version = hello.version, problem = p, "dropping this transfer");
                    next.abandon(p.clone()).await;
                    stream_bad = Some(p);
                    continue;
                }
                next.forward(f.raw.clone()).await;
                if writing {
                    writing = sink.write(chunk.file, chunk.data).await;
                }
            }
            Kind::End => {
                if stream_bad.is_none() && !seq.complete() {
                    let p = "END before every byte of the version arrived".to_string();
                    next.abandon(p.clone()).await;
                    stream_bad = Some(p);
                }
                if next.is_live() {
                    next.forward(f.raw.clone()).await;
                }
                break;
            }
            other => {
                let e = WireError::Unexpected { expected: "CHUNK or END", got: other };
                return Err(refuse(&mut stream, e).await);
            }
        }
    }
    let mine = match stream_bad {
        Some(p) => {
            drop(sink);
            HopResult::failed("", p)
        }
        None => sink.finish().await,
    };
    let mut results = vec![mine];
    results.extend(next.finish().await);
    stream.write_all(&json_frame(Kind::Result, &results)).await?;
    stream.shutdown().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn tokens_compare_whole() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
    }
}
