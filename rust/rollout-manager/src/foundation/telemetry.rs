//! Prometheus metrics: the process-wide ones (events counted where they happen: a scale
//! operation or weight update ending, an engine becoming ACTIVE, an autoscaler decision; build
//! info; the process's CPU, memory and file descriptors) and the exposition of a manager's
//! `/metrics`, which adds the metrics read from its fleet and router when scraped.
//!
//! Text exposition 0.0.4 by the `prometheus` crate (names, label escaping, histogram lines);
//! see docs/operations.md for the list of series.

use prometheus::core::Collector;
use prometheus::{Encoder, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry};
use std::sync::LazyLock;

/// Bucket bounds (seconds) of histograms of things that take seconds to many minutes: scale
/// operations, engine start-up, weight updates.
const SLOW_BUCKETS: [f64; 14] =
    [0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0];

/// Latency buckets (seconds) that reach `limit` (the request timeout): the usual sub-second
/// bounds, then minutes, so a long generation lands in a bucket of its own, not in `+Inf`.
/// `limit` itself is the last bound.
pub fn latency_buckets(limit: f64) -> Vec<f64> {
    const BASE: [f64; 22] = [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
        900.0, 1200.0, 1800.0, 3600.0,
    ];
    let mut out: Vec<f64> = BASE.iter().copied().filter(|b| *b < limit).collect();
    if limit.is_finite() && limit > 0.0 {
        out.push(limit);
    }
    out
}

/// Metric constructors take constant names and labels: an error is a bug that the unit test
/// below (which builds every metric) finds.
fn built<T>(made: prometheus::Result<T>, name: &str) -> T {
    match made {
        Ok(m) => m,
        Err(e) => panic!("metric {name} is malformed: {e}"),
    }
}

pub fn histogram_vec(name: &str, help: &str, buckets: Vec<f64>, labels: &[&str]) -> HistogramVec {
    built(HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels), name)
}

pub fn histogram(name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    built(Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)), name)
}

pub fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    built(IntCounterVec::new(Opts::new(name, help), labels), name)
}

pub fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> prometheus::IntGaugeVec {
    built(prometheus::IntGaugeVec::new(Opts::new(name, help), labels), name)
}

/// Process-wide event metrics.
pub struct Events {
    /// `rollout_scale_operation_duration_seconds{kind, outcome}`: from accepted to terminal.
    pub scale_seconds: HistogramVec,
    /// `rollout_engine_startup_seconds`: from launch (CREATING) to ACTIVE, first start or restart.
    pub engine_startup_seconds: HistogramVec,
    /// `rollout_weight_update_duration_seconds{outcome}`: from published to terminal.
    pub weight_update_seconds: HistogramVec,
    /// `rollout_autoscaler_decisions_total{action, reason}`.
    pub autoscaler_decisions: IntCounterVec,
    registry: Registry,
}

static EVENTS: LazyLock<Events> = LazyLock::new(|| {
    let registry = Registry::new();
    let events = Events {
        scale_seconds: histogram_vec(
            "rollout_scale_operation_duration_seconds",
            "Scale operations from accepted to finished, by kind and final status.",
            SLOW_BUCKETS.to_vec(),
            &["kind", "outcome"],
        ),
        engine_startup_seconds: histogram_vec(
            "rollout_engine_startup_seconds",
            "Engines from launch to ACTIVE (model load, health check, weight check), by why they started.",
            SLOW_BUCKETS.to_vec(),
            &["reason"],
        ),
        weight_update_seconds: histogram_vec(
            "rollout_weight_update_duration_seconds",
            "Fleet weight updates from published to finished, by final status.",
            SLOW_BUCKETS.to_vec(),
            &["outcome"],
        ),
        autoscaler_decisions: counter_vec(
            "rollout_autoscaler_decisions_total",
            "Autoscaler evaluations that decided, by action (scale_out, scale_in, none) and reason.",
            &["action", "reason"],
        ),
        registry,
    };
    let build = built(
        IntGauge::with_opts(
            Opts::new("rollout_build_info", "The manager's build (always 1).")
                .const_label("version", env!("CARGO_PKG_VERSION"))
                .const_label("program", "rollout-manager"),
        ),
        "rollout_build_info",
    );
    build.set(1);
    // The usual label sets exist from the start (at 0), so rate() and alerts see them before
    // the first event.
    for (kind, outcomes) in
        [("scale_out", &["active", "failed", "cancelled"][..]), ("scale_in", &["completed", "failed"][..])]
    {
        for outcome in outcomes {
            let _ = events.scale_seconds.with_label_values(&[kind, outcome]);
        }
    }
    for reason in ["create", "restart"] {
        let _ = events.engine_startup_seconds.with_label_values(&[reason]);
    }
    for outcome in ["completed", "failed"] {
        let _ = events.weight_update_seconds.with_label_values(&[outcome]);
    }
    let collectors: [Box<dyn Collector>; 5] = [
        Box::new(events.scale_seconds.clone()),
        Box::new(events.engine_startup_seconds.clone()),
        Box::new(events.weight_update_seconds.clone()),
        Box::new(events.autoscaler_decisions.clone()),
        Box::new(build),
    ];
    for c in collectors {
        if let Err(e) = events.registry.register(c) {
            tracing::error!(error = %e, "cannot register a metric");
        }
    }
    #[cfg(target_os = "linux")]
    if let Err(e) = events.registry.register(Box::new(prometheus::process_collector::ProcessCollector::for_self())) {
        tracing::error!(error = %e, "cannot register the process metrics");
    }
    events
});

pub fn events() -> &'static Events {
    &EVENTS
}

/// The text exposition of the process-wide metrics and of `instance` (a manager's fleet and
/// router, collected when scraped).
pub fn render(instance: Vec<prometheus::proto::MetricFamily>) -> String {
    let mut families = EVENTS.registry.gather();
    families.extend(instance);
    // A family without series (no engine yet) is left out: the encoder refuses one.
    families.retain(|f| !f.get_metric().is_empty());
    families.sort_by(|a, b| a.name().cmp(b.name()));
    let mut buf = Vec::with_capacity(16 * 1024);
    if let Err(e) = prometheus::TextEncoder::new().encode(&families, &mut buf) {
        tracing::error!(error = %e, "cannot encode the metrics");
    }
    String::from_utf8(buf).unwrap_or_default()
}

/// Content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_buckets_end_at_the_limit() {
        let b = latency_buckets(1800.0);
        assert_eq!(b.last(), Some(&1800.0));
        assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
        assert!(b.contains(&600.0) && b.contains(&0.001));
        let b = latency_buckets(45.0);
        assert_eq!(&b[b.len() - 2..], &[30.0, 45.0]);
        assert_eq!(latency_buckets(0.5).last(), Some(&0.5));
    }

    #[test]
    fn every_event_metric_is_built_and_rendered() {
        events().scale_seconds.with_label_values(&["scale_out", "COMPLETED"]).observe(3.0);
        events().autoscaler_decisions.with_label_values(&["none", "cooldown"]).inc();
        let text = render(Vec::new());
        for name in [
            "rollout_scale_operation_duration_seconds_bucket",
            "rollout_autoscaler_decisions_total",
            "rollout_build_info{",
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
    }
}
