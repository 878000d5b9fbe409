//! The fleet's records: plain data, serialised as the HTTP API shows them and as the store
//! keeps them. Their state machines live in `rollout_core`; the methods here apply an event and
//! keep the record's timestamps and history.

use crate::foundation::clock::unix_now;
use rollout_core::ids::{EngineId, OpId, UpdateId};
use rollout_core::weights::{
    EngineUpdateEvent, EngineUpdateStatus, UpdateStrategy, WeightUpdateEvent, WeightUpdateStatus, WeightVersion,
};
use rollout_core::{
    EngineOrigin, EngineStatus, IllegalTransition, ScaleInEvent, ScaleInStatus, ScaleOutEvent, ScaleOutStatus,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// One engine as reported by `GET /rollout/engines`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineRecord {
    pub engine_id: EngineId,
    pub url: String,
    pub status: EngineStatus,
    pub is_healthy: bool,
    pub origin: EngineOrigin,
    pub model_name: String,
    pub weight_version: Option<String>,
    /// SHA-256 of the weights the engine reports it loaded (`sglang-sim`'s `weights_checksum`),
    /// when known; checked against the published checksum before the engine is routable.
    #[serde(default)]
    pub weights_checksum: Option<String>,
    pub gpu_ids: Vec<u32>,
    pub pid: Option<u32>,
    pub started_at: f64,
    pub updated_at: f64,
    pub log_path: Option<PathBuf>,
    /// Requests the router has in flight to this engine.
    pub in_flight: usize,
    /// How the process ended, or why the engine failed.
    pub last_error: Option<String>,
    /// The operation that created this engine.
    pub created_by: Option<OpId>,
    /// How many times recovery restarted this engine.
    pub restarts: u32,
    /// What the engine waits for, when that is not obvious from its status (Ray mode:
    /// `PENDING_RESOURCES: ...` while its placement has no agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The last lines of the engine's log, kept when the manager gave up restarting it (its
    /// restart budget spent), so the reason is readable from the API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_tail: Option<Vec<String>>,
}

