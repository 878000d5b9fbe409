//! How a scale-out ends: which of its READY engines are kept, and the operation's last event.
//! Pure rules; `rollout-manager`'s scale-out use case runs the engines and applies them.

use crate::config::PartialSuccessPolicy;
use crate::state::ScaleOutEvent;

/// Why the scale-out stopped waiting for its engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Every engine's bring-up finished (some may have failed).
    Done,
    /// The operation's timeout passed with engines still coming up.
    TimedOut,
    /// Cancelled by request.
    Cancelled,
    /// The manager is shutting down.
    ShuttingDown,
    /// An engine failed under `rollback_all`: stop at once.
    RolledBack,
}

/// Whether READY engines may be kept at all, before looking at which are still READY:
/// everything finished and either nothing failed or the policy keeps partial results; or the
/// timeout passed under `keep_partial`. A cancel, a shutdown or a rollback keeps nothing.
pub fn may_keep(end: End, policy: PartialSuccessPolicy, any_failed: bool) -> bool {
    match end {
        End::Done => policy == PartialSuccessPolicy::KeepPartial || !any_failed,
        End::TimedOut => policy == PartialSuccessPolicy::KeepPartial,
        End::Cancelled | End::ShuttingDown | End::RolledBack => false,
    }
}

/// Whether the engines still READY at the end are activated: there must be some, and under
/// `rollback_all` none of the others may have been lost after they were ready.
pub fn activate(policy: PartialSuccessPolicy, ready: usize, lost_after_ready: usize) -> bool {
    ready > 0 && (lost_after_ready == 0 || policy == PartialSuccessPolicy::KeepPartial)
}

/// The operation's last event, given how it ended and whether any engine was kept.
pub fn last_event(end: End, kept_any: bool) -> ScaleOutEvent {
    match end {
        End::Cancelled => ScaleOutEvent::Cancel,
        End::ShuttingDown => ScaleOutEvent::Fail,
        End::Done | End::TimedOut | End::RolledBack if kept_any => ScaleOutEvent::Activated,
        End::Done | End::TimedOut | End::RolledBack => ScaleOutEvent::Fail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use PartialSuccessPolicy::{KeepPartial as Keep, RollbackAll as Rollback};

    #[test]
    fn which_ends_may_keep_engines() {
        let table = [
            (End::Done, Rollback, false, true),
            (End::Done, Rollback, true, false),
            (End::Done, Keep, true, true),
            (End::TimedOut, Keep, true, true),
            (End::TimedOut, Rollback, false, false),
            (End::Cancelled, Keep, false, false),
            (End::ShuttingDown, Keep, false, false),
            (End::RolledBack, Rollback, true, false),
        ];
        for (end, policy, failed, want) in table {
            assert_eq!(may_keep(end, policy, failed), want, "{end:?} {policy:?} failed={failed}");
        }
    }

    #[test]
    fn activation_and_last_event() {
        assert!(activate(Rollback, 2, 0));
        assert!(!activate(Rollback, 2, 1));
        assert!(activate(Keep, 1, 1));
        assert!(!activate(Keep, 0, 0));
        assert_eq!(last_event(End::Done, true), ScaleOutEvent::Activated);
        assert_eq!(last_event(End::Done, false), ScaleOutEvent::Fail);
        assert_eq!(last_event(End::Cancelled, false), ScaleOutEvent::Cancel);
        assert_eq!(last_event(End::ShuttingDown, false), ScaleOutEvent::Fail);
    }

    proptest! {
        /// A cancelled or shut-down operation never ends ACTIVE, and an operation that keeps
        /// nothing never ends ACTIVE: the outcome and the fleet agree.
        #[test]
        fn outcome_agrees_with_what_was_kept(end in 0usize..5, keep in any::<bool>(), failed in any::<bool>(), ready in 0usize..3, lost in 0usize..3) {
            let end = [End::Done, End::TimedOut, End::Cancelled, End::ShuttingDown, End::RolledBack][end];
            let policy = if keep { Keep } else { Rollback };
            let kept = may_keep(end, policy, failed) && activate(policy, ready, lost);
            let event = last_event(end, kept);
            prop_assert_eq!(event == ScaleOutEvent::Activated, kept);
            if kept { prop_assert!(ready > 0); }
        }
    }
}
