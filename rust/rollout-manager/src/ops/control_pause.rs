//! Pauses a client sends through the RL control plane (`/v1/rl/.../pause_generation`, then
//! `continue_generation`): the manager knows them. A paused engine leaves routing at once (the
//! routing table skips it; its running requests stay its own), and a failed health probe while
//! its scheduler answers is not taken for a hang, however long the pause lasts. Continuing it
//! puts it back.

use crate::ops::manager::Manager;
use crate::ops::op_error::OpError;
use rollout_core::ids::EngineId;
use rollout_core::EngineStatus;

/// Engines a client may pause: those serving or out of routing for a while, not those being
/// started, stopped or removed.
fn pausable(status: EngineStatus) -> bool {
    matches!(
        status,
        EngineStatus::Active | EngineStatus::Unhealthy | EngineStatus::WeightSyncing | EngineStatus::Draining
    )
}

/// Pauses `engine_id`: it is marked paused (out of routing) before `call` (the engine's own
/// `/pause_generation`) runs, and unmarked again when `call` fails. 404 for an unknown engine,
/// 409 for one that is starting, stopping or gone, or while a weight update runs. The pause
/// ends without a continue when the manager takes the engine over (a weight update, a
/// failure, a restart); it is not kept across a manager restart.
pub async fn pause<T, E>(
    manager: &Manager,
    engine_id: &EngineId,
    call: impl std::future::Future<Output = Result<T, E>>,
) -> Result<Result<T, E>, OpError> {
    manager.fleet.update(|inner| {
        if let Some(u) = inner.weights.running_update() {
            return Err(OpError::conflict(
                "update_in_progress",
                format!(
                    "weight update {} to {} runs; the manager pauses and continues its engines itself. Pause once it has ended",
                    u.update_id(),
                    u.version()
                ),
            ));
        }
        let e = inner.engines.get_mut(engine_id).ok_or_else(|| unknown(engine_id))?;
        if !pausable(e.status()) {
            return Err(OpError::conflict(
                "not_pausable",
                format!("{engine_id} is {}; only a running engine can be paused", e.status()),
            ));
        }
        e.set_paused_by_control(true);
        Ok(())
    })?;
    let answer = call.await;
    if answer.is_err() {
        manager.fleet.update(|inner| inner.engines.get_mut(engine_id).map(|e| e.set_paused_by_control(false)));
    }
    tracing::info!(engine_id = %engine_id, ok = answer.is_ok(), "generation paused by a client");
    Ok(answer)
}

/// Continues `engine_id`: `call` (the engine's `/continue_generation`) runs, then, if it
/// succeeded, the engine is back in routing when it is ACTIVE. 404 for an unknown engine.
pub async fn resume<T, E>(
    manager: &Manager,
    engine_id: &EngineId,
    call: impl std::future::Future<Output = Result<T, E>>,
) -> Result<Result<T, E>, OpError> {
    if !manager.fleet.lock().engines.contains_key(engine_id) {
        return Err(unknown(engine_id));
    }
    let answer = call.await;
    if answer.is_ok() {
        manager.fleet.update(|inner| inner.engines.get_mut(engine_id).map(|e| e.set_paused_by_control(false)));
    }
    tracing::info!(engine_id = %engine_id, ok = answer.is_ok(), "generation continued by a client");
    Ok(answer)
}

fn unknown(engine_id: &str) -> OpError {
    OpError::unknown("unknown_worker", format!("no engine {engine_id}; list them with GET /v1/rl/workers"))
}
