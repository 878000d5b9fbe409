//! The weights part of the registry (`FleetInner::weights`): the fleet's current version and
//! where it came from, the weight updates (the one in flight and their history) and the
//! trainer's group. Persisted as one record in the store, which is why it sits beside `fleet`
//! and `store` rather than inside `fleet` (the store may not use the fleet).

mod record;
#[cfg(test)]
pub(crate) use record::test_update;
pub use record::{EngineUpdate, NewUpdate, UpdateRecord};

use crate::foundation::clock::unix_now;
use crate::foundation::records::{
    checked, BroadcastStep, Bucket, TrainerGroup, Transition, UpdateSource, VersionSource, KEEP_UPDATES, RESUMED,
};
use rollout_core::ids::{EngineId, UpdateId};
use rollout_core::weights::{EngineUpdateEvent, WeightUpdateEvent, WeightUpdateStatus, WeightVersion};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The fleet's weights: persisted as one record in the store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsState {
    /// The version every routable engine serves once no update runs.
    current: WeightVersion,
    /// Where engines load `current` from (None: the startup `--model-path`).
    current_engine_path: Option<String>,
    /// Where `current` came from.
    source: VersionSource,
    /// When `current` became the fleet's version.
    current_since: f64,
    /// The update that made `current`, if any.
    current_update: Option<UpdateId>,
    /// The update in flight: its target is what new engines start on.
    running: Option<UpdateId>,
    updates: BTreeMap<UpdateId, UpdateRecord>,
    next_seq: u64,
    /// The trainer's weight-update group the engines joined last (kept while its members stay).
    #[serde(default)]
    group: Option<TrainerGroup>,
    /// Groups built so far (names the next one).
    #[serde(default)]
    groups_built: u64,
}

impl WeightsState {
    /// The version every routable engine serves once no update runs.
    pub fn current(&self) -> &WeightVersion {
        &self.current
    }

    /// Where engines load the current version from (None: the startup `--model-path`).
    pub fn current_engine_path(&self) -> &Option<String> {
        &self.current_engine_path
    }

    /// Where the current version came from.
    pub fn source(&self) -> VersionSource {
        self.source
    }

    /// When the current version became the fleet's.
    pub fn current_since(&self) -> f64 {
        self.current_since
    }

    /// The update that made the current version, if any.
    pub fn current_update(&self) -> &Option<UpdateId> {
        &self.current_update
    }

    /// The update in flight, if any.
    pub fn running(&self) -> &Option<UpdateId> {
        &self.running
    }

    /// Every update kept (the one in flight and the history), by id.
    pub fn updates(&self) -> &BTreeMap<UpdateId, UpdateRecord> {
        &self.updates
    }

    /// Says where update `update_id` stands (its `message`), phrased by `say` from the record.
    pub fn tell(&mut self, update_id: &str, say: impl FnOnce(&UpdateRecord) -> String) {
        if let Some(u) = self.updates.get_mut(update_id) {
            u.message = say(u);
        }
    }

    /// Records one engine's step in update `update_id` (started, verified, failed with
    /// `error`, skipped); a step the engine's machine refuses is ignored.
    pub fn engine_turn(&mut self, update_id: &str, engine: &EngineId, event: EngineUpdateEvent, error: Option<String>) {
        if let Some(u) = self.updates.get_mut(update_id) {
            u.engine(engine, event, error);
        }
    }

    /// A CHECKSUMMING publish's checkpoint is hashed and staged: the update records what it
    /// loads and the engines it moves, and is PENDING. False, nothing changed, when it is not
    /// CHECKSUMMING any more (it failed meanwhile).
    pub fn checksummed(&mut self, update_id: &str, staged: Staged) -> bool {
        let checksumming = WeightUpdateStatus::Checksumming;
        let Some(u) = self.updates.get_mut(update_id).filter(|u| u.status == checksumming) else { return false };
        u.message = format!(
            "publishing {} ({} files, {} bytes) to the fleet, {}",
            u.version, staged.files, staged.total_bytes, u.strategy
        );
        u.checksum = Some(staged.checksum);
        u.engine_path = staged.engine_path;
        u.total_bytes = staged.total_bytes;
        u.hashed_bytes.set(staged.total_bytes);
        u.engines = staged.engines.into_iter().map(|id| (id, EngineUpdate::pending())).collect();
        checked(u.apply(WeightUpdateEvent::Checksummed));
        true
    }

