//! Recovery: an engine's process watched until it exits, then restarted within the restart
//! budget (or failed for good); engines of a lost agent sent back to wait for another.

use super::*;

impl Manager {
    /// Marks the engine FAILED when its process exits without being asked to, and schedules
    /// its recovery if it had been serving.
    pub fn watch_exit(self: &Arc<Self>, engine_id: EngineId, process: EngineProcess) {
        let manager = self.clone();
        self.tasks.spawn(async move {
            let info = process.wait().await;
            if info.requested {
                return;
            }
            tracing::warn!(engine_id = %engine_id, exit = %info, "engine process exited unexpectedly");
            let was = manager.fleet.update(|inner| {
                let was = inner.engines.get(&engine_id).map(|e| e.status());
                // Ray mode: a placement unbound by an agent loss already says why (the loss).
                let lost = inner.placements.get(&engine_id).is_some_and(|p| p.agent.is_none());
                if let Some(e) = inner.engines.get_mut(&engine_id) {
                    if !lost {
                        e.set_last_error(Some(format!("process {info}")));
                    }
                    e.process_gone();
                }
                // Fails only from live states; an engine being removed is expected to exit.
                inner.engines.fail(&engine_id, None);
                was
            });
            // Engines still being created are the scale-out's to handle; removed ones stay gone.
            if matches!(was, Some(EngineStatus::Active | EngineStatus::Unhealthy))
                && manager.config.restart_failed_engines
            {
                let m = manager.clone();
                manager.tasks.spawn(async move { m.recover(&engine_id, Duration::from_secs(1)).await });
            }
        });
    }

    /// Restarts a FAILED managed engine on its GPUs with the fleet's current weights, retrying
    /// with exponential backoff (1 s doubling to 60 s) until it is ACTIVE again, it is removed
    /// on purpose, or the manager shuts down.
    pub async fn recover(self: &Arc<Self>, engine_id: &EngineId, first_delay: Duration) {
        let mut delay = first_delay;
        loop {
            // The restart budget decides the wait (backoff within a crash loop) or gives up.
            let Some(wait) = self.restart_wait(engine_id) else { return };
            tokio::select! {
                _ = tokio::time::sleep(delay.max(wait)) => {}
                _ = self.shutdown.cancelled() => return,
            }
            delay = Duration::ZERO;
            let restarted = self.fleet.update(|inner| {
                let origin = inner.engines.get(engine_id).map(|e| e.record().origin());
                if origin == Some(EngineOrigin::External) {
                    return false;
                }
                if inner.engines.get(engine_id).is_none_or(|e| e.status() != EngineStatus::Failed) {
                    return false; // removed, or no longer FAILED
                }
                let budget = self.restart_budget();
                let Some(e) = inner.engines.get_mut(engine_id) else { return false };
                match e.restart_decision(budget) {
                    rollout_core::health::RestartDecision::After { streak, .. } => e.count_crash(streak),
                    rollout_core::health::RestartDecision::GiveUp { .. } => return false,
                }
                if inner.engines.event(engine_id, EngineEvent::Restart).is_err() {
                    return false;
                }
                // In Ray mode the agent picks the port; the placement keeps its agent.
                if !self.ray() {
                    self.move_to_fresh_port(inner, engine_id);
                }
                if let Some(e) = inner.engines.get_mut(engine_id) {
                    e.count_restart();
                }
                true
            });
            if !restarted {
                return;
            }
            tracing::info!(engine_id = %engine_id, "restarting failed engine");
            let result = async {
                self.launch_healthy(engine_id, &self.shutdown).await?;
                self.fleet
                    .update(|inner| inner.engines.event(engine_id, EngineEvent::Healthy))
                    .map_err(EngineError::Moved)?;
                self.sync_weights(engine_id, &[EngineEvent::WeightsSynced, EngineEvent::Activated]).await?;
                Ok::<(), EngineError>(())
            }
            .await;
            match result {
                Ok(()) => {
                    tracing::info!(engine_id = %engine_id, "engine recovered");
                    return;
                }
                Err(e) => {
                    let process = self.fleet.update(|inner| {
                        inner.engines.fail(engine_id, Some(format!("recovery failed: {e}")));
                        inner.engines.get(engine_id).and_then(|en| en.process().cloned())
                    });
                    if let Some(p) = process {
                        p.stop(self.shutdown_grace()).await;
                    }
                    // Ray mode: never back off against a dead agent, nor count it against the
                    // engine's restart budget. Its placement goes back to PENDING_RESOURCES and
                    // the next attempt waits for the shim's new agent.
                    if let Some(url) = self.bound_agent(engine_id) {
                        if !self.agents.is_live(&url).await
                            && !self.agent_lost(&url, Some(engine_id), "unreachable while recovering").is_empty()
                        {
                            self.fleet.update(|inner| {
                                if let Some(e) = inner.engines.get_mut(engine_id) {
                                    e.forgive_one_crash();
                                }
                            });
                        }
                    }
                    tracing::warn!(engine_id = %engine_id, error = %e, "engine recovery failed; will retry within its restart budget");
                }
            }
        }
    }

