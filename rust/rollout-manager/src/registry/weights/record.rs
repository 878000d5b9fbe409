//! A weight update's record: what `GET /rollout/weights/updates/{id}` shows and the store
//! keeps. Its fields are visible only to the weights part, which changes them through its named
//! steps; everyone else reads them through the getters. A new record is made whole before the
//! part takes it.

use crate::foundation::clock::unix_now;
use crate::foundation::records::{HashProgress, TrainerPart, Transition, UpdateSource};
use rollout_core::ids::{EngineId, UpdateId};
use rollout_core::weights::{
    EngineUpdateEvent, EngineUpdateStatus, UpdateStrategy, WeightUpdateEvent, WeightUpdateStatus, WeightVersion,
};
use rollout_core::IllegalTransition;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One engine's part in an update.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EngineUpdate {
    pub(super) status: EngineUpdateStatus,
    pub(super) error: Option<String>,
    pub(super) started_at: Option<f64>,
    pub(super) finished_at: Option<f64>,
}

impl EngineUpdate {
    /// An engine's part before its turn.
    pub fn pending() -> Self {
        Self { status: EngineUpdateStatus::Pending, error: None, started_at: None, finished_at: None }
    }
}

/// One fleet update, as `GET /rollout/weights/updates/{id}` reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(as = WeightUpdate)]
pub struct UpdateRecord {
    pub(super) update_id: UpdateId,
    pub(super) version: String,
    /// The checkpoint directory; empty for a trainer update.
    pub(super) path: String,
    /// The checkpoint's checksum (SHA-256 of its shards' listing, docs/api.md); null while the
    /// update is CHECKSUMMING.
    pub(super) checksum: Option<String>,
    /// The checksum the publish asked for, if any: the update fails unless the files have it.
    #[serde(default)]
    pub(super) expected_checksum: Option<String>,
    /// Bytes of the checkpoint's `*.safetensors` files.
    #[serde(default)]
    pub(super) total_bytes: u64,
    /// Bytes hashed so far (equal to `total_bytes` once the checksum is known).
    #[serde(default)]
    pub(super) hashed_bytes: HashProgress,
    /// Where engines load it from (the published path for `disk`; for `relay` the staged copy
    /// on the manager's node, whose name engines on agents find under their node's relay dir).
    /// Empty while the update is CHECKSUMMING (nothing is staged before the checksum is known).
    pub(super) engine_path: String,
    pub(super) previous_version: String,
    pub(super) strategy: UpdateStrategy,
    /// Engines updated together (`max_unavailable`; the whole fleet for `all_at_once`).
    pub(super) max_unavailable: Option<u32>,
    /// `/pause_generation` mode used by `all_at_once`.
    pub(super) pause_mode: String,
    pub(super) transport: String,
    pub(super) status: WeightUpdateStatus,
    pub(super) engines: BTreeMap<EngineId, EngineUpdate>,
    pub(super) created_at: f64,
    pub(super) updated_at: f64,
    pub(super) finished_at: Option<f64>,
    pub(super) error_message: Option<String>,
    pub(super) message: String,
    pub(super) history: Vec<Transition>,
    /// How many times a restarted manager took this update up again (0: never interrupted).
    #[serde(default)]
    pub(super) resumed: u32,
    /// Where the bytes come from: a checkpoint on disk (a publish) or the trainer's broadcast.
    #[serde(default)]
    pub(super) source: UpdateSource,
    /// A trainer update's group and tensors (None for a publish).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) trainer: Option<TrainerPart>,
}

/// What every new update names, whatever its kind.
#[derive(Debug, Clone)]
pub struct NewUpdate {
    pub update_id: UpdateId,
    /// The version it moves the fleet to.
    pub version: String,
    /// The fleet's version when it opened (the one the fleet stays on if it fails).
    pub previous_version: String,
    /// `/pause_generation` mode.
    pub pause_mode: String,
    /// What it does first, for people.
    pub message: String,
}

impl UpdateRecord {
    fn opened(new: NewUpdate, status: WeightUpdateStatus, source: UpdateSource, transport: String) -> Self {
        let now = unix_now();
        Self {
            update_id: new.update_id,
            version: new.version,
            path: String::new(),
            checksum: None,
            expected_checksum: None,
            total_bytes: 0,
            hashed_bytes: HashProgress::default(),
            engine_path: String::new(),
            previous_version: new.previous_version,
            strategy: UpdateStrategy::AllAtOnce,
            max_unavailable: None,
            pause_mode: new.pause_mode,
            transport,
            status,
            engines: BTreeMap::new(),
            created_at: now,
            updated_at: now,
            finished_at: None,
            error_message: None,
            message: new.message,
            history: vec![Transition { status: status.to_string(), at: now }],
            resumed: 0,
            source,
            trainer: None,
        }
    }

