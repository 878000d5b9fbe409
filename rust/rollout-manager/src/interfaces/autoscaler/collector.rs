//! Reads every ACTIVE engine's load: `/v1/loads` for the gauges (SGLang >= 0.5 has it, with or
//! without `--enable-metrics`), `/metrics` for the latency histograms (and for the gauges
//! when an engine has no `/v1/loads`). One read of the fleet is one [`Tick`].

use crate::foundation::engine_http;
use crate::ops::manager::Manager;
use rollout_core::autoscaler::{metrics::sample_from_loads, prom, FleetState, Observation, Tick};
use rollout_core::{EngineOrigin, EngineStatus};
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

/// What the collector remembers between ticks.
#[derive(Debug, Default)]
pub struct Collector {
    /// Engines that answered 404 to `/v1/loads`: their gauges come from `/metrics`.
    no_loads_route: HashSet<String>,
}

/// The fleet as the scale API counts it, read under the registry lock.
pub fn fleet_state(manager: &Manager) -> (FleetState, Vec<(rollout_core::ids::EngineId, String)>) {
    let inner = manager.fleet.lock();
    let mut fleet = FleetState { live_engines: inner.engines.live_count(), ..FleetState::default() };
    let mut active = Vec::new();
    for e in inner.engines.values() {
        match e.status() {
            EngineStatus::Active => {
                fleet.active_engines += 1;
                active.push((e.record().engine_id().clone(), e.record().url().clone()));
            }
            EngineStatus::Pending
            | EngineStatus::Creating
            | EngineStatus::HealthChecking
            | EngineStatus::WeightSyncing
            | EngineStatus::Ready => fleet.starting_engines += 1,
            _ => {}
        }
        let live = !matches!(e.status(), EngineStatus::Removing | EngineStatus::Removed);
        if live && e.record().origin() == EngineOrigin::Initial {
            fleet.protected_engines += 1;
        }
    }
    // Room for more engines: what --max-engines allows and the free GPUs can hold (in Ray mode
    // the cluster decides: engines beyond its GPUs wait in PENDING_RESOURCES).
    let room = if manager.ray() {
        u32::MAX
    } else {
        inner.engines.free_gpus() / manager.config.rollout_num_gpus_per_engine.max(1)
    };
    fleet.capacity_engines = manager.config.max_engines.min(fleet.live_engines.saturating_add(room));
    fleet.operation_in_progress = inner.ops.running().map(|r| format!("{} {}", r.kind, r.request_id));
    (fleet, active)
}

impl Collector {
    /// Reads `engines` (id, url) concurrently; each read is bounded by `timeout`.
    pub async fn collect(
        &mut self,
        manager: &Manager,
        router_metrics: &crate::adapters::router::metrics::RouterMetrics,
        engines: &[(rollout_core::ids::EngineId, String)],
        timeout: Duration,
        at: f64,
    ) -> Tick {
        let reads = engines.iter().map(|(id, url)| {
            let use_loads = !self.no_loads_route.contains(id.as_str());
            async move { (id.to_string(), read_engine(&manager.http, url, use_loads, timeout).await) }
        });
        let results = futures::future::join_all(reads).await;
        let mut observations = BTreeMap::new();
        for (id, (observation, loads_missing)) in results {
            if loads_missing {
                self.no_loads_route.insert(id.clone());
            }
            observations.insert(id, observation);
        }
        self.no_loads_route.retain(|id| observations.contains_key(id));
        let router_queued = router_metrics.queued.get() as f64;
        Tick { at, engines: observations, router_queued }
    }
}

/// One engine: the observation, and whether `/v1/loads` turned out to be missing (404).
async fn read_engine(http: &reqwest::Client, url: &str, use_loads: bool, timeout: Duration) -> (Observation, bool) {
    let (observation, loads_missing) = read_engine_unquoted(http, url, use_loads, timeout).await;
    // Parse errors quote what the engine sent; keep the quote short.
    let observation = match observation {
        Observation::Missing { missing } => Observation::Missing { missing: engine_http::shorten(&missing) },
        sample => sample,
    };
    (observation, loads_missing)
}