/// `last_error` of a managed engine that a restarted manager starts again (until its restart
/// begins), for people; the registry marks the engine itself (`Engine::restart_queued`).
pub const RESTARTING: &str = "manager restarted; starting the engine again";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    pub status: String,
    pub at: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailedEngine {
    pub engine_id: EngineId,
    pub url: String,
    pub error: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScaleOutRecord {
    pub request_id: OpId,
    pub status: ScaleOutStatus,
    pub model_name: String,
    pub num_replicas: u32,
    pub engine_urls: Vec<String>,
    pub engine_ids: Vec<EngineId>,
    pub failed_engines: Vec<FailedEngine>,
    pub created_at: f64,
    pub updated_at: f64,
    pub error_message: Option<String>,
    pub weight_version: Option<String>,
    pub message: String,
    /// `initial` for the boot-time bring-up, `user` for API requests.
    pub trigger: Trigger,
    pub history: Vec<Transition>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScaleInRecord {
    pub request_id: OpId,
    pub status: ScaleInStatus,
    pub model_name: String,
    pub num_replicas: u32,
    pub engine_urls: Vec<String>,
    pub force: bool,
    pub engine_ids: Vec<EngineId>,
    pub removed_engines: Vec<EngineId>,
    pub failed_engines: Vec<FailedEngine>,
    pub created_at: f64,
    pub updated_at: f64,
    pub error_message: Option<String>,
    pub message: String,
    pub history: Vec<Transition>,
}

/// For an edge the caller has already checked (a fresh record, a state it just read under the
/// same lock): a refusal is a bug in that check. It is logged at error level, and fails debug
/// builds (the tests), rather than crashing a running manager.
pub fn checked<T>(result: Result<T, IllegalTransition>) {
    if let Err(e) = result {
        tracing::error!(error = %e, "a transition the caller checked was refused");
        debug_assert!(false, "{e}");
    }
}

/// Like [`checked`], for the one-operation lock taken after a check under the same lock.
pub fn checked_op(result: Result<(), RunningOp>) {
    if let Err(held) = result {
        tracing::error!(kind = held.kind, request_id = %held.request_id, "the one-operation lock was taken after a check said it was free");
        debug_assert!(false, "one-operation lock already held by {}", held.request_id);
    }
}

impl ScaleOutRecord {
    pub fn apply(&mut self, event: ScaleOutEvent) -> Result<(), IllegalTransition> {
        let next = self.status.on(event)?;
        tracing::info!(request_id = %self.request_id, from = %self.status, to = %next, "scale_out");
        self.status = next;
        self.updated_at = unix_now();
        self.history.push(Transition { status: next.to_string(), at: self.updated_at });
        if next.is_terminal() {
            observe_finished("scale_out", &next.to_string(), self.updated_at - self.created_at);
        }
        Ok(())
    }

    /// Applies the operation's forward events until it has reached `phase` (see
    /// [`ScaleOutStatus::events_to`]).
    pub fn advance_to(&mut self, phase: rollout_core::Phase) {
        for event in self.status.events_to(phase) {
            checked(self.apply(event));
        }
    }
}

impl ScaleInRecord {
    pub fn apply(&mut self, event: ScaleInEvent) -> Result<(), IllegalTransition> {
        let next = self.status.on(event)?;
        tracing::info!(request_id = %self.request_id, from = %self.status, to = %next, "scale_in");
        self.status = next;
        self.updated_at = unix_now();
        self.history.push(Transition { status: next.to_string(), at: self.updated_at });
        if next.is_terminal() {
            observe_finished("scale_in", &next.to_string(), self.updated_at - self.created_at);
        }
        Ok(())
    }
}

/// Counts a scale operation that reached a final status, with how long it took.
fn observe_finished(kind: &str, status: &str, secs: f64) {
    crate::foundation::telemetry::events()
        .scale_seconds
        .with_label_values(&[kind, &status.to_lowercase()])
        .observe(secs.max(0.0));
}

/// The kind and id of the scale operation in progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningOp {
    pub kind: &'static str,
    pub request_id: OpId,
}

/// Updates kept in memory and in the store (the oldest finished ones are forgotten first).
pub const KEEP_UPDATES: usize = 100;

/// One engine's part in an update.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineUpdate {
    pub status: EngineUpdateStatus,
    pub error: Option<String>,
    pub started_at: Option<f64>,
    pub finished_at: Option<f64>,
}

impl EngineUpdate {
    /// An engine's part before its turn.
    pub fn pending() -> Self {
        Self { status: EngineUpdateStatus::Pending, error: None, started_at: None, finished_at: None }
    }
}

/// One fleet update, as `GET /rollout/weights/updates/{id}` reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateRecord {
    pub update_id: UpdateId,
    pub version: String,
    pub path: String,
    /// SHA-256 of the checkpoint (see [`rollout_core::weights`] for the rule); `None` while the
    /// update is CHECKSUMMING.
    pub checksum: Option<String>,
    /// The checksum the publish asked for, if any: the update fails unless the files have it.
    #[serde(default)]
    pub expected_checksum: Option<String>,
    /// Bytes of the checkpoint's `*.safetensors` files.
    #[serde(default)]
    pub total_bytes: u64,
    /// Bytes hashed so far (equal to `total_bytes` once the checksum is known).
    #[serde(default)]
    pub hashed_bytes: HashProgress,
    /// Where engines load it from (the published path for `disk`; for `relay` the staged copy
    /// on the manager's node, whose name engines on agents find under their node's relay dir).
    /// Empty while the update is CHECKSUMMING (nothing is staged before the checksum is known).
    pub engine_path: String,
    pub previous_version: String,
    pub strategy: UpdateStrategy,
    /// Engines updated together (`max_unavailable`; the whole fleet for `all_at_once`).
    pub max_unavailable: Option<u32>,
    /// `/pause_generation` mode used by `all_at_once`.
    pub pause_mode: String,
    pub transport: String,
    pub status: WeightUpdateStatus,
    pub engines: BTreeMap<EngineId, EngineUpdate>,
    pub created_at: f64,
    pub updated_at: f64,
    pub finished_at: Option<f64>,
    pub error_message: Option<String>,
    pub message: String,
    pub history: Vec<Transition>,
    /// How many times a restarted manager took this update up again (0: never interrupted).
    #[serde(default)]
    pub resumed: u32,
    /// Where the bytes come from: a checkpoint on disk (a publish) or the trainer's broadcast.
    #[serde(default)]
    pub source: UpdateSource,
    /// A trainer update's group and tensors (None for a publish).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainer: Option<TrainerPart>,
}

