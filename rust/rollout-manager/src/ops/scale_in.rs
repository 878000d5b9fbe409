//! Scale-in: choose victims (LIFO among dynamic engines, or by URL), drain, remove.
//! See the module docs of [`crate::ops::scaling`] for the flow and guarantees.

use crate::ops::manager::Manager;
use crate::ops::op_error::OpError;
use crate::ops::scaling::{Accepted, ScaleInRequest};
use crate::registry::fleet::{EngineRecord, ScaleInRecord};
use rollout_core::ids::{EngineId, OpId};
use rollout_core::scale_in::Candidate;
use rollout_core::{EngineEvent, EngineOrigin, EngineStatus};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// What `POST /rollout/scale_in` answers.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum ScaleInAnswer {
    Accepted(Accepted),
    DryRun(DryRun),
}

/// What `POST /rollout/scale_in` with `dry_run` answers: the engines it would remove.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct DryRun {
    /// Always true.
    pub dry_run: bool,
    pub engines: Vec<EngineRecord>,
    pub message: String,
}

pub fn scale_in(manager: &Arc<Manager>, req: ScaleInRequest) -> Result<ScaleInAnswer, OpError> {
    let (target, drain) = check(manager, &req)?;
    let request_id: OpId = uuid::Uuid::new_v4().into();
    let result = manager.fleet.update(|inner| -> Result<(ScaleInAnswer, Option<Vec<EngineId>>), OpError> {
        if let Some(running) = inner.ops.running() {
            return Err(OpError::conflict(
                "operation_in_progress",
                format!(
                    "a {} operation is in progress (request_id {}); wait for it to finish or cancel it, then retry",
                    running.kind, running.request_id
                ),
            ));
        }
        let victims = choose_victims(inner, &req, target)?;
        if req.dry_run {
            let engines = victims.iter().filter_map(|id| inner.engines.get(id)).map(|e| e.record().clone()).collect();
            let message = format!("would remove {} engines; nothing was changed", victims.len());
            return Ok((ScaleInAnswer::DryRun(DryRun { dry_run: true, engines, message }), None));
        }
        let (model, urls) = (req.model_name.clone(), req.engine_urls.clone());
        let record = ScaleInRecord::new(request_id.clone(), model, target, urls, req.force, victims.clone());
        if victims.is_empty() {
            let record = record.noop(format!("fleet already has {target} engines or fewer; nothing to remove"));
            let answer = Accepted {
                request_id: request_id.clone(),
                status: crate::ops::scaling::AcceptedStatus::Noop,
                message: record.message().clone(),
            };
            crate::foundation::records::checked_op(inner.ops.start_scale_in(record));
            return Ok((ScaleInAnswer::Accepted(answer), None));
        }
        start_draining(inner, &victims, manager.config.move_on_drain);
        let record = record.draining(format!("scale-in accepted: removing {}", victims.join(", ")));
        let answer = Accepted {
            request_id: request_id.clone(),
            status: crate::ops::scaling::AcceptedStatus::Pending,
            message: record.message().clone(),
        };
        crate::foundation::records::checked_op(inner.ops.start_scale_in(record));
        Ok((ScaleInAnswer::Accepted(answer), Some(victims)))
    })?;
    let (answer, plan) = result;
    if let Some(victims) = plan {
        let m = manager.clone();
        let drain = if req.force { Duration::ZERO } else { drain };
        manager.tasks.spawn(async move {
            let _guard =
                crate::ops::scaling::OpGuard { manager: m.clone(), kind: "scale_in", request_id: request_id.clone() };
            run_scale_in(&m, &request_id, victims, drain).await
        });
    }
    Ok(answer)
}

/// The request's checks: the fleet's model, a valid target (engines to keep, or URLs), not
/// below the initial engines, a valid drain timeout. The target and the drain timeout.
fn check(manager: &Manager, req: &ScaleInRequest) -> Result<(u32, Duration), OpError> {
    if req.model_name != manager.config.model_name {
        return Err(OpError::invalid(
            "unknown_model",
            format!(
                "model_name {:?} is not served here; this fleet serves {:?}",
                req.model_name, manager.config.model_name
            ),
        ));
    }
    let target = crate::ops::scaling::replicas(req.num_replicas, u32::MAX)?;
    let drain = crate::ops::scaling::timeout(req.timeout_secs, manager.config.scale_in_drain_timeout)?;
    if target == 0 && req.engine_urls.is_empty() {
        return Err(OpError::invalid(
            "missing_target",
            "give num_replicas > 0 (engines to keep) or engine_urls (engines to remove)",
        ));
    }
    let initial = manager.config.initial_engines();
    if target > 0 && target < initial {
        return Err(OpError::invalid(
            "below_initial_engines",
            format!(
                "num_replicas {} is below the {initial} initial engines, which cannot be scaled in; ask for at least {initial}",
                req.num_replicas
            ),
        ));
    }
    Ok((target, drain))
}

