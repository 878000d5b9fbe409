//! Prometheus metrics with SGLang's names (`sglang:*`) and labels. Counters and histograms
//! are lock-free atomics (they are hit on every request, also in `--zero-cost` mode); gauges
//! are read from the ranks at scrape time.

use crate::cli::Config;
use crate::scheduler::RankLoad;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0,
    100.0, 200.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0,
];

/// A histogram with fixed buckets, safe to observe from many threads.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative counts per bucket; the last slot is +Inf.
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_nanos: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self.bounds.iter().position(|b| secs <= *b).unwrap_or(self.bounds.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            cumulative += b.load(Ordering::Relaxed);
            let le = self.bounds.get(i).map_or_else(|| "+Inf".to_string(), |v| format!("{v:?}"));
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative:?}.0");
        }
        let count = self.count.load(Ordering::Relaxed);
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}.0");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum:?}");
    }
}

/// Everything `/metrics` reports that is not read from the ranks.
#[derive(Debug)]
pub struct Metrics {
    /// Labels of scheduler metrics (without braces).
    sched_labels: String,
    /// Labels of tokenizer-side metrics (without braces).
    tok_labels: String,
    dp_size: usize,
    /// Index 0: is_streaming="false", 1: "true".
    prompt_tokens: [AtomicU64; 2],
    generation_tokens: [AtomicU64; 2],
    cached_tokens: AtomicU64,
    num_requests: AtomicU64,
    /// Abort calls the front end forwarded (SGLang counts calls, not the requests they end:
    /// 0.5.23 `managers/tokenizer_manager.py:2241-2265`).
    num_aborted: AtomicU64,
    queue_time: Histogram,
    ttft: [Histogram; 2],
    e2e: [Histogram; 2],
    /// f64 bits of the last weight load's duration.
    weight_load_secs: AtomicU64,
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// A finished request, as far as metrics care.
#[derive(Debug, Clone, Copy)]
pub struct RequestRecord {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub streaming: bool,
    pub e2e: Duration,
    pub queue_time: Option<Duration>,
    pub ttft: Option<Duration>,
}

impl Metrics {
    pub fn new(cfg: &Config) -> Self {
        let model = escape(cfg.served_model_name());
        Self {
            sched_labels: format!(
                "engine_type=\"unified\",model_name=\"{model}\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\""
            ),
            tok_labels: format!("engine_type=\"unified\",model_name=\"{model}\""),
            dp_size: cfg.dp_size as usize,
            prompt_tokens: [AtomicU64::new(0), AtomicU64::new(0)],
            generation_tokens: [AtomicU64::new(0), AtomicU64::new(0)],
            cached_tokens: AtomicU64::new(0),
            num_requests: AtomicU64::new(0),
            num_aborted: AtomicU64::new(0),
            queue_time: Histogram::new(LATENCY_BUCKETS),
            ttft: [Histogram::new(LATENCY_BUCKETS), Histogram::new(LATENCY_BUCKETS)],
            e2e: [Histogram::new(LATENCY_BUCKETS), Histogram::new(LATENCY_BUCKETS)],
            weight_load_secs: AtomicU64::new(0f64.to_bits()),
        }
    }

    pub fn record(&self, r: &RequestRecord) {
        let s = usize::from(r.streaming);
        let add = |c: &AtomicU64, v: usize| {
            c.fetch_add(u64::try_from(v).unwrap_or(u64::MAX), Ordering::Relaxed);
        };
        add(&self.prompt_tokens[s], r.prompt_tokens);
        add(&self.generation_tokens[s], r.completion_tokens);
        add(&self.cached_tokens, r.cached_tokens);
        self.num_requests.fetch_add(1, Ordering::Relaxed);
        self.e2e[s].observe(r.e2e);
        if let Some(q) = r.queue_time {
            self.queue_time.observe(q);
        }
        if let Some(t) = r.ttft {
            self.ttft[s].observe(t);
        }
    }

    /// One abort call forwarded to the schedulers (`sglang:num_aborted_requests_total`).
    pub fn count_abort_call(&self) {
        self.num_aborted.fetch_add(1, Ordering::Relaxed);
    }

    pub fn set_weight_load_duration(&self, d: Duration) {
        self.weight_load_secs.store(d.as_secs_f64().to_bits(), Ordering::Relaxed);
    }

