//! How a published version reaches the engines, behind one trait.
//!
//! [`WeightTransport::stage`] makes a version loadable on every node that hosts engines and
//! returns the path an engine passes to `/update_weights_from_disk` (and to `--model-path` when
//! it is launched). It runs once per publish, before any engine is touched; a failure fails the
//! publish with nothing changed.
//!
//! - [`Disk`]: engines read the published directory directly (shared storage, or one node).
//! - [`Relay`]: the version is read once and broadcast with `rollout-relay` (pipelined chain,
//!   per-chunk and whole-file checksums, atomic rename) to a receiver on every node that hosts
//!   engines, which writes it to node-local fast storage (`--relay-dir`, default
//!   `/dev/shm/elastic-rollout`); engines load it from there. In local mode there is one node,
//!   so one receiver, started with the first publish. Each version is staged as
//!   `<version>-<first 16 hex of its checksum>`, so a name published again with other bytes
//!   (after a failed update) never reuses an old copy. After an update ends, copies other than
//!   the fleet's current one are removed ([`WeightTransport::retain`]).

use futures::future::BoxFuture;
use rollout_core::weights::WeightVersion;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("{transport} transport cannot stage version {version}: {reason}")]
    Stage { transport: &'static str, version: String, reason: String },
}

pub trait WeightTransport: Send + Sync {
    /// The name shown in `GET /rollout/weights` (`disk`, `relay`).
    fn name(&self) -> &'static str;

    /// Makes `version` (read from `version.path`) loadable by every engine; returns the path
    /// engines load it from.
    fn stage<'a>(&'a self, version: &'a WeightVersion) -> BoxFuture<'a, Result<String, TransportError>>;

    /// Drops staged copies other than `keep` (engine paths still in use). Best effort.
    fn retain(&self, _keep: &[String]) {}
}

/// Engines load the published directory itself.
pub struct Disk;

impl WeightTransport for Disk {
    fn name(&self) -> &'static str {
        "disk"
    }

    fn stage<'a>(&'a self, version: &'a WeightVersion) -> BoxFuture<'a, Result<String, TransportError>> {
        Box::pin(async move {
            version.path.clone().ok_or_else(|| TransportError::Stage {
                transport: "disk",
                version: version.version.clone(),
                reason: "the version has no checkpoint path".into(),
            })
        })
    }
}

/// Node-local relay through `rollout-relay` (see the module docs).
pub struct Relay {
    root: PathBuf,
    receiver: tokio::sync::OnceCell<rollout_relay::ReceiverHandle>,
}

impl Relay {
    pub fn new(root: PathBuf) -> Self {
        Self { root, receiver: tokio::sync::OnceCell::new() }
    }

    /// The directory name a version is staged under.
    pub fn staged_name(version: &WeightVersion) -> String {
        let sum = version.checksum.as_deref().unwrap_or("unchecked");
        format!("{}-{}", version.version, &sum[..sum.len().min(16)])
    }
}

impl WeightTransport for Relay {
    fn name(&self) -> &'static str {
        "relay"
    }

    fn stage<'a>(&'a self, version: &'a WeightVersion) -> BoxFuture<'a, Result<String, TransportError>> {
        Box::pin(async move {
            let fail =
                |reason: String| TransportError::Stage { transport: "relay", version: version.version.clone(), reason };
            let source = version.path.as_deref().ok_or_else(|| fail("the version has no checkpoint path".into()))?;
            let receiver = self
                .receiver
                .get_or_try_init(|| async {
                    let r = rollout_relay::Receiver::bind("127.0.0.1:0", self.root.clone()).await?;
                    tracing::info!(addr = %r.local_addr()?, root = %self.root.display(), "weight relay receiver started");
                    r.spawn()
                })
                .await
                .map_err(|e| fail(format!("cannot start the receiver on {}: {e}", self.root.display())))?;
            let name = Self::staged_name(version);
            let report = rollout_relay::send(
                &name,
                Path::new(source),
                &[receiver.local_addr()],
                &rollout_relay::SendOptions::default(),
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
            if !report.all_ok() {
                let errors: Vec<String> = report
                    .receivers
                    .iter()
                    .filter_map(|r| r.error.as_ref().map(|e| format!("{}: {e}", r.addr)))
                    .collect();
                return Err(fail(errors.join("; ")));
            }
            if version.checksum.as_deref().is_some_and(|c| c != report.checksum) {
                return Err(fail(format!(
                    "the relayed copy's checksum {} differs from the published {:?}; the source changed while it was sent",
                    report.checksum, version.checksum
                )));
            }
            tracing::info!(version = %version.version, bytes = report.bytes, seconds = report.seconds, "weights staged by the relay");
            Ok(self.root.join(name).display().to_string())
        })
    }

    fn retain(&self, keep: &[String]) {
        let Ok(entries) = std::fs::read_dir(&self.root) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            let shown = path.display().to_string();
            let partial = path.extension().is_some_and(|e| e == "partial");
            if path.is_dir() && !partial && !keep.contains(&shown) {
                match std::fs::remove_dir_all(&path) {
                    Ok(()) => tracing::info!(path = %shown, "removed a staged weight version no longer in use"),
                    Err(e) => tracing::warn!(path = %shown, error = %e, "cannot remove a staged weight version"),
                }
            }
        }
    }
}
