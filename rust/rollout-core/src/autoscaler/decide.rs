//! The decision: [`decide`] turns the metrics window, the pipeline reports, the fleet and what
//! the autoscaler remembers into one [`Action`], plus every condition's state for the API.
//!
//! Expected flow of one evaluation:
//! 1. Guard: an operation in progress (anyone's) or engines still starting: no action. This is
//!    what stops cascading scale-outs while new engines load their weights.
//! 2. Bounds: below `min_engines` scale out to it; above `max_engines` scale in (empty queue).
//! 3. Cooldowns since the last scale-out / scale-in finished.
//! 4. Signals. While the trainer reports pipeline steps, they decide: `trainer_starved` (it
//!    waited) or `rollout_short` (the reported rates say it is about to) scales out,
//!    `rollout_throttled` (with an empty queue, and `supply_after_removal` when the reports carry
//!    rates) scales in. Otherwise the serving metrics
//!    decide: scale out when ANY scale-out condition held for its duration, scale in by one
//!    when ALL scale-in conditions did.
//!
//! Guarantees: never above `max_engines` (nor the manager's bound), never below `min_engines`
//! or the protected initial engines, never a scale-in with a queue above
//! `queue_depth_threshold` or without complete metrics, at most one engine per scale-in,
//! evidence older than the last scale event or interrupted by missing data never counts.
//! Time comes in as `now`; nothing here reads a clock.

use super::config::AutoscalerConfig;
use super::metrics::{FleetMetrics, MetricsWindow, Run};
use super::pipeline::{PipelineWindow, ReceivedReport};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

/// The fleet as the scale API counts it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetState {
    /// Engines that count towards the size (`num_replicas` targets are relative to this).
    pub live_engines: u32,
    /// Engines serving traffic.
    pub active_engines: u32,
    /// Engines between CREATING and READY.
    pub starting_engines: u32,
    /// Initial engines, which scale-in never removes.
    pub protected_engines: u32,
    /// The most engines the manager can hold (`--max-engines` and the GPU pool).
    pub capacity_engines: u32,
    /// A scale operation in progress (any caller's), e.g. `scale_out 5d0c…`.
    pub operation_in_progress: Option<String>,
}

/// What the autoscaler remembers between evaluations.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Memory {
    /// When its last scale-out finished.
    pub last_scale_out_at: Option<f64>,
    /// When its last scale-in finished.
    pub last_scale_in_at: Option<f64>,
    /// It started an operation that has not finished.
    pub pending: bool,
    /// Seconds from trigger to ACTIVE of recent scale-outs, newest last.
    pub time_to_ready: VecDeque<f64>,
}

impl Memory {
    const KEEP: usize = 10;

    pub fn record_time_to_ready(&mut self, secs: f64) {
        if secs.is_finite() && secs >= 0.0 {
            self.time_to_ready.push_back(secs);
            while self.time_to_ready.len() > Self::KEEP {
                self.time_to_ready.pop_front();
            }
        }
    }

    /// Median time-to-ready of recent scale-outs.
    pub fn expected_time_to_ready(&self) -> Option<f64> {
        let mut v: Vec<f64> = self.time_to_ready.iter().copied().collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    }

    /// When the last scale event finished; evidence before it does not count.
    pub fn last_event_at(&self) -> f64 {
        self.last_scale_out_at.into_iter().chain(self.last_scale_in_at).fold(f64::NEG_INFINITY, f64::max)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ConditionKind {
    ScaleOut,
    ScaleIn,
}

/// One condition's state, as `GET /autoscaler/conditions` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(as = AutoscalerCondition)]
pub struct Condition {
    #[serde(rename = "type")]
    pub kind: ConditionKind,
    /// Held long enough to count.
    pub triggered: bool,
    /// True on the latest data.
    pub holding: bool,
    /// The measured value (None without data).
    pub value: Option<f64>,
    pub threshold: f64,
    pub held_secs: f64,
    pub duration_secs: f64,
}

/// Which signal decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Signal {
    Serving,
    Pipeline,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    ScaleOut {
        delta: u32,
        from_engines: u32,
        to_engines: u32,
        reason: String,
        triggered_conditions: Vec<String>,
    },
    ScaleIn {
        delta: u32,
        from_engines: u32,
        to_engines: u32,
        reason: String,
        triggered_conditions: Vec<String>,
    },
    None {
        reason: String,
        /// Why, as one word of a short fixed list (a metric label): see [`Action::reason_code`].
        #[serde(skip)]
        code: &'static str,
    },
}

impl Action {
    pub fn name(&self) -> &'static str {
        match self {
            Action::ScaleOut { .. } => "scale_out",
            Action::ScaleIn { .. } => "scale_in",
            Action::None { .. } => "none",
        }
    }

