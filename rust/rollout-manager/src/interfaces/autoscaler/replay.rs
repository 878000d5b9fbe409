//! `rollout-manager autoscaler-replay --config X.yaml --trace trace.jsonl`: runs the same
//! `decide()` as the live autoscaler over a recorded trace (written by the YAML's
//! `trace_file`, or by hand) and prints one JSON line per decision, so a YAML can be tuned
//! before a run. The fleet follows the trace; a decided action counts as done at once.

use rollout_core::autoscaler::{parse_trace, replay, Action, AutoscalerConfig};
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// The autoscaler YAML to try.
    #[arg(long, value_name = "PATH")]
    pub config: PathBuf,
    /// The recorded trace, one JSON object per line (see docs/autoscaler.md).
    #[arg(long, value_name = "PATH")]
    pub trace: PathBuf,
    /// Print only the decisions that scale.
    #[arg(long)]
    pub actions_only: bool,
}

/// Counts of what the replay decided.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplaySummary {
    pub evaluations: usize,
    pub scale_outs: usize,
    pub scale_ins: usize,
}

/// Runs the replay, writing JSON lines to `out`. Errors name the file and what is wrong.
pub fn run(args: &ReplayArgs, out: &mut impl Write) -> Result<ReplaySummary, String> {
    let read = |p: &PathBuf| std::fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
    let config =
        AutoscalerConfig::from_yaml(&read(&args.config)?).map_err(|e| format!("{}: {e}", args.config.display()))?;
    let lines = parse_trace(&read(&args.trace)?).map_err(|e| format!("{}: {e}", args.trace.display()))?;
    let mut summary = ReplaySummary::default();
    for e in replay(config, &lines) {
        summary.evaluations += 1;
        let (delta, from, to, conditions) = match &e.action {
            Action::ScaleOut { delta, from_engines, to_engines, triggered_conditions, .. } => {
                summary.scale_outs += 1;
                (*delta, Some(*from_engines), Some(*to_engines), triggered_conditions.clone())
            }
            Action::ScaleIn { delta, from_engines, to_engines, triggered_conditions, .. } => {
                summary.scale_ins += 1;
                (*delta, Some(*from_engines), Some(*to_engines), triggered_conditions.clone())
            }
            Action::None { .. } if args.actions_only => continue,
            Action::None { .. } => (0, None, None, Vec::new()),
        };
        let line = json!({
            "at": e.at, "action": e.action.name(), "delta": delta, "from_engines": from, "to_engines": to,
            "reason": e.action.reason(), "signal": e.signal, "triggered_conditions": conditions,
            "metrics": super::service::metrics_view(e.metrics.as_ref()),
        });
        writeln!(out, "{line}").map_err(|e| format!("cannot write: {e}"))?;
    }
    Ok(summary)
}
