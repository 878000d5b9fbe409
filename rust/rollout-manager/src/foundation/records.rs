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

/// The fleet's weights: persisted as one record in the store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsState {
    /// The version every routable engine serves once no update runs.
    pub current: WeightVersion,
    /// Where engines load `current` from (None: the startup `--model-path`).
    pub current_engine_path: Option<String>,
    /// Where `current` came from.
    pub source: VersionSource,
    /// When `current` became the fleet's version.
    pub current_since: f64,
    /// The update that made `current`, if any.
    pub current_update: Option<UpdateId>,
    /// The update in flight: its target is what new engines start on.
    pub running: Option<UpdateId>,
    pub updates: BTreeMap<UpdateId, UpdateRecord>,
    pub next_seq: u64,
    /// The trainer's weight-update group the engines joined last (kept while its members stay).
    #[serde(default)]
    pub group: Option<TrainerGroup>,
    /// Groups built so far (names the next one).
    #[serde(default)]
    pub groups_built: u64,
}

impl WeightsState {
    pub fn new(startup_version: &str) -> Self {
        Self {
            current: WeightVersion::startup(startup_version),
            current_engine_path: None,
            source: VersionSource::Startup,
            current_since: unix_now(),
            current_update: None,
            running: None,
            updates: BTreeMap::new(),
            next_seq: 1,
            group: None,
            groups_built: 0,
        }
    }

    pub fn running_update(&self) -> Option<&UpdateRecord> {
        self.running.as_ref().and_then(|id| self.updates.get(id))
    }

    pub fn running_update_mut(&mut self) -> Option<&mut UpdateRecord> {
        let id = self.running.clone()?;
        self.updates.get_mut(&id)
    }

    /// The version engines must serve to become routable: the running update's target, else
    /// the current version; with the path they load it from (None: the startup model path).
    /// While the running update is still CHECKSUMMING its target is not known to be loadable,
    /// so engines keep starting on the current version.
    pub fn desired(&self) -> (WeightVersion, Option<String>) {
        match self.loading_update() {
            Some(u) if u.source == UpdateSource::Trainer => (u.version_record(), None),
            Some(u) => (u.version_record(), Some(u.engine_path.clone())),
            None => (self.current.clone(), self.current_engine_path.clone()),
        }
    }

    /// Whether the version engines must serve ([`WeightsState::desired`]) came from the
    /// trainer: it has no checkpoint, and an engine that does not serve it copies it from a
    /// peer (or waits for the trainer's next update) instead of loading it.
    pub fn desired_from_trainer(&self) -> bool {
        match self.loading_update() {
            Some(u) => u.source == UpdateSource::Trainer,
            None => self.source == VersionSource::Trainer,
        }
    }

    /// The running update once its checksum is known (PENDING or UPDATING): engines may be
    /// moving to its target.
    pub fn loading_update(&self) -> Option<&UpdateRecord> {
        self.running_update().filter(|u| u.status != WeightUpdateStatus::Checksumming)
    }

    /// Versions in publication order, oldest first (orders non-numeric versions for pins).
    pub fn version_order(&self) -> Vec<String> {
        let mut done: Vec<&UpdateRecord> =
            self.updates.values().filter(|u| u.status != WeightUpdateStatus::Failed).collect();
        done.sort_by(|a, b| a.created_at.total_cmp(&b.created_at));
        let mut out = Vec::new();
        if self.source == VersionSource::Startup || !done.iter().any(|u| u.version == self.current.version) {
            out.push(self.current.version.clone());
        }
        for u in done {
            if !out.contains(&u.version) {
                out.push(u.version.clone());
            }
        }
        out
    }

    /// Versions whose name is taken: the current one and every update that did not fail.
    pub fn known_versions(&self) -> Vec<WeightVersion> {
        let mut out = vec![self.current.clone()];
        out.extend(
            self.updates.values().filter(|u| u.status != WeightUpdateStatus::Failed).map(|u| u.version_record()),
        );
        out
    }

    /// Every version name the fleet has served: the current one, and each update's target
    /// (unless it failed) and the version it started from. A version an engine reports
    /// that is among these is not a trainer's new one (an engine that fell behind, or a
    /// reading from before an update), so the fleet never goes back to it by observation.
    pub fn seen_versions(&self) -> Vec<String> {
        let mut out = vec![self.current.version.clone()];
        for u in self.updates.values() {
            let target = (u.status != WeightUpdateStatus::Failed).then_some(&u.version);
            for v in target.into_iter().chain([&u.previous_version]) {
                if !out.contains(v) {
                    out.push(v.clone());
                }
            }
        }
        out
    }

    /// Whether an engine whose `/model_info` names `model_path` holds the fleet's model: the
    /// startup path, or a checkpoint the fleet published (SGLang renames an engine's
    /// `model_path` to the checkpoint's path on `/update_weights_from_disk`, so an engine that
    /// took a publish and is attached again names it).
    pub fn is_fleet_model(&self, startup_path: &str, model_path: &str) -> bool {
        model_path == startup_path
            || self.current_engine_path.as_deref() == Some(model_path)
            || self.updates.values().any(|u| {
                u.source == UpdateSource::Checkpoint
                    && u.status != WeightUpdateStatus::Failed
                    && (u.path == model_path || (!u.engine_path.is_empty() && u.engine_path == model_path))
            })
    }