/// The engines to remove: by `rollout_core::scale_in::victims` down to `target`, or the ones
/// the request names by URL (never an initial engine).
fn choose_victims(
    inner: &crate::registry::fleet::FleetInner,
    req: &ScaleInRequest,
    target: u32,
) -> Result<Vec<EngineId>, OpError> {
    let candidates: Vec<_> = inner
        .engines
        .values()
        .filter(|e| !matches!(e.status(), EngineStatus::Removing | EngineStatus::Removed))
        .collect();
    let victims: Vec<EngineId> = if target > 0 {
        let engines: Vec<Candidate> = candidates
            .iter()
            .map(|e| Candidate {
                engine_id: e.record().engine_id().clone(),
                seq: e.seq(),
                status: e.status(),
                origin: e.record().origin(),
                held: crate::ops::trainer_group::held(inner, e.id()),
            })
            .collect();
        rollout_core::scale_in::victims(&engines, target)
    } else {
        let mut ids = Vec::new();
        for url in &req.engine_urls {
            let normal = crate::ops::scaling::validate_engine_url(url)?;
            let want = normal.as_str();
            let engine = candidates.iter().find(|e| e.record().url() == want).ok_or_else(|| {
                OpError::invalid(
                    "unknown_engine_url",
                    format!("no engine with url {url} is in the fleet; see GET /rollout/engines"),
                )
            })?;
            if engine.record().origin() == EngineOrigin::Initial {
                return Err(OpError::invalid(
                    "initial_engine_protected",
                    format!("{} ({url}) is an initial engine and cannot be scaled in", engine.record().engine_id()),
                ));
            }
            if crate::ops::trainer_group::held(inner, engine.id()) {
                return Err(OpError::conflict(
                    "trainer_group_member",
                    format!(
                        "{} ({url}) holds ranks in the trainer's weight-update group, which cannot take a new rank; \
                         destroy the group first (POST /rollout/weights/trainer_group/destroy) or scale in another engine",
                        engine.record().engine_id()
                    ),
                ));
            }
            if !ids.contains(engine.record().engine_id()) {
                ids.push(engine.record().engine_id().clone());
            }
        }
        ids
    };
    Ok(victims)
}

/// Takes the victims out of routing at once (DRAINING engines get no new requests; with
/// `--move-on-drain` their movable requests are asked to move). Engines that never became
/// routable (still starting, or failed) skip the drain.
fn start_draining(inner: &mut crate::registry::fleet::FleetInner, victims: &[EngineId], move_on_drain: bool) {
    for id in victims {
        let status = inner.engines.get(id).map(|e| e.status());
        if matches!(status, Some(EngineStatus::Active | EngineStatus::Unhealthy)) {
            crate::foundation::records::checked(inner.engines.event(id, EngineEvent::Drain));
            if move_on_drain {
                if let Some(e) = inner.engines.get(id) {
                    e.load().request_moves();
                }
            }
        }
    }
}

async fn run_scale_in(manager: &Arc<Manager>, request_id: &OpId, victims: Vec<EngineId>, drain: Duration) {
    // An external router must stop sending them work before the drain starts.
    let urls: Vec<String> = {
        let inner = manager.fleet.lock();
        victims.iter().filter_map(|id| inner.engines.get(id).map(|e| e.record().url().clone())).collect()
    };
    if let Some(router) = &manager.external_router {
        router.forget(&urls).await;
    }
    // DRAINING: wait for in-flight requests, up to the drain timeout, then abort the rest.
    let loads: Vec<_> = {
        let inner = manager.fleet.lock();
        victims
            .iter()
            .filter_map(|id| {
                inner
                    .engines
                    .get(id)
                    .map(|e| (id.clone(), e.record().url().clone(), e.load().clone(), e.record().origin()))
            })
            .collect()
    };
    let drained = futures::future::join_all(loads.iter().map(|(id, url, load, origin)| async move {
        let idle = tokio::time::timeout(drain, load.wait_idle()).await.is_ok();
        // An external engine may serve other clients too: it is detached, never told to abort.
        if !idle && *origin != EngineOrigin::External {
            tracing::warn!(engine_id = %id, in_flight = load.get(), ?drain, "drain timeout; aborting in-flight requests");
            manager.engine_api.abort_all(url).await;
        }
    }));
    tokio::select! {
        _ = drained => {}
        _ = manager.shutdown.cancelled() => {}
    }
    // A member of a trainer update in flight stays until it ends: the trainer's broadcast
    // needs every member of its group.
    crate::ops::trainer_update::wait_not_members(manager, &victims, |update_id| {
        tracing::info!(request_id = %request_id, update_id = %update_id, "scale-in waits for the trainer update to finish");
        let says = format!(
            "drained; waiting for trainer update {update_id} to finish before removing its members (membership is frozen while it runs)"
        );
        manager.fleet.update(|inner| inner.ops.scale_in_says(request_id, says));
    })
    .await;
    manager.fleet.update(|inner| inner.ops.scale_in_drained(request_id));
    // REMOVING: stop processes and release resources. Partial success: what was removed stays
    // removed; failures are reported.
    let results = futures::future::join_all(
        victims.iter().map(|id| async move { (id.clone(), manager.remove_engine(id).await) }),
    )
    .await;
    manager.fleet.update(|inner| {
        // Removal always ends with the process reaped (SIGKILL after the grace period).
        for (id, exit) in &results {
            tracing::info!(engine_id = %id, exit = ?exit, "engine removed");
        }
        inner.ops.conclude_scale_in(request_id, results.iter().map(|(id, _)| id.clone()));
        // Sanity: a victim must be gone now.
        for id in &victims {
            if let Some(e) = inner.engines.get(id) {
                tracing::error!(engine_id = %id, status = %e.status(), "engine still present after removal");
            }
        }
    });
}
