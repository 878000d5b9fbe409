//! The manager as others reach it: the control API's handlers (parse, call a use case, map its
//! answer), the autoscaler's loop and API, smg registration and the load poller.
//!
//! A module here uses modules of this layer or lower ones, never a higher one
//! (`tests/layers.rs`, docs/architecture.md "Layers").

pub mod api;
pub mod autoscaler;
pub mod integrations;
pub mod openapi;
pub mod rl;
pub mod trainer_port;
