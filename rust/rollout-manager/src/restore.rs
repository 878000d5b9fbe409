//! Restart from `--state-dir`: rebuild the registry from the store after the manager was
//! stopped or killed at any point.
//!
//! Expected flow, per kind of record:
//! - finished operations are kept as they were, history included;
//! - a scale-out that was in flight ends FAILED, and the engines it had not yet activated are
//!   rolled back (initial engines are started again instead: they must exist);
//! - a scale-in that was in flight finishes: its victims are removed, and it ends COMPLETED;
//! - a managed engine that was serving (or had crashed) is started again on its GPUs with the
//!   fleet's weight version, through the same recovery path as a crash. Local engines die with
//!   the manager (PDEATHSIG), so there is no live process to adopt; should one still run, it is
//!   identified by pid *and* start time and killed, so no engine process exists without a record;
//! - an external engine is kept, out of routing (UNHEALTHY) until a health probe passes.

use crate::fleet::Engine;
use crate::fleet::InFlight;
use crate::host::process_start_ticks;
use crate::manager::Manager;
use crate::store::Snapshot;
use rollout_core::{EngineOrigin, EngineStatus, ScaleInEvent, ScaleInStatus, ScaleOutEvent};
use std::collections::HashSet;
use std::sync::Arc;

pub fn restore(manager: &Arc<Manager>, snapshot: Snapshot) {
    let mut to_recover = Vec::new();
    manager.fleet.update(|inner| {
        if let Some(meta) = &snapshot.meta {
            inner.weight_version = meta.weight_version.clone();
            inner.next_seq = meta.next_seq;
        }
        inner.next_seq = inner.next_seq.max(snapshot.engines.iter().map(|e| e.seq + 1).max().unwrap_or(0));

        // Engines of operations that were cut short.
        let mut rolled_back: HashSet<String> = HashSet::new();
        let mut scale_in_victims: HashSet<String> = HashSet::new();
        for mut op in snapshot.scale_outs.clone() {
            if !op.status.is_terminal() {
                for id in &op.engine_ids {
                    let active = snapshot.engines.iter().any(|e| &e.record.engine_id == id && e.record.status == EngineStatus::Active);
                    if !active {
                        rolled_back.insert(id.clone());
                    }
                }
                op.error_message = Some("the manager restarted while this operation was in flight; engines it had not activated were rolled back".into());
                let _ = op.apply(ScaleOutEvent::Fail);
            }
            inner.scale_outs.insert(op.request_id.clone(), op);
        }
        for mut op in snapshot.scale_ins.clone() {
            if !op.status.is_terminal() {
                scale_in_victims.extend(op.engine_ids.iter().cloned());
                if op.status == ScaleInStatus::Pending {
                    let _ = op.apply(ScaleInEvent::StartDraining);
                }
                if op.status == ScaleInStatus::Draining {
                    let _ = op.apply(ScaleInEvent::Drained);
                }
                op.removed_engines = op.engine_ids.clone();
                op.message = format!("{} (completed after a manager restart)", op.message);
                let _ = op.apply(ScaleInEvent::Removed);
            }
            inner.scale_ins.insert(op.request_id.clone(), op);
        }

        for stored in snapshot.engines {
            let mut record = stored.record;
            let id = record.engine_id.clone();
            // A process still running under the recorded identity is ours: stop it.
            if let (Some(pid), Some(ticks)) = (record.pid, stored.pid_start_ticks) {
                if record.origin != EngineOrigin::External && process_start_ticks(pid) == Some(ticks) {
                    tracing::warn!(engine_id = %id, pid, "a recorded engine process is still running; stopping it before restarting the engine");
                    let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
                }
            }
            let initial = record.origin == EngineOrigin::Initial;
            let gone = scale_in_victims.contains(&id)
                || (rolled_back.contains(&id) && !initial)
                || matches!(record.status, EngineStatus::Removing | EngineStatus::Removed)
                || (record.status == EngineStatus::Draining && !initial);
            if gone {
                tracing::info!(engine_id = %id, status = %record.status, "dropping engine after restart");
                continue;
            }
            record.pid = None;
            record.in_flight = 0;
            record.is_healthy = false;
            if record.origin == EngineOrigin::External {
                record.status = EngineStatus::Unhealthy;
                record.last_error = Some("manager restarted; waiting for a passing health probe".into());
            } else {
                if let Err(e) = inner.gpus.claim(&record.gpu_ids) {
                    tracing::error!(engine_id = %id, error = %e, "cannot claim the engine's GPUs after restart; dropping it");
                    continue;
                }
                record.status = EngineStatus::Failed;
                record.last_error = Some("manager restarted; starting the engine again".into());
                to_recover.push(id.clone());
            }
            let engine = Engine {
                seq: stored.seq,
                record,
                process: None,
                load: Arc::new(InFlight::default()),
                probe_failures: 0,
                pid_start_ticks: None,
            };
            inner.engines.insert(id, engine);
        }
    });
    for id in to_recover {
        let m = manager.clone();
        manager.tasks.spawn(async move { m.recover(&id, std::time::Duration::ZERO).await });
    }
}
