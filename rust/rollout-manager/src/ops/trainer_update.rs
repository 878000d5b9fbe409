//! Weights from the trainer: an update whose bytes the trainer broadcasts over NCCL (SGLang's
//! `/init_weights_update_group` + `/update_weights_from_distributed`), run by the manager so
//! that the fleet's version, the registry, the pins and the metrics follow it.
//!
//! Expected flow (`POST /rollout/weights/trainer_updates`, then
//! `POST /rollout/weights/updates/{id}/broadcast`; `elastic_rollout.trainer` is the client):
//! 1. [`open`]: the update is PENDING with the version as the fleet's target, so no engine
//!    becomes routable on another version while it runs (engines that start meanwhile wait, see
//!    [`crate::ops::manager::Manager::sync_weights`]). Its members are the ACTIVE engines and the
//!    engines waiting for the trainer's version, frozen until the update ends. The answer is
//!    the group layout: the group of the last update when the trainer names it and the members
//!    did not change, else a new group (new name, the trainer's master address and port). A
//!    group whose layout the trainer fixed ([`crate::ops::trainer_group`]) is kept as it is.
//! 2. `run`: for a new group, the old one is destroyed on its members still here, and every
//!    member joins the new one (`/init_weights_update_group`, in parallel) while the trainer
//!    joins as rank 0. Any member that cannot join fails the update before anything is paused.
//! 3. The trainer calls `.../broadcast` (answered once the group is ready) and broadcasts. The
//!    manager takes the ACTIVE members out of routing (WEIGHT_SYNCING) and, on every member in
//!    parallel: `/pause_generation` (the update's mode), `/begin_weight_update` (0.5.21 and
//!    later; a 404 means the release has no sessions), `/update_weights_from_distributed`,
//!    `/end_weight_update`, `/continue_generation`, then `/model_info` must report the version.
//! 4. Members that verified return to routing on the new version; the fleet version moves to
//!    it (source `trainer`) once every READY or ACTIVE engine serves it. A member that failed
//!    its part is out of routing (FAILED) and is restarted, copying the new version from a
//!    member that has it. When no member verified, the update is FAILED and the fleet stays.
//!
//! A trainer that fails before it broadcasts says so (`.../abort`): the update ends FAILED and
//! the group is destroyed; nothing was paused. A trainer that never broadcasts is timed out
//! after `--weight-update-timeout-secs`. A manager restart fails a trainer update in flight
//! (the broadcast cannot be resumed) and continues every member it may have paused.

use crate::adapters::engine_api::EngineError;
use crate::foundation::records::{BroadcastStep, Bucket, GroupMember, TrainerGroup, TrainerPart, UpdateSource};
use crate::ops::manager::Manager;
use crate::ops::op_error::OpError;
use crate::ops::weight_update::Turn;
use crate::registry::weights::TrainerStepRefused;
use crate::registry::weights::UpdateRecord;
use rollout_core::ids::{EngineId, UpdateId, VersionName};
use rollout_core::weights::{EngineUpdateEvent, WeightVersion};
use rollout_core::{EngineEvent, EngineStatus};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// Torch dtype names SGLang's distributed update accepts.
const DTYPES: &[&str] = &[
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
];

/// What the trainer asks for (`POST /rollout/weights/trainer_updates`).
#[derive(Debug, Clone)]
pub struct OpenRequest {
    pub version: VersionName,
    /// The tensors, in broadcast order; empty when the trainer names each bucket as it
    /// broadcasts it.
    pub tensors: Bucket,
    pub pause_mode: String,
    pub flush_cache: bool,
    /// Where the trainer listens as rank 0 when a new group is built.
    pub master_address: String,
    pub master_port: u16,
    /// The group the trainer holds (None: it holds none, so a new one is built).
    pub group_name: Option<String>,
    /// Prefix of a new group's name.
    pub group_prefix: String,
    /// The collective backend a new group is built over.
    pub backend: rollout_core::weights::GroupBackend,
}

/// 400 unless `bucket` names one or more tensors, each with a dtype SGLang accepts and a shape.
pub fn check_bucket(bucket: &Bucket) -> Result<(), OpError> {
    let n = bucket.names.len();
    if n == 0 || bucket.dtypes.len() != n || bucket.shapes.len() != n {
        return Err(OpError::invalid(
            "invalid_tensors",
            format!(
                "names, dtypes and shapes must be non-empty lists of equal length (got {}, {} and {}): one entry per tensor, in broadcast order",
                n,
                bucket.dtypes.len(),
                bucket.shapes.len()
            ),
        ));
    }
    if let Some(bad) = bucket.dtypes.iter().find(|d| !DTYPES.contains(&d.as_str())) {
        return Err(OpError::invalid(
            "invalid_dtype",
            format!("dtype {bad:?} is not a torch dtype name SGLang accepts; use one of {}", DTYPES.join(", ")),
        ));
    }
    Ok(())
}

fn check(req: &OpenRequest) -> Result<(), OpError> {
    if req.tensors != Bucket::default() {
        check_bucket(&req.tensors)?;
    }
    if !rollout_core::weights::PauseMode::known(&req.pause_mode) {
        return Err(OpError::invalid(
            "invalid_pause_mode",
            format!("pause_mode {:?} must be abort, retract or in_place", req.pause_mode),
        ));
    }
    if req.master_address.trim().is_empty() || req.master_port == 0 {
        return Err(OpError::invalid(
            "invalid_master",
            "master_address and master_port (1-65535) must name where the trainer listens as rank 0",
        ));
    }
    let prefix_ok = !req.group_prefix.is_empty()
        && req.group_prefix.len() <= 64
        && req.group_prefix.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if !prefix_ok {
        return Err(OpError::invalid(
            "invalid_group_prefix",
            format!("group_prefix {:?} must be 1 to 64 letters, digits, _ or -", req.group_prefix),
        ));
    }
    Ok(())
}

