//! The autoscaler's YAML (`--autoscaler-config`): the seed's field names and defaults, plus
//! two sections of our own (`pipeline_policy`, `trace_file`). Unknown fields are rejected so a
//! typo never passes silently; every validation error names the field as a YAML path.

use serde::{Deserialize, Serialize};

/// The whole file. Every field has the seed's default, so `{}` (or an empty file) is valid.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AutoscalerConfig {
    /// Whether the autoscaler acts at startup (`POST /autoscaler/enable` toggles it later).
    pub enabled: bool,
    /// Fewest engines the autoscaler keeps (it never scales in below this, nor below the
    /// manager's initial engines, which are protected).
    pub min_engines: u32,
    /// Most engines the autoscaler asks for (also bounded by `--max-engines` and the GPU pool).
    pub max_engines: u32,
    /// No operation for this long after a scale-out finished.
    pub scale_out_cooldown_secs: f64,
    /// No operation for this long after a scale-in finished.
    pub scale_in_cooldown_secs: f64,
    /// How often every ACTIVE engine's load is read.
    pub metrics_interval_secs: f64,
    /// How often a decision is taken (and acted on when enabled).
    pub evaluation_interval_secs: f64,
    /// Window of the throughput-stability check and of the conditions' history.
    pub condition_window_secs: f64,
    /// Accepted for compatibility with the seed's file; this autoscaler runs inside the manager
    /// and calls the scale API in-process, so the URL is not used.
    pub rollout_service_url: String,
    pub scale_out_policy: ScaleOutPolicy,
    pub scale_in_policy: ScaleInPolicy,
    /// Ours: the RL pipeline signal (`POST /rollout/pipeline`).
    pub pipeline_policy: PipelinePolicy,
    /// Ours: append every metrics tick to this JSON-lines file, for `rollout-manager
    /// autoscaler-replay`. Empty: no trace.
    pub trace_file: String,
}

/// Scale out when ANY condition holds for `condition_duration_secs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScaleOutPolicy {
    /// `token_usage_high`: mean KV-cache usage across engines above this.
    pub token_usage_threshold: f64,
    /// `queue_backlog`: waiting requests per engine above this.
    pub queue_depth_per_engine: u32,
    /// `queue_latency_high`: P95 queue time (seconds) above this.
    pub queue_time_p95_threshold: f64,
    /// `ttft_high`: P95 time to first token (seconds) above this.
    pub ttft_p95_threshold: f64,
    pub condition_duration_secs: f64,
    /// Most engines added by one scale-out.
    pub max_delta: u32,
}

/// Scale in (one engine) when ALL conditions hold for `condition_duration_secs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScaleInPolicy {
    /// `token_usage_low`: mean KV-cache usage below this.
    pub token_usage_threshold: f64,
    /// `no_queue`: total waiting requests at most this.
    pub queue_depth_threshold: u32,
    /// `throughput_stable`: variance of the fleet's generation throughput over the condition
    /// window, relative to its squared mean (dimensionless), below this.
    pub throughput_variance_threshold: f64,
    pub condition_duration_secs: f64,
    /// Engines removed by one scale-in; must be 1 (conservative scale-in).
    pub max_delta: u32,
    /// `projected_usage_ok`: usage spread over one engine fewer stays below this.
    pub projected_usage_max: f64,
}

/// The RL signal: a trainer reports per step how long it waited for rollout data and how long
/// rollout was held back by its staleness limit. While reports are fresh they, not serving
/// latency, drive the fleet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PipelinePolicy {
    /// Use the reports at all.
    pub enabled: bool,
    /// `trainer_starved`: the trainer waited more than this fraction of its step for data.
    pub trainer_wait_fraction_threshold: f64,
    /// `rollout_throttled`: rollout was held back by staleness more than this fraction.
    pub rollout_throttled_fraction_threshold: f64,
    /// How many of the latest steps must all show the condition.
    pub min_steps: u32,
    /// `trainer_starved` at once: one step where the trainer waited at least this fraction is
    /// enough (a wait that large is not noise, and every further starving step is lost work).
    pub severe_wait_fraction_threshold: f64,
    /// With rates in the reports (`rollout_samples`, `next_step_samples`): keep rollout's
    /// supply at least `1 + rate_headroom` times the trainer's demand. Below it scale out to the
    /// size that restores it (`rollout_short`); never scale in below it.
    pub rate_headroom: f64,
    /// Reports older than this are ignored; without fresh reports the serving metrics decide.
    pub report_max_age_secs: f64,
}

