//! Fault injection: crash or hang after the N-th `/generate` request, slow health checks, and
//! the runtime fault API.
//!
//! Guarantees: requests 1..=N are answered normally. Right after the N-th answer is written
//! the fault fires: `--crash-after-requests` exits the whole process with code
//! [`CRASH_EXIT_CODE`]; `--hang-after-requests` makes this engine stop answering anything
//! (every route, health included; the process stays alive). Requests numbered above N that
//! arrive before the fault fires never get an answer.
//!
//! The health delay starts at `--slow-health` and, with `--enable-fault-api`, can be changed
//! while the engine runs (`POST /sim/faults`, see [`FaultRequest`]), as can the hang: chaos
//! tests use that to break one engine of a fleet whose engines all got the same flags.

use serde::Deserialize;
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

/// No health delay (the stored value of [`Faults::slow_health`] when it is off).
const NO_DELAY: u64 = u64::MAX;

/// Per-engine request counter for the faults, and the current health delay.
#[derive(Debug)]
pub struct Faults {
    crash_after: Option<u64>,
    hang_after: Option<u64>,
    count: AtomicU64,
    /// Health delay in microseconds, or [`NO_DELAY`].
    slow_health_us: AtomicU64,
}

/// Body of `POST /sim/faults` (with `--enable-fault-api`). Absent fields change nothing.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultRequest {
    /// Seconds `/health` and `/health_generate` sleep before answering; `0` turns it off.
    pub slow_health: Option<f64>,
    /// `true`: from now on this engine answers nothing (like `--hang-after-requests`); there is
    /// no way back short of a signal. `false` is accepted and does nothing.
    pub hang: Option<bool>,
    /// `true`: the scheduler stops for good while the HTTP process keeps answering, as a hung
    /// SGLang scheduler does: generation, the health check and `/server_info` (which asks the
    /// scheduler for its internal state) never answer; `/model_info` and `/v1/loads` (SGLang
    /// 0.5.23 answers it from the last load snapshot, in the HTTP process) still do. `false`
    /// does nothing.
    pub hang_scheduler: Option<bool>,
}

impl Faults {
    pub fn new(crash_after: Option<u64>, hang_after: Option<u64>, slow_health: Option<f64>) -> Self {
        let faults =
            Self { crash_after, hang_after, count: AtomicU64::new(0), slow_health_us: AtomicU64::new(NO_DELAY) };
        faults.set_slow_health(slow_health);
        faults
    }

    /// The current health delay, if any.
    pub fn slow_health(&self) -> Option<Duration> {
        match self.slow_health_us.load(Ordering::Acquire) {
            NO_DELAY => None,
            us => Some(Duration::from_micros(us)),
        }
    }

    /// Sets the health delay (`None`, zero or a value that is not a finite positive number
    /// turn it off; validation of user input happens before this).
    pub fn set_slow_health(&self, secs: Option<f64>) {
        let us = match secs {
            Some(s) if s.is_finite() && s > 0.0 => ((s * 1e6) as u64).min(NO_DELAY - 1),
            _ => NO_DELAY,
        };
        self.slow_health_us.store(us, Ordering::Release);
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
        let f = Faults::new(Some(2), None, None);
        assert_eq!(f.admit(), Admission::Normal);
        assert_eq!(f.admit(), Admission::ServeThenFire(FaultKind::Crash));
        assert_eq!(f.admit(), Admission::Doomed);
    }

    #[test]
    fn earliest_fault_wins() {
        let f = Faults::new(Some(3), Some(1), None);
        assert_eq!(f.admit(), Admission::ServeThenFire(FaultKind::Hang));
        assert_eq!(f.admit(), Admission::Doomed);
        assert_eq!(Faults::new(None, None, None).admit(), Admission::Normal);
    }

    #[test]
    fn health_delay_can_change_at_runtime() {
        let f = Faults::new(None, None, Some(0.5));
        assert_eq!(f.slow_health(), Some(Duration::from_millis(500)));
        f.set_slow_health(Some(0.0));
        assert_eq!(f.slow_health(), None);
        f.set_slow_health(Some(2.25));
        assert_eq!(f.slow_health(), Some(Duration::from_millis(2250)));
        f.set_slow_health(None);
        assert_eq!(f.slow_health(), None);
    }
}