/// Where an update's bytes come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpdateSource {
    /// A checkpoint directory, published with `POST /rollout/weights/publish`.
    #[default]
    Checkpoint,
    /// The trainer's NCCL broadcast (`POST /rollout/weights/trainer_updates`).
    Trainer,
}

/// One engine's place in a weight-update group (the trainer is rank 0).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupMember {
    pub engine_id: EngineId,
    pub url: String,
    pub tp_size: u32,
    pub rank_offset: u32,
}

/// A weight-update group: SGLang's `/init_weights_update_group` arguments for every member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainerGroup {
    pub group_name: String,
    pub master_address: String,
    pub master_port: u16,
    pub world_size: u32,
    pub members: Vec<GroupMember>,
    /// Built for this update (the trainer must join it as rank 0), or kept from the last one.
    pub new: bool,
}

impl TrainerGroup {
    /// Members as [`rollout_core::catchup::reuse_group`] compares them.
    pub fn member_keys(&self) -> Vec<rollout_core::catchup::Member<'_>> {
        self.members.iter().map(|m| (m.engine_id.as_str(), m.url.as_str(), m.tp_size)).collect()
    }
}

/// The trainer's side of a trainer update: the group, the tensors it broadcasts, and how far
/// the handshake with the trainer got.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerPart {
    pub group: TrainerGroup,
    pub names: Vec<String>,
    pub dtypes: Vec<String>,
    pub shapes: Vec<Vec<u64>>,
    pub flush_cache: bool,
    /// Every member joined the group (or the group was kept): the trainer may broadcast.
    pub group_ready: bool,
    /// When the trainer said it broadcasts (`POST .../broadcast`); engines are paused then.
    pub broadcast_at: Option<f64>,
    /// When every member was paused and about to receive.
    #[serde(default)]
    pub receiving_at: Option<f64>,
    /// Why the trainer gave up before broadcasting (`POST .../abort`).
    #[serde(default)]
    pub aborted: Option<String>,
}

/// The `history` entry written when a restarted manager resumes an update (not a status: the
/// update keeps its status, PENDING or UPDATING).
pub const RESUMED: &str = "RESUMED";

impl UpdateRecord {
    pub fn apply(&mut self, event: WeightUpdateEvent) -> Result<(), IllegalTransition> {
        let next = self.status.on(event)?;
        tracing::info!(update_id = %self.update_id, version = %self.version, from = %self.status, to = %next, "weight_update");
        self.status = next;
        self.updated_at = unix_now();
        if next.is_terminal() {
            self.finished_at = Some(self.updated_at);
            crate::foundation::telemetry::events()
                .weight_update_seconds
                .with_label_values(&[next.to_string().to_lowercase()])
                .observe((self.updated_at - self.created_at).max(0.0));
        }
        self.history.push(Transition { status: next.to_string(), at: self.updated_at });
        Ok(())
    }

    /// Moves one engine's progress; engines not yet listed start as PENDING. Illegal moves are
    /// ignored (an engine already VERIFIED stays so).
    pub fn engine(&mut self, engine_id: &EngineId, event: EngineUpdateEvent, error: Option<String>) {
        let now = unix_now();
        let e = self.engines.entry(engine_id.clone()).or_insert_with(EngineUpdate::pending);
        if let Ok(next) = e.status.on(event) {
            e.status = next;
            if event == EngineUpdateEvent::Start {
                e.started_at = Some(now);
            }
            if next.is_terminal() {
                e.finished_at = Some(now);
            }
            if error.is_some() {
                e.error = error;
            }
        }
    }

    pub fn version_record(&self) -> WeightVersion {
        WeightVersion {
            version: self.version.clone(),
            // A trainer's version exists only in the engines: no checkpoint to load it from.
            path: (self.source == UpdateSource::Checkpoint).then(|| self.path.clone()),
            checksum: self.checksum.clone().or_else(|| self.expected_checksum.clone()),
            published_seq: 0,
        }
    }
}