    /// Renders the Prometheus text exposition.
    pub fn render(&self, loads: &[RankLoad], paused_reqs: usize) -> String {
        let mut out = String::with_capacity(16 * 1024);
        let rank_labels = |l: &RankLoad| {
            if self.dp_size > 1 {
                format!("{},dp_rank=\"{}\"", self.sched_labels, l.dp_rank)
            } else {
                self.sched_labels.clone()
            }
        };
        type Getter = fn(&RankLoad) -> f64;
        let gauges: [(&str, &str, Getter); 7] = [
            ("num_running_reqs", "The number of running requests.", |l| l.num_running_reqs as f64),
            ("num_queue_reqs", "The number of requests in the waiting queue.", |l| l.num_waiting_reqs as f64),
            ("num_used_tokens", "The number of used tokens.", |l| l.num_used_tokens as f64),
            ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", |l| {
                l.max_total_num_tokens as f64
            }),
            ("token_usage", "The token usage.", |l| (l.token_usage * 100.0).round() / 100.0),
            ("gen_throughput", "The generation throughput (token/s).", |l| l.gen_throughput),
            ("cache_hit_rate", "The prefix cache hit rate.", |l| l.cache_hit_rate),
        ];
        for (name, help, get) in gauges {
            let _ = writeln!(out, "# HELP sglang:{name} {help}");
            let _ = writeln!(out, "# TYPE sglang:{name} gauge");
            for l in loads {
                let _ = writeln!(out, "sglang:{name}{{{}}} {:?}", rank_labels(l), get(l));
            }
        }
        let _ = writeln!(out, "# HELP sglang:num_paused_reqs The number of paused requests.");
        let _ = writeln!(out, "# TYPE sglang:num_paused_reqs gauge");
        let _ = writeln!(out, "sglang:num_paused_reqs{{{}}} {:?}", self.sched_labels, paused_reqs as f64);
        let _ = writeln!(out, "# HELP sglang:weight_load_duration_seconds Duration of the last weight update.");
        let _ = writeln!(out, "# TYPE sglang:weight_load_duration_seconds gauge");
        let _ = writeln!(
            out,
            "sglang:weight_load_duration_seconds{{{},source=\"disk\"}} {:?}",
            self.sched_labels,
            f64::from_bits(self.weight_load_secs.load(Ordering::Relaxed))
        );

        let by_stream = |out: &mut String, name: &str, help: &str, c: &[AtomicU64; 2]| {
            let _ = writeln!(out, "# HELP sglang:{name} {help}");
            let _ = writeln!(out, "# TYPE sglang:{name} counter");
            for (i, flag) in ["false", "true"].iter().enumerate() {
                let _ = writeln!(
                    out,
                    "sglang:{name}{{{},is_streaming=\"{flag}\"}} {:?}",
                    self.tok_labels,
                    c[i].load(Ordering::Relaxed) as f64
                );
            }
        };
        by_stream(&mut out, "prompt_tokens_total", "Number of prefill tokens processed.", &self.prompt_tokens);
        by_stream(
            &mut out,
            "generation_tokens_total",
            "Number of generation tokens processed.",
            &self.generation_tokens,
        );
        let plain: [(&str, &str, &AtomicU64); 3] = [
            ("cached_tokens_total", "Number of cached prompt tokens.", &self.cached_tokens),
            ("num_requests_total", "Number of requests processed.", &self.num_requests),
            ("num_aborted_requests_total", "Number of requests aborted.", &self.num_aborted),
        ];
        for (name, help, c) in plain {
            let _ = writeln!(out, "# HELP sglang:{name} {help}");
            let _ = writeln!(out, "# TYPE sglang:{name} counter");
            let _ = writeln!(out, "sglang:{name}{{{}}} {:?}", self.tok_labels, c.load(Ordering::Relaxed) as f64);
        }

        let _ = writeln!(out, "# HELP sglang:queue_time_seconds Histogram of time spent in the waiting queue.");
        let _ = writeln!(out, "# TYPE sglang:queue_time_seconds histogram");
        self.queue_time.render(&mut out, "sglang:queue_time_seconds", &self.tok_labels);
        for (name, help, h) in [
            ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", &self.ttft),
            ("e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", &self.e2e),
        ] {
            let _ = writeln!(out, "# HELP sglang:{name} {help}");
            let _ = writeln!(out, "# TYPE sglang:{name} histogram");
            for (i, flag) in ["false", "true"].iter().enumerate() {
                let labels = format!("{},is_streaming=\"{flag}\"", self.tok_labels);
                h[i].render(&mut out, &format!("sglang:{name}"), &labels);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use clap::Parser;

    #[test]
    fn renders_counters_histograms_and_gauges() {
        let cfg = Config::try_parse_from(["sglang-sim", "--model-path", "m"]).unwrap();
        let m = Metrics::new(&cfg);
        m.record(&RequestRecord {
            prompt_tokens: 5,
            completion_tokens: 7,
            cached_tokens: 0,
            streaming: false,
            e2e: Duration::from_millis(300),
            queue_time: Some(Duration::from_millis(1)),
            ttft: Some(Duration::from_millis(20)),
        });
        let text = m.render(&[RankLoad { max_total_num_tokens: 100, ..RankLoad::default() }], 0);
        assert!(
            text.contains(
                "sglang:prompt_tokens_total{engine_type=\"unified\",model_name=\"m\",is_streaming=\"false\"} 5.0"
            ),
            "{text}"
        );
        assert!(text.contains("sglang:max_total_num_tokens{engine_type=\"unified\",model_name=\"m\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\"} 100.0"));
        assert!(text.contains("sglang:e2e_request_latency_seconds_bucket{engine_type=\"unified\",model_name=\"m\",is_streaming=\"false\",le=\"0.4\"} 1.0"));
        assert!(text.contains("sglang:e2e_request_latency_seconds_bucket{engine_type=\"unified\",model_name=\"m\",is_streaming=\"false\",le=\"0.2\"} 0.0"));
        assert!(text.contains("le=\"+Inf\"} 1.0"));
        assert!(text.contains("sglang:num_requests_total{engine_type=\"unified\",model_name=\"m\"} 1.0"));
    }
}