    /// A publish of the checkpoint at `path` (`total_bytes` in its files), CHECKSUMMING: it is
    /// hashed (and checked against `expected_checksum`) before anything is loaded.
    pub fn from_publish(
        new: NewUpdate,
        path: String,
        expected_checksum: Option<String>,
        total_bytes: u64,
        strategy: UpdateStrategy,
        max_unavailable: Option<u32>,
        transport: String,
    ) -> Self {
        let mut u = Self::opened(new, WeightUpdateStatus::Checksumming, UpdateSource::Checkpoint, transport);
        (u.path, u.expected_checksum, u.total_bytes) = (path, expected_checksum, total_bytes);
        (u.strategy, u.max_unavailable) = (strategy, max_unavailable);
        u
    }

    /// A trainer's update the fleet observed after the fact (every serving engine, `engines`,
    /// reports its version): COMPLETED, each engine verified.
    pub(super) fn observed(new: NewUpdate, engines: &[EngineId]) -> Self {
        let mut u = Self::opened(new, WeightUpdateStatus::Completed, UpdateSource::Trainer, "trainer".into());
        let done = EngineUpdate {
            status: EngineUpdateStatus::Verified,
            error: None,
            started_at: Some(u.created_at),
            finished_at: Some(u.created_at),
        };
        u.engines = engines.iter().map(|id| (id.clone(), done.clone())).collect();
        u.finished_at = Some(u.created_at);
        u
    }

    /// A trainer's update over its group, PENDING: every member takes part, all at once.
    pub fn from_trainer(new: NewUpdate, trainer: TrainerPart) -> Self {
        let mut u = Self::opened(new, WeightUpdateStatus::Pending, UpdateSource::Trainer, "trainer".into());
        u.engines = trainer.group.members.iter().map(|m| (m.engine_id.clone(), EngineUpdate::pending())).collect();
        u.trainer = Some(trainer);
        u
    }

    pub(super) fn apply(&mut self, event: WeightUpdateEvent) -> Result<(), IllegalTransition> {
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
    pub(super) fn engine(&mut self, engine_id: &EngineId, event: EngineUpdateEvent, error: Option<String>) {
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

impl EngineUpdate {
    pub fn status(&self) -> EngineUpdateStatus {
        self.status
    }

    pub fn error(&self) -> &Option<String> {
        &self.error
    }

    pub fn started_at(&self) -> Option<f64> {
        self.started_at
    }

    pub fn finished_at(&self) -> Option<f64> {
        self.finished_at
    }
}

impl UpdateRecord {
    pub fn update_id(&self) -> &UpdateId {
        &self.update_id
    }

    pub fn version(&self) -> &String {
        &self.version
    }

    pub fn path(&self) -> &String {
        &self.path
    }

    /// SHA-256 of the checkpoint (see [`rollout_core::weights`] for the rule); `None` while the
    /// update is CHECKSUMMING.
    pub fn checksum(&self) -> &Option<String> {
        &self.checksum
    }

    /// The checksum the publish asked for, if any: the update fails unless the files have it.
    pub fn expected_checksum(&self) -> &Option<String> {
        &self.expected_checksum
    }

    /// Bytes of the checkpoint's `*.safetensors` files.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Bytes hashed so far (equal to `total_bytes` once the checksum is known).
    pub fn hashed_bytes(&self) -> &HashProgress {
        &self.hashed_bytes
    }

    /// Where engines load it from (the published path for `disk`; for `relay` the staged copy
    /// on the manager's node, whose name engines on agents find under their node's relay dir).
    /// Empty while the update is CHECKSUMMING (nothing is staged before the checksum is known).
    pub fn engine_path(&self) -> &String {
        &self.engine_path
    }

    pub fn previous_version(&self) -> &String {
        &self.previous_version
    }

    pub fn strategy(&self) -> UpdateStrategy {
        self.strategy
    }

    /// Engines updated together (`max_unavailable`; the whole fleet for `all_at_once`).
    pub fn max_unavailable(&self) -> Option<u32> {
        self.max_unavailable
    }

    /// `/pause_generation` mode used by `all_at_once`.
    pub fn pause_mode(&self) -> &String {
        &self.pause_mode
    }

    pub fn transport(&self) -> &String {
        &self.transport
    }

    pub fn status(&self) -> WeightUpdateStatus {
        self.status
    }

    pub fn engines(&self) -> &BTreeMap<EngineId, EngineUpdate> {
        &self.engines
    }

    pub fn created_at(&self) -> f64 {
        self.created_at
    }

    pub fn updated_at(&self) -> f64 {
        self.updated_at
    }

    pub fn finished_at(&self) -> Option<f64> {
        self.finished_at
    }

    pub fn error_message(&self) -> &Option<String> {
        &self.error_message
    }

    pub fn message(&self) -> &String {
        &self.message
    }

    pub fn history(&self) -> &Vec<Transition> {
        &self.history
    }

    /// How many times a restarted manager took this update up again (0: never interrupted).
    pub fn resumed(&self) -> u32 {
        self.resumed
    }

    /// Where the bytes come from: a checkpoint on disk (a publish) or the trainer's broadcast.
    pub fn source(&self) -> UpdateSource {
        self.source
    }

    /// A trainer update's group and tensors (None for a publish).
    pub fn trainer(&self) -> &Option<TrainerPart> {
        &self.trainer
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