/// Opens a trainer update (see the module docs). Err: 400 for a bad request; 409 when another
/// update runs, the version name is taken, or no engine can take part.
pub fn open(manager: &Arc<Manager>, req: OpenRequest) -> Result<UpdateRecord, OpError> {
    check(&req)?;
    let update_id: UpdateId = uuid::Uuid::new_v4().into();
    let (record, old_group) = manager.fleet.update(|inner| -> Result<_, OpError> {
        refuse_if_busy(inner, &req.version)?;
        let (group, old_group) = plan_group(inner, &req)?;
        let record = new_record(&update_id, &req, &group, inner.weights.current().version.clone());
        inner.weights.start(record.clone()).map_err(|running| crate::ops::weight_update::in_flight(&running))?;
        inner.weights.set_group(Some(group));
        tracing::info!(update_id = %update_id, version = %req.version, "trainer update opened");
        Ok((record, old_group))
    })?;
    let m = manager.clone();
    let id = update_id.clone();
    manager.tasks.spawn(async move { run(m, id, old_group).await });
    Ok(record)
}

/// 409 while another update runs or when `version` was served before.
fn refuse_if_busy(inner: &crate::registry::fleet::FleetInner, version: &str) -> Result<(), OpError> {
    if let Some(u) = inner.weights.running_update() {
        return Err(OpError::conflict(
            "update_in_progress",
            format!(
                "update {} to {} is in progress ({}); wait for it to finish (GET /rollout/weights/updates/{}), then update again",
                u.update_id(), u.version(), u.status(), u.update_id()
            ),
        ));
    }
    if inner.weights.known_versions().iter().any(|v| v.version == version) {
        return Err(OpError::conflict(
            "version_conflict",
            format!("version {version} is taken (the fleet serves or served it); name every update anew"),
        ));
    }
    Ok(())
}

/// The group this update broadcasts over: the current one when its members and master are
/// unchanged (and the trainer did not name another), else a new one over the engines that can
/// take part now, each with its rank offset. With a new group, the old one (to destroy).
/// 409 when no engine can take part.
fn plan_group(
    inner: &mut crate::registry::fleet::FleetInner,
    req: &OpenRequest,
) -> Result<(TrainerGroup, Option<TrainerGroup>), OpError> {
    if let Some(kept) = crate::ops::trainer_group::reuse_fixed(inner, req.group_name.as_deref())? {
        return Ok((kept, None));
    }
    let members = crate::ops::trainer_group::takers(inner);
    if members.is_empty() {
        return Err(OpError::conflict(
            "no_active_engines",
            "no engine is ACTIVE to receive the weights; wait for the fleet (GET /rollout/engines), then update",
        ));
    }
    let world_size = members.last().map_or(1, |m| m.rank_offset + m.tp_size);
    let keys: Vec<rollout_core::catchup::Member<'_>> =
        members.iter().map(|m| (m.engine_id.as_str(), m.url.as_str(), m.tp_size)).collect();
    let current = inner.weights.group().as_ref();
    let current_keys = current.map(TrainerGroup::member_keys);
    let reuse = rollout_core::catchup::reuse_group(
        current.zip(current_keys.as_deref()).map(|(g, k)| (g.group_name.as_str(), g.master_address.as_str(), k)),
        req.group_name.as_deref(),
        &req.master_address,
        &keys,
    );
    Ok(match (reuse, current) {
        (true, Some(g)) if g.backend == req.backend => (TrainerGroup { new: false, ..g.clone() }, None),
        _ => {
            let built = inner.weights.count_group_built();
            let g = TrainerGroup {
                group_name: format!("{}_{}", req.group_prefix, built),
                master_address: req.master_address.clone(),
                master_port: req.master_port,
                world_size,
                members,
                new: true,
                fixed: None,
                backend: req.backend,
            };
            (g, inner.weights.take_group())
        }
    })
}

/// The record of a trainer update just opened over `group` (PENDING: its members join first
/// where the group is new).
fn new_record(update_id: &UpdateId, req: &OpenRequest, group: &TrainerGroup, previous_version: String) -> UpdateRecord {
    let message = if group.new {
        format!(
            "new group {}: the trainer joins as rank 0 at {}:{}, then POSTs /rollout/weights/updates/{update_id}/broadcast",
            group.group_name, group.master_address, group.master_port
        )
    } else {
        format!("group {} kept: POST /rollout/weights/updates/{update_id}/broadcast, then broadcast", group.group_name)
    };
    let new = crate::registry::weights::NewUpdate {
        update_id: update_id.clone(),
        version: req.version.to_string(),
        previous_version,
        pause_mode: req.pause_mode.clone(),
        message,
    };
    let part = TrainerPart {
        group_ready: !group.new,
        group: group.clone(),
        names: req.tensors.names.clone(),
        dtypes: req.tensors.dtypes.clone(),
        shapes: req.tensors.shapes.clone(),
        flush_cache: req.flush_cache,
        bucketed: req.tensors.names.is_empty(),
        buckets_sent: 0,
        buckets_received: 0,
        last_sent: false,
        pending: None,
        broadcast_at: None,
        receiving_at: None,
        aborted: None,
    };
    UpdateRecord::from_trainer(new, part)
}

/// The answer for an update id nobody knows (or a text that cannot be one).
pub fn unknown_update(update_id: &str) -> OpError {
    OpError::unknown(
        "unknown_request",
        format!("no weight update with id {update_id}; list them with GET /rollout/weights/updates"),
    )
}