async fn read_engine_unquoted(
    http: &reqwest::Client,
    url: &str,
    use_loads: bool,
    timeout: Duration,
) -> (Observation, bool) {
    let metrics = async {
        let text = engine_http::get_text(http, &format!("{url}/metrics"), timeout, engine_http::MAX_METRICS_BYTES)
            .await
            .map_err(|e| format!("/metrics: {e}"))?;
        let samples = prom::parse(&text).map_err(|e| format!("/metrics: {e}"))?;
        Ok::<_, String>(samples)
    };
    if !use_loads {
        return match metrics.await {
            Ok(samples) => match prom::sample_from_metrics(&samples) {
                Ok(s) => (Observation::Sample(s), false),
                Err(e) => (Observation::Missing { missing: format!("/metrics: {e}") }, false),
            },
            Err(e) => (Observation::Missing { missing: e }, false),
        };
    }
    let loads = async {
        let body = engine_http::get_json(http, &format!("{url}/v1/loads"), timeout).await.map_err(|e| match e {
            engine_http::ReadError::Status(404) => (true, "/v1/loads: 404".to_string()),
            e => (false, format!("/v1/loads: {e}")),
        })?;
        sample_from_loads(&body).map_err(|e| (false, format!("/v1/loads: {e}")))
    };
    let (loads, metrics) = tokio::join!(loads, metrics);
    match loads {
        Ok(mut sample) => {
            // Histograms are a bonus: an engine without --enable-metrics still has its gauges.
            if let Ok(samples) = metrics {
                sample.queue_time = prom::histogram(&samples, "sglang:queue_time_seconds");
                sample.ttft = prom::histogram(&samples, "sglang:time_to_first_token_seconds");
            }
            (Observation::Sample(sample), false)
        }
        Err((not_found, loads_error)) => match metrics.map(|s| prom::sample_from_metrics(&s)) {
            Ok(Ok(sample)) => (Observation::Sample(sample), not_found),
            Ok(Err(e)) => (Observation::Missing { missing: format!("{loads_error}; /metrics: {e}") }, not_found),
            Err(e) => (Observation::Missing { missing: format!("{loads_error}; {e}") }, not_found),
        },
    }
}

#[cfg(test)]
mod tests {
    #![expect(clippy::disallowed_methods, reason = "test servers and tasks live as long as their test")]
    use super::*;
    use axum::routing::get;
    use axum::Router;

    /// A fake engine on a free loopback port; `loads` false: `/v1/loads` is 404.
    async fn fake_engine(loads: bool) -> String {
        let metrics = "sglang:num_running_reqs{tp_rank=\"0\"} 2\nsglang:num_queue_reqs{tp_rank=\"0\"} 7\n\
                       sglang:token_usage{tp_rank=\"0\"} 0.5\n\
                       sglang:queue_time_seconds_bucket{le=\"1.0\"} 3\nsglang:queue_time_seconds_bucket{le=\"+Inf\"} 4\n";
        let mut app = Router::new().route("/metrics", get(move || async move { metrics }));
        if loads {
            app = app.route(
                "/v1/loads",
                get(|| async {
                    axum::Json(serde_json::json!({"loads": [
                        {"num_running_reqs": 1, "num_waiting_reqs": 3, "token_usage": 0.25, "gen_throughput": 10.0}]}))
                }),
            );
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}")
    }

    #[tokio::test]
    async fn loads_for_gauges_metrics_for_histograms_and_a_fallback() {
        let http = reqwest::Client::new();
        let timeout = Duration::from_secs(5);
        let with_loads = fake_engine(true).await;
        let (o, missing_route) = read_engine(&http, &with_loads, true, timeout).await;
        let Observation::Sample(s) = o else { panic!("{o:?}") };
        assert_eq!((s.num_queue_reqs, s.token_usage, missing_route), (3.0, 0.25, false));
        assert_eq!(s.queue_time.unwrap().count, 4.0);

        let metrics_only = fake_engine(false).await;
        let (o, missing_route) = read_engine(&http, &metrics_only, true, timeout).await;
        let Observation::Sample(s) = o else { panic!("{o:?}") };
        assert_eq!((s.num_queue_reqs, s.token_usage, missing_route), (7.0, 0.5, true));
        let (o, _) = read_engine(&http, &metrics_only, false, timeout).await;
        assert!(matches!(o, Observation::Sample(_)));

        // Nothing listens: missing, with the reason.
        let (o, _) = read_engine(&http, "http://127.0.0.1:9", true, timeout).await;
        let Observation::Missing { missing } = o else { panic!("{o:?}") };
        assert!(missing.contains("/v1/loads"), "{missing}");
    }
}