    /// Engines start moving to update `update_id`'s target: a PENDING update is UPDATING from
    /// now (one resumed after a restart is already). None when it is unknown or has ended.
    pub fn updating(&mut self, update_id: &str) -> Option<&UpdateRecord> {
        let u = self.updates.get_mut(update_id).filter(|u| !u.status.is_terminal())?;
        if u.status == WeightUpdateStatus::Pending {
            checked(u.apply(WeightUpdateEvent::Start));
        }
        Some(u)
    }

    /// Ends update `update_id` FAILED with `why` (the fleet stays on the version it started
    /// from), unless it ended already; it is no longer in flight.
    pub fn fail(&mut self, update_id: &str, why: &str) {
        if let Some(u) = self.updates.get_mut(update_id) {
            u.error_message = Some(format!("{why}; the fleet stays on {}", u.previous_version));
            if let Err(e) = u.apply(WeightUpdateEvent::Fail) {
                tracing::info!(update_id = %update_id, error = %e, "the update had already ended");
            }
        }
        self.stop_running(update_id);
    }

    /// Like [`WeightsState::fail`], for a trainer update that ends before its broadcast: no
    /// engine took part, each is recorded skipped.
    pub fn fail_before_broadcast(&mut self, update_id: &str, why: &str) {
        if let Some(u) = self.updates.get_mut(update_id) {
            u.message = "failed before the broadcast".into();
            let members: Vec<EngineId> = u.engines.keys().cloned().collect();
            for id in members {
                u.engine(&id, EngineUpdateEvent::Skip, None);
            }
        }
        self.fail(update_id, why);
    }

    /// Update `update_id`'s checkpoint was staged again (its copy was gone after a restart).
    pub fn restaged_update(&mut self, update_id: &str, engine_path: String) {
        if let Some(u) = self.updates.get_mut(update_id) {
            u.engine_path = engine_path;
        }
    }

    /// Every member of trainer update `update_id`'s new group joined it: the trainer may start
    /// its broadcast.
    pub fn group_joined(&mut self, update_id: &str, group_name: &str) {
        let Some(u) = self.updates.get_mut(update_id) else { return };
        if let Some(t) = u.trainer.as_mut() {
            t.group_ready = true;
        }
        if !u.status.is_terminal() {
            u.message = format!(
                "every member joined group {group_name}: POST /rollout/weights/updates/{update_id}/broadcast, then broadcast"
            );
        }
    }

    /// The trainer's next step of its broadcast. An update opened with its tensors has one
    /// step, those tensors (`step` None; a second call changes nothing). A bucketed update takes
    /// one bucket per call, each once the one before was answered by every member, until the
    /// step marked last. Refused while the group's members have not all joined.
    pub fn trainer_sends(&mut self, update_id: &str, step: Option<BroadcastStep>) -> Result<(), TrainerStepRefused> {
        let u = self.updates.get_mut(update_id).ok_or(TrainerStepRefused::Unknown)?;
        let t = u.trainer.as_mut().ok_or(TrainerStepRefused::NotATrainerUpdate)?;
        if !t.group_ready {
            return Err(TrainerStepRefused::GroupNotReady);
        }
        let step = match (t.bucketed, step) {
            (false, Some(_)) => return Err(TrainerStepRefused::TensorsGivenAtOpen),
            (false, None) if t.broadcast_at.is_some() => return Ok(()),
            (false, None) => BroadcastStep {
                bucket: Some(Bucket { names: t.names.clone(), dtypes: t.dtypes.clone(), shapes: t.shapes.clone() }),
                last: true,
            },
            (true, None) => return Err(TrainerStepRefused::BucketExpected),
            (true, Some(_)) if t.last_sent => return Err(TrainerStepRefused::LastStepSent),
            (true, Some(step)) if step.bucket.is_none() && t.buckets_sent == 0 => {
                return Err(TrainerStepRefused::BucketExpected)
            }
            (true, Some(_)) if t.pending.is_some() || t.buckets_received < t.buckets_sent => {
                return Err(TrainerStepRefused::BucketInFlight)
            }
            (true, Some(step)) => step,
        };
        if t.broadcast_at.is_none() {
            t.broadcast_at = Some(unix_now());
        }
        if step.bucket.is_some() {
            t.buckets_sent += 1;
        }
        t.last_sent = step.last;
        u.message = match (t.bucketed, step.last) {
            (false, _) => format!("the trainer broadcasts {}; the engines receive it", u.version),
            (true, false) => {
                format!("the trainer broadcasts bucket {} of {}; the engines receive it", t.buckets_sent, u.version)
            }
            (true, true) => format!(
                "the trainer sent the last of {} buckets of {}; the engines finish the update",
                t.buckets_sent, u.version
            ),
        };
        t.pending = Some(step);
        Ok(())
    }

