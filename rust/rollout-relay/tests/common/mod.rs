//! Test harness: receivers on loopback, checkpoints in scratch directories, and a TCP proxy
//! that damages one connection's byte stream (flip a byte, cut it, or stall it) so the relay's
//! integrity checks meet real broken connections.

#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use rollout_relay::manifest::MARKER;
use rollout_relay::{Receiver, ReceiverHandle, ReceiverOptions};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Generous upper bound for anything a test waits on.
pub const DEADLINE: Duration = Duration::from_secs(30);

pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("relay-test-{name}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Deterministic pseudo-random bytes.
pub fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A checkpoint: two safetensors shards, a config and an empty file.
pub fn checkpoint(name: &str) -> PathBuf {
    let d = scratch(name);
    std::fs::write(d.join("model-00001-of-00002.safetensors"), bytes(1_500_000, 1)).unwrap();
    std::fs::write(d.join("model-00002-of-00002.safetensors"), bytes(700_001, 2)).unwrap();
    std::fs::write(d.join("config.json"), br#"{"model_type":"llama"}"#).unwrap();
    std::fs::write(d.join("empty.txt"), b"").unwrap();
    d
}

/// Every file of `a` equals the same-named file of `b`, and nothing else is in `b` but the
/// receiver's marker.
pub fn assert_same_files(a: &Path, b: &Path) {
    assert!(b.join(MARKER).is_file(), "{} has no marker", b.display());
    let list = |d: &Path| {
        let mut v: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_str() != Some(MARKER))
            .collect();
        v.sort();
        v
    };
    assert_eq!(list(a), list(b), "{} vs {}", a.display(), b.display());
    for name in list(a) {
        assert!(std::fs::read(a.join(&name)).unwrap() == std::fs::read(b.join(&name)).unwrap(), "{name:?} differs");
    }
}

/// Names in a receiver's root (versions and leftovers).
pub fn entries(d: &Path) -> Vec<String> {
    let mut v: Vec<_> =
        std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

pub async fn receiver(dest: &Path) -> ReceiverHandle {
    receiver_with(dest, ReceiverOptions::default()).await
}

pub async fn receiver_with(dest: &Path, opts: ReceiverOptions) -> ReceiverHandle {
    Receiver::bind("127.0.0.1:0", dest).await.unwrap().with_options(opts).spawn().unwrap()
}

/// What the proxy does to the client->server bytes of one connection.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// Pass everything.
    None,
    /// XOR the byte at this stream offset with 0xFF.
    Flip(u64),
    /// Close both sides once this many bytes went through.
    Cut(u64),
    /// Stop forwarding after this many bytes (hold the connection open).
    Stall(u64),
}

/// A TCP proxy in front of `target`; connection i gets the i-th queued fault (then `None`).
pub struct Proxy {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    pub async fn start(target: SocketAddr, faults: &[Fault]) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let queue = Arc::new(Mutex::new(faults.iter().copied().collect::<VecDeque<_>>()));
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((client, _)) = listener.accept().await else { return };
                let fault = queue.lock().unwrap().pop_front().unwrap_or(Fault::None);
                conns.spawn(pipe(client, target, fault));
            }
        });
        Proxy { addr, task }
    }
}

async fn pipe(client: TcpStream, target: SocketAddr, fault: Fault) {
    let Ok(server) = TcpStream::connect(target).await else { return };
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let up = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut sr, &mut cw).await;
    });
    let mut buf = vec![0u8; 64 * 1024];
    let mut at = 0u64;
    loop {
        let n = match cr.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let (start, end) = (at, at + n as u64);
        match fault {
            Fault::Flip(o) if (start..end).contains(&o) => buf[(o - start) as usize] ^= 0xFF,
            Fault::Cut(o) if end > o => {
                let keep = (o - start) as usize;
                let _ = sw.write_all(&buf[..keep]).await;
                up.abort();
                return;
            }
            Fault::Stall(o) if end > o => {
                let keep = (o - start) as usize;
                let _ = sw.write_all(&buf[..keep]).await;
                std::future::pending::<()>().await;
            }
            _ => {}
        }
        if sw.write_all(&buf[..n]).await.is_err() {
            break;
        }
        at = end;
    }
    let _ = sw.shutdown().await;
    let _ = up.await;
}

/// Polls `cond` until it holds or the deadline passes.
pub async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
