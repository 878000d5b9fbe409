//! Ray mode's placements as the shim reports on them (docs/ray.md): an agent bound to a
//! placement, an agent lost, a placement group released. Each is one registry update, committed
//! to the store like every fleet change, so a restarted manager keeps the placements and their
//! agents.
//!
//! Errors ([`OpError`]): `not_ray_placement` (conflict: a local manager has none),
//! `unknown_placement` (unknown), `placement_not_wanted`, `placement_bound_elsewhere`,
//! `placement_still_wanted` (conflict: see `rollout_core::PlacementConflict`).

use crate::ops::manager::Manager;
use crate::ops::op_error::OpError;
use rollout_core::ids::EngineId;
use rollout_core::{AgentBinding, BindOutcome, EngineEvent, EngineStatus, Placement, PlacementConflict};

pub fn unknown(engine_id: &str) -> OpError {
    OpError::unknown(
        "unknown_placement",
        format!("no placement for engine {engine_id:?}; list them with GET /rollout/placements"),
    )
}

fn conflict(e: &PlacementConflict) -> OpError {
    let code = match e {
        PlacementConflict::NotWanted(_) => "placement_not_wanted",
        PlacementConflict::BoundElsewhere { .. } => "placement_bound_elsewhere",
        PlacementConflict::StillWanted(_) => "placement_still_wanted",
    };
    OpError::conflict(code, e.to_string())
}

/// Placements exist only in Ray mode: 409 `not_ray_placement` on a local manager.
pub fn ray_only(manager: &Manager) -> Result<(), OpError> {
    if manager.ray() {
        return Ok(());
    }
    Err(OpError::conflict(
        "not_ray_placement",
        "this manager runs with --placement local and has no placements; start it with --placement ray",
    ))
}

/// The placement of `engine_id` as it is now.
pub fn placement(manager: &Manager, engine_id: &EngineId) -> Result<Placement, OpError> {
    manager.fleet.lock().placements.get(engine_id).cloned().ok_or_else(|| unknown(engine_id))
}

/// An agent now hosts the placement of `engine_id`: the engine leaves PENDING and is launched
/// through it. Idempotent for the same agent; 409 while another agent that still answers is
/// bound (a dead one is replaced, and the engine recovered through the new one). The placement.
pub async fn bind(manager: &Manager, engine_id: &EngineId, binding: AgentBinding) -> Result<Placement, OpError> {
    ray_only(manager)?;
    let previous = {
        let inner = manager.fleet.lock();
        let p = inner.placements.get(engine_id).ok_or_else(|| unknown(engine_id))?;
        p.agent.as_ref().map(|a| a.url.clone()).filter(|u| *u != binding.url)
    };
    // Only a live agent keeps its placement; asked outside the lock.
    let previous_live = match &previous {
        Some(url) => manager.agents.is_live(url).await,
        None => false,
    };
    let (agent_url, node_id) = (binding.url.clone(), binding.node_id.clone());
    let gpu_ids: Vec<u32> = binding.gpu_ids.iter().filter_map(|g| g.parse().ok()).collect();
    let outcome = manager.fleet.update(|inner| {
        let outcome = inner
            .placements
            .change_if(engine_id, |p| {
                let outcome = p.bind(binding, previous_live);
                let changed = outcome.as_ref().is_ok_and(|o| *o != BindOutcome::Same);
                (outcome, changed)
            })
            .ok_or_else(|| unknown(engine_id))?
            .map_err(|e| conflict(&e))?;
        if outcome != BindOutcome::Same {
            if let Some(e) = inner.engines.get_mut(engine_id) {
                e.placed_on(gpu_ids);
            }
            if inner.engines.get(engine_id).is_some_and(|e| e.status() == EngineStatus::Pending) {
                crate::foundation::records::checked(inner.engines.event(engine_id, EngineEvent::Bound));
            }
        }
        Ok::<_, OpError>(outcome)
    })?;
    match &outcome {
        BindOutcome::Bound => {
            tracing::info!(engine_id = %engine_id, agent = %agent_url, node_id = %node_id, "placement bound")
        }
        BindOutcome::Same => {}
        BindOutcome::Replaced { previous } => {
            tracing::warn!(engine_id = %engine_id, old = %previous.url, new = %agent_url, "placement re-bound: the old agent is gone");
            // Its engine went with the old agent: recover it through the new one.
            manager.agents.forget(&previous.url, engine_id);
        }
    }
    placement(manager, engine_id)
}

/// The agent at `agent_url` bound to the placement of `engine_id` is gone: the placement goes
/// back to PENDING_RESOURCES and its engine is recovered through the next agent bound. A report
/// naming an agent not bound is ignored. The placement, and whether it was unbound.
pub fn lost(
    manager: &Manager,
    engine_id: &EngineId,
    agent_url: &str,
    reason: &str,
) -> Result<(Placement, bool), OpError> {
    ray_only(manager)?;
    if !manager.fleet.lock().placements.contains_key(engine_id) {
        return Err(unknown(engine_id));
    }
    let unbound = manager.agent_lost(agent_url, Some(engine_id), reason);
    Ok((placement(manager, engine_id)?, !unbound.is_empty()))
}

/// The shim removed the placement group of a placement desired absent: it is forgotten.
pub fn released(manager: &Manager, engine_id: &EngineId) -> Result<(), OpError> {
    ray_only(manager)?;
    manager.fleet.update(|inner| {
        let p = inner.placements.get(engine_id).ok_or_else(|| unknown(engine_id))?;
        p.check_released().map_err(|e| conflict(&e))?;
        inner.placements.remove(engine_id);
        Ok::<_, OpError>(())
    })?;
    tracing::info!(engine_id = %engine_id, "placement released");
    Ok(())
}