    pub fn reason(&self) -> &str {
        match self {
            Action::ScaleOut { reason, .. } | Action::ScaleIn { reason, .. } | Action::None { reason, .. } => reason,
        }
    }

    /// The reason as a short, bounded label: the triggered conditions of a scaling action
    /// (joined by `+`), or for no action one of `operation_in_progress`, `engines_starting`,
    /// `cooldown`, `at_maximum`, `waiting_for_metrics`, `at_minimum`, `holding`, `no_condition`.
    pub fn reason_code(&self) -> String {
        match self {
            Action::ScaleOut { triggered_conditions, .. } | Action::ScaleIn { triggered_conditions, .. } => {
                triggered_conditions.join("+")
            }
            Action::None { code, .. } => code.to_string(),
        }
    }
}

/// One evaluation: the action and everything that led to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    pub at: f64,
    #[serde(flatten)]
    pub action: Action,
    pub signal: Signal,
    pub conditions: BTreeMap<String, Condition>,
    /// The latest complete metrics, if any.
    pub metrics: Option<FleetMetrics>,
}

/// The seed's delta: one engine per 10% of usage above 70% once usage passes 90%, or one per
/// 20 queued requests beyond 5 per engine, at least 1, at most `max_delta`.
pub fn seed_delta(avg_token_usage: f64, total_queue: f64, engines: u32, max_delta: u32) -> u32 {
    let usage_delta = if avg_token_usage > 0.9 { ((avg_token_usage - 0.7) / 0.1 + 1e-9).floor() as u32 } else { 0 };
    let queue_delta = ((total_queue - f64::from(engines) * 5.0) / 20.0).floor().max(0.0) as u32;
    usage_delta.max(queue_delta).max(1).min(max_delta.max(1))
}

/// Engines to add when rollout supplies `supply` samples/s with `active` engines and the trainer
/// will take `demand`: enough that supply is `1 + headroom` times demand, assuming throughput
/// grows with the number of engines. At least 1, at most `max_delta`.
pub fn rate_delta(demand: f64, supply: f64, headroom: f64, active: u32, max_delta: u32) -> u32 {
    let max_delta = max_delta.max(1);
    if supply <= 0.0 {
        return max_delta;
    }
    let n = f64::from(active.max(1));
    let wanted = (n * demand * (1.0 + headroom) / supply - 1e-9).ceil() - n;
    (wanted.clamp(1.0, f64::from(max_delta))) as u32
}

/// Engines to add when the trainer waits `wait_fraction` of each step: rollout must get
/// `1 / (1 - wait)` times faster. At least 1, at most `max_delta`.
pub fn pipeline_delta(wait_fraction: f64, active: u32, max_delta: u32) -> u32 {
    let w = wait_fraction.clamp(0.0, 0.9);
    let needed = (f64::from(active.max(1)) / (1.0 - w)).ceil() - f64::from(active.max(1));
    (needed.max(1.0) as u32).min(max_delta.max(1))
}

fn condition(kind: ConditionKind, run: Run, value: Option<f64>, threshold: f64, duration: f64) -> Condition {
    Condition {
        kind,
        triggered: run.holding && run.held_secs + 1e-9 >= duration,
        holding: run.holding,
        value,
        threshold,
        held_secs: run.held_secs,
        duration_secs: duration,
    }
}

