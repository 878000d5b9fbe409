//! The router's Prometheus metrics, served on the control port's `/metrics`.
//!
//! Counters and histograms are plain atomics (no lock on the request path); per-engine gauges
//! (in flight, estimated tokens, the engine's reported KV pool) are read from the fleet's
//! routing table when scraped.

use crate::fleet::Backend;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds (seconds) of the latency histogram buckets.
const BUCKETS: [f64; 14] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|b| secs <= *b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, b) in BUCKETS.iter().enumerate() {
            cumulative += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {count}");
    }
}

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

#[derive(Debug, Default)]
pub struct RouterMetrics {
    pub requests: AtomicU64,
    /// Responses forwarded from engines, by status class (1xx..5xx).
    pub responses: [AtomicU64; 5],
    pub retries: AtomicU64,
    pub errors_no_engine: AtomicU64,
    pub errors_version: AtomicU64,
    pub errors_no_answer: AtomicU64,
    pub errors_bad_request: AtomicU64,
    pub errors_timeout: AtomicU64,
    /// Requests kept on their session's or prompt's engine / moved off it by the gate.
    pub affinity_kept: AtomicU64,
    pub affinity_moved: AtomicU64,
    /// Requests waiting in the router for a slot (`--max-inflight-per-engine`), and how many
    /// ended their wait without one.
    pub queued: AtomicU64,
    pub errors_queue_timeout: AtomicU64,
    /// Time to the engine's response headers.
    pub first_byte: Histogram,
    /// Time until the response body ended.
    pub duration: Histogram,
}

impl RouterMetrics {
    pub fn error(&self, kind: ErrorKind) {
        let c = match kind {
            ErrorKind::NoEngine => &self.errors_no_engine,
            ErrorKind::VersionUnavailable => &self.errors_version,
            ErrorKind::NoAnswer => &self.errors_no_answer,
            ErrorKind::BadRequest => &self.errors_bad_request,
            ErrorKind::Timeout => &self.errors_timeout,
            ErrorKind::QueueTimeout => &self.errors_queue_timeout,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn response(&self, status: u16) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.responses[class].fetch_add(1, Ordering::Relaxed);
    }

    /// Prometheus text exposition.
    pub fn render(&self, backends: &[Backend]) -> String {
        let mut out = String::with_capacity(4096);
        let counter = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Ordering::Relaxed));
        };
        counter(&mut out, "rollout_router_requests_total", "Requests received by the router.", &self.requests);
        let _ = writeln!(out, "# HELP rollout_router_responses_total Engine responses forwarded, by status class.");
        let _ = writeln!(out, "# TYPE rollout_router_responses_total counter");
        for (i, c) in self.responses.iter().enumerate() {
            let _ =
                writeln!(out, "rollout_router_responses_total{{class=\"{}xx\"}} {}", i + 1, c.load(Ordering::Relaxed));
        }
        counter(&mut out, "rollout_router_retries_total", "Attempts repeated on another engine.", &self.retries);
        let _ = writeln!(out, "# HELP rollout_router_errors_total Requests the router answered with an error itself.");
        let _ = writeln!(out, "# TYPE rollout_router_errors_total counter");
        for (kind, c) in [
            ("no_engine", &self.errors_no_engine),
            ("version_unavailable", &self.errors_version),
            ("no_answer", &self.errors_no_answer),
            ("bad_request", &self.errors_bad_request),
            ("timeout", &self.errors_timeout),
            ("queue_timeout", &self.errors_queue_timeout),
        ] {
            let _ = writeln!(out, "rollout_router_errors_total{{kind=\"{kind}\"}} {}", c.load(Ordering::Relaxed));
        }
        let _ =
            writeln!(out, "# HELP rollout_router_affinity_total Affine requests kept on, or moved off, their engine.");
        let _ = writeln!(out, "# TYPE rollout_router_affinity_total counter");
        let _ = writeln!(
            out,
            "rollout_router_affinity_total{{outcome=\"kept\"}} {}",
            self.affinity_kept.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "rollout_router_affinity_total{{outcome=\"moved\"}} {}",
            self.affinity_moved.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP rollout_router_queued_requests Requests waiting in the router for an engine slot \
             (--max-inflight-per-engine).\n# TYPE rollout_router_queued_requests gauge\nrollout_router_queued_requests {}",
            self.queued.load(Ordering::Relaxed)
        );
        self.first_byte.render(
            &mut out,
            "rollout_router_time_to_headers_seconds",
            "Time until the engine's response headers.",
        );
        self.duration.render(
            &mut out,
            "rollout_router_request_duration_seconds",
            "Time until the response body ended.",
        );
        type Reader = fn(&Backend) -> f64;
        let gauges: [(&str, &str, Reader); 4] = [
            ("rollout_engine_in_flight", "Requests the router has in flight to the engine.", |b| b.load.get() as f64),
            ("rollout_engine_estimated_tokens", "KV tokens the router estimates its in-flight requests hold.", |b| {
                b.load.est_tokens() as f64
            }),
            ("rollout_engine_kv_capacity_tokens", "KV pool size last reported by the engine (0: unknown).", |b| {
                b.load.snapshot().capacity as f64
            }),
            ("rollout_engine_served_total", "Requests the router sent to the engine.", |b| b.load.served() as f64),
        ];
        for (name, help, f) in gauges {
            let kind = if name.ends_with("_total") { "counter" } else { "gauge" };
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for b in backends {
                let _ = writeln!(out, "{name}{{engine_id=\"{}\"}} {}", b.engine_id, f(b));
            }
        }
        out
    }
}
