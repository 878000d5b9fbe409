//! Wiring: the manager's server (the manager, router, API, autoscaler and integrations built and
//! run in order) and the node agent's gRPC server.
//!
//! A module here uses modules of this layer or lower ones, never a higher one
//! (`tests/layers.rs`, docs/architecture.md "Layers").

pub mod agent;
pub mod server;
