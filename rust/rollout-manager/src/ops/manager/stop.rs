//! Stop: an engine removed (its process stopped, its resources given back), failed, or every
//! engine stopped at shutdown.

use super::*;

impl Manager {
    /// Stops an engine's process (SIGINT, then SIGKILL to its group after the shutdown
    /// grace: `foundation::host`), releases
    /// its GPUs and port, and marks it REMOVED.
    pub async fn remove_engine(&self, engine_id: &EngineId) -> Option<ExitInfo> {
        let process = self.fleet.update(|inner| {
            if let Err(e) = inner.engines.event(engine_id, EngineEvent::Remove) {
                // Already on its way out: whoever moved it there finishes the removal too.
                tracing::debug!(engine_id = %engine_id, error = %e, "remove");
            }
            inner.engines.get(engine_id).and_then(|e| e.process().cloned())
        });
        let exit = match process {
            Some(p) => Some(p.stop(self.shutdown_grace()).await),
            None => None,
        };
        let ray = self.ray();
        self.fleet.update(|inner| {
            if ray {
                // The shim removes the placement group now, then says released.
                inner.placements.change(engine_id, |p| p.unwant());
            }
            if let Some(e) = inner.engines.get_mut(engine_id) {
                e.process_gone();
            }
            if inner.engines.event(engine_id, EngineEvent::Removed).is_ok() {
                // Forget removed engines entirely; their operation records keep their ids.
                inner.engines.forget(engine_id);
            }
        });
        exit
    }

    /// Stops an engine but keeps it listed as FAILED (used when an initial engine cannot start,
    /// so the operator sees it).
    pub async fn fail_engine(&self, engine_id: &EngineId, error: &str) {
        let process = self.fleet.update(|inner| {
            inner.engines.fail(engine_id, Some(error.to_string()));
            inner.engines.get(engine_id).and_then(|e| e.process().cloned())
        });
        if let Some(p) = process {
            p.stop(self.shutdown_grace()).await;
        }
    }

    /// Stops every engine process, in parallel, each with the shutdown grace. Used at exit.
    pub async fn stop_all(&self) {
        let processes: Vec<EngineProcess> =
            self.fleet.lock().engines.values().filter_map(|e| e.process().cloned()).collect();
        let grace = self.shutdown_grace();
        futures::future::join_all(processes.iter().map(|p| p.stop(grace))).await;
    }
}
