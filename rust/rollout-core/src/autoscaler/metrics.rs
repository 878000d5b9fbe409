//! Engine load samples, the sliding window of metrics ticks, and their aggregation across the
//! fleet.
//!
//! One tick is what the collector read from every ACTIVE engine at one instant: a sample per
//! engine, or `missing` with the reason. A tick is *complete* only when every engine answered;
//! an incomplete tick breaks every condition's run (missing data resets the timers and never
//! counts as idle).

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

/// A cumulative Prometheus histogram: `cumulative[i]` observations were `<= le[i]`; `count`
/// includes the `+Inf` bucket. Bounds are finite (JSON has no infinity).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Histogram {
    pub le: Vec<f64>,
    pub cumulative: Vec<f64>,
    pub count: f64,
}

impl Histogram {
    /// Observations since `earlier` (same engine, an older read). A counter that went down
    /// (the engine restarted) or different buckets: the whole of `self`.
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let comparable = self.le == earlier.le && self.count >= earlier.count;
        let grew = comparable && self.cumulative.iter().zip(&earlier.cumulative).all(|(a, b)| a >= b);
        if !grew {
            return self.clone();
        }
        Histogram {
            le: self.le.clone(),
            cumulative: self.cumulative.iter().zip(&earlier.cumulative).map(|(a, b)| a - b).collect(),
            count: self.count - earlier.count,
        }
    }

    /// Adds `other` when it has the same buckets; returns false (and adds nothing) otherwise.
    pub fn add(&mut self, other: &Histogram) -> bool {
        if self.le.is_empty() && self.count == 0.0 {
            *self = other.clone();
            return true;
        }
        if self.le != other.le {
            return false;
        }
        for (a, b) in self.cumulative.iter_mut().zip(&other.cumulative) {
            *a += b;
        }
        self.count += other.count;
        true
    }

    /// The `q` quantile, interpolated linearly inside its bucket as Prometheus'
    /// `histogram_quantile` does. None without observations. Beyond the last finite bound the
    /// answer is that bound.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count.is_nan() || self.count <= 0.0 || self.le.is_empty() || self.le.len() != self.cumulative.len() {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * self.count;
        let mut lower = 0.0;
        let mut below = 0.0;
        for (le, cum) in self.le.iter().zip(&self.cumulative) {
            if *cum >= rank {
                let in_bucket = cum - below;
                if in_bucket <= 0.0 {
                    return Some(*le);
                }
                return Some(lower + (le - lower) * (rank - below) / in_bucket);
            }
            lower = *le;
            below = *cum;
        }
        self.le.last().copied()
    }
}

/// One engine's load at one instant, summed over its data-parallel ranks (each rank counted
/// once, however many tensor-parallel ranks export it).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineSample {
    pub num_running_reqs: f64,
    pub num_queue_reqs: f64,
    pub num_used_tokens: f64,
    pub max_total_num_tokens: f64,
    /// Mean KV-cache usage of its ranks, 0..1.
    pub token_usage: f64,
    /// Generated tokens per second (sum over ranks).
    pub gen_throughput: f64,
    /// `sglang:queue_time_seconds`, cumulative; absent when the engine serves no `/metrics`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_time: Option<Histogram>,
    /// `sglang:time_to_first_token_seconds`, cumulative.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft: Option<Histogram>,
}

/// What one read of one engine gave.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Observation {
    /// The engine did not answer (or answered nonsense); the reason is kept for `/health`.
    Missing {
        missing: String,
    },
    Sample(EngineSample),
}

/// Every ACTIVE engine, read at `at` (seconds on the caller's clock).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Tick {
    pub at: f64,
    pub engines: BTreeMap<String, Observation>,
    /// Requests waiting in our router for an engine slot (`--max-inflight-per-engine`): queued
    /// work like the engines' own queues, counted in `total_queue_reqs`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub router_queued: f64,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

impl Tick {
    /// Every engine answered, and there is at least one.
    pub fn complete(&self) -> bool {
        !self.engines.is_empty() && self.engines.values().all(|o| matches!(o, Observation::Sample(_)))
    }

    fn sample(&self, engine: &str) -> Option<&EngineSample> {
        match self.engines.get(engine) {
            Some(Observation::Sample(s)) => Some(s),
            _ => None,
        }
    }