/// Relative variance (variance over squared mean) of the fleet's throughput on the run within
/// the window; None when the run does not cover the window.
fn throughput_variance(run: &[&FleetMetrics], window: f64, max_gap: f64, not_before: f64) -> Option<(f64, f64)> {
    let latest = run.first()?;
    let inside: Vec<f64> =
        run.iter().take_while(|m| m.at >= latest.at - window && m.at >= not_before).map(|m| m.gen_throughput).collect();
    let oldest = run.iter().take_while(|m| m.at >= latest.at - window && m.at >= not_before).last()?.at;
    let span = latest.at - oldest;
    if inside.len() < 2 || span + max_gap < window {
        return None;
    }
    let n = inside.len() as f64;
    let mean = inside.iter().sum::<f64>() / n;
    let var = inside.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    let rel = if mean.abs() < 1e-9 {
        if var < 1e-12 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        var / (mean * mean)
    };
    Some((rel, span))
}

/// The pipeline reports that count now: fresh, of steps that began after the last scale event
/// (a step that straddled it measured the fleet before it), newest first.
fn counted_reports<'a>(
    pipeline: &'a PipelineWindow,
    config: &AutoscalerConfig,
    not_before: f64,
    now: f64,
) -> Vec<&'a ReceivedReport> {
    let p = &config.pipeline_policy;
    pipeline
        .recent()
        .take_while(|r| r.at >= now - p.report_max_age_secs && r.at - r.report.step_secs >= not_before)
        .take(p.min_steps as usize)
        .collect()
}

/// The reported rates, when the counted reports carry them: the trainer's demand from the
/// newest step (it names the next step's samples), rollout's supply averaged over the steps.
fn rates(reports: &[&ReceivedReport]) -> Option<(f64, f64)> {
    let demand = reports.first()?.report.demand_rate()?;
    let supplies: Vec<f64> = reports.iter().filter_map(|r| r.report.supply_rate()).collect();
    (!supplies.is_empty()).then(|| (demand, supplies.iter().sum::<f64>() / supplies.len() as f64))
}

