//! Fault injection for `/generate`: crash or hang after the N-th request.
//!
//! Guarantees: requests 1..=N are answered normally. Right after the N-th answer is written
//! the fault fires: `--crash-after-requests` exits the whole process with code
//! [`CRASH_EXIT_CODE`]; `--hang-after-requests` makes this engine stop answering anything
//! (every route, health included; the process stays alive). Requests numbered above N that
//! arrive before the fault fires never get an answer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Exit code of a simulated crash (distinct from 1 = startup failure, 2 = bad usage).
pub const CRASH_EXIT_CODE: i32 = 3;

/// What the fault does when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    Crash,
    Hang,
}

/// How one `/generate` request should be treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Serve normally.
    Normal,
    /// Serve normally, then fire this fault.
    ServeThenFire(FaultKind),
    /// The fault is about to fire: never answer.
    Doomed,
}

/// Per-engine request counter for the faults.
#[derive(Debug)]
pub struct Faults {
    crash_after: Option<u64>,
    hang_after: Option<u64>,
    count: AtomicU64,
}

impl Faults {
    pub fn new(crash_after: Option<u64>, hang_after: Option<u64>) -> Self {
        Self { crash_after, hang_after, count: AtomicU64::new(0) }
    }

    /// Counts one `/generate` request and says how to treat it.
    pub fn admit(&self) -> Admission {
        if self.crash_after.is_none() && self.hang_after.is_none() {
            return Admission::Normal;
        }
        let n = self.count.fetch_add(1, Ordering::AcqRel) + 1;
        let first = [self.crash_after.map(|c| (c, FaultKind::Crash)), self.hang_after.map(|h| (h, FaultKind::Hang))]
            .into_iter()
            .flatten()
            .min_by_key(|(limit, _)| *limit);
        match first {
            Some((limit, kind)) if n == limit => Admission::ServeThenFire(kind),
            Some((limit, _)) if n > limit => Admission::Doomed,
            _ => Admission::Normal,
        }
    }
}

/// Ends the process shortly (so the answer that triggered it can be flushed first).
pub fn crash_soon(port: u16) {
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        tracing::error!(port, "simulated crash (--crash-after-requests): exiting");
        eprintln!("sglang-sim: simulated crash on port {port} (--crash-after-requests)");
        std::process::exit(CRASH_EXIT_CODE);
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn counts_to_the_limit() {
        let f = Faults::new(Some(2), None);
        assert_eq!(f.admit(), Admission::Normal);
        assert_eq!(f.admit(), Admission::ServeThenFire(FaultKind::Crash));
        assert_eq!(f.admit(), Admission::Doomed);
    }

    #[test]
    fn earliest_fault_wins() {
        let f = Faults::new(Some(3), Some(1));
        assert_eq!(f.admit(), Admission::ServeThenFire(FaultKind::Hang));
        assert_eq!(f.admit(), Admission::Doomed);
        assert_eq!(Faults::new(None, None).admit(), Admission::Normal);
    }
}
