//! How a published version reaches the engines, behind one trait.
//!
//! [`WeightTransport::stage`] makes a version loadable on every node that hosts engines and
//! returns the path an engine passes to `/update_weights_from_disk` (and to `--model-path` when
//! it is launched). It runs once per publish, before any engine is touched; a failure fails the
//! publish with nothing changed.
//!
//! - [`Disk`]: engines read the published directory directly (shared storage, or one node).
//!
//! A node-local relay transport (broadcast to /dev/shm on each node, then load from there) is
//! the `rollout-relay` crate's job; it is not wired in yet (see docs/architecture.md).

use futures::future::BoxFuture;
use rollout_core::weights::WeightVersion;

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
