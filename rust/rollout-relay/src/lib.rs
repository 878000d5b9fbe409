//! Elastic Rollout's weight relay: moves a checkpoint version from one source to every node
//! that hosts engines, where it lands on local fast storage (e.g. `/dev/shm`) for the engines
//! to load with `/update_weights_from_disk`.
//!
//! Data path: a pipelined chain. The sender reads the version once and streams it in chunks
//! (4 MiB by default) to the first receiver, which writes each chunk locally *and* forwards it
//! to the next receiver, and so on: with the chain full, every link carries the data at the
//! same time, so the time for N receivers is close to the time for one (plus N chunk times).
//!
//! Integrity, end to end: the manifest (sent first) lists every file with its size and SHA-256
//! and the version checksum (the SHA-256 of the `sha256sum` listing of the `*.safetensors`
//! files in name order, the rule the engines' loaders use); every chunk carries a CRC-32 checked at every hop; a receiver
//! writes under `<dest>/<version>.partial/` and renames to `<dest>/<version>/` only after every
//! hash matched. A corrupted, reordered or truncated transfer is detected, reported per
//! receiver, retried (by the sender, for the failed receivers only) and never exposed.
//!
//! Wire format: [`protocol`]. Chain mechanics: [`chain`]. Receiving: [`receiver`], [`sink`].
//! Sending: [`sender`]. NCCL (feature `nccl`): `nccl`, bootstrapped over the same TCP
//! connection (rank 0 creates the NCCL unique id and sends it in `HELLO`).

pub mod chain;
pub mod manifest;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod protocol;
pub mod receiver;
pub mod sender;
pub mod sink;

pub use manifest::Manifest;
pub use protocol::Transport;
pub use receiver::{Receiver, ReceiverHandle, ReceiverOptions};
pub use sender::{send, ReceiverReport, Report, SendError, SendOptions};
