//! The fleet's records: plain data, serialised as the HTTP API shows them and as the store
//! keeps them. Their state machines live in `rollout_core`; the methods here apply an event and
//! keep the record's timestamps and history.

use rollout_core::ids::{EngineId, OpId};
use rollout_core::IllegalTransition;
use serde::{Deserialize, Serialize};

/// `last_error` of a managed engine that a restarted manager starts again (until its restart
/// begins), for people; the registry marks the engine itself (`Engine::restart_queued`).
pub const RESTARTING: &str = "manager restarted; starting the engine again";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Transition {
    pub status: String,
    pub at: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FailedEngine {
    pub engine_id: EngineId,
    pub url: String,
    pub error: String,
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

/// The kind and id of the scale operation in progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningOp {
    pub kind: &'static str,
    pub request_id: OpId,
}

/// Updates kept in memory and in the store (the oldest finished ones are forgotten first).
pub const KEEP_UPDATES: usize = 100;

/// Where an update's bytes come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum UpdateSource {
    /// A checkpoint directory, published with `POST /rollout/weights/publish`.
    #[default]
    Checkpoint,
    /// The trainer's NCCL broadcast (`POST /rollout/weights/trainer_updates`).
    Trainer,
}

/// One engine's place in a weight-update group (the trainer is rank 0).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GroupMember {
    pub engine_id: EngineId,
    pub url: String,
    pub tp_size: u32,
    /// The engine's first rank; the trainer is rank 0.
    pub rank_offset: u32,
    /// Its process when it joined (a restarted member is no longer in the group).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

/// A weight-update group: SGLang's `/init_weights_update_group` arguments for every member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TrainerGroup {
    pub group_name: String,
    /// Where the trainer listens as rank 0.
    pub master_address: String,
    pub master_port: u16,
    /// 1 (the trainer) plus every member's `tp_size`.
    pub world_size: u32,
    pub members: Vec<GroupMember>,
    /// Built for this update (the trainer must join it as rank 0), or kept from the last one.
    pub new: bool,
    /// The trainer fixed the group's name and world size (`POST /rollout/weights/trainer_group`,
    /// for trainers that build their group once, as AReaL does): None for a group an update
    /// built. A fixed group is kept until the trainer destroys it, its members are held
    /// against scale-in, and engines beyond its world copy each new version from a member.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fixed: Option<FixedJoin>,
    /// The collective backend the members join over (`nccl`, or `gloo` for engines on CPU).
    #[serde(default)]
    pub backend: rollout_core::weights::GroupBackend,
}

/// How far the members of a group the trainer fixed got in joining it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum FixedJoin {
    /// `/init_weights_update_group` is in flight on the members (the trainer joins as rank 0).
    Joining,
    /// Every member joined: updates may name the group.
    Joined,
    /// A member could not join (or the manager restarted meanwhile); the group is unusable.
    Failed { error: String },
}

impl TrainerGroup {
    /// Members as [`rollout_core::catchup::reuse_group`] compares them.
    pub fn member_keys(&self) -> Vec<rollout_core::catchup::Member<'_>> {
        self.members.iter().map(|m| (m.engine_id.as_str(), m.url.as_str(), m.tp_size)).collect()
    }
}

/// The tensors of one `/update_weights_from_distributed` call, in broadcast order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    pub names: Vec<String>,
    pub dtypes: Vec<String>,
    pub shapes: Vec<Vec<u64>>,
}

/// What the trainer said it broadcasts next: a bucket of tensors (None: no more tensors, only
/// the end), and whether it is the last step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BroadcastStep {
    pub bucket: Option<Bucket>,
    pub last: bool,
}

/// The trainer's side of a trainer update: the group, the tensors it broadcasts, and how far
/// the handshake with the trainer got.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TrainerPart {
    pub group: TrainerGroup,
    /// The tensors, when the update was opened with them (one bucket); empty when the trainer
    /// names each bucket as it broadcasts it (`bucketed`).
    pub names: Vec<String>,
    pub dtypes: Vec<String>,
    pub shapes: Vec<Vec<u64>>,
    pub flush_cache: bool,
    /// The trainer sends its tensors in buckets, each named by its own `.../broadcast` call.
    #[serde(default)]
    pub bucketed: bool,
    /// Buckets the trainer announced so far.
    #[serde(default)]
    pub buckets_sent: u32,
    /// Buckets every member still taking part has answered.
    #[serde(default)]
    pub buckets_received: u32,
    /// The trainer sent its last step: no bucket follows.
    #[serde(default)]
    pub last_sent: bool,
    /// The step the update's task has not taken yet (kept in memory only: a restart fails a
    /// trainer update in flight anyway).
    #[serde(skip)]
    pub pending: Option<BroadcastStep>,
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

/// On the wire: the plain number of bytes.
impl utoipa::PartialSchema for HashProgress {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        <u64 as utoipa::PartialSchema>::schema()
    }
}

impl utoipa::ToSchema for HashProgress {}

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
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
