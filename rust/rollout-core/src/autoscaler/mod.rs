//! The autoscaler's pure half: its configuration (the seed's YAML), engine load samples and
//! their sliding window, a Prometheus text parser, the RL pipeline signal, and [`decide()`].
//!
//! The manager (`rollout-manager/src/autoscaler/`) reads the engines, feeds
//! [`AutoscalerState`] and acts through the scale API; `rollout-manager autoscaler-replay`
//! feeds it a recorded trace instead. See `docs/autoscaler.md`.

pub mod config;
pub mod decide;
pub mod metrics;
pub mod pipeline;
pub mod prom;
pub mod state;

#[cfg(test)]
mod decide_tests;

pub use config::{AutoscalerConfig, AutoscalerConfigError, PipelinePolicy, ScaleInPolicy, ScaleOutPolicy};
pub use decide::{decide, Action, Condition, ConditionKind, Evaluation, FleetState, Memory, Signal};
pub use metrics::{EngineSample, FleetMetrics, Histogram, MetricsWindow, Observation, Tick};
pub use pipeline::{PipelineReport, PipelineWindow};
pub use state::{parse_trace, replay, AutoscalerState, TraceLine};