/// The API's answer to a trainer step the weights part refused.
fn refused(update_id: &UpdateId, why: TrainerStepRefused) -> OpError {
    match why {
        TrainerStepRefused::Unknown => unknown_update(update_id),
        TrainerStepRefused::NotATrainerUpdate => OpError::conflict(
            "not_a_trainer_update",
            format!("update {update_id} publishes a checkpoint; only a trainer update is broadcast or aborted by the trainer"),
        ),
        TrainerStepRefused::GroupNotReady => OpError::conflict(
            "group_not_ready",
            format!("the members of update {update_id} have not all joined the group yet; call again"),
        ),
        TrainerStepRefused::BroadcastStarted => OpError::conflict(
            "broadcast_started",
            format!("the broadcast of update {update_id} has started; it ends when every member has answered"),
        ),
        TrainerStepRefused::TensorsGivenAtOpen => OpError::invalid(
            "tensors_given_at_open",
            format!("update {update_id} was opened with its tensors; POST .../broadcast without a body (open it without names to send buckets)"),
        ),
        TrainerStepRefused::BucketExpected => OpError::invalid(
            "bucket_expected",
            format!("update {update_id} was opened without tensors: each .../broadcast names its bucket ({{\"names\", \"dtypes\", \"shapes\", \"last\"}}), or ends the update with {{\"last\": true}}"),
        ),
        TrainerStepRefused::LastStepSent => OpError::conflict(
            "last_bucket_sent",
            format!("the last bucket of update {update_id} was sent; wait for the update (GET /rollout/weights/updates/{update_id})"),
        ),
        TrainerStepRefused::BucketInFlight => OpError::conflict(
            "bucket_in_flight",
            format!("the members of update {update_id} have not all received the bucket before; call again"),
        ),
    }
}

fn trainer_update(inner: &crate::registry::fleet::FleetInner, update_id: &UpdateId) -> Result<UpdateRecord, OpError> {
    let u = inner.weights.updates().get(update_id).ok_or_else(|| unknown_update(update_id))?;
    if u.trainer().is_none() {
        return Err(OpError::conflict(
            "not_a_trainer_update",
            format!("update {update_id} publishes a checkpoint; only trainer updates take this call"),
        ));
    }
    Ok(u.clone())
}

/// Waits (up to `limit`) until `done` holds for the update's record, and answers the record.
async fn wait_for(
    manager: &Manager,
    update_id: &UpdateId,
    limit: Duration,
    done: impl Fn(&UpdateRecord) -> bool,
) -> Result<UpdateRecord, OpError> {
    manager
        .watch(limit, || {
            let u = trainer_update(&manager.fleet.lock(), update_id)?;
            let done = done(&u);
            Ok((u, done))
        })
        .await
}

/// The trainer is about to broadcast `step` (None: the tensors it opened the update with).
/// Once every member joined the group (and, for a bucket after the first, received the one
/// before), the manager takes the step; answered then, with the record (UPDATING) once every
/// member is paused and about to receive. 400 for a step that does not fit the update (see
/// [`TrainerStepRefused`]); 409 when the update failed (the group could not be built, or it
/// timed out) or ended, or its last bucket was sent.
pub async fn start_broadcast(
    manager: &Arc<Manager>,
    update_id: &UpdateId,
    step: Option<BroadcastStep>,
) -> Result<UpdateRecord, OpError> {
    if let Some(bucket) = step.as_ref().and_then(|s| s.bucket.as_ref()) {
        check_bucket(bucket)?;
    }
    // A step that does not fit the update is refused before any wait.
    let opened = trainer_update(&manager.fleet.lock(), update_id)?;
    if let Some(t) = opened.trainer() {
        let misfit = match (t.bucketed, &step) {
            (false, Some(_)) => Some(TrainerStepRefused::TensorsGivenAtOpen),
            (true, None) => Some(TrainerStepRefused::BucketExpected),
            (true, Some(s)) if s.bucket.is_none() && t.buckets_sent == 0 => Some(TrainerStepRefused::BucketExpected),
            _ => None,
        };
        if let Some(why) = misfit {
            return Err(refused(update_id, why));
        }
    }
    let limit = Duration::from_secs_f64(manager.config.weight_update_timeout_secs);
    let ready = |u: &UpdateRecord| {
        u.status().is_terminal()
            || u.trainer().as_ref().is_some_and(|t| {
                t.group_ready && (t.last_sent || (t.pending.is_none() && t.buckets_received == t.buckets_sent))
            })
    };
    let u = wait_for(manager, update_id, limit, ready).await?;
    if u.status().is_terminal() {
        return Err(OpError::conflict(
            "update_ended",
            format!(
                "update {update_id} is {}: {}",
                u.status(),
                u.error_message().as_deref().unwrap_or("nothing more to broadcast")
            ),
        ));
    }
    manager.fleet.update(|inner| inner.weights.trainer_sends(update_id, step)).map_err(|e| refused(update_id, e))?;
    // Answered once every member is paused and about to receive.
    let receiving =
        |u: &UpdateRecord| u.status().is_terminal() || u.trainer().as_ref().is_some_and(|t| t.receiving_at.is_some());
    wait_for(manager, update_id, limit, receiving).await
}

/// After the trainer broadcast bucket `n` (1-based): waits until every member received it, or
/// the update ended, for at most `--weight-update-timeout-secs`; answers the record as it is
/// then (the caller tells the three apart).
pub async fn wait_received(manager: &Manager, update_id: &UpdateId, n: u32) -> Result<UpdateRecord, OpError> {
    let limit = Duration::from_secs_f64(manager.config.weight_update_timeout_secs);
    wait_for(manager, update_id, limit, |u| {
        u.status().is_terminal() || u.trainer().as_ref().is_some_and(|t| t.buckets_received >= n)
    })
    .await
}

/// Waits until the update ended (its members told the version and verified it, or it failed),
/// for at most `--weight-update-timeout-secs` plus 5 s.
pub async fn wait_ended(manager: &Manager, update_id: &UpdateId) -> Result<UpdateRecord, OpError> {
    let limit = Duration::from_secs_f64(manager.config.weight_update_timeout_secs) + Duration::from_secs(5);
    wait_for(manager, update_id, limit, |u| u.status().is_terminal()).await
}