/// Decides what to do now. Pure: the same inputs give the same answer.
pub fn decide(
    window: &MetricsWindow,
    pipeline: &PipelineWindow,
    fleet: &FleetState,
    memory: &Memory,
    config: &AutoscalerConfig,
    now: f64,
) -> Evaluation {
    let max_gap = config.max_gap_secs();
    let not_before = memory.last_event_at();
    let run = window.continuous(now, max_gap);
    let metrics = run.first().map(|m| (*m).clone());
    let out = &config.scale_out_policy;
    let inp = &config.scale_in_policy;
    let mut conditions = BTreeMap::new();
    let value = |f: &dyn Fn(&FleetMetrics) -> Option<f64>| metrics.as_ref().and_then(f);
    let run_of = |f: &dyn Fn(&FleetMetrics) -> bool| window.run(now, max_gap, not_before, f);

    let (so, si) = (ConditionKind::ScaleOut, ConditionKind::ScaleIn);
    let od = out.condition_duration_secs;
    let qpe = f64::from(out.queue_depth_per_engine);
    let per_engine = |m: &FleetMetrics| m.total_queue_reqs / f64::from(m.num_engines.max(1));
    conditions.insert(
        "token_usage_high".to_string(),
        condition(
            so,
            run_of(&|m| m.avg_token_usage > out.token_usage_threshold),
            value(&|m| Some(m.avg_token_usage)),
            out.token_usage_threshold,
            od,
        ),
    );
    conditions.insert(
        "queue_backlog".to_string(),
        condition(so, run_of(&|m| per_engine(m) > qpe), value(&|m| Some(per_engine(m))), qpe, od),
    );
    conditions.insert(
        "queue_latency_high".to_string(),
        condition(
            so,
            run_of(&|m| m.queue_time_p95.is_some_and(|p| p > out.queue_time_p95_threshold)),
            value(&|m| m.queue_time_p95),
            out.queue_time_p95_threshold,
            od,
        ),
    );
    conditions.insert(
        "ttft_high".to_string(),
        condition(
            so,
            run_of(&|m| m.ttft_p95.is_some_and(|p| p > out.ttft_p95_threshold)),
            value(&|m| m.ttft_p95),
            out.ttft_p95_threshold,
            od,
        ),
    );

    let id = inp.condition_duration_secs;
    let qthr = f64::from(inp.queue_depth_threshold);
    conditions.insert(
        "token_usage_low".to_string(),
        condition(
            si,
            run_of(&|m| m.avg_token_usage < inp.token_usage_threshold),
            value(&|m| Some(m.avg_token_usage)),
            inp.token_usage_threshold,
            id,
        ),
    );
    conditions.insert(
        "no_queue".to_string(),
        condition(si, run_of(&|m| m.total_queue_reqs <= qthr), value(&|m| Some(m.total_queue_reqs)), qthr, id),
    );
    let stable = throughput_variance(&run, config.condition_window_secs, max_gap, not_before);
    let stable_ok = stable.is_some_and(|(v, _)| v < inp.throughput_variance_threshold);
    conditions.insert(
        "throughput_stable".to_string(),
        Condition {
            kind: si,
            triggered: stable_ok,
            holding: stable_ok,
            value: stable.map(|(v, _)| v),
            threshold: inp.throughput_variance_threshold,
            held_secs: stable.map_or(0.0, |(_, span)| span),
            duration_secs: config.condition_window_secs,
        },
    );
    // Usage spread over one engine fewer, at the busiest tick of the scale-in duration.
    let projected = metrics.as_ref().filter(|m| m.num_engines > 1).map(|latest| {
        let busiest = run
            .iter()
            .take_while(|m| m.at >= latest.at - id && m.at >= not_before)
            .map(|m| m.avg_token_usage)
            .fold(0.0, f64::max);
        busiest * f64::from(latest.num_engines) / f64::from(latest.num_engines - 1)
    });
    let projected_ok = projected.is_some_and(|p| p < inp.projected_usage_max);
    conditions.insert(
        "projected_usage_ok".to_string(),
        Condition {
            kind: si,
            triggered: projected_ok,
            holding: projected_ok,
            value: projected,
            threshold: inp.projected_usage_max,
            held_secs: 0.0,
            duration_secs: 0.0,
        },
    );

    // The RL pipeline signal.
    let p = &config.pipeline_policy;
    let fresh = p.enabled && pipeline.latest().is_some_and(|r| r.at >= now - p.report_max_age_secs);
    let reports = counted_reports(pipeline, config, not_before, now);
    let enough = p.enabled && reports.len() >= p.min_steps as usize;
    let mean = |f: fn(&ReceivedReport) -> f64| {
        (!reports.is_empty()).then(|| reports.iter().map(|r| f(r)).sum::<f64>() / reports.len() as f64)
    };
    let wait_mean = mean(|r| r.report.wait_fraction());
    let severe =
        p.enabled && reports.first().is_some_and(|r| r.report.wait_fraction() >= p.severe_wait_fraction_threshold);
    let starved =
        severe || (enough && reports.iter().all(|r| r.report.wait_fraction() > p.trainer_wait_fraction_threshold));
    let throttled = enough
        && reports.iter().all(|r| {
            r.report.throttled_fraction() > p.rollout_throttled_fraction_threshold
                && r.report.wait_fraction() <= p.trainer_wait_fraction_threshold
        });
    let rates = if p.enabled { rates(&reports) } else { None };
    // Supply S below demand D makes the trainer wait 1 - S/D of each step: short when that
    // projected wait is above the wait threshold (the two rules agree; noise near S = D is not
    // a shortage).
    let short = rates.is_some_and(|(demand, supply)| supply < demand * (1.0 - p.trainer_wait_fraction_threshold));
    // Rollout's rate is the fleet's capacity only if work was queued (in the engines or the
    // router) during each of those steps; otherwise it is a lower bound, too low to judge a
    // removal by, and the throttled rule decides alone.
    let saturated = !reports.is_empty()
        && reports
            .iter()
            .all(|r| run.iter().any(|m| m.at <= r.at && m.at >= r.at - r.report.step_secs && m.total_queue_reqs > 0.0));
    // Supply after removing one engine, over demand: a scale-in must leave the headroom.
    let after_removal = rates.filter(|_| saturated && fleet.active_engines > 1).map(|(demand, supply)| {
        supply * f64::from(fleet.active_engines - 1) / f64::from(fleet.active_engines) / demand
    });
    let removal_ok = after_removal.is_some_and(|r| r >= 1.0 + p.rate_headroom);
    if p.enabled {
        let span = reports.first().zip(reports.last()).map_or(0.0, |(a, b)| a.at - b.at);
        let pipeline_condition = |kind, triggered: bool, value, threshold| Condition {
            kind,
            triggered,
            holding: triggered,
            value,
            threshold,
            held_secs: if triggered { span } else { 0.0 },
            duration_secs: 0.0,
        };
        conditions.insert(
            "trainer_starved".to_string(),
            pipeline_condition(so, starved, wait_mean, p.trainer_wait_fraction_threshold),
        );
        conditions.insert(
            "rollout_throttled".to_string(),
            pipeline_condition(
                si,
                throttled,
                mean(|r| r.report.throttled_fraction()),
                p.rollout_throttled_fraction_threshold,
            ),
        );
        conditions.insert(
            "rollout_short".to_string(),
            pipeline_condition(
                so,
                short,
                rates.map(|(demand, supply)| supply / demand),
                1.0 - p.trainer_wait_fraction_threshold,
            ),
        );
        if rates.is_some() && saturated {
            conditions.insert(
                "supply_after_removal".to_string(),
                Condition {
                    kind: si,
                    triggered: removal_ok,
                    holding: removal_ok,
                    value: after_removal,
                    threshold: 1.0 + p.rate_headroom,
                    held_secs: 0.0,
                    duration_secs: 0.0,
                },
            );
        }
    }
    let signal = if fresh { Signal::Pipeline } else { Signal::Serving };
    let action = choose(Choice {
        fleet,
        memory,
        config,
        now,
        conditions: &conditions,
        metrics: metrics.as_ref(),
        signal,
        wait_mean: wait_mean.unwrap_or(0.0),
        rates,
        missing: window.latest().map_or(0, |m| m.missing_engines),
    });
    Evaluation { at: now, action, signal, conditions, metrics }
}

