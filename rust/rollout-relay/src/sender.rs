//! The source side: reads a version once per attempt and pipelines it down the chain
//! `sender -> r1 -> r2 -> ...`, each receiver forwarding every chunk while writing it.
//!
//! Expected flow of [`send`]: build (or take) the manifest; attempt 1 sends to the whole
//! chain; every later attempt (up to `max_attempts`, after `retry_backoff`) sends again to the
//! receivers that failed, as a shorter chain. The [`Report`] says, per receiver, whether it
//! holds the verified version, after how many attempts, and the last error.
//!
//! Errors: [`send`] fails only when nothing can be sent (bad version name, unreadable source,
//! empty chain); receivers that fail are reported in the `Report`, never hidden.

use crate::chain::{Downstream, Timeouts};
use crate::manifest::{Manifest, ManifestError};
use crate::protocol::{frame, json_frame, ChunkBuilder, Hello, HopResult, Kind, Transport};
use serde::Serialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Chunk frames read ahead of the network.
const READ_AHEAD: usize = 4;

/// How a version is sent.
#[derive(Debug, Clone)]
pub struct SendOptions {
    /// Bytes of file data per chunk (at most 64 MiB).
    pub chunk_size: usize,
    /// Total attempts per receiver, the first included.
    pub max_attempts: u32,
    /// Wait before each retry.
    pub retry_backoff: Duration,
    /// Token the receivers require, if any.
    pub token: Option<String>,
    pub connect_timeout: Duration,
    /// Longest wait for a handshake step, and for the results after `END`.
    pub io_timeout: Duration,
    /// A manifest computed earlier (e.g. at publish time), so the source is read only once.
    /// It must describe `source` exactly: receivers refuse bytes that do not match it.
    pub manifest: Option<Manifest>,
    /// Data path: `Tcp` (the chain) or `Nccl` (feature `nccl`).
    pub transport: Transport,
}

impl Default for SendOptions {
    fn default() -> Self {
        SendOptions {
            chunk_size: 4 << 20,
            max_attempts: 3,
            retry_backoff: Duration::from_millis(200),
            token: None,
            connect_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(120),
            manifest: None,
            transport: Transport::Tcp,
        }
    }
}

/// Outcome for one receiver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReceiverReport {
    pub addr: String,
    pub ok: bool,
    /// Attempts that included this receiver.
    pub attempts: u32,
    /// Bytes it wrote in its successful attempt (0 if it already had the version).
    pub bytes: u64,
    pub already_present: bool,
    /// The last failure, if it never succeeded; earlier failures are in `history`.
    pub error: Option<String>,
    pub history: Vec<String>,
}

/// What [`send`] did.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub version: String,
    pub checksum: String,
    /// Bytes in the version.
    pub bytes: u64,
    /// Seconds from the first connection to the last result (manifest building excluded).
    pub seconds: f64,
    /// Seconds spent hashing the source for the manifest (0 when one was given).
    pub manifest_seconds: f64,
    pub attempts: u32,
    pub receivers: Vec<ReceiverReport>,
}

impl Report {
    pub fn all_ok(&self) -> bool {
        self.receivers.iter().all(|r| r.ok)
    }
}

/// Why nothing could be sent.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("no receivers given")]
    EmptyChain,
    #[error("chunk size {0} is outside 1 byte..64 MiB")]
    ChunkSize(usize),
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error("the manifest is for version {manifest:?}, not {version:?}")]
    ManifestVersion { manifest: String, version: String },
    #[error("{0}")]
    Transport(String),
}