/// The trainer gives up before broadcasting (it could not join, say): the update ends FAILED
/// with `reason`, the group is destroyed on its members, nothing was paused. Answered once the
/// update has ended. 409 once the broadcast started (the update then ends when the members
/// answer, each within `--weight-update-timeout-secs`).
pub async fn abort(manager: &Arc<Manager>, update_id: &UpdateId, reason: &str) -> Result<UpdateRecord, OpError> {
    manager.fleet.update(|inner| inner.weights.trainer_aborts(update_id, reason)).map_err(|e| refused(update_id, e))?;
    let limit = Duration::from_secs_f64(manager.config.weight_update_timeout_secs) + Duration::from_secs(5);
    wait_for(manager, update_id, limit, |u| u.status().is_terminal()).await
}

/// [`crate::ops::trainer_group::build`], after giving up a trainer update still running over a group the trainer fixed: a
/// trainer that builds its group again was restarted, so the rank 0 that update waits on is gone
/// (left alone it would hold every member in its receive, and refuse this build, until
/// `--weight-update-timeout-secs`). An update whose last step was sent is not given up: the build
/// waits for its end. The give-up restarts the members left waiting, and the build
/// waits for them ([`crate::ops::trainer_group::build_when_it_fits`]).
pub async fn rebuild_group(
    manager: &Arc<Manager>,
    req: crate::ops::trainer_group::BuildRequest,
) -> Result<TrainerGroup, OpError> {
    crate::ops::trainer_group::check(&req)?;
    let running = {
        let inner = manager.fleet.lock();
        inner.weights.running_update().and_then(|u| {
            let t = u.trainer().as_ref().filter(|t| t.group.fixed.is_some())?;
            Some((u.update_id().clone(), t.last_sent))
        })
    };
    match running {
        Some((update_id, false)) => {
            let reason = "the trainer built a new group: the rank 0 this update waited on is gone";
            tracing::warn!(%update_id, group = %req.group_name, "{reason}; giving the update up");
            abort(manager, &update_id, reason).await?;
        }
        Some((update_id, true)) => {
            // Its last step was sent: it ends by itself (verifying, catching engines up).
            let limit = Duration::from_secs_f64(manager.config.weight_update_timeout_secs);
            wait_for(manager, &update_id, limit, |u| u.status().is_terminal()).await?;
        }
        None => {}
    }
    crate::ops::trainer_group::build_when_it_fits(manager, req).await
}

/// Runs an opened update to its end (see the module docs). Never panics; every outcome is
/// recorded on the update.
async fn run(manager: Arc<Manager>, update_id: UpdateId, old_group: Option<TrainerGroup>) {
    let Some((group, want)) = ({
        let inner = manager.fleet.lock();
        inner
            .weights
            .updates()
            .get(&update_id)
            .and_then(|u| u.trainer().as_ref().map(|t| (t.group.clone(), u.version_record())))
    }) else {
        return;
    };
    let timeout = Duration::from_secs_f64(manager.config.weight_update_timeout_secs);
    if let Some(old) = old_group {
        // The engines still here leave the old group; the trainer's side is the trainer's.
        let here: Vec<GroupMember> = {
            let inner = manager.fleet.lock();
            old.members.iter().filter(|m| inner.engines.contains_key(&m.engine_id)).cloned().collect()
        };
        crate::ops::trainer_group::destroy(&manager, &old.group_name, &here).await;
    }
    if group.new && !join_group(&manager, &update_id, &group, timeout).await {
        return;
    }
    // Wait for the trainer: broadcast, abort, a timeout, or the manager's shutdown.
    let started = next_step(&manager, &update_id);
    let outcome = tokio::select! {
        r = tokio::time::timeout(timeout, started) => r,
        () = manager.shutdown.cancelled() => return,
    };
    let first = match outcome {
        Ok(Ok(step)) => step,
        Ok(Err(None)) => return,
        Ok(Err(Some(reason))) => {
            crate::ops::trainer_group::destroy(&manager, &group.group_name, &group.members).await;
            let why = format!("aborted by the trainer before its broadcast: {reason}; nothing was paused");
            return end_before_broadcast(&manager, &update_id, &why, true);
        }
        Err(_) => {
            let why = format!(
                "the trainer did not broadcast within {}s of opening the update (POST /rollout/weights/updates/{update_id}/broadcast); nothing was paused",
                timeout.as_secs()
            );
            // The group stays: the trainer may still hold it and name it next time.
            return end_before_broadcast(&manager, &update_id, &why, false);
        }
    };
    broadcast(&manager, &update_id, &group, &want, first).await;
}

/// The members of a new group join it (`/init_weights_update_group`, all at once); true when
/// every one did, else the update ended FAILED (nothing was paused) and the ones that joined left.
async fn join_group(manager: &Manager, update_id: &UpdateId, group: &TrainerGroup, timeout: Duration) -> bool {
    if let Err(why) = crate::ops::trainer_group::join_members(manager, group, timeout).await {
        end_before_broadcast(manager, update_id, &format!("{why}; nothing was paused"), true);
        return false;
    }
    manager.fleet.update(|inner| inner.weights.group_joined(update_id, &group.group_name));
    true
}

/// Waits for the trainer's next step of its broadcast and takes it (`Ok`), or for its abort
/// (`Err` with its reason; `Err(None)` when the update or the registry is gone).
async fn next_step(manager: &Manager, update_id: &UpdateId) -> Result<BroadcastStep, Option<String>> {
    let mut changes = manager.fleet.subscribe();
    loop {
        let state = {
            let inner = manager.fleet.lock();
            let t = inner.weights.updates().get(update_id).and_then(|u| u.trainer().as_ref());
            t.map(|t| (t.aborted.clone(), t.pending.is_some()))
        };
        match state {
            None => return Err(None),
            Some((Some(reason), _)) => return Err(Some(reason)),
            Some((None, true)) => {
                if let Some(step) = manager.fleet.update(|inner| inner.weights.take_step(update_id)) {
                    return Ok(step);
                }
            }
            Some((None, false)) => {}
        }
        if changes.changed().await.is_err() {
            return Err(None);
        }
    }
}

