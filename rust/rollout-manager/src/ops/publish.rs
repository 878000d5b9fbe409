//! Publishing a checkpoint on disk as the fleet's next weight version (`POST
//! /rollout/weights/publish`).
//!
//! Flow: the checkpoint's headers are read (a missing, empty or invalid checkpoint is refused and
//! nothing is published); then, in one registry update, the publish is decided against the
//! updates the manager knows (`decide`): the same version from the same path again is the
//! earlier update (nothing is hashed again), the same as the running update joins it, anything
//! else while an update runs or under a name taken by other files is refused; a new version
//! starts an update in CHECKSUMMING, whose files are hashed in the background before its waves
//! run ([`crate::ops::weight_update::checksum_then_run`]).
//!
//! Errors ([`OpError`]): `invalid_checkpoint` (invalid), `update_in_progress` and
//! `version_conflict` (conflict).

use crate::adapters::weights::checkpoint;
use crate::ops::manager::Manager;
use crate::ops::op_error::OpError;
use crate::registry::fleet::WeightsState;
use crate::registry::weights::UpdateRecord;
use rollout_core::ids::{UpdateId, VersionName};
use rollout_core::weights::{check_publish, PublishCheck, UpdateStrategy, WeightUpdateStatus};
use std::sync::Arc;

/// A publish, its fields checked by the caller.
#[derive(Debug, Clone)]
pub struct Publish {
    pub version: VersionName,
    /// An absolute directory, as the engines see it.
    pub path: String,
    /// The SHA-256 the files must have, lowercase hex.
    pub checksum: Option<String>,
    pub strategy: UpdateStrategy,
    pub max_unavailable: Option<u32>,
    /// `/pause_generation` mode for `all_at_once`.
    pub pause_mode: String,
}

/// What a publish came to.
#[derive(Debug)]
pub enum Published {
    /// A new update, in CHECKSUMMING.
    Started(Box<UpdateRecord>),
    /// The running update publishes this version from this path: this publish joined it.
    Joined(Box<UpdateRecord>),
    /// Published before from this path: the latest update that published it, if still recorded
    /// (else the fleet's current version), with its status and checksum.
    Existing { update_id: Option<UpdateId>, status: String, version: String, checksum: Option<String> },
}

/// Publishes `req` (see the module docs). Answers at once; a started update runs in the
/// background.
pub async fn publish(manager: &Arc<Manager>, req: Publish) -> Result<Published, OpError> {
    // Only the headers are read here; the files are hashed in the background (CHECKSUMMING).
    let dir = std::path::PathBuf::from(&req.path);
    let ckpt = tokio::task::spawn_blocking(move || checkpoint::inspect(&dir))
        .await
        .map_err(|e| OpError::internal("checkpoint_task", e.to_string()))?
        .map_err(|e| OpError::invalid("invalid_checkpoint", format!("{e}; nothing was published")))?;
    let update_id: UpdateId = uuid::Uuid::new_v4().into();
    let transport = manager.transport.name().to_string();
    let published = manager.fleet.update(|inner| -> Result<Published, OpError> {
        match decide(&inner.weights, &req.version, &req.path, req.checksum.as_deref())? {
            Decision::Existing(existing) => return Ok(existing),
            Decision::Join(id) => {
                let running = inner.weights.updates().get(&id).cloned();
                return running
                    .map(|u| Published::Joined(Box::new(u)))
                    .ok_or_else(|| OpError::internal("join", format!("update {id} vanished")));
            }
            Decision::New => {}
        }
        let new = crate::registry::weights::NewUpdate {
            update_id: update_id.clone(),
            version: req.version.to_string(),
            previous_version: inner.weights.current().version.clone(),
            pause_mode: req.pause_mode.clone(),
            message: format!(
                "checking {} ({} files, {} bytes, {} tensors) before publishing it, {}",
                req.version,
                ckpt.files.len(),
                ckpt.total_bytes,
                ckpt.num_tensors,
                req.strategy
            ),
        };
        let (path, expected) = (req.path.clone(), req.checksum.clone());
        let record = UpdateRecord::from_publish(
            new,
            path,
            expected,
            ckpt.total_bytes,
            req.strategy,
            req.max_unavailable,
            transport,
        );
        inner.weights.start(record.clone()).map_err(|running| crate::ops::weight_update::in_flight(&running))?;
        Ok(Published::Started(Box::new(record)))
    })?;
    if let Published::Started(_) = published {
        let m = manager.clone();
        manager.tasks.spawn(crate::ops::weight_update::checksum_then_run(m, update_id));
    }
    Ok(published)
}

/// What a publish means given the updates the manager knows.
enum Decision {
    /// A new version: start an update.
    New,
    /// The running update publishes this version from this path: answer with it.
    Join(UpdateId),
    /// Published before (same version and path, and the checksum, when given, matches).
    Existing(Published),
}