/// Sends `version` (the files of `source`) to every receiver of `chain`.
pub async fn send(version: &str, source: &Path, chain: &[SocketAddr], opts: &SendOptions) -> Result<Report, SendError> {
    if chain.is_empty() {
        return Err(SendError::EmptyChain);
    }
    if opts.chunk_size == 0 || opts.chunk_size > 64 << 20 {
        return Err(SendError::ChunkSize(opts.chunk_size));
    }
    let started = Instant::now();
    let manifest = match &opts.manifest {
        Some(m) => {
            m.validate()?;
            if m.version != version {
                return Err(SendError::ManifestVersion { manifest: m.version.clone(), version: version.into() });
            }
            m.clone()
        }
        None => {
            let (v, dir) = (version.to_string(), source.to_path_buf());
            tokio::task::spawn_blocking(move || Manifest::build(&v, &dir))
                .await
                .map_err(|e| SendError::Transport(format!("manifest task failed: {e}")))??
        }
    };
    let manifest_seconds = if opts.manifest.is_some() { 0.0 } else { started.elapsed().as_secs_f64() };
    let transfer_start = Instant::now();
    let addrs: Vec<String> = chain.iter().map(|a| a.to_string()).collect();
    let mut reports: Vec<ReceiverReport> = addrs
        .iter()
        .map(|a| ReceiverReport {
            addr: a.clone(),
            ok: false,
            attempts: 0,
            bytes: 0,
            already_present: false,
            error: None,
            history: vec![],
        })
        .collect();
    let mut attempts = 0;
    while attempts < opts.max_attempts.max(1) {
        let pending: Vec<usize> = (0..reports.len()).filter(|i| !reports[*i].ok).collect();
        if pending.is_empty() {
            break;
        }
        if attempts > 0 {
            tokio::time::sleep(opts.retry_backoff).await;
        }
        attempts += 1;
        let route: Vec<String> = pending.iter().map(|i| addrs[*i].clone()).collect();
        let results = match opts.transport {
            Transport::Tcp => send_once(&manifest, source, route, opts).await,
            #[cfg(feature = "nccl")]
            Transport::Nccl => crate::nccl::send_once(&manifest, source, route, opts).await,
            #[cfg(not(feature = "nccl"))]
            Transport::Nccl => {
                return Err(SendError::Transport(
                    "this build has no NCCL transport: rebuild rollout-relay with `--features nccl`".into(),
                ))
            }
        };
        for (i, r) in pending.iter().zip(results) {
            let rep = &mut reports[*i];
            rep.attempts += 1;
            if r.ok {
                rep.ok = true;
                rep.bytes = r.bytes;
                rep.already_present = r.already_present;
                rep.error = None;
            } else {
                let e = r.error.unwrap_or_else(|| "failed".into());
                tracing::warn!(receiver = rep.addr, attempt = attempts, error = e, "receiver failed");
                rep.history.push(format!("attempt {attempts}: {e}"));
                rep.error = Some(e);
            }
        }
    }
    Ok(Report {
        version: version.to_string(),
        checksum: manifest.checksum.clone(),
        bytes: manifest.total_bytes(),
        seconds: transfer_start.elapsed().as_secs_f64(),
        manifest_seconds,
        attempts,
        receivers: reports,
    })
}

/// One pass down the chain `route`; one result per route address.
async fn send_once(manifest: &Manifest, source: &Path, route: Vec<String>, opts: &SendOptions) -> Vec<HopResult> {
    let hello = Hello {
        version: manifest.version.clone(),
        route: vec![],
        token: opts.token.clone(),
        transport: Transport::Tcp,
        nccl: None,
    };
    let timeouts = Timeouts { connect: opts.connect_timeout, io: opts.io_timeout };
    let mut next = Downstream::open(route, &hello, json_frame(Kind::Manifest, manifest), timeouts).await;
    if next.is_live() {
        let (tx, mut rx) = mpsc::channel(READ_AHEAD);
        let (m, dir, chunk) = (manifest.clone(), source.to_path_buf(), opts.chunk_size);
        let reader = tokio::task::spawn_blocking(move || read_chunks(&m, &dir, chunk, &tx));
        while let Some(f) = rx.recv().await {
            next.forward(f).await;
            if !next.is_live() {
                break;
            }
        }
        drop(rx);
        match reader.await {
            Ok(Ok(())) => next.forward(frame(Kind::End, &[])).await,
            Ok(Err(e)) => next.abandon(format!("the sender cannot read its source: {e}")).await,
            Err(e) => next.abandon(format!("the sender's reader failed: {e}")).await,
        }
    }
    next.finish().await
}

/// Reads the files in manifest order into chunk frames (blocking).
fn read_chunks(manifest: &Manifest, dir: &Path, chunk: usize, tx: &mpsc::Sender<bytes::Bytes>) -> Result<(), String> {
    for (i, entry) in manifest.files.iter().enumerate() {
        let path: PathBuf = dir.join(&entry.name);
        let mut f = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut offset = 0u64;
        while offset < entry.size {
            let n = usize::try_from((entry.size - offset).min(chunk as u64)).unwrap_or(chunk);
            let b = ChunkBuilder::read_from(&mut f, n).map_err(|e| {
                format!("{}: {e} at offset {offset} (the file changed since the manifest?)", path.display())
            })?;
            let idx = u32::try_from(i).map_err(|_| "too many files".to_string())?;
            if tx.blocking_send(b.finish(idx, offset)).is_err() {
                // Nobody to send to any more; the caller reports why.
                return Ok(());
            }
            offset += n as u64;
        }
    }
    Ok(())
}
