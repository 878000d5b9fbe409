//! `rollout-manager`: the fleet manager of Elastic Rollout.
//!
//! See `docs/architecture.md` for the picture; each module's docs say what it owns.

// A lint is silenced only with #[expect(..., reason = "...")], which fails once it is no longer needed.
#![deny(clippy::allow_attributes, clippy::allow_attributes_without_reason)]

pub mod agent;
pub mod api;
pub mod auth;
pub mod autoscaler;
pub mod clock;
pub mod dialect;
pub mod engine_api;
pub mod engine_host;
pub mod engine_http;
pub mod error;
pub mod fleet;
pub mod health;
pub mod host;
pub mod http_serve;
pub mod integrations;
pub mod keeper;
pub mod launch;
pub mod locks;
pub mod manager;
pub mod op_error;
pub mod placements;
pub mod publish;
pub mod records;
pub mod restore;
pub mod router;
pub mod scale_in;
pub mod scale_out;
pub mod scaling;
pub mod server;
pub mod slots;
pub mod store;
pub mod telemetry;
#[cfg(test)]
mod testing;
pub mod trainer_update;
#[cfg(test)]
mod use_case_tests;
pub mod weight_update;
pub mod weights;
