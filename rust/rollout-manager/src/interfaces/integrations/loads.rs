//! The load poller: every `--load-poll-interval-secs`, read each routable engine's `/v1/loads`
//! and record its KV pool size and the tokens it holds or has queued, so the router's own
//! estimate is corrected by what the engine actually reports. An engine that does not answer
//! keeps its last report; routing then relies on the router's exact in-flight counts.
//!
//! SGLang before 0.5.8 has no `/v1/loads`, only `/get_load` (which 0.5.23 removed), and it
//! does not report the pool size there: 0.5.6 and 0.5.7 answer one
//! `{dp_rank, num_reqs, num_waiting_reqs, num_tokens}` per DP rank, 0.5.2 to 0.5.5 answer
//! `{"load": tokens}` for DP rank 0 alone. For those engines the pool size is read once from
//! `/get_server_info` (`max_total_num_tokens` per rank, times `dp_size`).
//!
//! Each poll also sets every engine's automatic in-flight cap (`--max-inflight-per-engine
//! auto`, [`rollout_core::lengths::auto_inflight_cap`]) from its pool, the requests it runs and
//! its running limit (`num_running_reqs`, `max_running_requests` of `/v1/loads`), and the mean
//! size of the answers the router saw.

use crate::adapters::dialect::Route;
use crate::foundation::locks::Locked;
use crate::ops::manager::Manager;
use rollout_core::lengths::AUTO_CAP_UNREPORTED;
use serde::Deserialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
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
    #[serde(default)]
    num_running_reqs: u64,
    #[serde(default)]
    max_running_requests: u64,
}

/// One engine's load report, its DP ranks summed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Report {
    /// KV pool size.
    cap: u64,
    /// Tokens used or queued.
    used: u64,
    /// Requests running (0 where not reported).
    running: u64,
    /// Running limit (0 where not reported).
    max_running: u64,
}

/// Sums an engine's DP ranks. Sums saturate: an engine that reports absurd numbers looks full,
/// it does not overflow the router.
fn parse(body: &[u8]) -> Option<Report> {
    let loads: Loads = serde_json::from_slice(body).ok()?;
    if loads.loads.is_empty() {
        return None;
    }
    let sum = |f: fn(&RankLoad) -> u64| loads.loads.iter().fold(0u64, |acc, l| acc.saturating_add(f(l)));
    Some(Report {
        cap: sum(|l| l.max_total_num_tokens),
        used: sum(|l| l.num_used_tokens.saturating_add(l.num_waiting_uncached_tokens)),
        running: sum(|l| l.num_running_reqs),
        max_running: sum(|l| l.max_running_requests),
    })
}

/// `/get_load`: the tokens used or queued, summed over the DP ranks it reports.
fn parse_legacy(body: &[u8]) -> Option<u64> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Legacy {
        /// 0.5.6 and later: one entry per DP rank.
        Ranks(Vec<LegacyRank>),
        /// 0.5.2 to 0.5.5: DP rank 0's tokens.
        Total { load: u64 },
    }
    #[derive(Deserialize)]
    struct LegacyRank {
        num_tokens: u64,
    }
    match serde_json::from_slice(body).ok()? {
        Legacy::Ranks(ranks) if !ranks.is_empty() => {
            Some(ranks.iter().fold(0u64, |acc, r| acc.saturating_add(r.num_tokens)))
        }
        Legacy::Ranks(_) => None,
        Legacy::Total { load } => Some(load),
    }
}

/// `/get_server_info`: the KV pool size of the whole engine (`max_total_num_tokens` is one
/// DP rank's).
fn parse_pool_size(body: &[u8]) -> Option<u64> {
    let info: serde_json::Value = serde_json::from_slice(body).ok()?;
    let per_rank = info.get("max_total_num_tokens")?.as_u64()?;
    let ranks = info.get("dp_size").and_then(serde_json::Value::as_u64).unwrap_or(1).max(1);
    Some(per_rank.saturating_mul(ranks))
}

pub fn spawn_poller(manager: &Arc<Manager>) {
    let m = manager.clone();
    manager.tasks.spawn(async move {
        let pool_sizes = Mutex::new(HashMap::new());
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
            poll_all(&m, period.max(Duration::from_millis(500)), &pool_sizes).await;
        }
    });
}

/// Pool sizes read from `/get_server_info`, by engine URL (engines without `/v1/loads` only).
type PoolSizes = Mutex<HashMap<String, u64>>;