    pub(super) fn restart_budget(&self) -> rollout_core::health::RestartBudget {
        rollout_core::health::RestartBudget {
            max_restarts: self.config.restart_budget,
            window_secs: self.config.restart_window_secs,
        }
    }

    /// How long to wait before the next restart of the FAILED engine `engine_id` (its backoff
    /// within a crash loop), or None when there is nothing to restart: the engine is gone, no
    /// longer FAILED, or its restart budget is spent. Then it stays FAILED, its `detail` says
    /// why and its record keeps the last lines of its log.
    pub(super) fn restart_wait(&self, engine_id: &EngineId) -> Option<Duration> {
        let budget = self.restart_budget();
        let (decision, log_path) = {
            let inner = self.fleet.lock();
            let e = inner.engines.get(engine_id).filter(|e| e.status() == EngineStatus::Failed)?;
            (e.restart_decision(budget), e.record().log_path().clone().filter(|_| !self.ray()))
        };
        let restarts = match decision {
            rollout_core::health::RestartDecision::After { secs, .. } => return Some(Duration::from_secs_f64(secs)),
            rollout_core::health::RestartDecision::GiveUp { restarts } => restarts,
        };
        let tail = log_path.map(|p| crate::adapters::launch::log_tail(&p, LOG_TAIL_LINES));
        let gave_up = self.fleet.update(|inner| {
            let Some(e) = inner.engines.get_mut(engine_id).filter(|e| e.status() == EngineStatus::Failed) else {
                return false;
            };
            let detail = format!(
                "crash loop: restarted {restarts} times in a row without serving for --restart-window-secs ({} s); \
                 the manager gave up (--restart-budget {}). Fix the cause (last_error, log_tail), then scale in to \
                 remove it (FAILED engines go first) and scale out again",
                budget.window_secs, budget.max_restarts
            );
            e.give_up(detail, tail.clone().unwrap_or_default())
        });
        if gave_up {
            tracing::error!(engine_id = %engine_id, restarts, "engine crash-loops: restart budget spent, it stays FAILED");
        }
        None
    }

    /// A local engine about to start again moves to a free port (the old one may linger in
    /// TIME_WAIT or be taken); if none can be had it keeps the old one, and a launch that finds
    /// it taken fails and is retried.
    pub(super) fn move_to_fresh_port(&self, inner: &mut crate::registry::fleet::FleetInner, engine_id: &EngineId) {
        let host = &self.config.engine_host;
        if let Err(e) = inner.engines.move_port(
            engine_id,
            |taken| free_port(host, taken),
            |port| format!("http://{}:{port}", url_host(host)),
        ) {
            tracing::warn!(engine_id = %engine_id, error = %e, "no new port for the restart; keeping the old one");
        }
    }

    /// Ray mode: the agent bound to the engine's placement.
    pub(super) fn bound_agent(&self, engine_id: &EngineId) -> Option<String> {
        let inner = self.fleet.lock();
        inner.placements.get(engine_id).and_then(|p| p.agent.as_ref()).map(|a| a.url.clone())
    }

    /// Ray mode: the agent at `agent_url` is gone (reported by the shim when its host actor or
    /// node died, or found refusing connections by the manager). Every placement bound to it
    /// (only `only`'s, if given) goes back to PENDING_RESOURCES so the shim places it again, and
    /// its engine is taken as exited: a serving engine is recovered on the fleet's current
    /// weights once a new agent is bound, one being created is left to its scale-out.
    /// Returns the engines unbound; a stale report (not bound to that agent) unbinds nothing.
    pub fn agent_lost(&self, agent_url: &str, only: Option<&EngineId>, reason: &str) -> Vec<EngineId> {
        let unbound = self.fleet.update(|inner| {
            let mut unbound = Vec::new();
            inner.placements.change_each(|engine_id, placement| {
                if only.is_some_and(|o| o != engine_id) {
                    return false;
                }
                let lost = matches!(placement.lose(agent_url), rollout_core::LoseOutcome::Unbound { .. });
                if lost {
                    unbound.push(engine_id.clone());
                }
                lost
            });
            for engine_id in &unbound {
                if let Some(e) = inner.engines.get_mut(engine_id) {
                    e.set_last_error(Some(format!("agent {agent_url} lost: {reason}")));
                }
            }
            unbound
        });
        for engine_id in &unbound {
            tracing::warn!(engine_id = %engine_id, agent = %agent_url, reason, "agent lost; its placement waits for a new agent");
            // An unrequested exit, so a serving engine is recovered. Its process went with the
            // agent (agents stop their engines when their host actor dies).
            self.agents.forget(agent_url, engine_id);
        }
        unbound
    }

