//! What one health probe means for an engine: the health monitor's decision, pure.
//!
//! An ACTIVE engine leaves routing after `threshold` failed probes in a row (UNHEALTHY); an
//! UNHEALTHY one whose probe passes tries to come back (the manager checks its weights first);
//! an UNHEALTHY managed engine that keeps failing, three times the threshold in a row, is
//! restarted when `--restart-failed-engines` is on. Every other case changes nothing.
//!
//! SGLang's health check is a 1-token generation, which waits while generation is paused: a
//! trainer that pauses engines for its weight update makes every probe fail although nothing
//! is wrong. A failed probe whose engine's scheduler still answers a control call (its load) is
//! taken for such a pause, not counted, for at most `--health-pause-grace-secs`; past that it
//! counts as the failure it is (a pause that never ends, or a scheduler that answers control
//! calls but cannot generate).

use crate::state::EngineStatus;

/// The monitor's settings that decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbePolicy {
    /// `--health-failure-threshold`.
    pub threshold: u32,
    /// `--restart-failed-engines`.
    pub restart_failed: bool,
}

/// What one probe found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Probe {
    Passed,
    Failed,
    /// The probe failed but the scheduler answers control calls: generation is paused, since
    /// `for_secs` (the first such probe in a row).
    Paused {
        for_secs: f64,
    },
}

/// Whether `probe` counts as a passed probe (`Some(true)`), a failed one (`Some(false)`), or
/// not at all (`None`: a pause within `grace_secs`).
pub fn counts(probe: Probe, grace_secs: f64) -> Option<bool> {
    match probe {
        Probe::Passed => Some(true),
        Probe::Failed => Some(false),
        Probe::Paused { for_secs } if for_secs < grace_secs => None,
        Probe::Paused { .. } => Some(false),
    }
}

/// What to do about an engine after a probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Take it out of routing (ACTIVE -> UNHEALTHY).
    TakeOut,
    /// Try to bring it back (UNHEALTHY -> ACTIVE once its weights check out).
    TryBack,
    /// It is hung: stop and restart it.
    Restart,
}

/// The verdict on an engine in `status` whose probe `passed`, with `failures` consecutive
/// failed probes counted so far (this one included); `managed` is false for external engines
/// (which are never restarted).
pub fn verdict(
    status: EngineStatus,
    passed: bool,
    failures: u32,
    managed: bool,
    policy: ProbePolicy,
) -> Option<Verdict> {
    match (status, passed) {
        (EngineStatus::Active, false) if failures >= policy.threshold => Some(Verdict::TakeOut),
        (EngineStatus::Unhealthy, true) => Some(Verdict::TryBack),
        (EngineStatus::Unhealthy, false)
            if managed && policy.restart_failed && failures == policy.threshold.saturating_mul(3) =>
        {
            Some(Verdict::Restart)
        }
        _ => None,
    }
}

/// Which start of an engine a probe was sent to: a result is applied only to the same one, so a
/// probe sent before a restart cannot count against the engine that came back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incarnation {
    pub url: String,
    pub pid: Option<u32>,
    pub restarts: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use EngineStatus as S;

    const POLICY: ProbePolicy = ProbePolicy { threshold: 3, restart_failed: true };

    #[test]
    fn verdict_table() {
        let table = [
            // (status, passed, failures, managed, verdict)
            (S::Active, true, 0, true, None),
            (S::Active, false, 2, true, None),
            (S::Active, false, 3, true, Some(Verdict::TakeOut)),
            (S::Active, false, 4, false, Some(Verdict::TakeOut)),
            (S::Unhealthy, true, 0, true, Some(Verdict::TryBack)),
            (S::Unhealthy, true, 0, false, Some(Verdict::TryBack)),
            (S::Unhealthy, false, 8, true, None),
            (S::Unhealthy, false, 9, true, Some(Verdict::Restart)),
            (S::Unhealthy, false, 10, true, None),
            (S::Unhealthy, false, 9, false, None),
            (S::Draining, false, 9, true, None),
            (S::WeightSyncing, true, 0, true, None),
        ];
        for (status, passed, failures, managed, want) in table {
            assert_eq!(
                verdict(status, passed, failures, managed, POLICY),
                want,
                "{status} {passed} {failures} {managed}"
            );
        }
        let no_restart = ProbePolicy { restart_failed: false, ..POLICY };
        assert_eq!(verdict(S::Unhealthy, false, 9, true, no_restart), None);
    }

    #[test]
    fn a_pause_counts_only_past_its_grace() {
        let table = [
            (Probe::Passed, 600.0, Some(true)),
            (Probe::Failed, 600.0, Some(false)),
            (Probe::Paused { for_secs: 0.0 }, 600.0, None),
            (Probe::Paused { for_secs: 599.9 }, 600.0, None),
            (Probe::Paused { for_secs: 600.0 }, 600.0, Some(false)),
            (Probe::Paused { for_secs: 0.0 }, 0.0, Some(false)),
            (Probe::Paused { for_secs: f64::NAN }, 600.0, Some(false)),
        ];
        for (probe, grace, want) in table {
            assert_eq!(counts(probe, grace), want, "{probe:?} grace {grace}");
        }
    }

    proptest! {
        /// Only ACTIVE and UNHEALTHY engines are acted on; a passing probe never takes an
        /// engine out or restarts it; a failing one never brings it back.
        #[test]
        fn verdicts_follow_the_probe(
            status in proptest::sample::select(EngineStatus::ALL.to_vec()),
            passed in any::<bool>(),
            failures in 0u32..40,
            managed in any::<bool>(),
            threshold in 1u32..6,
            restart_failed in any::<bool>(),
        ) {
            let v = verdict(status, passed, failures, managed, ProbePolicy { threshold, restart_failed });
            if !matches!(status, S::Active | S::Unhealthy) {
                prop_assert_eq!(v, None);
            }
            match v {
                Some(Verdict::TakeOut) | Some(Verdict::Restart) => prop_assert!(!passed),
                Some(Verdict::TryBack) => prop_assert!(passed),
                None => {}
            }
            if v == Some(Verdict::Restart) {
                prop_assert!(managed && restart_failed);
            }
        }
    }
}
