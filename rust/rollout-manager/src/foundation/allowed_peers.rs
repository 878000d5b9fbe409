//! A TCP listener that serves only peers from given networks (`--trainer-allow-cidr`).
//!
//! A caller from elsewhere gets one HTTP answer, 403 with a JSON body that names the flag, and
//! its connection is closed; nothing it sent is read as a request. The check is on the peer's
//! address as the kernel reports it (an IPv4-mapped IPv6 peer counts as its IPv4 address).

use axum::serve::Listener;
use rollout_core::cidr::Cidr;
use std::net::SocketAddr;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

/// `inner`, accepting only peers in `allowed`.
pub struct AllowedPeers {
    inner: TcpListener,
    allowed: Vec<Cidr>,
    /// The flag the refusal names.
    flag: &'static str,
    /// The refusals being written (each at most 5 s).
    refusals: tokio_util::task::TaskTracker,
}

impl AllowedPeers {
    pub fn new(inner: TcpListener, allowed: Vec<Cidr>, flag: &'static str) -> Self {
        Self { inner, allowed, flag, refusals: tokio_util::task::TaskTracker::new() }
    }
}

/// The refusal a peer outside the networks gets, as a whole HTTP/1.1 answer.
pub fn refusal(peer: SocketAddr, flag: &str) -> Vec<u8> {
    let message = format!(
        "{} is not in the networks this port serves ({flag}); call it from an allowed host or add its network",
        peer.ip().to_canonical()
    );
    let body = serde_json::json!({"success": false, "message": message,
                                  "error": {"code": "peer_not_allowed", "message": message}})
    .to_string();
    format!(
        "HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

impl Listener for AllowedPeers {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (stream, peer) = Listener::accept(&mut self.inner).await;
            if self.allowed.iter().any(|c| c.contains(peer.ip())) {
                return (stream, peer);
            }
            tracing::warn!(%peer, flag = self.flag, "refused a caller outside the allowed networks");
            let answer = refusal(peer, self.flag);
            self.refusals.spawn(async move {
                let mut stream = stream;
                // Bounded: a peer that does not read its answer does not hold the task.
                let write = async {
                    let _ = stream.write_all(&answer).await;
                    let _ = stream.shutdown().await;
                    // Read what it sent until it closes: a close with unread bytes would be a
                    // reset, which can reach the peer before the answer does.
                    let mut sink = [0u8; 4096];
                    while matches!(tokio::io::AsyncReadExt::read(&mut stream, &mut sink).await, Ok(n) if n > 0) {}
                };
                let _ = tokio::time::timeout(std::time::Duration::from_secs(5), write).await;
            });
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}
