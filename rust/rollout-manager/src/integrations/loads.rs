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

/// Sums an engine's DP ranks: (pool size, tokens used or queued). Sums saturate: an engine
/// that reports absurd numbers looks full, it does not overflow the router.
fn parse(body: &[u8]) -> Option<(u64, u64)> {
    let loads: Loads = serde_json::from_slice(body).ok()?;
    if loads.loads.is_empty() {
        return None;
    }
    let cap = loads.loads.iter().fold(0u64, |acc, l| acc.saturating_add(l.max_total_num_tokens));
    let used = loads
        .loads
        .iter()
        .fold(0u64, |acc, l| acc.saturating_add(l.num_used_tokens).saturating_add(l.num_waiting_uncached_tokens));
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
    futures::future::join_all(routes.backends.iter().map(|b| async move {
        let url = format!("{}/v1/loads?include=core", b.url);
        let Ok(body) = crate::engine_http::get(&manager.http, &url, timeout, crate::engine_http::MAX_JSON_BYTES).await
        else {
            return;
        };
        if let Some((cap, used)) = parse(&body) {
            b.load.report(cap, used);
        }
    }))
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sums_ranks() {
        let body = br#"{"timestamp": 1, "loads": [
            {"dp_rank": 0, "num_used_tokens": 100, "num_waiting_uncached_tokens": 5, "max_total_num_tokens": 1000},
            {"dp_rank": 1, "num_used_tokens": 50, "max_total_num_tokens": 1000}]}"#;
        assert_eq!(parse(body), Some((2000, 155)));
        assert_eq!(parse(b"{}"), None);
        assert_eq!(parse(b"garbage"), None);
        let max = u64::MAX;
        let body = format!(
            r#"{{"loads": [{{"num_used_tokens": {max}, "num_waiting_uncached_tokens": {max}, "max_total_num_tokens": {max}}},
                            {{"num_used_tokens": {max}, "max_total_num_tokens": 1}}]}}"#
        );
        assert_eq!(parse(body.as_bytes()), Some((max, max)));
    }

    proptest! {
        /// Whatever an engine answers: a report or nothing, never a panic.
        #[test]
        fn any_answer_is_read_without_panic(body in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse(&body);
        }

        /// Any u64 in any field is summed without overflow.
        #[test]
        fn any_numbers_are_read_without_overflow(
            ranks in proptest::collection::vec(
                (any::<u64>(), any::<u64>(), any::<u64>(),
                 any::<f64>()), 0..6)
        ) {
            let loads: Vec<String> = ranks.iter().map(|(a, b, c, f)| format!(
                r#"{{"num_used_tokens": {a}, "num_waiting_uncached_tokens": {b}, "max_total_num_tokens": {c}, "token_usage": {f:?}}}"#
            )).collect();
            let body = format!(r#"{{"loads": [{}]}}"#, loads.join(","));
            let parsed = parse(body.as_bytes());
            // "NaN"/"inf" are not JSON: those bodies are refused; the others are read.
            let json_ok = ranks.iter().all(|r| r.3.is_finite());
            prop_assert_eq!(parsed.is_some(), json_ok && !ranks.is_empty());
        }
    }
}