/// Resolves with the trainer's reason once it aborted the update (or once the update is gone).
async fn aborted(manager: &Manager, update_id: &UpdateId) -> String {
    let mut changes = manager.fleet.subscribe();
    loop {
        let reason = {
            let inner = manager.fleet.lock();
            match inner.weights.updates().get(update_id).and_then(|u| u.trainer().as_ref()) {
                None => Some("the update is gone".to_string()),
                Some(t) => t.aborted.clone(),
            }
        };
        if let Some(reason) = reason {
            return reason;
        }
        if changes.changed().await.is_err() {
            return "the registry is gone".into();
        }
    }
}

/// Ends the update FAILED before any engine was paused; the fleet stays where it was.
fn end_before_broadcast(manager: &Manager, update_id: &UpdateId, why: &str, forget_group: bool) {
    tracing::warn!(update_id = %update_id, error = why, "trainer update failed");
    manager.fleet.update(|inner| {
        inner.weights.fail_before_broadcast(update_id, why);
        if forget_group {
            inner.weights.set_group(None);
        }
    });
}

/// One member's side of the broadcast, as it goes.
struct Receiver {
    m: GroupMember,
    /// It was ACTIVE and left routing for the update.
    routed: bool,
    /// Its update session is open (SGLang 0.5.21 on).
    session: bool,
    /// It loaded a bucket: it no longer holds only the version it served before.
    loaded: bool,
    /// Why its part failed; it takes no more buckets then.
    failed: Option<EngineError>,
}

/// The broadcast: every member's side in parallel, bucket after bucket, then the commit.
async fn broadcast(
    manager: &Arc<Manager>,
    update_id: &UpdateId,
    group: &TrainerGroup,
    want: &WeightVersion,
    first: BroadcastStep,
) {
    let plan = start_members(manager, update_id, group);
    let Some((pause_mode, flush_cache)) = manager.fleet.lock().weights.updates().get(update_id).and_then(|u| {
        let t = u.trainer().as_ref()?;
        Some((u.pause_mode().clone(), t.flush_cache))
    }) else {
        return;
    };
    // Every member paused (and in its session) first, so the trainer's broadcast meets engines
    // that hold no running request; then every member receives.
    let prepared =
        futures::future::join_all(plan.iter().map(|(m, _)| watched(manager, &m.url, prepare(manager, m, &pause_mode))))
            .await;
    manager.fleet.update(|inner| inner.weights.members_receiving(update_id));
    let mut members: Vec<Receiver> = plan
        .into_iter()
        .zip(prepared)
        .map(|((m, routed), ready)| {
            let (session, failed) = match ready {
                Ok(session) => (session, None),
                Err(e) => (false, Some(e)),
            };
            Receiver { m, routed, session, loaded: false, failed }
        })
        .collect();
    let ended = receive_buckets(manager, update_id, &group.group_name, want, flush_cache, first, &mut members).await;
    let ended = &ended;
    let results =
        futures::future::join_all(members.iter_mut().map(|r| finish(manager, r, ended, want, flush_cache))).await;
    // When no member got the version, the fleet stays on its own, and a member that failed
    // but still verifiably serves it goes back to routing: restarting it could leave no engine
    // holding a version that exists only in the engines.
    let none_got_it = results.iter().all(Result::is_err);
    // Engines beyond a fixed group's world serve the old version: out of routing now, as the
    // members come back on the new one, and caught up once the update has ended.
    let parked = if none_got_it { Vec::new() } else { crate::ops::trainer_group::park_non_members(manager, group) };
    let turns = futures::future::join_all(members.iter().zip(results).map(|(r, result)| async move {
        // A member that loaded a bucket holds part of a version: it cannot go back.
        if none_got_it && r.routed && !r.loaded {
            if let Some(turn) = back_on_current(manager, &r.m, &result).await {
                return turn;
            }
        }
        settle(manager, r, want, result).await
    }))
    .await;
    let interrupted = manager.shutdown.is_cancelled();
    let plan: Vec<(GroupMember, bool)> = members.into_iter().map(|r| (r.m, r.routed)).collect();
    let (verified, failures, restart) = record_turns(manager, update_id, &plan, &turns);
    if interrupted {
        return;
    }
    if verified == 0 {
        let why = format!("no member received {}: {}", want.version, failures.join("; "));
        crate::ops::weight_update::fail(manager, update_id, want, &why).await;
        return crate::ops::trainer_group::catch_up(manager, parked);
    }
    let committed = commit_when_settled(manager, update_id, want).await;
    crate::ops::trainer_group::catch_up(manager, parked);
    if !committed {
        return;
    }
    if !failures.is_empty() {
        tracing::warn!(update_id = %update_id, failures = ?failures, "members failed their part; they are restarted on a copy of the new version");
        let says = format!(
            "the fleet serves {}; {} member(s) failed their part and are restarted on a copy of it",
            want.version,
            failures.len()
        );
        manager.fleet.update(|inner| inner.weights.tell(update_id, |_| says));
        for id in restart {
            let m = manager.clone();
            if m.config.restart_failed_engines {
                manager.tasks.spawn(async move { m.recover(&id, Duration::ZERO).await });
            }
        }
    }
}

