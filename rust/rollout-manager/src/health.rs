//! Periodic health probes of routable engines.
//!
//! Every `--health-check-interval-secs`, each ACTIVE or UNHEALTHY engine is probed at
//! `--health-check-endpoint`. After `--health-failure-threshold` consecutive failures an ACTIVE
//! engine becomes UNHEALTHY and leaves routing; one successful probe brings it back. Engines
//! whose process exits are marked FAILED by the process watcher, not here.
//! Recovery of crashed engines (restart with current weights) is not implemented yet.

use crate::manager::Manager;
use rollout_core::{EngineEvent, EngineStatus};
use std::sync::Arc;
use std::time::Duration;

pub fn spawn_monitor(manager: &Arc<Manager>) {
    let m = manager.clone();
    manager.tasks.spawn(async move {
        let period = Duration::from_secs_f64(m.config.health_check_interval_secs);
        let mut ticker = tokio::time::interval(period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => probe_all(&m).await,
                _ = m.shutdown.cancelled() => return,
            }
        }
    });
}

async fn probe_all(manager: &Arc<Manager>) {
    let targets: Vec<(String, String)> = manager
        .fleet
        .lock()
        .engines
        .values()
        .filter(|e| matches!(e.record.status, EngineStatus::Active | EngineStatus::Unhealthy))
        .map(|e| (e.record.engine_id.clone(), e.record.url.clone()))
        .collect();
    let timeout = Duration::from_secs_f64(manager.config.health_check_timeout_secs);
    let endpoint = &manager.config.health_check_endpoint;
    let results = futures::future::join_all(targets.iter().map(|(id, url)| async move {
        let ok = manager
            .http
            .get(format!("{url}{endpoint}"))
            .timeout(timeout)
            .send()
            .await
            .map(|r| r.status().is_success())
            .unwrap_or(false);
        (id, ok)
    }))
    .await;
    let threshold = manager.config.health_failure_threshold;
    manager.fleet.update(|inner| {
        for (id, ok) in results {
            let Some(engine) = inner.engines.get_mut(id.as_str()) else { continue };
            let status = engine.record.status;
            if ok {
                engine.probe_failures = 0;
                if status == EngineStatus::Unhealthy {
                    let _ = inner.engine_event(id, EngineEvent::ProbeRecovered);
                }
            } else {
                engine.probe_failures += 1;
                let failures = engine.probe_failures;
                if status == EngineStatus::Active && failures >= threshold {
                    engine.record.last_error = Some(format!("{failures} consecutive failed health probes"));
                    tracing::warn!(engine_id = %id, failures, "engine unhealthy; taken out of routing");
                    let _ = inner.engine_event(id, EngineEvent::ProbeFailed);
                }
            }
        }
    });
}
