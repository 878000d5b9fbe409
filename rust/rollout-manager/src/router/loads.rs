//! The load poller: every `--load-poll-interval-secs`, read each routable engine's `/v1/loads`
//! and record its KV pool size and the tokens it holds or has queued, so the router's own
//! estimate is corrected by what the engine actually reports. An engine that does not answer
//! keeps its last report; routing then relies on the router's exact in-flight counts.

use crate::manager::Manager;
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;

#[derive(Deserialize)]
struct Loads {
    #[serde(default)]
    loads: Vec<RankLoad>,
}

#[derive(Deserialize)]
struct RankLoad {
    #[serde(default)]
    num_used_tokens: u64,
    #[serde(default)]
    num_waiting_uncached_tokens: u64,
    #[serde(default)]
    max_total_num_tokens: u64,
}

/// Sums an engine's DP ranks: (pool size, tokens used or queued).
fn parse(body: &[u8]) -> Option<(u64, u64)> {
    let loads: Loads = serde_json::from_slice(body).ok()?;
    if loads.loads.is_empty() {
        return None;
    }
    let cap = loads.loads.iter().map(|l| l.max_total_num_tokens).sum();
    let used = loads.loads.iter().map(|l| l.num_used_tokens + l.num_waiting_uncached_tokens).sum();
    Some((cap, used))
}

pub fn spawn_poller(manager: &Arc<Manager>) {
    let m = manager.clone();
    manager.tasks.spawn(async move {
        let period = Duration::from_secs_f64(m.config.load_poll_interval_secs);
        let mut ticker = tokio::time::interval(period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut changes = m.fleet.subscribe();
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                // A new routable engine gets its pool size read at once, not a period later.
                Ok(()) = changes.changed() => {}
                _ = m.shutdown.cancelled() => return,
            }
            poll_all(&m, period.max(Duration::from_millis(500))).await;
        }
    });
}

async fn poll_all(manager: &Manager, timeout: Duration) {
    let routes = manager.fleet.routes();
    futures::future::join_all(routes.iter().map(|b| async move {
        let resp = manager.http.get(format!("{}/v1/loads?include=core", b.url)).timeout(timeout).send().await;
        let Ok(resp) = resp else { return };
        let Ok(body) = resp.bytes().await else { return };
        if let Some((cap, used)) = parse(&body) {
            b.load.report(cap, used);
        }
    }))
    .await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sums_ranks() {
        let body = br#"{"timestamp": 1, "loads": [
            {"dp_rank": 0, "num_used_tokens": 100, "num_waiting_uncached_tokens": 5, "max_total_num_tokens": 1000},
            {"dp_rank": 1, "num_used_tokens": 50, "max_total_num_tokens": 1000}]}"#;
        assert_eq!(parse(body), Some((2000, 155)));
        assert_eq!(parse(b"{}"), None);
        assert_eq!(parse(b"garbage"), None);
    }
}