/// Bytes of a checkpoint hashed so far: shared between the hashing threads, which add to it,
/// and the record, which shows it (serialised as a plain number).
#[derive(Debug, Clone, Default)]
pub struct HashProgress(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl HashProgress {
    pub fn counter(&self) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
        self.0.clone()
    }

    pub fn get(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn set(&self, bytes: u64) {
        self.0.store(bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

impl PartialEq for HashProgress {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl Serialize for HashProgress {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u64(self.get())
    }
}

impl<'de> Deserialize<'de> for HashProgress {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let bytes = u64::deserialize(deserializer)?;
        let out = Self::default();
        out.set(bytes);
        Ok(out)
    }
}

/// Where the fleet's current weight version came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VersionSource {
    /// The `--weight-version` flag the manager started with.
    Startup,
    /// A committed weight update from a checkpoint.
    Publish,
    /// A committed update broadcast by the trainer: no checkpoint; engines that start later
    /// copy it from an engine that serves it.
    Trainer,
}

/// Who started a scale-out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Trigger {
    /// The boot-time bring-up of `--rollout-num-gpus`.
    Initial,
    /// A request to the API.
    User,
    /// The autoscaler.
    Autoscaler,
}

impl std::fmt::Display for Trigger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Trigger::Initial => "initial",
            Trigger::User => "user",
            Trigger::Autoscaler => "autoscaler",
        })
    }
}

/// An update record for tests: `version` published from `/ckpt/<version>`, staged at
/// `/stage/<version>`, in `status`, made at `at`.
#[cfg(test)]
pub(crate) fn test_update(id: &str, version: &str, at: f64, status: WeightUpdateStatus) -> UpdateRecord {
    UpdateRecord {
        update_id: UpdateId::parse(id).unwrap(),
        version: version.into(),
        path: format!("/ckpt/{version}"),
        checksum: Some(format!("sum-{version}")),
        expected_checksum: None,
        total_bytes: 0,
        hashed_bytes: HashProgress::default(),
        engine_path: format!("/stage/{version}"),
        previous_version: "default".into(),
        strategy: UpdateStrategy::Rolling,
        max_unavailable: None,
        pause_mode: "abort".into(),
        transport: "disk".into(),
        status,
        engines: BTreeMap::new(),
        created_at: at,
        updated_at: at,
        finished_at: None,
        error_message: None,
        message: String::new(),
        history: Vec::new(),
        resumed: 0,
        source: UpdateSource::Checkpoint,
        trainer: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, version: &str, at: f64, status: WeightUpdateStatus) -> UpdateRecord {
        test_update(id, version, at, status)
    }

    #[test]
    fn hash_progress_serialises_as_a_number_and_is_shared_by_clones() {
        let u = record("u", "v1", 0.0, WeightUpdateStatus::Checksumming);
        let counter = u.hashed_bytes.counter();
        let copy = u.clone();
        counter.fetch_add(42, std::sync::atomic::Ordering::Relaxed);
        let v = serde_json::to_value(&copy).unwrap();
        assert_eq!(v["hashed_bytes"], 42);
        let back: UpdateRecord = serde_json::from_value(v).unwrap();
        assert_eq!(back.hashed_bytes.get(), 42);
        assert_eq!(back, copy);
    }

    #[test]
    fn engine_progress_starts_pending_and_ignores_illegal_moves() {
        let mut u = record("u", "v1", 0.0, WeightUpdateStatus::Updating);
        let (e0, e1) = (EngineId::of_seq(0), EngineId::of_seq(1));
        u.engine(&e0, EngineUpdateEvent::Start, None);
        assert_eq!(u.engines["engine_0"].status, EngineUpdateStatus::Updating);
        assert!(u.engines["engine_0"].started_at.is_some());
        u.engine(&e0, EngineUpdateEvent::Fail, Some("bad header".into()));
        u.engine(&e0, EngineUpdateEvent::Verified, None);
        assert_eq!(u.engines["engine_0"].status, EngineUpdateStatus::Failed);
        assert_eq!(u.engines["engine_0"].error.as_deref(), Some("bad header"));
        u.engine(&e1, EngineUpdateEvent::Verified, None);
        assert_eq!(u.engines["engine_1"].status, EngineUpdateStatus::Verified);
    }
}
