//! Pure domain model of Elastic Rollout.
//!
//! Everything here is deterministic and free of IO: identifiers, the state machines of engines
//! and scale operations, GPU placement on a local pool, and the configuration of the manager with
//! its validation. The service crate (`rollout-manager`) performs the effects these types decide.

// A lint is silenced only with #[expect(..., reason = "...")], which fails once it is no longer needed.
#![deny(clippy::allow_attributes, clippy::allow_attributes_without_reason)]

pub mod addr;
pub mod autoscaler;
pub mod catchup;
pub mod cidr;
pub mod cli;
pub mod config;
#[cfg(test)]
mod fuzz_tests;
pub mod health;
pub mod ids;
pub mod lengths;
pub mod moves;
pub mod placement;
pub mod restore;
pub mod rids;
pub mod rl;
pub mod routes;
pub mod routing;
pub mod scale_in;
pub mod scale_out;
pub mod state;
pub mod tail;
pub mod weights;

pub use addr::EngineAddr;
pub use cli::{LogArgs, LogFormat, ServeArgs};
pub use config::{ConfigError, EngineKind, PartialSuccessPolicy, PlacementMode, ServeConfig, WeightTransportKind};
pub use placement::{
    AgentBinding, BindOutcome, Desired, GpuPool, LoseOutcome, Placement, PlacementConflict, PlacementError,
    PlacementStatus,
};
pub use state::{
    EngineEvent, EngineOrigin, EngineStatus, IllegalTransition, Phase, ScaleInEvent, ScaleInStatus, ScaleOutEvent,
    ScaleOutStatus,
};