    /// A trainer updated the engines without the manager and every serving engine (`engines`)
    /// now reports `version`: it becomes the fleet's version (source `trainer`), with a
    /// COMPLETED update recording what was observed, so the version history (and the pins'
    /// order) has it and engines that start later copy it from a peer.
    pub fn observe_trainer_version(&mut self, version: &str, engines: &[EngineId]) -> UpdateId {
        let now = unix_now();
        let update_id: UpdateId = uuid::Uuid::new_v4().into();
        let done = EngineUpdate {
            status: EngineUpdateStatus::Verified,
            error: None,
            started_at: Some(now),
            finished_at: Some(now),
        };
        let record = UpdateRecord {
            update_id: update_id.clone(),
            version: version.to_string(),
            path: String::new(),
            checksum: None,
            expected_checksum: None,
            total_bytes: 0,
            hashed_bytes: HashProgress::default(),
            engine_path: String::new(),
            previous_version: self.current.version.clone(),
            strategy: UpdateStrategy::AllAtOnce,
            max_unavailable: None,
            pause_mode: String::new(),
            transport: "trainer".into(),
            status: WeightUpdateStatus::Completed,
            engines: engines.iter().map(|id| (id.clone(), done.clone())).collect(),
            created_at: now,
            updated_at: now,
            finished_at: Some(now),
            error_message: None,
            message: format!(
                "observed: every serving engine reports {version}, which a trainer loaded without the manager"
            ),
            history: vec![Transition { status: WeightUpdateStatus::Completed.to_string(), at: now }],
            resumed: 0,
            source: UpdateSource::Trainer,
            trainer: None,
        };
        self.updates.insert(update_id.clone(), record);
        self.current =
            WeightVersion { version: version.to_string(), path: None, checksum: None, published_seq: self.next_seq };
        self.next_seq += 1;
        self.current_engine_path = None;
        self.source = VersionSource::Trainer;
        self.current_since = now;
        self.current_update = Some(update_id.clone());
        self.prune();
        tracing::info!(
            version,
            update_id = %update_id,
            "fleet weight version taken from the engines (a trainer updated them directly)"
        );
        update_id
    }

    /// Forgets the oldest finished updates beyond [`KEEP_UPDATES`]; running ones stay.
    pub fn prune(&mut self) {
        if self.updates.len() <= KEEP_UPDATES {
            return;
        }
        let mut done: Vec<(f64, UpdateId)> = self
            .updates
            .iter()
            .filter(|(id, u)| u.status.is_terminal() && self.current_update.as_ref() != Some(id))
            .map(|(id, u)| (u.created_at, id.clone()))
            .collect();
        done.sort_by(|a, b| a.0.total_cmp(&b.0));
        let excess = self.updates.len() - KEEP_UPDATES;
        for (_, id) in done.into_iter().take(excess) {
            self.updates.remove(&id);
        }
    }

    /// After a manager restart: the update that was in flight, if any, is marked resumed
    /// (count, `RESUMED` history entry, message) and keeps running; its id is returned.
    /// Whether it can really go on is checked next ([`check_resumable`]).
    pub fn resume_after_restart(&mut self) -> Option<UpdateId> {
        let u = self.running_update_mut()?;
        if u.status.is_terminal() {
            self.running = None;
            return None;
        }
        u.resumed += 1;
        u.updated_at = unix_now();
        u.history.push(Transition { status: RESUMED.into(), at: u.updated_at });
        u.message = format!("resumed after a manager restart ({} so far); publishing {}", u.resumed, u.version);
        tracing::info!(update_id = %u.update_id, version = %u.version, resumed = u.resumed, "weight update resumed after a restart");
        Some(u.update_id.clone())
    }

