//! The router's Prometheus metrics, served on `/metrics` of both ports.
//!
//! Counters, the queue gauge and the latency histograms are the `prometheus` crate's atomics,
//! resolved to their label values once, so the request path takes no lock and looks nothing up.
//! The latency buckets reach `--request-timeout-secs`. Per-engine gauges (in flight, estimated
//! tokens, the engine's reported KV pool) are read from the fleet's routing table when scraped,
//! so an engine that left routing has no series.

use crate::foundation::telemetry::{counter_vec, gauge_vec, histogram, latency_buckets};
use crate::registry::fleet::Backend;
use prometheus::core::Collector;
use prometheus::proto::MetricFamily;
use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge};
use std::time::Duration;

/// Why a request got an error from the router itself.
#[derive(Debug, Clone, Copy)]
pub enum ErrorKind {
    NoEngine,
    VersionUnavailable,
    NoAnswer,
    BadRequest,
    /// The engine's answer did not end within `--request-timeout-secs`.
    Timeout,
    /// No engine slot freed within `--request-timeout-secs` (`--max-inflight-per-engine`).
    QueueTimeout,
}

const ERROR_KINDS: [&str; 6] =
    ["no_engine", "version_unavailable", "no_answer", "bad_request", "timeout", "queue_timeout"];

/// A latency histogram observed with a [`Duration`].
#[derive(Debug, Clone)]
pub struct Latency(Histogram);

impl Latency {
    pub fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }
}

#[derive(Debug)]
pub struct RouterMetrics {
    requests: IntCounter,
    responses_by_class: IntCounterVec,
    /// Responses forwarded from engines, by status class (1xx..5xx).
    responses: [IntCounter; 5],
    retries: IntCounter,
    errors_by_kind: IntCounterVec,
    errors: [IntCounter; 6],
    affinity: IntCounterVec,
    /// Requests kept on their session's or prompt's engine / moved off it by the gate.
    affinity_kept: IntCounter,
    affinity_moved: IntCounter,
    /// Requests waiting in the router for a slot (`--max-inflight-per-engine`).
    pub queued: IntGauge,
    /// Time to the engine's response headers.
    pub first_byte: Latency,
    /// Time until the response body ended.
    pub duration: Latency,
    /// Requests moved to another engine while they ran, by reason (drain, lost, weight_update).
    moves: IntCounterVec,
    /// Tokens sent again as prompt to continue moved requests (prefilled again on the target).
    move_prefill_tokens: IntCounter,
    /// Requests ended with their output so far when their engine was lost, since a
    /// continuation would change them (`rollout_core::moves::continuable`).
    ended_on_loss: IntCounter,
}

impl RouterMetrics {
    /// Metrics whose latency buckets end at `request_timeout_secs`.
    pub fn new(request_timeout_secs: f64) -> Self {
        let responses_by_class =
            counter_vec("rollout_router_responses_total", "Engine responses forwarded, by status class.", &["class"]);
        let errors_by_kind = counter_vec(
            "rollout_router_errors_total",
            "Requests the router answered with an error itself, by kind.",
            &["kind"],
        );
        let affinity = counter_vec(
            "rollout_router_affinity_total",
            "Affine requests kept on, or moved off, their engine.",
            &["outcome"],
        );
        let buckets = latency_buckets(request_timeout_secs);
        Self {
            requests: counter_vec("rollout_router_requests_total", "Requests received by the router.", &[])
                .with_label_values::<&str>(&[]),
            responses: ["1xx", "2xx", "3xx", "4xx", "5xx"].map(|c| responses_by_class.with_label_values(&[c])),
            responses_by_class,
            retries: counter_vec("rollout_router_retries_total", "Attempts repeated on another engine.", &[])
                .with_label_values::<&str>(&[]),
            errors: ERROR_KINDS.map(|k| errors_by_kind.with_label_values(&[k])),
            errors_by_kind,
            affinity_kept: affinity.with_label_values(&["kept"]),
            affinity_moved: affinity.with_label_values(&["moved"]),
            affinity,
            queued: gauge_vec(
                "rollout_router_queued_requests",
                "Requests waiting in the router for an engine slot (--max-inflight-per-engine).",
                &[],
            )
            .with_label_values::<&str>(&[]),
            first_byte: Latency(histogram(
                "rollout_router_time_to_headers_seconds",
                "Time until the engine's response headers.",
                buckets.clone(),
            )),
            duration: Latency(histogram(
                "rollout_router_request_duration_seconds",
                "Time until the response body ended (or was cut).",
                buckets,
            )),
            moves: {
                let moves = counter_vec(
                    "rollout_router_moves_total",
                    "Running requests moved to another engine, by reason (drain: a scale-in; lost: the engine died \
                     mid-answer; weight_update: aborted by a weight update, with partial rollout; tail, preempt: \
                     the tail planner; chunk: the next chunk of a request generated in chunks).",
                    &["reason"],
                );
                for reason in ["drain", "lost", "weight_update"] {
                    let _ = moves.with_label_values(&[reason]);
                }
                moves
            },
            move_prefill_tokens: counter_vec(
                "rollout_router_move_prefill_tokens_total",
                "Prompt and output tokens sent again to continue moved requests (prefilled again on the target).",
                &[],
            )
            .with_label_values::<&str>(&[]),
            ended_on_loss: counter_vec(
                "rollout_router_ended_on_engine_loss_total",
                "Requests ended with their output so far (finish abort) when their engine was lost, because a \
                 continuation would change them (stop strings, a grammar, penalties, a logit processor).",
                &[],
            )
            .with_label_values::<&str>(&[]),
        }
    }