    /// The update's task takes the trainer's next step (None: there is none yet).
    pub fn take_step(&mut self, update_id: &str) -> Option<BroadcastStep> {
        self.updates.get_mut(update_id).and_then(|u| u.trainer.as_mut()).and_then(|t| t.pending.take())
    }

    /// Every member still taking part answered the trainer's latest bucket.
    pub fn bucket_received(&mut self, update_id: &str) {
        if let Some(t) = self.updates.get_mut(update_id).and_then(|u| u.trainer.as_mut()) {
            t.buckets_received = t.buckets_sent;
        }
    }

    /// The trainer gives up (the update's task ends it), for `reason`: before its broadcast,
    /// or between two buckets of a bucketed update. Nothing to do once the update ended;
    /// refused once the last step was sent (or the one broadcast of an unbucketed update
    /// started).
    pub fn trainer_aborts(&mut self, update_id: &str, reason: &str) -> Result<(), TrainerStepRefused> {
        let u = self.updates.get_mut(update_id).ok_or(TrainerStepRefused::Unknown)?;
        let ended = u.status.is_terminal();
        let t = u.trainer.as_mut().ok_or(TrainerStepRefused::NotATrainerUpdate)?;
        if ended {
            return Ok(());
        }
        if t.last_sent || (!t.bucketed && t.broadcast_at.is_some()) {
            return Err(TrainerStepRefused::BroadcastStarted);
        }
        t.aborted = Some(reason.to_string());
        Ok(())
    }

    /// Every member of trainer update `update_id` is paused and about to receive.
    pub fn members_receiving(&mut self, update_id: &str) {
        if let Some(t) = self.updates.get_mut(update_id).and_then(|u| u.trainer.as_mut()) {
            t.receiving_at = Some(unix_now());
        }
    }

    /// The publish order the next committed version gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The trainer's weight-update group the engines joined last.
    pub fn group(&self) -> &Option<TrainerGroup> {
        &self.group
    }

    /// Groups built so far (names the next one).
    pub fn groups_built(&self) -> u64 {
        self.groups_built
    }

    /// Records a new update as the one in flight (its target is what new engines start on
    /// from now); refused, naming the one in flight, while another runs.
    pub fn start(&mut self, record: UpdateRecord) -> Result<(), UpdateId> {
        if let Some(running) = &self.running {
            return Err(running.clone());
        }
        self.running = Some(record.update_id.clone());
        self.updates.insert(record.update_id.clone(), record);
        self.prune();
        Ok(())
    }

    /// `update_id` is no longer in flight (it ended); a no-op for any other id.
    pub fn stop_running(&mut self, update_id: &str) {
        if self.running.as_deref() == Some(update_id) {
            self.running = None;
        }
    }

