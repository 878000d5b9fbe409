//! The use cases: engine lifecycle and recovery, scale operations, health probes, weight updates,
//! placements, restart. Each refuses with a typed `OpError`; none knows HTTP.
//!
//! A module here uses modules of this layer or lower ones, never a higher one
//! (`tests/layers.rs`, docs/architecture.md "Layers").

pub mod control_pause;
pub mod health;
pub mod manager;
pub mod op_error;
pub mod placements;
pub mod publish;
pub mod restore;
pub mod scale_in;
pub mod scale_out;
pub mod scaling;
pub mod trainer_group;
pub mod trainer_update;
pub mod weight_update;