    fn same_engines(&self, other: &Tick) -> bool {
        self.engines.len() == other.engines.len() && self.engines.keys().zip(other.engines.keys()).all(|(a, b)| a == b)
    }
}

/// The fleet at one tick, as the conditions see it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FleetMetrics {
    pub at: f64,
    /// Engines that answered.
    pub num_engines: u32,
    /// Engines that did not.
    pub missing_engines: u32,
    pub avg_token_usage: f64,
    pub max_token_usage: f64,
    pub total_queue_reqs: f64,
    pub total_running_reqs: f64,
    pub gen_throughput: f64,
    /// Over the requests that finished since the previous tick; None without any.
    pub queue_time_p95: Option<f64>,
    pub ttft_p95: Option<f64>,
}

impl FleetMetrics {
    /// Aggregates one tick; `prev` (the tick before) gives the histogram deltas.
    pub fn of(tick: &Tick, prev: Option<&Tick>) -> Self {
        let samples: Vec<(&String, &EngineSample)> = tick
            .engines
            .iter()
            .filter_map(|(id, o)| match o {
                Observation::Sample(s) => Some((id, s)),
                Observation::Missing { .. } => None,
            })
            .collect();
        let n = samples.len();
        let mut m = FleetMetrics {
            at: tick.at,
            num_engines: n as u32,
            missing_engines: (tick.engines.len() - n) as u32,
            ..FleetMetrics::default()
        };
        let mut queue_time = Histogram::default();
        let mut ttft = Histogram::default();
        for (id, s) in &samples {
            m.avg_token_usage += s.token_usage;
            m.max_token_usage = m.max_token_usage.max(s.token_usage);
            m.total_queue_reqs += s.num_queue_reqs;
            m.total_running_reqs += s.num_running_reqs;
            m.gen_throughput += s.gen_throughput;
            let earlier = prev.and_then(|p| p.sample(id));
            let delta = |now: &Option<Histogram>, before: Option<&Option<Histogram>>| match (now, before) {
                (Some(h), Some(Some(b))) => Some(h.since(b)),
                _ => None,
            };
            if let Some(h) = delta(&s.queue_time, earlier.map(|e| &e.queue_time)) {
                queue_time.add(&h);
            }
            if let Some(h) = delta(&s.ttft, earlier.map(|e| &e.ttft)) {
                ttft.add(&h);
            }
        }
        if n > 0 {
            m.avg_token_usage /= n as f64;
        }
        if tick.router_queued.is_finite() && tick.router_queued > 0.0 {
            m.total_queue_reqs += tick.router_queued;
        }
        m.queue_time_p95 = queue_time.quantile(0.95);
        m.ttft_p95 = ttft.quantile(0.95);
        m
    }
}

/// The sliding window: ticks oldest first, each with its aggregate.
#[derive(Debug, Clone, Default)]
pub struct MetricsWindow {
    ticks: VecDeque<(Tick, FleetMetrics)>,
}

/// How long a predicate has held on the latest ticks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Run {
    /// It holds on the latest tick.
    pub holding: bool,
    /// Seconds from the first tick of the unbroken run to the latest tick (0 if not holding).
    pub held_secs: f64,
}

impl MetricsWindow {
    /// Appends a tick (ticks older than the latest are ignored) and drops those older than
    /// `retain_secs` before it.
    pub fn push(&mut self, tick: Tick, retain_secs: f64) {
        if self.ticks.back().is_some_and(|(last, _)| tick.at < last.at) {
            return;
        }
        let metrics = FleetMetrics::of(&tick, self.ticks.back().map(|(t, _)| t));
        let at = tick.at;
        self.ticks.push_back((tick, metrics));
        while self.ticks.front().is_some_and(|(t, _)| t.at < at - retain_secs) {
            self.ticks.pop_front();
        }
    }

    pub fn latest(&self) -> Option<&FleetMetrics> {
        self.ticks.back().map(|(_, m)| m)
    }

    pub fn latest_tick(&self) -> Option<&Tick> {
        self.ticks.back().map(|(t, _)| t)
    }

    pub fn len(&self) -> usize {
        self.ticks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ticks.is_empty()
    }

