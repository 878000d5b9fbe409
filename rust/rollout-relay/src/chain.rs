//! The next hop of a chain, as seen by the hop (or sender) in front of it.
//!
//! Expected flow: [`Downstream::open`] connects to the first reachable address of the route
//! (an unreachable one is reported failed and skipped), sends `HELLO` with the rest of the
//! route and the manifest; the caller [`forward`](Downstream::forward)s every chunk frame and
//! `END`; [`finish`](Downstream::finish) waits for the downstream's `RESULT` and returns one
//! [`HopResult`] per address of the route, in route order.
//!
//! Guarantees: `finish` always returns exactly one result per route address, whatever failed;
//! a hop that gives up forwarding ([`abandon`](Downstream::abandon)) sends `ERROR` so every
//! hop behind it discards its partial copy.

use crate::protocol::{
    error_frame, hello_frame, read_frame, read_frame_within, Hello, HopResult, Kind, WireError, PROTOCOL_VERSION,
};
use bytes::Bytes;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Frames queued for the next hop (backpressure: a slow hop slows the chain in front of it).
const FORWARD_QUEUE: usize = 8;

/// Timeouts of one hop-to-hop connection.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// TCP connect.
    pub connect: Duration,
    /// Any single read or handshake step, and the wait for `RESULT` after `END`.
    pub io: Duration,
}

/// The connection to the next hop, or the record of why there is none.
pub struct Downstream {
    route: Vec<String>,
    /// Index in `route` of the hop we are connected to (== route.len() when none).
    first: usize,
    /// Results for `route[..first]` (unreachable hops).
    skipped: Vec<HopResult>,
    tx: Option<mpsc::Sender<Bytes>>,
    forwarder: Option<JoinHandle<Result<(), WireError>>>,
    results: Option<JoinHandle<Result<Vec<HopResult>, WireError>>>,
    /// Set when this hop stopped forwarding on purpose.
    abandoned: Option<String>,
    timeouts: Timeouts,
}

async fn connect(
    addr: &str,
    hello: &Hello,
    manifest_frame: &Bytes,
    t: Timeouts,
) -> Result<(OwnedReadHalf, OwnedWriteHalf), WireError> {
    let stream = tokio::time::timeout(t.connect, TcpStream::connect(addr))
        .await
        .map_err(|_| WireError::Timeout(t.connect, "connect"))??;
    stream.set_nodelay(true)?;
    let (mut rd, mut wr) = stream.into_split();
    wr.write_all(&hello_frame(hello)).await?;
    let welcome = read_frame_within(&mut rd, t.io, "welcome").await?.expect(Kind::Welcome, "WELCOME")?;
    let w: crate::protocol::Welcome = welcome.json("welcome")?;
    if w.protocol != PROTOCOL_VERSION {
        return Err(WireError::Malformed {
            what: "welcome",
            reason: format!("receiver speaks protocol {}, this sender {PROTOCOL_VERSION}", w.protocol),
        });
    }
    wr.write_all(manifest_frame).await?;
    Ok((rd, wr))
}

impl Downstream {
    /// Connects to the first reachable hop of `route`. `hello` is the template (its `route`
    /// is replaced with the hops after the one connected).
    pub async fn open(route: Vec<String>, hello: &Hello, manifest_frame: Bytes, timeouts: Timeouts) -> Downstream {
        let mut skipped = Vec::new();
        for (i, addr) in route.iter().enumerate() {
            let h = Hello { route: route[i + 1..].to_vec(), ..hello.clone() };
            match connect(addr, &h, &manifest_frame, timeouts).await {
                Ok((rd, wr)) => {
                    let (tx, rx) = mpsc::channel(FORWARD_QUEUE);
                    return Downstream {
                        first: i,
                        skipped,
                        tx: Some(tx),
                        forwarder: Some(tokio::spawn(forward_loop(wr, rx))),
                        results: Some(tokio::spawn(read_results(rd))),
                        abandoned: None,
                        timeouts,
                        route,
                    };
                }
                Err(e) => {
                    tracing::warn!(addr, error = %e, "next hop unreachable, skipping it");
                    skipped.push(HopResult::failed(addr.clone(), format!("unreachable: {e}")));
                }
            }
        }
        Downstream {
            first: route.len(),
            skipped,
            tx: None,
            forwarder: None,
            results: None,
            abandoned: None,
            timeouts,
            route,
        }
    }

    /// Whether frames still go somewhere.
    pub fn is_live(&self) -> bool {
        self.tx.is_some()
    }

    /// Queues a frame for the next hop; a dead connection is noted and later frames dropped.
    pub async fn forward(&mut self, frame: Bytes) {
        if let Some(tx) = &self.tx {
            if tx.send(frame).await.is_err() {
                self.tx = None;
            }
        }
    }

    /// Stops forwarding for `reason`: the hops behind get `ERROR` and discard what they have.
    pub async fn abandon(&mut self, reason: String) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(error_frame(format!("upstream hop gave up: {reason}"))).await;
        }
        self.abandoned = Some(reason);
    }

    /// Waits for the downstream's results (after `END` was forwarded) and returns one result
    /// per route address, in route order.
    pub async fn finish(mut self) -> Vec<HopResult> {
        self.tx = None;
        let forwarded = match self.forwarder.take() {
            Some(f) => {
                f.await.unwrap_or_else(|e| Err(WireError::Malformed { what: "forwarder", reason: e.to_string() }))
            }
            None => Ok(()),
        };
        let tail = &self.route[self.first..];
        let mut out = std::mem::take(&mut self.skipped);
        let Some(results) = self.results.take() else {
            return out;
        };
        if let Some(reason) = &self.abandoned {
            results.abort();
            out.extend(tail.iter().map(|a| HopResult::failed(a.clone(), format!("not delivered: {reason}"))));
            return out;
        }
        let got = match tokio::time::timeout(self.timeouts.io, results).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(WireError::Malformed { what: "result reader", reason: e.to_string() }),
            Err(_) => Err(WireError::Timeout(self.timeouts.io, "the next hop's result")),
        };
        match got {
            Ok(list) => {
                for (i, addr) in tail.iter().enumerate() {
                    match list.get(i) {
                        Some(r) => out.push(HopResult { addr: addr.clone(), ..r.clone() }),
                        None => out.push(HopResult::failed(addr.clone(), "no result reported")),
                    }
                }
            }
            Err(e) => {
                let why = match forwarded {
                    Err(fe) => format!("{e} (sending: {fe})"),
                    Ok(()) => e.to_string(),
                };
                if let Some((head, rest)) = tail.split_first() {
                    out.push(HopResult::failed(head.clone(), why));
                    out.extend(
                        rest.iter().map(|a| HopResult::failed(a.clone(), format!("not delivered: hop {head} failed"))),
                    );
                }
            }
        }
        out
    }
}

impl Drop for Downstream {
    fn drop(&mut self) {
        // Dropped without `finish` (the upstream broke): closing the connection makes the next
        // hop discard its partial copy.
        if let Some(f) = self.forwarder.take() {
            f.abort();
        }
        if let Some(r) = self.results.take() {
            r.abort();
        }
    }
}

async fn forward_loop(mut wr: OwnedWriteHalf, mut rx: mpsc::Receiver<Bytes>) -> Result<(), WireError> {
    while let Some(frame) = rx.recv().await {
        wr.write_all(&frame).await?;
    }
    wr.flush().await?;
    Ok(())
}

async fn read_results(mut rd: OwnedReadHalf) -> Result<Vec<HopResult>, WireError> {
    let f = read_frame(&mut rd).await?.expect(Kind::Result, "RESULT")?;
    f.json("result")
}