async fn poll_all(manager: &Manager, timeout: Duration, pool_sizes: &PoolSizes) {
    let routes = manager.fleet.routes();
    let footprint = manager.fleet.slot_queue().lengths(rollout_core::lengths::LengthEstimator::mean_footprint);
    futures::future::join_all(routes.backends.iter().map(|b| async move {
        if let Some(r) = poll_one(manager, &b.url, timeout, pool_sizes).await {
            b.load.report(r.cap, r.used);
            b.load.report_running(r.running, r.max_running);
        }
        let cap = rollout_core::lengths::auto_inflight_cap(b.load.engine_report(), footprint, AUTO_CAP_UNREPORTED);
        b.load.set_auto_cap(cap);
    }))
    .await;
    let live: std::collections::HashSet<&str> = routes.backends.iter().map(|b| b.url.as_str()).collect();
    lock(pool_sizes).retain(|url, _| live.contains(url.as_str()));
}

fn lock(pool_sizes: &PoolSizes) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
    pool_sizes.locked()
}

/// One engine's report, from whichever route it serves.
async fn poll_one(manager: &Manager, url: &str, timeout: Duration, pool_sizes: &PoolSizes) -> Option<Report> {
    let limit = crate::foundation::engine_http::MAX_JSON_BYTES;
    let (name, body) = manager.routes.get(&manager.http, url, Route::Loads, timeout, limit).await.ok()?;
    if name != "/get_load" {
        return parse(&body);
    }
    let used = parse_legacy(&body)?;
    let known = lock(pool_sizes).get(url).copied();
    let cap = match known {
        Some(cap) => cap,
        None => {
            let (_, info) = manager.routes.get(&manager.http, url, Route::ServerInfo, timeout, limit).await.ok()?;
            let cap = parse_pool_size(&info)?;
            lock(pool_sizes).insert(url.to_string(), cap);
            cap
        }
    };
    Some(Report { cap, used, ..Report::default() })
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
        assert_eq!(parse(body), Some(Report { cap: 2000, used: 155, running: 0, max_running: 0 }));
        let body = br#"{"loads": [
            {"num_running_reqs": 3, "max_running_requests": 48, "max_total_num_tokens": 1000},
            {"num_running_reqs": 2, "max_running_requests": 48, "max_total_num_tokens": 1000}]}"#;
        assert_eq!(parse(body), Some(Report { cap: 2000, used: 0, running: 5, max_running: 96 }));
        assert_eq!(parse(b"{}"), None);
        assert_eq!(parse(b"garbage"), None);
        let max = u64::MAX;
        let body = format!(
            r#"{{"loads": [{{"num_used_tokens": {max}, "num_waiting_uncached_tokens": {max}, "max_total_num_tokens": {max}}},
                            {{"num_used_tokens": {max}, "max_total_num_tokens": 1}}]}}"#
        );
        assert_eq!(parse(body.as_bytes()).map(|r| (r.cap, r.used)), Some((max, max)));
    }

    #[test]
    fn reads_the_legacy_shapes() {
        // 0.5.6: one entry per DP rank.
        let body = br#"[{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 700},
                        {"dp_rank": 1, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 20}]"#;
        assert_eq!(parse_legacy(body), Some(720));
        // 0.5.2: DP rank 0's tokens.
        assert_eq!(parse_legacy(br#"{"load": 42}"#), Some(42));
        assert_eq!(parse_legacy(b"[]"), None);
        assert_eq!(parse_legacy(br#"{"loads": []}"#), None);
        assert_eq!(parse_legacy(br#"[{"num_tokens": -1}]"#), None);
        let max = u64::MAX;
        assert_eq!(parse_legacy(format!(r#"[{{"num_tokens": {max}}}, {{"num_tokens": 1}}]"#).as_bytes()), Some(max));
        // The pool: per rank times the ranks.
        assert_eq!(parse_pool_size(br#"{"max_total_num_tokens": 1000, "dp_size": 2, "version": "0.5.2"}"#), Some(2000));
        assert_eq!(parse_pool_size(br#"{"max_total_num_tokens": 1000}"#), Some(1000));
        assert_eq!(parse_pool_size(br#"{"max_total_num_tokens": 1000, "dp_size": 0}"#), Some(1000));
        assert_eq!(parse_pool_size(br#"{"dp_size": 2}"#), None);
        assert_eq!(
            parse_pool_size(format!(r#"{{"max_total_num_tokens": {max}, "dp_size": 4}}"#).as_bytes()),
            Some(max)
        );
    }

    proptest! {
        /// Whatever an engine answers: a report or nothing, never a panic.
        #[test]
        fn any_answer_is_read_without_panic(body in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse(&body);
            let _ = parse_legacy(&body);
            let _ = parse_pool_size(&body);
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