impl Default for AutoscalerConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            min_engines: 1,
            max_engines: 32,
            scale_out_cooldown_secs: 60.0,
            scale_in_cooldown_secs: 300.0,
            metrics_interval_secs: 10.0,
            evaluation_interval_secs: 30.0,
            condition_window_secs: 60.0,
            rollout_service_url: "http://localhost:8000/rollout".into(),
            scale_out_policy: ScaleOutPolicy::default(),
            scale_in_policy: ScaleInPolicy::default(),
            pipeline_policy: PipelinePolicy::default(),
            trace_file: String::new(),
        }
    }
}

impl Default for ScaleOutPolicy {
    fn default() -> Self {
        Self {
            token_usage_threshold: 0.85,
            queue_depth_per_engine: 10,
            queue_time_p95_threshold: 5.0,
            ttft_p95_threshold: 10.0,
            condition_duration_secs: 30.0,
            max_delta: 4,
        }
    }
}

impl Default for ScaleInPolicy {
    fn default() -> Self {
        Self {
            token_usage_threshold: 0.3,
            queue_depth_threshold: 0,
            throughput_variance_threshold: 0.1,
            condition_duration_secs: 120.0,
            max_delta: 1,
            projected_usage_max: 0.5,
        }
    }
}

impl Default for PipelinePolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            trainer_wait_fraction_threshold: 0.2,
            rollout_throttled_fraction_threshold: 0.2,
            min_steps: 3,
            severe_wait_fraction_threshold: 0.5,
            rate_headroom: 0.2,
            report_max_age_secs: 300.0,
        }
    }
}

/// A bad autoscaler file: `field` is the YAML path (`scale_in_policy.max_delta`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid autoscaler config: {field}: {message}")]
pub struct AutoscalerConfigError {
    pub field: String,
    pub message: String,
}

fn bad(field: &str, message: impl Into<String>) -> AutoscalerConfigError {
    AutoscalerConfigError { field: field.to_string(), message: message.into() }
}

fn positive(field: &str, v: f64) -> Result<(), AutoscalerConfigError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(bad(field, format!("{v} must be a positive number")))
    }
}

fn non_negative(field: &str, v: f64) -> Result<(), AutoscalerConfigError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(bad(field, format!("{v} must be a number >= 0")))
    }
}

fn fraction(field: &str, v: f64) -> Result<(), AutoscalerConfigError> {
    if v.is_finite() && v > 0.0 && v <= 1.0 {
        Ok(())
    } else {
        Err(bad(field, format!("{v} must be a fraction in (0, 1]")))
    }
}