    /// Makes `want` the fleet's version, from the update `update_id` (which must be UPDATING:
    /// false, nothing changed, otherwise: one that failed meanwhile leaves the version alone).
    /// The update's engines not yet done are recorded skipped (they left the fleet before their
    /// turn), the update COMMITTED, and nothing is in flight any more.
    pub fn commit(&mut self, update_id: &str, want: &WeightVersion) -> bool {
        let updating = WeightUpdateStatus::Updating;
        let Some(u) = self.updates.get_mut(update_id).filter(|u| u.status == updating) else { return false };
        let pending: Vec<EngineId> =
            u.engines.iter().filter(|(_, e)| !e.status.is_terminal()).map(|(id, _)| id.clone()).collect();
        for id in pending {
            u.engine(
                &id,
                rollout_core::weights::EngineUpdateEvent::Skip,
                Some("left the fleet before its turn".into()),
            );
        }
        u.message = format!("the fleet serves {}", u.version);
        checked(u.apply(WeightUpdateEvent::Commit));
        (self.current_engine_path, self.source) = match u.source {
            UpdateSource::Trainer => (None, VersionSource::Trainer),
            UpdateSource::Checkpoint => (Some(u.engine_path.clone()), VersionSource::Publish),
        };
        self.current = WeightVersion { published_seq: self.next_seq, ..want.clone() };
        self.next_seq += 1;
        self.current_since = unix_now();
        self.current_update = Some(u.update_id.clone());
        self.running = None;
        true
    }

    /// Where engines load the current version from now (it was staged again), if `version`
    /// is still the current one.
    pub fn restaged(&mut self, version: &str, engine_path: String) {
        if self.current.version == version {
            self.current_engine_path = Some(engine_path);
        }
    }

    /// The trainer's group the engines joined (None: forgotten, the next update builds one).
    pub fn set_group(&mut self, group: Option<TrainerGroup>) {
        self.group = group;
    }

    /// The members of the fixed group `group_name` joined it, or could not (`Err(why)`); a
    /// no-op when that group is no longer the one joining (it was destroyed or replaced).
    pub fn fixed_group_joined(&mut self, group_name: &str, outcome: Result<(), String>) {
        let joining = Some(crate::foundation::records::FixedJoin::Joining);
        if let Some(g) = self.group.as_mut().filter(|g| g.group_name == group_name && g.fixed == joining) {
            g.fixed = Some(match outcome {
                Ok(()) => crate::foundation::records::FixedJoin::Joined,
                Err(error) => crate::foundation::records::FixedJoin::Failed { error },
            });
        }
    }

    /// Forgets the trainer's group, returning it.
    pub fn take_group(&mut self) -> Option<TrainerGroup> {
        self.group.take()
    }

    /// Counts a group built now; its number names it.
    pub fn count_group_built(&mut self) -> u64 {
        self.groups_built += 1;
        self.groups_built
    }

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

    fn running_update_mut(&mut self) -> Option<&mut UpdateRecord> {
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
        let new = NewUpdate {
            update_id: update_id.clone(),
            version: version.to_string(),
            previous_version: self.current.version.clone(),
            pause_mode: String::new(),
            message: format!(
                "observed: every serving engine reports {version}, which a trainer loaded without the manager"
            ),
        };
        let record = UpdateRecord::observed(new, engines);
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
    /// Whether it can really go on is checked next (`crate::ops::weight_update::check_resumable`).
    /// A fixed group whose members were still joining is marked failed (the join was cut).
    pub fn resume_after_restart(&mut self) -> Option<UpdateId> {
        // A fixed group's join was cut: its members may hold part of it.
        if let Some(name) = self.group.as_ref().map(|g| g.group_name.clone()) {
            self.fixed_group_joined(&name, Err("the manager restarted while the members joined".into()));
        }
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
        if let Some(id) = self.running.clone() {
            self.fail(&id, why);
        }
        self.running = None;
    }
}

/// What staging a publish's checkpoint found ([`WeightsState::checksummed`]).
#[derive(Debug, Clone)]
pub struct Staged {
    /// The checkpoint's checksum.
    pub checksum: String,
    /// Where engines load it from.
    pub engine_path: String,
    pub total_bytes: u64,
    pub files: usize,
    /// The engines the update moves (those routable now).
    pub engines: Vec<EngineId>,
}

/// Why a trainer's step on its update was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainerStepRefused {
    /// No such update.
    Unknown,
    /// The update loads a checkpoint; the trainer has no part in it.
    NotATrainerUpdate,
    /// The members of a new group have not all joined it yet.
    GroupNotReady,
    /// The broadcast has started (or its last bucket was sent): the update ends when every
    /// member has answered.
    BroadcastStarted,
    /// The update was opened with its tensors: the broadcast call names none.
    TensorsGivenAtOpen,
    /// The update is bucketed: each broadcast call names its bucket.
    BucketExpected,
    /// The last step was sent already.
    LastStepSent,
    /// The bucket before has not been answered by every member yet.
    BucketInFlight,
}