/// The broadcast starts: ACTIVE members leave routing; the others (waiting for weights,
/// draining) take part as they are, since a member missing from the collective would hang the
/// trainer's broadcast; members gone are skipped. Each member taking part, and whether it was
/// routed.
fn start_members(manager: &Manager, update_id: &UpdateId, group: &TrainerGroup) -> Vec<(GroupMember, bool)> {
    manager.fleet.update(|inner| {
        let mut plan = Vec::new();
        for m in &group.members {
            let status = inner.engines.get(&m.engine_id).map(|e| e.status());
            let routed = status == Some(EngineStatus::Active);
            let alive = matches!(
                status,
                Some(
                    EngineStatus::Active
                        | EngineStatus::WeightSyncing
                        | EngineStatus::Draining
                        | EngineStatus::Unhealthy
                )
            );
            if routed {
                crate::foundation::records::checked(inner.engines.event(&m.engine_id, EngineEvent::UpdateWeights));
            }
            if alive {
                inner.weights.engine_turn(update_id, &m.engine_id, EngineUpdateEvent::Start, None);
            } else {
                let why = Some("left the fleet before the broadcast".into());
                inner.weights.engine_turn(update_id, &m.engine_id, EngineUpdateEvent::Skip, why);
            }
            if alive {
                plan.push((m.clone(), routed));
            }
        }
        let pending = inner
            .weights
            .updates()
            .get(update_id)
            .is_some_and(|u| u.status() == rollout_core::weights::WeightUpdateStatus::Pending);
        debug_assert!(pending, "the broadcast of update {update_id} starts on a PENDING update");
        if !pending {
            tracing::error!(update_id = %update_id, "the broadcast starts on an update that is not PENDING");
        }
        inner.weights.updating(update_id);
        plan
    })
}

/// Records each member's turn on the update: how many verified the version, why the others
/// failed, and the failed ones (to restart).
fn record_turns(
    manager: &Manager,
    update_id: &UpdateId,
    plan: &[(GroupMember, bool)],
    turns: &[Turn],
) -> (usize, Vec<String>, Vec<EngineId>) {
    let mut verified = 0usize;
    let mut failures = Vec::new();
    let mut restart = Vec::new();
    manager.fleet.update(|inner| {
        for ((m, _), turn) in plan.iter().zip(turns) {
            let w = &mut inner.weights;
            match turn {
                Turn::Verified => {
                    verified += 1;
                    w.engine_turn(update_id, &m.engine_id, EngineUpdateEvent::Verified, None);
                }
                Turn::Skipped => {
                    let why = Some("left the fleet during its turn".into());
                    w.engine_turn(update_id, &m.engine_id, EngineUpdateEvent::Skip, why)
                }
                Turn::Failed(why) => {
                    w.engine_turn(update_id, &m.engine_id, EngineUpdateEvent::Fail, Some(why.clone()));
                    failures.push(format!("{}: {why}", m.engine_id));
                    restart.push(m.engine_id.clone());
                }
            }
        }
    });
    (verified, failures, restart)
}

/// Commits the version once every ACTIVE engine is a member that received it (one that did not
/// left routing), waiting up to 30 s for the registry to settle if one is still behind (a member
/// returning to routing); else the update fails. False when it did not commit.
async fn commit_when_settled(manager: &Arc<Manager>, update_id: &UpdateId, want: &WeightVersion) -> bool {
    let mut changes = manager.fleet.subscribe();
    let settle_by = tokio::time::Instant::now() + Duration::from_secs(30);
    while !crate::ops::weight_update::commit(manager, update_id, want) {
        tokio::select! {
            _ = changes.changed() => {}
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            () = tokio::time::sleep_until(settle_by) => break,
            () = manager.shutdown.cancelled() => return false,
        }
    }
    if manager.fleet.lock().weights.running().as_deref() == Some(update_id) {
        let why = "engines on another version stayed routable; the update could not commit".to_string();
        crate::ops::weight_update::fail(manager, update_id, want, &why).await;
        return false;
    }
    true
}

/// `work` on the engine at `url`, given up when the engine stops answering (out of routing,
/// it is not health-probed; an engine that hangs now would hold the update).
async fn watched<T>(
    manager: &Manager,
    url: &str,
    work: impl std::future::Future<Output = Result<T, EngineError>>,
) -> Result<T, EngineError> {
    tokio::select! {
        result = work => result,
        why = crate::ops::health::stops_answering(manager, url) => Err(EngineError::Unresponsive(why)),
    }
}

/// A member's first step: `/pause_generation`, then `/begin_weight_update`. Ok(whether a
/// session was opened; false on releases without sessions).
async fn prepare(manager: &Manager, m: &GroupMember, pause_mode: &str) -> Result<bool, EngineError> {
    let timeout = Duration::from_secs_f64(manager.config.weight_update_timeout_secs);
    manager.engine_api.control(&m.url, "/pause_generation", json!({"mode": pause_mode})).await?;
    manager.engine_api.weights_call(&m.url, "/begin_weight_update", json!({}), timeout).await
}