    /// The unbroken run of ticks ending at the latest one, newest first: every tick complete,
    /// with the latest tick's engines, no gap longer than `max_gap`, and the latest tick no
    /// older than `max_gap` at `now`.
    pub fn continuous(&self, now: f64, max_gap: f64) -> Vec<&FleetMetrics> {
        let Some((last, _)) = self.ticks.back() else { return Vec::new() };
        if now - last.at > max_gap || !last.complete() {
            return Vec::new();
        }
        let mut run = Vec::new();
        let mut newer_at = last.at;
        for (tick, metrics) in self.ticks.iter().rev() {
            if !tick.complete() || !tick.same_engines(last) || newer_at - tick.at > max_gap {
                break;
            }
            newer_at = tick.at;
            run.push(metrics);
        }
        run
    }

    /// How long `holds` has been true on the continuous run ending now, counting only ticks
    /// at or after `not_before` (evidence older than the last scale event does not count).
    pub fn run(&self, now: f64, max_gap: f64, not_before: f64, holds: impl Fn(&FleetMetrics) -> bool) -> Run {
        let run = self.continuous(now, max_gap);
        let Some(latest) = run.first() else { return Run { holding: false, held_secs: 0.0 } };
        if latest.at < not_before || !holds(latest) {
            return Run { holding: false, held_secs: 0.0 };
        }
        let first = run.iter().take_while(|m| m.at >= not_before && holds(m)).last().map_or(latest.at, |m| m.at);
        Run { holding: true, held_secs: latest.at - first }
    }
}

