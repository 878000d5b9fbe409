//! The autoscaler as a value: the metrics window, the pipeline reports, its memory and its
//! evaluation cadence. The manager feeds it live ticks and acts on what it returns; the offline
//! replay feeds it a recorded trace. Both run the same code.

use super::config::AutoscalerConfig;
use super::decide::{decide, Action, Evaluation, FleetState, Memory};
use super::metrics::{MetricsWindow, Observation, Tick};
use super::pipeline::{PipelineReport, PipelineWindow};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
pub struct AutoscalerState {
    pub config: AutoscalerConfig,
    pub window: MetricsWindow,
    pub pipeline: PipelineWindow,
    pub memory: Memory,
    /// When the next decision is due (None until the first tick).
    next_evaluation: Option<f64>,
}

impl AutoscalerState {
    pub fn new(config: AutoscalerConfig) -> Self {
        Self {
            config,
            window: MetricsWindow::default(),
            pipeline: PipelineWindow::default(),
            memory: Memory::default(),
            next_evaluation: None,
        }
    }

    /// Adds a tick. Returns the decision when one is due (every `evaluation_interval_secs`).
    pub fn on_tick(&mut self, tick: Tick, fleet: &FleetState) -> Option<Evaluation> {
        let now = tick.at;
        self.window.push(tick, self.config.retention_secs());
        let due = *self.next_evaluation.get_or_insert(now + self.config.evaluation_interval_secs);
        if now + 1e-9 < due {
            return None;
        }
        self.next_evaluation = Some(now + self.config.evaluation_interval_secs);
        Some(self.evaluate(fleet, now))
    }

    /// The decision now, without moving the cadence (what `/autoscaler/conditions` shows).
    pub fn evaluate(&self, fleet: &FleetState, now: f64) -> Evaluation {
        decide(&self.window, &self.pipeline, fleet, &self.memory, &self.config, now)
    }

    /// Adds a trainer step. A step is the pipeline signal's unit of evidence, so it is decided
    /// on at once instead of at the next evaluation: returns the decision when it is an action
    /// (and the cadence restarts from it).
    pub fn on_report(&mut self, at: f64, report: PipelineReport, fleet: &FleetState) -> Option<Evaluation> {
        self.pipeline.push(at, report);
        let evaluation = self.evaluate(fleet, at);
        if matches!(evaluation.action, Action::None { .. }) {
            return None;
        }
        self.next_evaluation = Some(at + self.config.evaluation_interval_secs);
        Some(evaluation)
    }

    /// An operation this autoscaler started has finished at `at` (its cooldown starts).
    pub fn on_finished(&mut self, action: &str, triggered_at: f64, at: f64, became_ready: bool) {
        self.memory.pending = false;
        match action {
            "scale_out" => {
                self.memory.last_scale_out_at = Some(at);
                if became_ready {
                    self.memory.record_time_to_ready(at - triggered_at);
                }
            }
            "scale_in" => self.memory.last_scale_in_at = Some(at),
            _ => {}
        }
    }

    /// Seconds until the next decision.
    pub fn next_evaluation_in(&self, now: f64) -> Option<f64> {
        self.next_evaluation.map(|t| (t - now).max(0.0))
    }
}

/// One line of a recorded trace (JSON lines): a metrics tick (`engines`, with the `fleet` as
/// the scale API counted it), or a pipeline report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceLine {
    pub at: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetState>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engines: Option<BTreeMap<String, Observation>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineReport>,
    /// Requests waiting in the router at this tick (absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_queued: Option<f64>,
}

/// Replays a trace: every decision the config would have taken on it. The fleet follows the
/// trace (what really happened), not the decisions; a decided action counts as done at once
/// for the cooldowns. Lines must come in time order; a bad line is an error naming it.
pub fn replay(config: AutoscalerConfig, lines: &[TraceLine]) -> Vec<Evaluation> {
    let mut state = AutoscalerState::new(config);
    let mut fleet = FleetState::default();
    let mut out = Vec::new();
    let acted = |state: &mut AutoscalerState, evaluation: &Evaluation, at: f64| match &evaluation.action {
        Action::ScaleOut { .. } => state.on_finished("scale_out", at, at, false),
        Action::ScaleIn { .. } => state.on_finished("scale_in", at, at, false),
        Action::None { .. } => {}
    };
    for line in lines {
        if let Some(report) = &line.pipeline {
            if let Some(evaluation) = state.on_report(line.at, report.clone(), &fleet) {
                acted(&mut state, &evaluation, line.at);
                out.push(evaluation);
            }
        }
        if let Some(f) = &line.fleet {
            fleet = f.clone();
        }
        let Some(engines) = &line.engines else { continue };
        if line.fleet.is_none() {
            // Without a recorded fleet, the engines that were read are the fleet.
            let n = engines.len() as u32;
            fleet = FleetState {
                live_engines: n,
                active_engines: n,
                capacity_engines: fleet.capacity_engines.max(state.config.max_engines),
                ..fleet
            };
        }
        let tick = Tick { at: line.at, engines: engines.clone(), router_queued: line.router_queued.unwrap_or(0.0) };
        if let Some(evaluation) = state.on_tick(tick, &fleet) {
            acted(&mut state, &evaluation, line.at);
            out.push(evaluation);
        }
    }
    out
}

/// Parses a JSON-lines trace; blank lines and `#` comments are skipped.
pub fn parse_trace(text: &str) -> Result<Vec<TraceLine>, String> {
    let mut lines = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let parsed: TraceLine = serde_json::from_str(line).map_err(|e| format!("trace line {}: {e}", i + 1))?;
        if let Some(report) = &parsed.pipeline {
            report.validate().map_err(|(field, msg)| format!("trace line {}: pipeline.{field}: {msg}", i + 1))?;
        }
        lines.push(parsed);
    }
    Ok(lines)
}