/// The trainer's buckets, each received by every member still taking part (in parallel), from
/// `first` until the trainer's last step. Ok(whether the members must still be told the
/// version: the last step named no tensors); Err(why the trainer stopped before its last step:
/// it aborted, sent nothing in time, or every member failed).
async fn receive_buckets(
    manager: &Manager,
    update_id: &UpdateId,
    group_name: &str,
    want: &WeightVersion,
    flush_cache: bool,
    first: BroadcastStep,
    members: &mut [Receiver],
) -> Result<bool, String> {
    let timeout = Duration::from_secs_f64(manager.config.weight_update_timeout_secs);
    let mut step = first;
    let mut received = 0u32;
    loop {
        if let Some(bucket) = &step.bucket {
            // The version and the cache flush come with the last bucket, once all of it is in.
            let body = json!({"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes,
                              "group_name": group_name, "weight_version": step.last.then_some(&want.version),
                              "flush_cache": flush_cache && step.last});
            let body = &body;
            let taking_part = members.iter_mut().filter(|r| r.failed.is_none());
            let receiving = futures::future::join_all(taking_part.map(|r| async move {
                let call = manager.engine_api.weights_call(
                    &r.m.url,
                    "/update_weights_from_distributed",
                    body.clone(),
                    timeout,
                );
                match watched(manager, &r.m.url, call).await {
                    Ok(true) => r.loaded = true,
                    Ok(false) => {
                        let detail = "not served (404)".into();
                        r.failed = Some(EngineError::Refused { path: "/update_weights_from_distributed", detail });
                    }
                    Err(e) => {
                        // Unless it says the receive itself failed (then nothing was loaded),
                        // it may hold part of the bucket: SGLang asks to discard the weights
                        // after a failed load, and a call cut by a timeout may still load.
                        r.loaded |= !receive_failed(&e);
                        r.failed = Some(e);
                    }
                }
            }));
            // A trainer that gives the update up mid-bucket (its rank 0 is gone: it was
            // restarted) never sends the rest: the members must not wait out the timeout.
            let gave_up = tokio::select! {
                _ = receiving => None,
                reason = aborted(manager, update_id) => Some(reason),
            };
            if let Some(reason) = gave_up {
                for r in members.iter_mut().filter(|r| r.failed.is_none()) {
                    // It may hold part of the bucket: it is restarted, not continued.
                    r.loaded = true;
                    r.failed = Some(EngineError::UpdateStopped(format!("the trainer gave the update up: {reason}")));
                }
                return Err(format!("the trainer aborted during bucket {}: {reason}", received + 1));
            }
            received += 1;
            if members.iter().all(|r| r.failed.is_some()) {
                return Err(format!("every member failed bucket {received}"));
            }
            manager.fleet.update(|inner| inner.weights.bucket_received(update_id));
        }
        if step.last {
            return Ok(step.bucket.is_none());
        }
        let next = tokio::select! {
            r = tokio::time::timeout(timeout, next_step(manager, update_id)) => r,
            () = manager.shutdown.cancelled() => return Err("the manager is shutting down".into()),
        };
        step = match next {
            Ok(Ok(step)) => step,
            Ok(Err(Some(reason))) => return Err(format!("the trainer aborted after {received} bucket(s): {reason}")),
            Ok(Err(None)) => return Err("the update is gone".into()),
            Err(_) => {
                return Err(format!(
                    "the trainer sent no bucket within {}s after bucket {received} (POST /rollout/weights/updates/{update_id}/broadcast)",
                    timeout.as_secs()
                ))
            }
        };
    }
}

/// Whether an engine's refusal of `/update_weights_from_distributed` says the tensors never
/// arrived, so nothing was loaded (SGLang 0.5.23: "Failed to receive weights: ...", returned
/// before `load_weights`; older releases receive and load in one step and say nothing of the
/// kind).
fn receive_failed(e: &EngineError) -> bool {
    matches!(e, EngineError::Refused { detail, .. } if detail.contains("Failed to receive weights"))
}

/// A member's last step. One that received every bucket ends its session, is told the version
/// (and flushes its cache) when the last bucket did not, continues, and must report the
/// version in `/model_info`. Any other failed its part: it continues with what it holds if it
/// loaded nothing, else it stays paused until it is stopped.
async fn finish(
    manager: &Manager,
    r: &mut Receiver,
    ended: &Result<bool, String>,
    want: &WeightVersion,
    flush_cache: bool,
) -> Result<(Option<String>, Option<String>), EngineError> {
    let failed = match (r.failed.take(), ended) {
        (None, Ok(tell)) => {
            let complete = complete(manager, &r.m, r.session, *tell, want, flush_cache);
            return watched(manager, &r.m.url, complete).await;
        }
        (Some(e), _) => e,
        (None, Err(why)) => EngineError::UpdateStopped(why.clone()),
    };
    if r.loaded {
        // It holds part of the version: it must not generate again (it is stopped and started
        // afresh, see `settle`), so it stays paused.
        return Err(failed);
    }
    let api = &manager.engine_api;
    if r.session {
        let timeout = Duration::from_secs(30);
        let _ = api.weights_call(&r.m.url, "/end_weight_update", json!({}), timeout).await;
    }
    // Resume even after a failed step: SGLang keeps serving what it held, untouched.
    let _ = api.control(&r.m.url, "/continue_generation", json!({})).await;
    Err(failed)
}

/// A member that received every bucket: `/end_weight_update` (when a session is open), the
/// version (`/update_weight_version`, `/flush_cache`) when `tell`, `/continue_generation`, and
/// the version `/model_info` reports.
async fn complete(
    manager: &Manager,
    m: &GroupMember,
    session: bool,
    tell: bool,
    want: &WeightVersion,
    flush_cache: bool,
) -> Result<(Option<String>, Option<String>), EngineError> {
    let timeout = Duration::from_secs_f64(manager.config.weight_update_timeout_secs);
    let api = &manager.engine_api;
    let url = m.url.as_str();
    let served = |path: &'static str| {
        move |served: bool| {
            if served {
                Ok(())
            } else {
                Err(EngineError::Refused { path, detail: "not served (404)".into() })
            }
        }
    };
    let mut done = if session {
        api.weights_call(url, "/end_weight_update", json!({}), timeout).await.map(|_| ())
    } else {
        Ok(())
    };
    if tell && done.is_ok() {
        // Not abort_all_requests (SGLang's default): the paused requests go on after the update.
        let body = json!({"new_version": want.version, "abort_all_requests": false});
        done = api
            .weights_call(url, "/update_weight_version", body, timeout)
            .await
            .and_then(served("/update_weight_version"));
    }
    if tell && flush_cache && done.is_ok() {
        done = api.weights_call(url, "/flush_cache", json!({}), timeout).await.and_then(served("/flush_cache"));
    }
    // Resume even after a failed step: SGLang keeps serving what it holds.
    api.control(url, "/continue_generation", json!({})).await?;
    done?;
    let (found, checksum) = manager.served_weights(&m.engine_id).await?;
    crate::adapters::engine_api::verify(want, found.as_deref(), checksum.as_deref())?;
    Ok((found, checksum))
}

