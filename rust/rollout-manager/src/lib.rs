//! `rollout-manager`: the fleet manager of Elastic Rollout.
//!
//! See `docs/architecture.md` for the picture; each module's docs say what it owns.

// A lint is silenced only with #[expect(..., reason = "...")], which fails once it is no longer needed.
#![deny(clippy::allow_attributes, clippy::allow_attributes_without_reason)]

pub mod adapters;
pub mod app;
pub mod foundation;
pub mod interfaces;
pub mod ops;
pub mod registry;
#[cfg(test)]
mod testing;
#[cfg(test)]
mod use_case_tests;
