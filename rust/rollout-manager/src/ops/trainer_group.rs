//! A weight-update group whose layout the trainer fixes (`POST /rollout/weights/trainer_group`).
//!
//! Some trainers build their NCCL group once and never again: AReaL takes the group's world
//! size from its own allocation and joins it in `connect_engine`, before any update. For them
//! the manager cannot rebuild the group when the fleet changes, so it places engines into the
//! trainer's layout instead:
//! 1. [`build`]: the first engines (creation order) whose ranks come to exactly the trainer's
//!    `world_size - 1` are the members ([`rollout_core::catchup::fill_world`]); the old group is
//!    destroyed on its members; every member joins the new one while the trainer joins as rank
//!    0. `GET /rollout/weights/trainer_group` shows how far the join got.
//! 2. Updates that name the group use it as it is ([`reuse_fixed`]): it is never rebuilt.
//!    One whose member is gone, restarted or moved is refused (409 `group_member_lost`): NCCL
//!    cannot take a new rank into a formed group, so the trainer must build another.
//! 3. Members are held against scale-in ([`held`]); engines beyond the world (a scale-out's)
//!    do not receive the broadcast: they leave routing when the members come back on the new
//!    version and copy it from a member ([`park_non_members`], [`catch_up`]).
//!
//! The group stays until the trainer destroys it (`POST /rollout/weights/trainer_group/destroy`)
//! or builds another.

use crate::foundation::records::{FixedJoin, GroupMember, TrainerGroup};
use crate::ops::manager::Manager;
use crate::ops::op_error::OpError;
use rollout_core::catchup::FillError;
use rollout_core::ids::EngineId;
use rollout_core::{EngineEvent, EngineStatus};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// What the trainer fixes (`POST /rollout/weights/trainer_group`).
#[derive(Debug, Clone)]
pub struct BuildRequest {
    pub group_name: String,
    pub master_address: String,
    pub master_port: u16,
    pub world_size: u32,
    pub backend: rollout_core::weights::GroupBackend,
}

/// Checks a build's fields before anything changes (400s).
pub fn check(req: &BuildRequest) -> Result<(), OpError> {
    let name_ok = !req.group_name.is_empty()
        && req.group_name.len() <= 128
        && req.group_name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if !name_ok {
        return Err(OpError::invalid(
            "invalid_group_name",
            format!("group_name {:?} must be 1 to 128 letters, digits, _, - or .", req.group_name),
        ));
    }
    if req.master_address.trim().is_empty() || req.master_port == 0 {
        return Err(OpError::invalid(
            "invalid_master",
            "master_address and master_port (1-65535) must name where the trainer listens as rank 0",
        ));
    }
    if req.world_size < 2 {
        return Err(OpError::invalid(
            "invalid_world_size",
            format!(
                "world_size {} must be at least 2: the trainer is rank 0, the engines hold the rest",
                req.world_size
            ),
        ));
    }
    Ok(())
}

/// The 409 for a fleet whose engines cannot fill the trainer's world.
fn misfit(why: FillError, takers: &[GroupMember], world_size: u32) -> OpError {
    let tps: Vec<String> = takers.iter().map(|m| format!("{} (tp {})", m.engine_id, m.tp_size)).collect();
    let fleet = if tps.is_empty() { "no engine".to_string() } else { tps.join(", ") };
    let message = match why {
        FillError::NoEngineRanks => format!("world_size {world_size} leaves no rank for an engine"),
        FillError::TooFew { have, need } => format!(
            "world_size {world_size} needs engines holding {need} ranks; the ACTIVE engines hold {have}: {fleet}. \
             Scale out first (POST /rollout/scale_out), or build the group with world_size {}",
            have + 1
        ),
        FillError::Uneven { engines, at, need } => format!(
            "world_size {world_size} needs engines holding exactly {need} ranks; the first {engines} hold {at} and the \
             next would pass it: {fleet}"
        ),
    };
    OpError::conflict("group_does_not_fit", message)
}