/// A routed member whose part failed, put back into routing on the fleet's current version if
/// it still serves it (`/model_info`; SGLang keeps the old weights when a receive fails). None:
/// it does not (or cannot be asked), and the usual failure applies.
async fn back_on_current(
    manager: &Manager,
    m: &GroupMember,
    result: &Result<(Option<String>, Option<String>), EngineError>,
) -> Option<Turn> {
    let Err(why) = result else { return None };
    let (found, checksum) = manager.served_weights(&m.engine_id).await.ok()?;
    manager.fleet.update(|inner| {
        if !inner.weights.current().served_by(found.as_deref(), checksum.as_deref()) {
            return None;
        }
        let back = inner
            .engines
            .event(&m.engine_id, EngineEvent::WeightsSynced)
            .and_then(|_| inner.engines.event(&m.engine_id, EngineEvent::Activated));
        back.ok()?;
        tracing::warn!(engine_id = %m.engine_id, error = %why, "member failed its part; it still serves the fleet's version and is back in routing");
        Some(Turn::Failed(format!("{why} (it still serves the fleet's version and is back in routing)")))
    })
}

/// How a member's part ended. A routed member (taken out of routing for its turn) returns to
/// routing verified, or is FAILED; any other member (waiting for weights, draining) keeps its
/// state and only has its version recorded, or stays where it was, unless it loaded part of
/// the version and did not get the rest: then it is FAILED too (it serves no version whole).
async fn settle(
    manager: &Arc<Manager>,
    r: &Receiver,
    want: &WeightVersion,
    result: Result<(Option<String>, Option<String>), EngineError>,
) -> Turn {
    if r.routed {
        return crate::ops::weight_update::finish_turn(manager, &r.m.engine_id, want, result).await;
    }
    match result {
        Ok((found, checksum)) => manager.fleet.update(|inner| match inner.engines.get_mut(&r.m.engine_id) {
            Some(e) => {
                e.set_weights(found, checksum);
                // An engine waiting for this version has it now (its wait ends, see
                // `Manager::catch_up`).
                e.has_trainer_version();
                Turn::Verified
            }
            None => Turn::Skipped,
        }),
        Err(e) if r.loaded => {
            let why = format!("holds part of {} after its update failed: {e}", want.version);
            manager.fail_engine(&r.m.engine_id, &why).await;
            Turn::Failed(e.to_string())
        }
        Err(e) => Turn::Failed(e.to_string()),
    }
}

/// The trainer leaves its group for good (`POST /rollout/weights/trainer_group/destroy`): the
/// group is destroyed on its members still in the fleet and forgotten, so the next update
/// builds a new one. Answers the group destroyed (None: there was none). 409 while an update
/// runs.
pub async fn destroy_group(manager: &Manager) -> Result<Option<TrainerGroup>, OpError> {
    let group = manager.fleet.update(|inner| {
        if let Some(u) = inner.weights.running_update() {
            return Err(OpError::conflict(
                "update_in_progress",
                format!("update {} uses the group; destroy it once the update has ended", u.update_id()),
            ));
        }
        Ok(inner.weights.take_group())
    })?;
    if let Some(g) = &group {
        let here: Vec<GroupMember> = {
            let inner = manager.fleet.lock();
            g.members.iter().filter(|m| inner.engines.contains_key(&m.engine_id)).cloned().collect()
        };
        crate::ops::trainer_group::destroy(manager, &g.group_name, &here).await;
        tracing::info!(group = %g.group_name, "trainer group destroyed");
    }
    Ok(group)
}

/// Scale-in: waits while a trainer update runs whose group has any of `engines` (a member
/// removed from the collective would hang the trainer's broadcast). `waiting` is called once
/// with the update's id when it has to wait.
pub async fn wait_not_members(manager: &Manager, engines: &[EngineId], waiting: impl FnOnce(&UpdateId)) {
    let mut waiting = Some(waiting);
    let mut changes = manager.fleet.subscribe();
    loop {
        let holding = {
            let inner = manager.fleet.lock();
            inner.weights.running_update().and_then(|u| {
                let t = u.trainer().as_ref()?;
                t.group.members.iter().any(|m| engines.contains(&m.engine_id)).then(|| u.update_id().clone())
            })
        };
        let Some(update_id) = holding else { return };
        if let Some(f) = waiting.take() {
            f(&update_id);
        }
        tokio::select! {
            _ = changes.changed() => {}
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            () = manager.shutdown.cancelled() => return,
        }
    }
}

/// After a restart, before any engine is re-adopted: a trainer update in flight cannot go on
/// (its broadcast was cut). Continues every member it may have paused, ending any session it
/// opened, unless a bucket was sent (a member may hold part of the version: it stays paused
/// until it is restarted, as a member caught mid-turn is), forgets its group, and answers why
/// it cannot resume (the caller fails it). Ok when the update in flight is not a trainer update.
pub async fn check_resumable(manager: &Manager) -> Result<(), crate::ops::weight_update::CannotResume> {
    let (members, partial) = {
        let inner = manager.fleet.lock();
        match inner.weights.running_update() {
            Some(u) if u.source() == UpdateSource::Trainer => u
                .trainer()
                .as_ref()
                .map(|t| (t.group.members.clone(), t.bucketed && t.buckets_sent > 0))
                .unwrap_or_default(),
            _ => return Ok(()),
        }
    };
    manager.fleet.update(|inner| inner.weights.set_group(None));
    if partial {
        return Err(crate::ops::weight_update::CannotResume::TrainerUpdate);
    }
    let timeout = Duration::from_secs(30);
    futures::future::join_all(members.iter().map(|m| async move {
        let _ = manager.engine_api.weights_call(&m.url, "/end_weight_update", json!({}), timeout).await;
        let _ = manager.engine_api.control(&m.url, "/continue_generation", json!({})).await;
    }))
    .await;
    Err(crate::ops::weight_update::CannotResume::TrainerUpdate)
}