    /// Ray mode: an engine whose start failed because its node went away (its placement was
    /// unbound by the agent's loss or bound since to another agent, or the agent it was launched
    /// through no longer answers) is placed again: it goes back to CREATING and its next launch
    /// waits for the agent Ray binds on another node. A failure of the engine itself (the agent
    /// it runs on answers) is not retried here. Whether it was.
    pub async fn place_again_after_node_loss(&self, engine_id: &EngineId, error: &EngineError) -> bool {
        if !self.ray() || matches!(error, EngineError::Cancelled | EngineError::Left(_)) {
            return false;
        }
        let (bound, launched_on, old) = {
            let inner = self.fleet.lock();
            let Some(p) = inner.placements.get(engine_id).filter(|p| p.desired == rollout_core::Desired::Present)
            else {
                return false;
            };
            let engine = inner.engines.get(engine_id);
            let launched_on = engine.and_then(|e| e.launched_on()).map(str::to_string);
            (p.agent.as_ref().map(|a| a.url.clone()), launched_on, engine.and_then(|e| e.process().cloned()))
        };
        // The agent the failed attempt ran on: the one it launched through, else the one bound.
        let Some(ran_on) = launched_on.or_else(|| bound.clone()) else { return false };
        if bound.as_deref() == Some(ran_on.as_str()) {
            if self.agents.is_live(&ran_on).await {
                return false;
            }
            // The loss was not noticed yet: the placement is unbound now.
            self.agent_lost(&ran_on, Some(engine_id), "its agent stopped answering while the engine started");
        }
        if let Some(old) = old {
            // The old process's exit fails the engine: let that happen before it starts again.
            self.wait_process_settled(engine_id, &old).await;
        }
        let again = self.fleet.update(|inner| {
            let moved_on =
                inner.placements.get(engine_id).is_some_and(|p| p.agent.as_ref().is_none_or(|a| a.url != ran_on));
            // A step that failed while the process still ran fails the engine first.
            if !moved_on || (!inner.engines.fail(engine_id, None) && !is_failed(inner, engine_id)) {
                return false;
            }
            if inner.engines.event(engine_id, EngineEvent::Restart).is_err() {
                return false;
            }
            if let Some(e) = inner.engines.get_mut(engine_id) {
                e.process_gone();
            }
            true
        });
        if again {
            tracing::warn!(engine_id = %engine_id, agent = %ran_on, error = %error, "the engine's node was lost while it started; placing it again");
        }
        again
    }

    /// Waits (at most 2 s) until the engine no longer holds `old`, its process: the exit was
    /// taken (`watch_exit`).
    async fn wait_process_settled(&self, engine_id: &EngineId, old: &EngineProcess) {
        let _ = self
            .watch(Duration::from_secs(2), || {
                let inner = self.fleet.lock();
                let process = inner.engines.get(engine_id).and_then(|e| e.process());
                let holds = process.is_some_and(|p| p.pid == old.pid && p.start_ticks == old.start_ticks);
                Ok(((), !holds))
            })
            .await;
    }

    /// Ray mode: unbinds the placements of every agent the connections find gone, until shutdown.
    pub fn spawn_agent_loss_watch(self: &Arc<Self>) {
        let (m, mut lost) = (self.clone(), self.agents.lost_agents());
        self.tasks.spawn(async move {
            loop {
                let (url, why) = tokio::select! {
                    r = lost.recv() => match r {
                        Ok(found) => found,
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                            tracing::warn!(missed = n, "agent-loss notices dropped");
                            continue;
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                    },
                    () = m.shutdown.cancelled() => return,
                };
                m.agent_lost(&url, None, &format!("the agent {why}"));
            }
        });
    }
}

fn is_failed(inner: &crate::registry::fleet::FleetInner, engine_id: &EngineId) -> bool {
    inner.engines.get(engine_id).is_some_and(|e| e.status() == EngineStatus::Failed)
}