/// Builds the group the trainer fixed (see the module docs) and starts its members' join;
/// answers the group (`fixed.state` `joining`). 400 for a bad request; 409 while an update
/// runs or another fixed group is joining, or when the fleet cannot fill the world.
/// Builds the group; while the engines cannot fill the trainer's world but some are on their
/// way up (a trainer started again right after a failed sync finds the engines that held part of
/// it restarting), waits for them, up to `--weight-update-timeout-secs`.
pub async fn build_when_it_fits(manager: &Arc<Manager>, req: BuildRequest) -> Result<TrainerGroup, OpError> {
    let mut changes = manager.fleet.subscribe();
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(manager.config.weight_update_timeout_secs);
    // The build and the look at who is coming are two snapshots: an engine may come up between
    // them, so a misfit with nobody coming is tried once more before it is the answer.
    let mut again = true;
    loop {
        match build(manager, req.clone()) {
            Ok(group) => return Ok(group),
            Err(e) if e.code() == "group_does_not_fit" => {
                if engines_coming(manager) {
                    again = true;
                    tokio::select! {
                        _ = changes.changed() => {}
                        () = tokio::time::sleep_until(deadline) => return Err(e),
                        () = manager.shutdown.cancelled() => return Err(e),
                    }
                    // At most one look every 20 ms however busy the registry is.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                } else if std::mem::take(&mut again) {
                    continue;
                } else {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
    }
}

pub fn build(manager: &Arc<Manager>, req: BuildRequest) -> Result<TrainerGroup, OpError> {
    check(&req)?;
    let (group, old) = manager.fleet.update(|inner| -> Result<_, OpError> {
        if let Some(u) = inner.weights.running_update() {
            return Err(OpError::conflict(
                "update_in_progress",
                format!(
                    "update {} to {} is in progress; build the group once it has ended",
                    u.update_id(),
                    u.version()
                ),
            ));
        }
        if let Some(g) = inner.weights.group().as_ref().filter(|g| g.fixed == Some(FixedJoin::Joining)) {
            return Err(OpError::conflict(
                "group_joining",
                format!(
                    "the members of group {} are still joining it; wait (GET /rollout/weights/trainer_group)",
                    g.group_name
                ),
            ));
        }
        let takers = takers(inner);
        let tps: Vec<u32> = takers.iter().map(|m| m.tp_size).collect();
        let n = rollout_core::catchup::fill_world(&tps, req.world_size)
            .map_err(|why| misfit(why, &takers, req.world_size))?;
        inner.weights.count_group_built();
        let group = TrainerGroup {
            group_name: req.group_name.clone(),
            master_address: req.master_address.clone(),
            master_port: req.master_port,
            world_size: req.world_size,
            members: takers.into_iter().take(n).collect(),
            new: true,
            fixed: Some(FixedJoin::Joining),
            backend: req.backend,
        };
        let old = inner.weights.take_group();
        inner.weights.set_group(Some(group.clone()));
        tracing::info!(group = %group.group_name, world_size = group.world_size, members = n, "trainer fixed a group");
        Ok((group, old))
    })?;
    let m = manager.clone();
    let joining = group.clone();
    manager.tasks.spawn(async move {
        if let Some(old) = old {
            let here: Vec<GroupMember> = {
                let inner = m.fleet.lock();
                old.members.iter().filter(|x| inner.engines.contains_key(&x.engine_id)).cloned().collect()
            };
            destroy(&m, &old.group_name, &here).await;
        }
        let timeout = Duration::from_secs_f64(m.config.weight_update_timeout_secs);
        let outcome = tokio::select! {
            r = join_members(&m, &joining, timeout) => r,
            () = m.shutdown.cancelled() => Err("the manager shut down while the members joined".into()),
        };
        if let Err(why) = &outcome {
            tracing::warn!(group = %joining.group_name, error = %why, "the fixed group could not be built");
        }
        m.fleet.update(|inner| inner.weights.fixed_group_joined(&joining.group_name, outcome));
    });
    Ok(group)
}

/// The group the engines hold now (`GET /rollout/weights/trainer_group`); 404 when none.
pub fn current(manager: &Manager) -> Result<TrainerGroup, OpError> {
    manager.fleet.lock().weights.group().clone().ok_or_else(|| {
        OpError::unknown(
            "no_trainer_group",
            "the engines hold no trainer group; build one (POST /rollout/weights/trainer_group) or open a trainer update",
        )
    })
}

/// Waits until the members of group `name` joined it or could not (at most
/// `--weight-update-timeout-secs` plus 5 s), and answers the group as it is then. 404 when the
/// engines hold no group of that name (another build replaced it).
pub async fn wait_joined(manager: &Manager, name: &str) -> Result<TrainerGroup, OpError> {
    let limit = Duration::from_secs_f64(manager.config.weight_update_timeout_secs) + Duration::from_secs(5);
    manager
        .watch(limit, || {
            let group = current(manager)?;
            if group.group_name != name {
                return Err(OpError::unknown(
                    "group_replaced",
                    format!("the engines hold group {}, not {name}: another build replaced it", group.group_name),
                ));
            }
            let joining = group.fixed == Some(FixedJoin::Joining);
            Ok((group, !joining))
        })
        .await
}

/// Whether an engine is on its way to serving (starting, restarting, catching up, or failed and
/// about to be restarted): a group that does not fit now may fit once it is up.
pub fn engines_coming(manager: &Manager) -> bool {
    let restart = manager.config.restart_failed_engines;
    manager.fleet.lock().engines.values().any(|e| match e.status() {
        EngineStatus::Pending | EngineStatus::Creating | EngineStatus::HealthChecking | EngineStatus::Ready => true,
        EngineStatus::WeightSyncing => !e.awaiting_trainer(),
        EngineStatus::Unhealthy | EngineStatus::Failed => restart,
        _ => false,
    })
}

/// The engines a group built now would take, in rank order (ACTIVE ones, and ones waiting for
/// the trainer's version), with their ranks.
pub fn candidates(manager: &Manager) -> Vec<GroupMember> {
    takers(&manager.fleet.lock())
}

/// For an update that names the fixed group: the group as it is (`new` false). None when the
/// update names no fixed group. 409 while its members join, when their join failed, or when a
/// member is no longer the process that joined (gone, restarted, moved).
pub fn reuse_fixed(
    inner: &crate::registry::fleet::FleetInner,
    group_name: Option<&str>,
) -> Result<Option<TrainerGroup>, OpError> {
    let Some(g) = inner.weights.group().as_ref() else { return Ok(None) };
    let Some(state) = g.fixed.as_ref().filter(|_| group_name == Some(g.group_name.as_str())) else { return Ok(None) };
    match state {
        FixedJoin::Joined => {}
        FixedJoin::Joining => {
            return Err(OpError::conflict(
                "group_not_joined",
                format!(
                    "the members of group {} are still joining it; wait (GET /rollout/weights/trainer_group)",
                    g.group_name
                ),
            ))
        }
        FixedJoin::Failed { error } => {
            return Err(OpError::conflict(
                "group_failed",
                format!("group {} could not be built ({error}); build it again", g.group_name),
            ))
        }
    }
    let lost: Vec<String> = g.members.iter().filter_map(|m| lost_member(inner, m)).collect();
    if !lost.is_empty() {
        return Err(OpError::conflict(
            "group_member_lost",
            format!(
                "group {} lost members: {}. NCCL cannot take a new rank into a formed group: destroy the trainer's side, \
                 then build a new group (POST /rollout/weights/trainer_group with another group_name)",
                g.group_name,
                lost.join("; ")
            ),
        ));
    }
    Ok(Some(TrainerGroup { new: false, ..g.clone() }))
}

/// Why member `m` can no longer take part (None: it can).
fn lost_member(inner: &crate::registry::fleet::FleetInner, m: &GroupMember) -> Option<String> {
    let Some(e) = inner.engines.get(&m.engine_id) else { return Some(format!("{} left the fleet", m.engine_id)) };
    let alive = matches!(e.status(), EngineStatus::Active | EngineStatus::WeightSyncing | EngineStatus::Unhealthy);
    if !alive {
        return Some(format!("{} is {}", m.engine_id, e.status()));
    }
    if e.url() != m.url || e.record().pid() != m.pid {
        return Some(format!("{} was restarted since it joined", m.engine_id));
    }
    None
}

/// Whether scale-in must leave `engine_id` alone: it holds ranks in the group the trainer fixed.
pub fn held(inner: &crate::registry::fleet::FleetInner, engine_id: &str) -> bool {
    inner
        .weights
        .group()
        .as_ref()
        .is_some_and(|g| g.fixed.is_some() && g.members.iter().any(|m| m.engine_id == engine_id))
}

/// When a trainer update's members come back on the new version: every ACTIVE engine that is
/// not a member (one beyond a fixed group's world) leaves routing, since it serves the old
/// version. Answers them, for [`catch_up`] once the update has ended.
pub fn park_non_members(manager: &Manager, group: &TrainerGroup) -> Vec<EngineId> {
    manager.fleet.update(|inner| {
        let others: Vec<EngineId> = inner
            .engines
            .values()
            .filter(|e| e.status() == EngineStatus::Active && !group.members.iter().any(|m| &m.engine_id == e.id()))
            .map(|e| e.id().clone())
            .collect();
        others.into_iter().filter(|id| inner.engines.event(id, EngineEvent::UpdateWeights).is_ok()).collect()
    })
}

/// The engines [`park_non_members`] took out catch up on the fleet's version, each in its
/// own task (copied from a member; back in routing after), as an engine that missed a
/// version does.
pub fn catch_up(manager: &Arc<Manager>, parked: Vec<EngineId>) {
    for id in parked {
        tracing::info!(engine_id = %id, "engine beyond the trainer's group copies the new version");
        let m = manager.clone();
        manager.tasks.spawn(async move { crate::ops::health::catch_up_out_of_routing(&m, &id).await });
    }
}

/// The engines that can take part in a trainer update now (ACTIVE, or waiting for the
/// trainer's version), in creation order, each with its rank offset behind the trainer's rank 0.
pub(crate) fn takers(inner: &crate::registry::fleet::FleetInner) -> Vec<GroupMember> {
    let mut engines: Vec<&crate::registry::fleet::Engine> = inner
        .engines
        .values()
        .filter(|e| {
            e.status() == EngineStatus::Active || (e.status() == EngineStatus::WeightSyncing && e.awaiting_trainer())
        })
        .collect();
    engines.sort_by_key(|e| e.seq());
    let tps: Vec<u32> = engines.iter().map(|e| e.ranks()).collect();
    let (offsets, _) = rollout_core::catchup::plan_ranks(&tps);
    engines
        .iter()
        .zip(tps.iter().zip(offsets))
        .map(|(e, (tp, off))| GroupMember {
            engine_id: e.record().engine_id().clone(),
            url: e.record().url().clone(),
            tp_size: *tp,
            rank_offset: off,
            pid: e.record().pid(),
        })
        .collect()
}

/// Every member of `group` joins it (`/init_weights_update_group`, all at once, while the
/// trainer joins as rank 0). Err(why) when one could not: the ones that joined left again.
pub(crate) async fn join_members(manager: &Manager, group: &TrainerGroup, timeout: Duration) -> Result<(), String> {
    let body = |m: &GroupMember| {
        json!({"master_address": group.master_address, "master_port": group.master_port,
               "rank_offset": m.rank_offset, "world_size": group.world_size,
               "group_name": group.group_name, "backend": group.backend.name()})
    };
    let api = &manager.engine_api;
    let body = &body;
    let joined = futures::future::join_all(group.members.iter().map(|m| async move {
        let r = api.weights_call(&m.url, "/init_weights_update_group", body(m), timeout).await;
        (m, r)
    }))
    .await;
    let failed: Vec<String> = joined
        .iter()
        .filter_map(|(m, r)| match r {
            Ok(true) => None,
            Ok(false) => Some(format!("{}: /init_weights_update_group is not served (404)", m.engine_id)),
            Err(e) => Some(format!("{}: {e}", m.engine_id)),
        })
        .collect();
    if failed.is_empty() {
        return Ok(());
    }
    let ok: Vec<GroupMember> =
        joined.iter().filter(|(_, r)| matches!(r, Ok(true))).map(|(m, _)| (*m).clone()).collect();
    destroy(manager, &group.group_name, &ok).await;
    Err(format!("members could not join group {}: {}", group.group_name, failed.join("; ")))
}

/// Destroys group `name` on `members`, best effort (an engine gone or never joined answers an
/// error, which is ignored).
pub(crate) async fn destroy(manager: &Manager, name: &str, members: &[GroupMember]) {
    let timeout = Duration::from_secs(30);
    futures::future::join_all(members.iter().map(|m| {
        manager.engine_api.weights_call(&m.url, "/destroy_weights_update_group", json!({"group_name": name}), timeout)
    }))
    .await;
}