/// Reads a `/v1/loads` answer (`{"loads": [one entry per DP rank]}`) into a sample. Errors
/// say what was wrong; an engine without the route answers 404 before this is called.
pub fn sample_from_loads(body: &serde_json::Value) -> Result<EngineSample, String> {
    let loads = body.get("loads").and_then(|l| l.as_array()).ok_or("no \"loads\" array")?;
    if loads.is_empty() {
        return Err("\"loads\" is empty".into());
    }
    let mut s = EngineSample::default();
    let mut usage = 0.0;
    for rank in loads {
        let num = |k: &str| -> Result<f64, String> {
            match rank.get(k) {
                None | Some(serde_json::Value::Null) => Ok(0.0),
                Some(v) => v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| format!("{k} is not a number")),
            }
        };
        let required = |k: &str| -> Result<f64, String> {
            rank.get(k).ok_or_else(|| format!("a load has no {k}"))?;
            num(k)
        };
        s.num_running_reqs += required("num_running_reqs")?;
        s.num_queue_reqs += required("num_waiting_reqs")?;
        s.num_used_tokens += num("num_used_tokens")?;
        s.max_total_num_tokens += num("max_total_num_tokens")?;
        s.gen_throughput += num("gen_throughput")?;
        usage += required("token_usage")?;
    }
    s.token_usage = usage / loads.len() as f64;
    // Each number is finite, but an engine can still report sums beyond f64.
    let sums = [s.num_running_reqs, s.num_queue_reqs, s.num_used_tokens, s.max_total_num_tokens, s.gen_throughput];
    if !(s.token_usage.is_finite() && sums.iter().all(|v| v.is_finite())) {
        return Err("the loads' sums are out of range".into());
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn hist(le: &[f64], cum: &[f64]) -> Histogram {
        Histogram { le: le.to_vec(), cumulative: cum.to_vec(), count: *cum.last().unwrap_or(&0.0) }
    }

    #[test]
    fn quantiles_interpolate_inside_the_bucket() {
        let h = hist(&[1.0, 2.0, 4.0], &[0.0, 10.0, 20.0]);
        assert_eq!(h.quantile(0.5), Some(2.0));
        assert_eq!(h.quantile(0.75), Some(3.0));
        assert_eq!(h.quantile(0.25), Some(1.5));
        assert_eq!(Histogram::default().quantile(0.95), None);
        // Beyond the last finite bound: that bound.
        let h = Histogram { le: vec![1.0], cumulative: vec![1.0], count: 10.0 };
        assert_eq!(h.quantile(0.95), Some(1.0));
    }

    #[test]
    fn deltas_survive_counter_resets() {
        let a = hist(&[1.0, 2.0], &[5.0, 9.0]);
        let b = hist(&[1.0, 2.0], &[6.0, 12.0]);
        assert_eq!(b.since(&a), hist(&[1.0, 2.0], &[1.0, 3.0]));
        let restarted = hist(&[1.0, 2.0], &[1.0, 1.0]);
        assert_eq!(restarted.since(&b), restarted);
    }

    fn sample(usage: f64, queue: f64) -> Observation {
        Observation::Sample(EngineSample { token_usage: usage, num_queue_reqs: queue, ..EngineSample::default() })
    }

    fn tick(at: f64, engines: &[(&str, Observation)]) -> Tick {
        Tick { at, engines: engines.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(), router_queued: 0.0 }
    }

    #[test]
    fn aggregation_averages_usage_and_sums_queues() {
        let t = tick(
            0.0,
            &[("a", sample(0.2, 3.0)), ("b", sample(0.6, 1.0)), ("c", Observation::Missing { missing: "x".into() })],
        );
        let m = FleetMetrics::of(&t, None);
        assert_eq!((m.num_engines, m.missing_engines), (2, 1));
        assert!((m.avg_token_usage - 0.4).abs() < 1e-9);
        assert_eq!(m.total_queue_reqs, 4.0);
        assert!(!t.complete());
        // Requests waiting in the router are queued work too.
        let m = FleetMetrics::of(&Tick { router_queued: 5.0, ..t }, None);
        assert_eq!(m.total_queue_reqs, 9.0);
    }

    #[test]
    fn runs_break_on_gaps_missing_data_and_fleet_changes() {
        let mut w = MetricsWindow::default();
        for at in [0.0, 10.0, 20.0, 30.0] {
            w.push(tick(at, &[("a", sample(0.9, 0.0))]), 1000.0);
        }
        let high = |m: &FleetMetrics| m.avg_token_usage > 0.85;
        assert_eq!(w.run(30.0, 25.0, 0.0, high), Run { holding: true, held_secs: 30.0 });
        // Stale: the latest tick is too old.
        assert!(!w.run(60.0, 25.0, 0.0, high).holding);
        // Evidence before a scale event does not count.
        assert_eq!(w.run(30.0, 25.0, 15.0, high).held_secs, 10.0);
        // A missing engine resets the run.
        w.push(tick(40.0, &[("a", Observation::Missing { missing: "timeout".into() })]), 1000.0);
        assert!(!w.run(40.0, 25.0, 0.0, high).holding);
        w.push(tick(50.0, &[("a", sample(0.9, 0.0))]), 1000.0);
        assert_eq!(w.run(50.0, 25.0, 0.0, high).held_secs, 0.0);
        // A new engine resets it too.
        w.push(tick(60.0, &[("a", sample(0.9, 0.0)), ("b", sample(0.9, 0.0))]), 1000.0);
        assert_eq!(w.run(60.0, 25.0, 0.0, high), Run { holding: true, held_secs: 0.0 });
        // A long gap.
        w.push(tick(100.0, &[("a", sample(0.9, 0.0)), ("b", sample(0.9, 0.0))]), 1000.0);
        assert_eq!(w.run(100.0, 25.0, 0.0, high).held_secs, 0.0);
    }

    #[test]
    fn the_window_drops_old_ticks() {
        let mut w = MetricsWindow::default();
        for i in 0..100 {
            w.push(tick(f64::from(i), &[("a", sample(0.1, 0.0))]), 10.0);
        }
        assert_eq!(w.len(), 11);
    }

    #[test]
    fn loads_sum_ranks_and_average_usage() {
        let body = json!({"loads": [
            {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2, "token_usage": 0.5, "gen_throughput": 100.0,
             "num_used_tokens": 50, "max_total_num_tokens": 100},
            {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": 0.1, "gen_throughput": 20.0,
             "num_used_tokens": 10, "max_total_num_tokens": 100}]});
        let s = sample_from_loads(&body).unwrap();
        assert_eq!((s.num_running_reqs, s.num_queue_reqs, s.gen_throughput), (4.0, 2.0, 120.0));
        assert!((s.token_usage - 0.3).abs() < 1e-9);
        assert!(sample_from_loads(&json!({"loads": []})).is_err());
        assert!(sample_from_loads(&json!({"loads": [{"num_running_reqs": 1}]}))
            .unwrap_err()
            .contains("num_waiting_reqs"));
        assert!(sample_from_loads(&json!({"nope": 1})).is_err());
    }

    #[test]
    fn ticks_round_trip_as_json() {
        let t = tick(1.0, &[("a", sample(0.2, 1.0)), ("b", Observation::Missing { missing: "refused".into() })]);
        let text = serde_json::to_string(&t).unwrap();
        assert_eq!(serde_json::from_str::<Tick>(&text).unwrap(), t);
    }
}
