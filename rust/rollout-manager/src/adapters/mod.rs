//! What talks to the outside behind small traits: SGLang's control calls, engine processes and
//! node agents, weight transports; and the data plane, which reads only the routing table.
//!
//! A module here uses modules of this layer or lower ones, never a higher one
//! (`tests/layers.rs`, docs/architecture.md "Layers").

pub mod dialect;
pub mod engine_api;
pub mod engine_host;
pub mod keeper;
pub mod launch;
pub mod router;
pub mod weights;