impl AutoscalerConfig {
    /// Parses and validates a YAML document. An empty document means every default.
    pub fn from_yaml(text: &str) -> Result<Self, AutoscalerConfigError> {
        let config: Self = if text.trim().is_empty() {
            Self::default()
        } else {
            serde_norway::from_str(text).map_err(|e| {
                let field = e.location().map_or_else(|| "<file>".to_string(), |l| format!("line {}", l.line()));
                bad(&field, e.to_string())
            })?
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks every rule; the error names the field to fix.
    pub fn validate(&self) -> Result<(), AutoscalerConfigError> {
        if self.min_engines == 0 {
            return Err(bad("min_engines", "must be at least 1 (the fleet never scales to zero)"));
        }
        if self.max_engines < self.min_engines {
            return Err(bad("max_engines", format!("{} is below min_engines {}", self.max_engines, self.min_engines)));
        }
        non_negative("scale_out_cooldown_secs", self.scale_out_cooldown_secs)?;
        non_negative("scale_in_cooldown_secs", self.scale_in_cooldown_secs)?;
        positive("metrics_interval_secs", self.metrics_interval_secs)?;
        positive("evaluation_interval_secs", self.evaluation_interval_secs)?;
        positive("condition_window_secs", self.condition_window_secs)?;
        if self.condition_window_secs < 2.0 * self.metrics_interval_secs {
            return Err(bad(
                "condition_window_secs",
                format!(
                    "{} must span at least two metrics_interval_secs ({}) so throughput variance has samples",
                    self.condition_window_secs, self.metrics_interval_secs
                ),
            ));
        }
        let out = &self.scale_out_policy;
        fraction("scale_out_policy.token_usage_threshold", out.token_usage_threshold)?;
        positive("scale_out_policy.queue_time_p95_threshold", out.queue_time_p95_threshold)?;
        positive("scale_out_policy.ttft_p95_threshold", out.ttft_p95_threshold)?;
        non_negative("scale_out_policy.condition_duration_secs", out.condition_duration_secs)?;
        if out.max_delta == 0 {
            return Err(bad("scale_out_policy.max_delta", "must be at least 1"));
        }
        let inp = &self.scale_in_policy;
        fraction("scale_in_policy.token_usage_threshold", inp.token_usage_threshold)?;
        if inp.token_usage_threshold >= out.token_usage_threshold {
            return Err(bad(
                "scale_in_policy.token_usage_threshold",
                format!(
                    "{} must be below scale_out_policy.token_usage_threshold {}, or the fleet would oscillate",
                    inp.token_usage_threshold, out.token_usage_threshold
                ),
            ));
        }
        if inp.queue_depth_threshold >= out.queue_depth_per_engine.max(1) {
            return Err(bad(
                "scale_in_policy.queue_depth_threshold",
                format!(
                    "{} must be below scale_out_policy.queue_depth_per_engine {}",
                    inp.queue_depth_threshold, out.queue_depth_per_engine
                ),
            ));
        }
        non_negative("scale_in_policy.throughput_variance_threshold", inp.throughput_variance_threshold)?;
        non_negative("scale_in_policy.condition_duration_secs", inp.condition_duration_secs)?;
        if inp.max_delta != 1 {
            return Err(bad(
                "scale_in_policy.max_delta",
                format!(
                    "{} is not supported: scale-in removes one engine at a time; lower scale_in_cooldown_secs to shrink faster",
                    inp.max_delta
                ),
            ));
        }
        fraction("scale_in_policy.projected_usage_max", inp.projected_usage_max)?;
        if inp.projected_usage_max >= out.token_usage_threshold {
            return Err(bad(
                "scale_in_policy.projected_usage_max",
                format!(
                    "{} must be below scale_out_policy.token_usage_threshold {}, or a scale-in could trigger a scale-out",
                    inp.projected_usage_max, out.token_usage_threshold
                ),
            ));
        }
        let p = &self.pipeline_policy;
        fraction("pipeline_policy.trainer_wait_fraction_threshold", p.trainer_wait_fraction_threshold)?;
        fraction("pipeline_policy.rollout_throttled_fraction_threshold", p.rollout_throttled_fraction_threshold)?;
        if p.min_steps == 0 {
            return Err(bad("pipeline_policy.min_steps", "must be at least 1"));
        }
        fraction("pipeline_policy.severe_wait_fraction_threshold", p.severe_wait_fraction_threshold)?;
        if p.severe_wait_fraction_threshold < p.trainer_wait_fraction_threshold {
            return Err(bad(
                "pipeline_policy.severe_wait_fraction_threshold",
                format!(
                    "{} must be at least pipeline_policy.trainer_wait_fraction_threshold {}",
                    p.severe_wait_fraction_threshold, p.trainer_wait_fraction_threshold
                ),
            ));
        }
        if !(p.rate_headroom.is_finite() && (0.0..=10.0).contains(&p.rate_headroom)) {
            return Err(bad(
                "pipeline_policy.rate_headroom",
                format!("{} must be between 0 and 10 (0.2 keeps supply 20% above demand)", p.rate_headroom),
            ));
        }
        positive("pipeline_policy.report_max_age_secs", p.report_max_age_secs)?;
        Ok(())
    }

    /// How long metrics ticks are kept: enough for the longest condition plus a margin.
    pub fn retention_secs(&self) -> f64 {
        let longest = self
            .condition_window_secs
            .max(self.scale_out_policy.condition_duration_secs)
            .max(self.scale_in_policy.condition_duration_secs);
        longest + 3.0 * self.metrics_interval_secs
    }

    /// Largest gap between two ticks that still counts as continuous data.
    pub fn max_gap_secs(&self) -> f64 {
        2.5 * self.metrics_interval_secs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seed's example file, verbatim in its fields.
    const SEED_YAML: &str = r#"
enabled: true
min_engines: 1
max_engines: 32
scale_out_cooldown_secs: 60.0
scale_in_cooldown_secs: 300.0
metrics_interval_secs: 10.0
evaluation_interval_secs: 30.0
condition_window_secs: 60.0
rollout_service_url: "http://localhost:8000/rollout"
scale_out_policy:
  token_usage_threshold: 0.85
  queue_depth_per_engine: 10
  queue_time_p95_threshold: 5.0
  ttft_p95_threshold: 10.0
  condition_duration_secs: 30.0
  max_delta: 4
scale_in_policy:
  token_usage_threshold: 0.3
  queue_depth_threshold: 0
  throughput_variance_threshold: 0.1
  condition_duration_secs: 120.0
  max_delta: 1
  projected_usage_max: 0.5
"#;

    #[test]
    fn the_seed_file_is_the_default() {
        assert_eq!(AutoscalerConfig::from_yaml(SEED_YAML).unwrap(), AutoscalerConfig::default());
        assert_eq!(AutoscalerConfig::from_yaml("").unwrap(), AutoscalerConfig::default());
        assert_eq!(AutoscalerConfig::from_yaml("{}").unwrap(), AutoscalerConfig::default());
    }

    #[test]
    fn partial_files_keep_the_other_defaults() {
        let c = AutoscalerConfig::from_yaml(
            "min_engines: 2\nmax_engines: 8\nscale_out_policy:\n  token_usage_threshold: 0.80\n  max_delta: 2\nscale_in_policy:\n  token_usage_threshold: 0.25\n",
        )
        .unwrap();
        assert_eq!((c.min_engines, c.max_engines), (2, 8));
        assert_eq!(c.scale_out_policy.max_delta, 2);
        assert_eq!(c.scale_out_policy.queue_depth_per_engine, 10);
        assert_eq!(c.scale_in_policy.token_usage_threshold, 0.25);
        assert_eq!(c.scale_in_policy.projected_usage_max, 0.5);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            ("min_engines: 0", "min_engines"),
            ("min_engines: 4\nmax_engines: 2", "max_engines"),
            ("metrics_interval_secs: 0", "metrics_interval_secs"),
            ("metrics_interval_secs: 40", "condition_window_secs"),
            ("scale_out_cooldown_secs: -1", "scale_out_cooldown_secs"),
            ("scale_out_policy: {token_usage_threshold: 1.5}", "scale_out_policy.token_usage_threshold"),
            ("scale_out_policy: {max_delta: 0}", "scale_out_policy.max_delta"),
            ("scale_in_policy: {token_usage_threshold: 0.9}", "scale_in_policy.token_usage_threshold"),
            ("scale_in_policy: {max_delta: 2}", "scale_in_policy.max_delta"),
            (
                "pipeline_policy: {trainer_wait_fraction_threshold: 0.6, severe_wait_fraction_threshold: 0.5}",
                "pipeline_policy.severe_wait_fraction_threshold",
            ),
            ("scale_in_policy: {projected_usage_max: 0.9}", "scale_in_policy.projected_usage_max"),
            ("scale_in_policy: {queue_depth_threshold: 10}", "scale_in_policy.queue_depth_threshold"),
            ("pipeline_policy: {min_steps: 0}", "pipeline_policy.min_steps"),
            ("pipeline_policy: {rate_headroom: -0.1}", "pipeline_policy.rate_headroom"),
        ];
        for (yaml, field) in cases {
            let err = AutoscalerConfig::from_yaml(yaml).unwrap_err();
            assert_eq!(err.field, field, "{yaml}: {err}");
            assert!(err.to_string().contains(field), "{err}");
        }
    }

    #[test]
    fn unknown_fields_and_wrong_types_are_rejected_with_their_name() {
        let err = AutoscalerConfig::from_yaml("scale_out_policy:\n  token_usage_treshold: 0.8\n").unwrap_err();
        assert!(err.message.contains("token_usage_treshold"), "{err}");
        assert!(err.field.starts_with("line"), "{err}");
        let err = AutoscalerConfig::from_yaml("max_engines: many").unwrap_err();
        assert!(err.message.contains("max_engines") || err.message.contains("invalid"), "{err}");
    }

    #[test]
    fn retention_covers_the_longest_condition() {
        let c = AutoscalerConfig::default();
        assert!(c.retention_secs() >= 120.0);
    }
}