    /// A request a continuation would change ended with its output when its engine was lost.
    pub fn ended_on_loss(&self) {
        self.ended_on_loss.inc();
    }

    /// A request moved for `reason`, continuing with `prefill` tokens of prompt.
    pub fn moved(&self, reason: &str, prefill: usize) {
        self.moves.with_label_values(&[reason]).inc();
        self.move_prefill_tokens.inc_by(prefill as u64);
    }

    pub fn request(&self) {
        self.requests.inc();
    }

    pub fn retry(&self) {
        self.retries.inc();
    }

    pub fn affinity(&self, kept: bool) {
        if kept { &self.affinity_kept } else { &self.affinity_moved }.inc();
    }

    pub fn error(&self, kind: ErrorKind) {
        self.errors[kind as usize].inc();
    }

    pub fn response(&self, status: u16) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.responses[class].inc();
    }

    /// The router's metrics now, with one series per engine in `backends` for the gauges.
    pub fn families(&self, backends: &[Backend]) -> Vec<MetricFamily> {
        let mut out = Vec::new();
        out.extend(self.requests.collect());
        out.extend(self.responses_by_class.collect());
        out.extend(self.retries.collect());
        out.extend(self.errors_by_kind.collect());
        out.extend(self.affinity.collect());
        out.extend(self.queued.collect());
        out.extend(self.first_byte.0.collect());
        out.extend(self.duration.0.collect());
        out.extend(self.moves.collect());
        out.extend(self.move_prefill_tokens.collect());
        out.extend(self.ended_on_loss.collect());
        type Reader = fn(&Backend) -> i64;
        let gauges: [(&str, &str, Reader); 4] = [
            ("rollout_engine_in_flight", "Requests the router has in flight to the engine.", |b| {
                i64::try_from(b.load.get()).unwrap_or(i64::MAX)
            }),
            ("rollout_engine_estimated_tokens", "KV tokens the router estimates its in-flight requests hold.", |b| {
                i64::try_from(b.load.est_tokens()).unwrap_or(i64::MAX)
            }),
            ("rollout_engine_kv_capacity_tokens", "KV pool size last reported by the engine (0: unknown).", |b| {
                i64::try_from(b.load.snapshot().capacity).unwrap_or(i64::MAX)
            }),
            (
                "rollout_engine_auto_inflight_cap",
                "The engine's automatic in-flight cap (--max-inflight-per-engine auto; 0: not computed yet).",
                |b| i64::try_from(b.load.auto_cap().unwrap_or(0)).unwrap_or(i64::MAX),
            ),
        ];
        for (name, help, read) in gauges {
            let g = gauge_vec(name, help, &["engine_id"]);
            for b in backends {
                g.with_label_values(&[b.engine_id.as_str()]).set(read(b));
            }
            out.extend(g.collect());
        }
        let served =
            counter_vec("rollout_engine_served_total", "Requests the router sent to the engine.", &["engine_id"]);
        for b in backends {
            served.with_label_values(&[b.engine_id.as_str()]).inc_by(b.load.served());
        }
        out.extend(served.collect());
        out
    }
}

/// The text of `/metrics` on both ports: the process-wide metrics, the fleet's and the router's.
pub fn render(fleet: &crate::registry::fleet::Fleet, router: &RouterMetrics) -> String {
    let mut families = router.families(&fleet.routes().backends);
    families.extend(fleet.metric_families());
    crate::foundation::telemetry::render(families)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(m: &RouterMetrics) -> String {
        crate::foundation::telemetry::render(m.families(&[]))
    }

    #[test]
    fn a_long_generation_lands_in_a_bucket_below_the_timeout() {
        let m = RouterMetrics::new(1800.0);
        m.duration.observe(Duration::from_secs(700));
        let t = text(&m);
        assert!(t.contains("rollout_router_request_duration_seconds_bucket{le=\"600\"} 0"), "{t}");
        assert!(t.contains("rollout_router_request_duration_seconds_bucket{le=\"900\"} 1"), "{t}");
        assert!(t.contains("rollout_router_request_duration_seconds_bucket{le=\"1800\"} 1"), "{t}");
    }

    #[test]
    fn counters_keep_their_labels() {
        let m = RouterMetrics::new(60.0);
        m.request();
        m.response(503);
        m.error(ErrorKind::QueueTimeout);
        m.affinity(false);
        let t = text(&m);
        for line in [
            "rollout_router_requests_total 1",
            "rollout_router_responses_total{class=\"5xx\"} 1",
            "rollout_router_errors_total{kind=\"queue_timeout\"} 1",
            "rollout_router_errors_total{kind=\"no_engine\"} 0",
            "rollout_router_affinity_total{outcome=\"moved\"} 1",
        ] {
            assert!(t.lines().any(|l| l == line), "{line} missing from:\n{t}");
        }
    }
}