    /// Ends the running update FAILED because it cannot go on after a restart; the fleet stays
    /// on its current version (engines are brought back to it as they are re-adopted).
    pub fn fail_running(&mut self, why: &str) {
        if let Some(u) = self.running_update_mut() {
            u.error_message = Some(format!("{why}; the fleet stays on {}", u.previous_version));
            checked(u.apply(WeightUpdateEvent::Fail));
        }
        self.running = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, version: &str, at: f64, status: WeightUpdateStatus) -> UpdateRecord {
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

    #[test]
    fn the_fleets_model_is_the_startup_path_or_a_published_checkpoint() {
        let mut w = WeightsState::new("v0");
        w.updates.insert(UpdateId::parse("u1").unwrap(), record("u1", "v1", 1.0, WeightUpdateStatus::Completed));
        w.updates.insert(UpdateId::parse("u2").unwrap(), record("u2", "v2", 2.0, WeightUpdateStatus::Failed));
        let mut trained = record("u3", "v3", 3.0, WeightUpdateStatus::Completed);
        trained.source = UpdateSource::Trainer;
        w.updates.insert(UpdateId::parse("u3").unwrap(), trained);
        for (path, fleet) in [
            ("/models/base", true),
            ("/ckpt/v1", true),
            ("/stage/v1", true),
            ("/ckpt/v2", false),
            ("/ckpt/v3", false),
            ("/models/other", false),
            ("", false),
        ] {
            assert_eq!(w.is_fleet_model("/models/base", path), fleet, "{path}");
        }
    }

    #[test]
    fn desired_is_the_running_target_else_current() {
        let mut w = WeightsState::new("v0");
        assert_eq!(w.desired(), (WeightVersion::startup("v0"), None));
        w.updates.insert(UpdateId::parse("u1").unwrap(), record("u1", "v1", 1.0, WeightUpdateStatus::Updating));
        w.running = Some(UpdateId::parse("u1").unwrap());
        let (want, path) = w.desired();
        assert_eq!((want.version.as_str(), want.checksum.as_deref()), ("v1", Some("sum-v1")));
        assert_eq!(path.as_deref(), Some("/stage/v1"));
        // While its checkpoint is still being hashed, engines keep starting on the current one.
        w.updates.get_mut("u1").unwrap().status = WeightUpdateStatus::Checksumming;
        assert_eq!(w.desired(), (WeightVersion::startup("v0"), None));
        assert!(w.loading_update().is_none() && w.running_update().is_some());
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
    fn a_restart_resumes_the_running_update_and_counts_it() {
        let mut w = WeightsState::new("v0");
        assert_eq!(w.resume_after_restart(), None);
        w.updates.insert(UpdateId::parse("u1").unwrap(), record("u1", "v1", 1.0, WeightUpdateStatus::Updating));
        w.running = Some(UpdateId::parse("u1").unwrap());
        assert_eq!(w.resume_after_restart().as_deref(), Some("u1"));
        assert_eq!(w.resume_after_restart().as_deref(), Some("u1"));
        let u = &w.updates["u1"];
        assert_eq!((u.status, u.resumed), (WeightUpdateStatus::Updating, 2));
        let entries: Vec<&str> = u.history.iter().map(|h| h.status.as_str()).collect();
        assert_eq!(entries, vec![RESUMED, RESUMED]);
        // Still the target: new and re-adopted engines are brought to it.
        assert_eq!(w.desired().0.version, "v1");
        // One that cannot go on ends FAILED with the reason; the fleet stays where it was.
        w.fail_running("the checkpoint is gone");
        assert_eq!(w.running, None);
        let u = &w.updates["u1"];
        assert_eq!(u.status, WeightUpdateStatus::Failed);
        assert_eq!(u.error_message.as_deref(), Some("the checkpoint is gone; the fleet stays on default"));
        assert_eq!(w.desired().0.version, "v0");
        assert_eq!(w.resume_after_restart(), None);
    }

    #[test]
    fn records_written_before_resume_existed_read_as_never_resumed() {
        let mut v = serde_json::to_value(record("u", "v1", 0.0, WeightUpdateStatus::Updating)).unwrap();
        v.as_object_mut().unwrap().remove("resumed");
        let back: UpdateRecord = serde_json::from_value(v).unwrap();
        assert_eq!(back.resumed, 0);
    }

    #[test]
    fn version_order_and_known_versions_skip_failed_updates() {
        let mut w = WeightsState::new("v0");
        w.updates.insert(UpdateId::parse("a").unwrap(), record("a", "v1", 1.0, WeightUpdateStatus::Completed));
        w.updates.insert(UpdateId::parse("b").unwrap(), record("b", "bad", 2.0, WeightUpdateStatus::Failed));
        w.updates.insert(UpdateId::parse("c").unwrap(), record("c", "v2", 3.0, WeightUpdateStatus::Completed));
        assert_eq!(w.version_order(), vec!["v0", "v1", "v2"]);
        let known: Vec<String> = w.known_versions().into_iter().map(|v| v.version).collect();
        assert_eq!(known, vec!["v0", "v1", "v2"]);
    }

    #[test]
    fn prune_keeps_running_and_current_updates() {
        let mut w = WeightsState::new("v0");
        for i in 0..KEEP_UPDATES + 5 {
            let id = format!("u{i:04}");
            w.updates.insert(
                UpdateId::parse(&id).unwrap(),
                record(&id, &format!("v{i}"), i as f64, WeightUpdateStatus::Completed),
            );
        }
        w.current_update = Some(UpdateId::parse("u0000").unwrap());
        w.updates.get_mut("u0001").unwrap().status = WeightUpdateStatus::Updating;
        w.running = Some(UpdateId::parse("u0001").unwrap());
        w.prune();
        assert_eq!(w.updates.len(), KEEP_UPDATES);
        assert!(w.updates.contains_key("u0000") && w.updates.contains_key("u0001"));
        assert!(!w.updates.contains_key("u0002") && w.updates.contains_key("u0007"));
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