/// `given`: the checksum the publish asked for. Err: 409.
fn decide(w: &WeightsState, version: &str, path: &str, given: Option<&str>) -> Result<Decision, OpError> {
    if let Some(u) = w.running_update().filter(|u| u.version() == version && u.path() == path) {
        let known = u.checksum().as_deref().or(u.expected_checksum().as_deref());
        if let (Some(_), None) = (given, known) {
            // Joining would mean failing the running update if the files lack this checksum.
            return Err(OpError::conflict(
                "update_in_progress",
                format!(
                    "update {} is still hashing {version} from {path}, published without a checksum; publish again once it is PENDING (GET /rollout/weights/updates/{}) to compare checksums",
                    u.update_id(), u.update_id()
                ),
            ));
        }
        if let (Some(g), Some(k)) = (given, known) {
            if g != k {
                return Err(OpError::conflict(
                    "version_conflict",
                    format!(
                        "update {} publishes {version} from {path} with checksum {k}; this publish expects {g}: publish other bytes under a new version name",
                        u.update_id()
                    ),
                ));
            }
        }
        return Ok(Decision::Join(u.update_id().clone()));
    }
    match check_publish(&w.known_versions(), version, path, given) {
        PublishCheck::Same => {
            let existing = w
                .updates()
                .values()
                .filter(|u| u.version() == version && u.status() != WeightUpdateStatus::Failed)
                .max_by(|a, b| a.created_at().total_cmp(&b.created_at()));
            let (update_id, status, checksum) = existing.map_or_else(
                || (None, "COMPLETED".to_string(), w.current().checksum.clone()),
                |u| (Some(u.update_id().clone()), u.status().to_string(), u.checksum().clone()),
            );
            Ok(Decision::Existing(Published::Existing { update_id, status, version: version.to_string(), checksum }))
        }
        PublishCheck::Conflict(why) => Err(OpError::conflict("version_conflict", why)),
        PublishCheck::New => match w.running_update() {
            Some(u) => Err(OpError::conflict(
                "update_in_progress",
                format!(
                    "update {} to {} is in progress ({}); wait for it to finish (GET /rollout/weights/updates/{}), then publish again",
                    u.update_id(), u.version(), u.status(), u.update_id()
                ),
            )),
            None => Ok(Decision::New),
        },
    }
}

/// Waits (up to `limit`) until the update ended, and answers its record as it is then (still
/// running when `limit` passed). 404 when the registry no longer holds it.
pub async fn wait_ended(
    manager: &Manager,
    update_id: &UpdateId,
    limit: std::time::Duration,
) -> Result<UpdateRecord, OpError> {
    manager
        .watch(limit, || {
            let record =
                manager.fleet.lock().weights.updates().get(update_id).cloned().ok_or_else(|| {
                    OpError::unknown("unknown_request", format!("no weight update with id {update_id}"))
                })?;
            let ended = record.status().is_terminal();
            Ok((record, ended))
        })
        .await
}

/// SGLang's `UpdateWeightsFromDiskReqInput`, as far as a publish takes it: a trainer's
/// `/update_weights_from_disk` to the whole fleet (SMG's RL control plane fanned out to every
/// worker, or the trainer port) is the manager's publish of that checkpoint. Unknown fields are
/// ignored, as SGLang ignores them.
#[derive(Debug, serde::Deserialize)]
pub struct FromDisk {
    pub model_path: String,
    #[serde(default)]
    pub weight_version: Option<String>,
    #[serde(default)]
    pub load_format: Option<String>,
    #[serde(default)]
    pub abort_all_requests: bool,
}

impl FromDisk {
    /// The publish this asks for, checked (400s: `weight_version_required`, `invalid_version`,
    /// `invalid_load_format`, `invalid_path`); nothing is published here.
    pub fn publish(self, strategy: UpdateStrategy, pause_mode: String) -> Result<Publish, OpError> {
        if self.load_format.as_deref().is_some_and(|f| f != "auto") {
            return Err(OpError::invalid(
                "invalid_load_format",
                "load_format: the manager's engines load a checkpoint of safetensors files as SGLang's default does; leave it out",
            ));
        }
        let Some(raw) = self.weight_version else {
            return Err(OpError::invalid(
                "weight_version_required",
                "weight_version is required: the manager names every version the fleet serves (pins, metrics and \
                 each answer's meta_info say it)",
            ));
        };
        let version = VersionName::parse(&raw).map_err(|e| OpError::invalid("invalid_version", e.to_string()))?;
        if !std::path::Path::new(&self.model_path).is_absolute() {
            return Err(OpError::invalid(
                "invalid_path",
                format!(
                    "model_path {:?} must be absolute: engines resolve it from their own directory",
                    self.model_path
                ),
            ));
        }
        Ok(Publish { version, path: self.model_path, checksum: None, strategy, max_unavailable: None, pause_mode })
    }
}

/// How a publish that was waited for ended.
#[derive(Debug)]
pub enum Waited {
    /// The update it started or joined, as it was when it ended (or when the wait gave up:
    /// then it is still running).
    Update(Box<UpdateRecord>),
    /// Published before from this path, and the fleet still serves that version.
    Before { update_id: Option<UpdateId>, status: String },
}

/// Publishes `req` and waits up to `limit` for its update to end. The same version from the
/// same path again is [`Waited::Before`] while the fleet serves it; once the fleet moved on it is
/// 409 `version_conflict` (SGLang would load the older files again, but the manager keeps one
/// name per version).
pub async fn publish_and_wait(
    manager: &Arc<Manager>,
    req: Publish,
    limit: std::time::Duration,
) -> Result<Waited, OpError> {
    let update_id = match publish(manager, req).await? {
        Published::Started(u) | Published::Joined(u) => u.update_id().clone(),
        Published::Existing { version, .. } if manager.fleet.lock().weights.current().version.as_str() != version => {
            return Err(OpError::conflict(
                "version_conflict",
                format!(
                    "version {version} was published from this path before and the fleet has moved on since; to go \
                     back to these files, publish them under a new version name"
                ),
            ));
        }
        Published::Existing { update_id, status, .. } => return Ok(Waited::Before { update_id, status }),
    };
    Ok(Waited::Update(Box::new(wait_ended(manager, &update_id, limit).await?)))
}