struct Choice<'a> {
    fleet: &'a FleetState,
    memory: &'a Memory,
    config: &'a AutoscalerConfig,
    now: f64,
    conditions: &'a BTreeMap<String, Condition>,
    metrics: Option<&'a FleetMetrics>,
    signal: Signal,
    wait_mean: f64,
    rates: Option<(f64, f64)>,
    missing: u32,
}

fn none(code: &'static str, reason: impl Into<String>) -> Action {
    Action::None { reason: reason.into(), code }
}

fn choose(c: Choice<'_>) -> Action {
    let Choice { fleet, memory, config, now, conditions, metrics, signal, wait_mean, rates, missing } = c;
    let live = fleet.live_engines;
    let ceiling = config.max_engines.min(fleet.capacity_engines);
    let floor = config.min_engines.max(fleet.protected_engines);
    let triggered = |name: &str| conditions.get(name).is_some_and(|c| c.triggered);
    let queue_empty =
        metrics.is_some_and(|m| m.total_queue_reqs <= f64::from(config.scale_in_policy.queue_depth_threshold));

    // 1. Guard.
    if let Some(op) = &fleet.operation_in_progress {
        return none("operation_in_progress", format!("waiting: {op} is in progress"));
    }
    if fleet.starting_engines > 0 || memory.pending {
        let eta = memory
            .expected_time_to_ready()
            .map_or_else(String::new, |t| format!("; engines usually take {t:.0}s to become ready"));
        return none("engines_starting", format!("waiting: {} engines still starting{eta}", fleet.starting_engines));
    }
    // 2. Bounds.
    if live < config.min_engines.min(ceiling) {
        let to = config.min_engines.min(ceiling);
        return Action::ScaleOut {
            delta: to - live,
            from_engines: live,
            to_engines: to,
            reason: format!("below min_engines {}", config.min_engines),
            triggered_conditions: vec!["below_min_engines".into()],
        };
    }
    if live > ceiling && live > floor && queue_empty {
        return Action::ScaleIn {
            delta: 1,
            from_engines: live,
            to_engines: live - 1,
            reason: format!("above max_engines {ceiling}"),
            triggered_conditions: vec!["above_max_engines".into()],
        };
    }
    // 3. Cooldowns.
    for (last, cooldown, what) in [
        (memory.last_scale_out_at, config.scale_out_cooldown_secs, "scale-out"),
        (memory.last_scale_in_at, config.scale_in_cooldown_secs, "scale-in"),
    ] {
        if let Some(left) = last.map(|t| t + cooldown - now).filter(|l| *l > 0.0) {
            return none("cooldown", format!("cooldown after {what}: {left:.0}s left"));
        }
    }
    // 4. Signals.
    let (out_names, in_names): (Vec<&str>, Vec<&str>) = match signal {
        Signal::Pipeline => {
            (vec!["trainer_starved", "rollout_short"], vec!["rollout_throttled", "supply_after_removal"])
        }
        Signal::Serving => (
            vec!["token_usage_high", "queue_backlog", "queue_latency_high", "ttft_high"],
            vec!["token_usage_low", "no_queue", "throughput_stable", "projected_usage_ok"],
        ),
    };
    // `supply_after_removal` exists only when the reports carry rates measured on a busy fleet.
    let in_names: Vec<&str> =
        in_names.into_iter().filter(|n| conditions.contains_key(*n) || *n != "supply_after_removal").collect();
    let fired: Vec<String> = out_names.iter().filter(|n| triggered(n)).map(|n| n.to_string()).collect();
    if !fired.is_empty() {
        if live >= ceiling {
            return none(
                "at_maximum",
                format!("scale-out wanted ({}) but the fleet is at its maximum of {ceiling}", fired.join(", ")),
            );
        }
        let max_delta = config.scale_out_policy.max_delta;
        let delta = match (signal, metrics) {
            (Signal::Pipeline, _) => {
                let by_wait =
                    triggered("trainer_starved").then(|| pipeline_delta(wait_mean, fleet.active_engines, max_delta));
                let by_rate = rates.filter(|_| triggered("rollout_short")).map(|(demand, supply)| {
                    rate_delta(demand, supply, config.pipeline_policy.rate_headroom, fleet.active_engines, max_delta)
                });
                by_wait.into_iter().chain(by_rate).max().unwrap_or(1)
            }
            (Signal::Serving, Some(m)) => seed_delta(m.avg_token_usage, m.total_queue_reqs, m.num_engines, max_delta),
            (Signal::Serving, None) => 1,
        };
        let to = (live + delta).min(ceiling);
        return Action::ScaleOut {
            delta: to - live,
            from_engines: live,
            to_engines: to,
            reason: format!("Conditions met: {}", fired.join(", ")),
            triggered_conditions: fired,
        };
    }
    if metrics.is_none() {
        return none(
            "waiting_for_metrics",
            if missing > 0 {
                format!("waiting for metrics: {missing} engines did not answer (missing data never counts as idle)")
            } else {
                "waiting for metrics".to_string()
            },
        );
    }
    let all_in = in_names.iter().all(|n| triggered(n)) && queue_empty;
    if all_in {
        if live <= floor || fleet.active_engines <= config.min_engines {
            return none("at_minimum", format!("scale-in conditions met but the fleet is at its minimum of {floor}"));
        }
        return Action::ScaleIn {
            delta: 1,
            from_engines: live,
            to_engines: live - 1,
            reason: format!("Conditions met: {}", in_names.join(", ")),
            triggered_conditions: in_names.iter().map(|s| s.to_string()).collect(),
        };
    }
    let holding: Vec<String> = conditions
        .iter()
        .filter(|(n, c)| {
            c.holding && !c.triggered && (out_names.contains(&n.as_str()) || in_names.contains(&n.as_str()))
        })
        .map(|(n, c)| format!("{n} ({:.0}s of {:.0}s)", c.held_secs, c.duration_secs))
        .collect();
    if holding.is_empty() {
        none(
            "no_condition",
            format!("no condition met ({} signal)", if signal == Signal::Pipeline { "pipeline" } else { "serving" }),
        )
    } else {
        none("holding", format!("holding, not yet long enough: {}", holding.join(", ")))
    }
}
