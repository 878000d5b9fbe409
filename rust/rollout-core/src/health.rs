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

/// `--restart-budget` and `--restart-window-secs`: how many times in a row an engine is
/// restarted before the manager gives up on it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RestartBudget {
    /// Restarts allowed in a row, counting each one after which the engine did not stay up
    /// `window_secs` (a crash loop).
    pub max_restarts: u32,
    /// How long an engine must serve (ACTIVE) after a restart for the next failure to start a
    /// new count.
    pub window_secs: f64,
}

/// Backoff between restarts in a row: the first at once (after the caller's own delay), then
/// 1 s, 2 s, 4 s ... up to this.
pub const MAX_RESTART_BACKOFF_SECS: f64 = 60.0;

/// What to do about a failed engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RestartDecision {
    /// Restart it after this many seconds; it is the `streak`-th restart in a row.
    After { secs: f64, streak: u32 },
    /// The budget is spent: it stays FAILED.
    GiveUp { restarts: u32 },
}

/// Whether to restart an engine that failed, given `streak`, the restarts in a row so far, and
/// `stayed_up_secs`, how long it served (ACTIVE) since its last start (None: it never did). A
/// run as long as the window ends the streak: the failure is a new one, not a loop.
pub fn restart_decision(streak: u32, stayed_up_secs: Option<f64>, budget: RestartBudget) -> RestartDecision {
    let streak = match stayed_up_secs {
        Some(up) if up >= budget.window_secs => 0,
        _ => streak,
    };
    if streak >= budget.max_restarts {
        return RestartDecision::GiveUp { restarts: streak };
    }
    let secs = if streak == 0 { 0.0 } else { (2f64.powi(streak as i32 - 1)).min(MAX_RESTART_BACKOFF_SECS) };
    RestartDecision::After { secs, streak: streak + 1 }
}

/// `--health-max-unhealthy-fraction`: how many of `wanting` engines whose probes failed past
/// the threshold may leave routing now, when `out` engines are already out (UNHEALTHY) of
/// `serving` (ACTIVE and UNHEALTHY together). At most `fraction` of the serving engines are
/// out at once, never fewer than one; the rest are held in routing and probed again, so a
/// failure of every probe at once (a network blip, a shared storage stall, a slow health
/// route) cannot empty the fleet.
pub fn takeouts_allowed(serving: usize, out: usize, wanting: usize, fraction: f64) -> usize {
    let bound = ((serving as f64) * fraction.clamp(0.0, 1.0)).floor() as usize;
    bound.max(1).saturating_sub(out).min(wanting)
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

    const BUDGET: RestartBudget = RestartBudget { max_restarts: 3, window_secs: 600.0 };

    #[test]
    fn a_crash_loop_ends_after_its_budget() {
        use RestartDecision::{After, GiveUp};
        let table = [
            // (streak, stayed up, decision)
            (0, None, After { secs: 0.0, streak: 1 }),
            (1, None, After { secs: 1.0, streak: 2 }),
            (2, Some(30.0), After { secs: 2.0, streak: 3 }),
            (3, None, GiveUp { restarts: 3 }),
            (3, Some(599.0), GiveUp { restarts: 3 }),
            // It served for the whole window: a new failure, not the same loop.
            (3, Some(600.0), After { secs: 0.0, streak: 1 }),
            (9, Some(3600.0), After { secs: 0.0, streak: 1 }),
        ];
        for (streak, up, want) in table {
            assert_eq!(restart_decision(streak, up, BUDGET), want, "streak {streak} up {up:?}");
        }
        let long = RestartBudget { max_restarts: 100, window_secs: 600.0 };
        assert_eq!(restart_decision(20, None, long), RestartDecision::After { secs: 60.0, streak: 21 });
    }

    #[test]
    fn a_blip_takes_out_at_most_the_bounded_share() {
        let table = [
            // (serving, out, wanting, fraction, allowed)
            (8, 0, 8, 0.5, 4),
            (8, 3, 8, 0.5, 1),
            (8, 4, 2, 0.5, 0),
            (8, 0, 1, 0.5, 1),
            (1, 0, 1, 0.5, 1),
            (3, 0, 3, 0.5, 1),
            (3, 1, 2, 0.5, 0),
            (8, 0, 8, 1.0, 8),
            (8, 0, 8, 0.0, 1),
            (0, 0, 0, 0.5, 0),
        ];
        for (serving, out, wanting, fraction, want) in table {
            assert_eq!(takeouts_allowed(serving, out, wanting, fraction), want, "{serving} {out} {wanting} {fraction}");
        }
    }

    proptest! {
        /// Never more than the budget of restarts in a row, and the backoff never shrinks
        /// within a streak or passes its cap.
        #[test]
        fn restarts_in_a_row_stay_within_the_budget(max in 1u32..10, ups in proptest::collection::vec(proptest::option::of(0f64..1200.0), 1..40)) {
            let budget = RestartBudget { max_restarts: max, window_secs: 600.0 };
            let (mut streak, mut last) = (0u32, -1.0f64);
            for up in ups {
                match restart_decision(streak, up, budget) {
                    RestartDecision::After { secs, streak: next } => {
                        prop_assert!(next <= max);
                        prop_assert!(secs <= MAX_RESTART_BACKOFF_SECS);
                        if next > 1 { prop_assert!(secs >= last); }
                        streak = next;
                        last = secs;
                    }
                    RestartDecision::GiveUp { restarts } => {
                        prop_assert_eq!(restarts, max);
                        prop_assert!(up.is_none_or(|u| u < 600.0));
                        break;
                    }
                }
            }
        }

        /// The engines out of routing never pass the bound once this round is done (beyond
        /// those already out), and one can always leave when none is out.
        #[test]
        fn takeouts_respect_the_bound(serving in 0usize..64, out_share in 0.0f64..1.0, wanting in 0usize..64, fraction in 0.0f64..1.0) {
            let out = ((serving as f64) * out_share) as usize;
            let wanting = wanting.min(serving - out);
            let allowed = takeouts_allowed(serving, out, wanting, fraction);
            prop_assert!(allowed <= wanting);
            let bound = (((serving as f64) * fraction).floor() as usize).max(1);
            prop_assert!(allowed == 0 || out + allowed <= bound);
            if out == 0 && wanting > 0 { prop_assert!(allowed >= 1); }
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
