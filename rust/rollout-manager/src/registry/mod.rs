//! The fleet's state: the in-memory registry behind one lock, publishing a routing table with every
//! change, and the store it commits to.
//!
//! A module here uses modules of this layer or lower ones, never a higher one
//! (`tests/layers.rs`, docs/architecture.md "Layers").

pub mod engines;
pub mod fleet;
pub mod operations;
pub mod store;
pub mod weights;
