//! What everything else stands on and that knows nothing of the fleet's use cases: plain records
//! (as the API and the store show them), the router's slot queue and per-engine loads, child
//! processes, capped HTTP reads, the JSON error body, the clock and lock rules, metrics text.
//!
//! A module here uses modules of this layer or lower ones, never a higher one
//! (`tests/layers.rs`, docs/architecture.md "Layers").

pub mod allowed_peers;
pub mod auth;
pub mod clock;
pub mod engine_http;
pub mod error;
pub mod host;
pub mod http_serve;
pub mod locks;
pub mod records;
pub mod slots;
pub mod telemetry;