#[cfg(test)]
mod tests {
    use super::*;
    use rollout_core::weights::{EngineUpdateStatus, WeightUpdateStatus};

    fn record(id: &str, version: &str, at: f64, status: WeightUpdateStatus) -> UpdateRecord {
        crate::registry::weights::test_update(id, version, at, status)
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
    fn one_update_in_flight_and_a_commit_only_from_updating() {
        let mut w = WeightsState::new("v0");
        w.start(record("u1", "v1", 1.0, WeightUpdateStatus::Pending)).unwrap();
        assert_eq!(w.start(record("u2", "v2", 2.0, WeightUpdateStatus::Pending)), Err(UpdateId::parse("u1").unwrap()));
        assert!(!w.updates().contains_key("u2"), "a refused update is not recorded");
        let v1 = w.updates()["u1"].version_record();
        assert!(!w.commit("u1", &v1), "PENDING does not commit");
        w.stop_running("u2");
        assert_eq!(w.running().as_deref(), Some("u1"), "only the update in flight stops itself");
        assert_eq!(w.updating("u1").map(|u| u.status), Some(WeightUpdateStatus::Updating));
        let engine = EngineId::of_seq(3);
        w.updates.get_mut("u1").unwrap().engines.insert(engine.clone(), EngineUpdate::pending());
        let seq = w.next_seq();
        assert!(w.commit("u1", &v1));
        assert_eq!((w.current().version.as_str(), w.current().published_seq, w.next_seq()), ("v1", seq, seq + 1));
        assert_eq!((w.source(), w.current_engine_path().as_deref()), (VersionSource::Publish, Some("/stage/v1")));
        assert_eq!((w.running(), w.current_update().as_deref()), (&None, Some("u1")));
        assert_eq!(
            w.updates()["u1"].engines[engine.as_str()].status,
            EngineUpdateStatus::Skipped,
            "left before its turn"
        );
        assert!(!w.commit("u1", &v1), "a committed update does not commit twice");
        w.restaged("v0", "/elsewhere".into());
        assert_eq!(w.current_engine_path().as_deref(), Some("/stage/v1"), "only the current version is restaged");
        assert_eq!((w.count_group_built(), w.count_group_built(), w.groups_built()), (1, 2, 2));
    }

    fn trainer_record(id: &str, version: &str) -> UpdateRecord {
        use crate::foundation::records::{TrainerGroup, TrainerPart};
        let mut u = record(id, version, 1.0, WeightUpdateStatus::Pending);
        u.source = UpdateSource::Trainer;
        let group = TrainerGroup {
            group_name: "g1".into(),
            master_address: "127.0.0.1".into(),
            master_port: 1,
            world_size: 2,
            members: vec![],
            new: true,
            fixed: None,
            backend: rollout_core::weights::GroupBackend::Nccl,
        };
        u.trainer = Some(TrainerPart {
            group,
            names: vec!["w".into()],
            dtypes: vec!["bfloat16".into()],
            shapes: vec![vec![1]],
            flush_cache: false,
            bucketed: false,
            buckets_sent: 0,
            buckets_received: 0,
            last_sent: false,
            pending: None,
            group_ready: false,
            broadcast_at: None,
            receiving_at: None,
            aborted: None,
        });
        u
    }

    #[test]
    fn the_trainers_handshake_goes_forward_only() {
        let mut w = WeightsState::new("v0");
        w.start(trainer_record("t1", "v1")).unwrap();
        assert_eq!(w.trainer_sends("nope", None), Err(TrainerStepRefused::Unknown));
        assert_eq!(w.trainer_sends("t1", None), Err(TrainerStepRefused::GroupNotReady), "the group is not joined yet");
        w.group_joined("t1", "g1");
        assert!(w.updates()["t1"].message.contains("every member joined group g1"));
        assert_eq!(w.trainer_sends("t1", Some(step(&["a"], false))), Err(TrainerStepRefused::TensorsGivenAtOpen));
        assert_eq!(w.trainer_sends("t1", None), Ok(()));
        let taken = w.take_step("t1").unwrap();
        assert!(taken.last, "the tensors given at the open are the one and last step");
        assert_eq!(taken.bucket.unwrap().names, vec!["w".to_string()]);
        let at = w.updates()["t1"].trainer.as_ref().unwrap().broadcast_at;
        assert!(at.is_some());
        assert_eq!(w.trainer_sends("t1", None), Ok(()), "a second call is answered the same");
        assert_eq!(w.take_step("t1"), None, "and gives no second step");
        assert_eq!(w.updates()["t1"].trainer.as_ref().unwrap().broadcast_at, at, "and changes nothing");
        assert_eq!(w.trainer_aborts("t1", "gave up"), Err(TrainerStepRefused::BroadcastStarted));
        w.members_receiving("t1");
        assert!(w.updates()["t1"].trainer.as_ref().unwrap().receiving_at.is_some());

        let mut w = WeightsState::new("v0");
        w.start(record("p1", "v1", 1.0, WeightUpdateStatus::Pending)).unwrap();
        assert_eq!(w.trainer_sends("p1", None), Err(TrainerStepRefused::NotATrainerUpdate));
        assert_eq!(w.trainer_aborts("p1", "x"), Err(TrainerStepRefused::NotATrainerUpdate));
        let mut w = WeightsState::new("v0");
        w.start(trainer_record("t2", "v2")).unwrap();
        assert_eq!(w.trainer_aborts("t2", "could not join"), Ok(()));
        assert_eq!(w.updates()["t2"].trainer.as_ref().unwrap().aborted.as_deref(), Some("could not join"));
    }

    fn step(names: &[&str], last: bool) -> BroadcastStep {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let bucket = (!names.is_empty()).then(|| Bucket {
            dtypes: vec!["bfloat16".into(); names.len()],
            shapes: vec![vec![1]; names.len()],
            names,
        });
        BroadcastStep { bucket, last }
    }

    #[test]
    fn a_bucketed_broadcast_takes_one_bucket_at_a_time_until_the_last() {
        let mut w = WeightsState::new("v0");
        let mut u = trainer_record("t1", "v1");
        if let Some(t) = u.trainer.as_mut() {
            (t.names, t.dtypes, t.shapes, t.bucketed) = (vec![], vec![], vec![], true);
        }
        w.start(u).unwrap();
        w.group_joined("t1", "g1");
        assert_eq!(w.trainer_sends("t1", None), Err(TrainerStepRefused::BucketExpected));
        assert_eq!(
            w.trainer_sends("t1", Some(step(&[], true))),
            Err(TrainerStepRefused::BucketExpected),
            "an end before any bucket would tell the engines a version they never got"
        );
        assert_eq!(w.trainer_sends("t1", Some(step(&["a", "b"], false))), Ok(()));
        assert_eq!(
            w.trainer_sends("t1", Some(step(&["c"], false))),
            Err(TrainerStepRefused::BucketInFlight),
            "a bucket waits until every member answered the one before"
        );
        assert_eq!(w.take_step("t1"), Some(step(&["a", "b"], false)));
        assert_eq!(w.trainer_sends("t1", Some(step(&["c"], false))), Err(TrainerStepRefused::BucketInFlight));
        w.bucket_received("t1");
        assert_eq!(w.trainer_aborts("x", "r"), Err(TrainerStepRefused::Unknown));
        assert_eq!(w.trainer_sends("t1", Some(step(&["c"], false))), Ok(()));
        assert!(w.updates()["t1"].message.contains("bucket 2 of v1"), "{}", w.updates()["t1"].message);
        w.take_step("t1");
        w.bucket_received("t1");
        assert_eq!(w.trainer_sends("t1", Some(step(&[], true))), Ok(()), "the end may come without tensors");
        let t = w.updates()["t1"].trainer.clone().unwrap();
        assert_eq!((t.buckets_sent, t.buckets_received, t.last_sent), (2, 2, true));
        assert_eq!(w.trainer_sends("t1", Some(step(&["d"], true))), Err(TrainerStepRefused::LastStepSent));
        assert_eq!(w.trainer_aborts("t1", "late"), Err(TrainerStepRefused::BroadcastStarted));

        // Between two buckets the trainer may still give up.
        let mut w = WeightsState::new("v0");
        let mut u = trainer_record("t2", "v2");
        if let Some(t) = u.trainer.as_mut() {
            (t.names, t.dtypes, t.shapes, t.bucketed) = (vec![], vec![], vec![], true);
        }
        w.start(u).unwrap();
        w.group_joined("t2", "g1");
        w.trainer_sends("t2", Some(step(&["a"], false))).unwrap();
        assert_eq!(w.trainer_aborts("t2", "out of memory"), Ok(()));
        assert_eq!(w.updates()["t2"].trainer.as_ref().unwrap().aborted.as_deref(), Some("out of memory"));
    }

    #[test]
    fn a_failed_update_names_the_version_the_fleet_stays_on_and_ends_once() {
        let mut w = WeightsState::new("v0");
        let mut t = trainer_record("t1", "v1");
        t.previous_version = "v0".into();
        t.engines.insert(EngineId::of_seq(1), EngineUpdate::pending());
        w.start(t).unwrap();
        w.fail_before_broadcast("t1", "members could not join");
        let u = &w.updates()["t1"];
        assert_eq!(u.status, WeightUpdateStatus::Failed);
        assert_eq!(u.error_message.as_deref(), Some("members could not join; the fleet stays on v0"));
        assert_eq!(u.engines[EngineId::of_seq(1).as_str()].status, EngineUpdateStatus::Skipped);
        assert_eq!(w.running(), &None);
        w.fail("t1", "again");
        assert_eq!(w.updates()["t1"].status, WeightUpdateStatus::Failed, "an ended update stays ended");
        assert_eq!(w.current().version, "v0");
    }

    #[test]
    fn a_publish_is_checksummed_once_and_only_while_checksumming() {
        let mut w = WeightsState::new("v0");
        w.start(record("p1", "v1", 1.0, WeightUpdateStatus::Checksumming)).unwrap();
        assert!(w.updating("p1").is_some_and(|u| u.status == WeightUpdateStatus::Checksumming), "not loadable yet");
        let staged = Staged {
            checksum: "abc".into(),
            engine_path: "/stage/v1".into(),
            total_bytes: 10,
            files: 2,
            engines: vec![EngineId::of_seq(1), EngineId::of_seq(2)],
        };
        assert!(w.checksummed("p1", staged.clone()));
        let u = &w.updates()["p1"];
        assert_eq!((u.status, u.checksum.as_deref(), u.total_bytes), (WeightUpdateStatus::Pending, Some("abc"), 10));
        assert_eq!((u.hashed_bytes.get(), u.engines.len()), (10, 2));
        assert!(!w.checksummed("p1", staged), "a PENDING update is not checksummed again");
        assert_eq!(w.updating("p1").map(|u| u.status), Some(WeightUpdateStatus::Updating));
        assert_eq!(w.updating("p1").map(|u| u.status), Some(WeightUpdateStatus::Updating), "UPDATING stays");
        w.engine_turn("p1", &EngineId::of_seq(1), rollout_core::weights::EngineUpdateEvent::Start, None);
        assert_eq!(w.updates()["p1"].engines[EngineId::of_seq(1).as_str()].status, EngineUpdateStatus::Updating);
        w.fail("p1", "x");
        assert!(w.updating("p1").is_none(), "an ended update does not start again");
    }
}
