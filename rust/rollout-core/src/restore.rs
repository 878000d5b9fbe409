//! What a restarted manager does with each record it finds in its store: pure rules, applied
//! by `rollout-manager`'s restore use case.

use crate::ids::EngineId;
use crate::state::{EngineOrigin, EngineStatus};

/// A stored engine as the plan sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredEngine {
    pub status: EngineStatus,
    pub origin: EngineOrigin,
    /// Its process was found still running under the recorded identity and re-attached.
    pub live: bool,
    /// It was a victim of a scale-in that was in flight (that scale-in completes).
    pub scale_in_victim: bool,
    /// It belonged to an in-flight scale-out that had not activated it (rolled back).
    pub rolled_back: bool,
}

/// What happens to one stored engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// It was being removed or rolled back: it leaves the fleet; a live process is stopped.
    Drop,
    /// An external engine: kept, out of routing (UNHEALTHY) until a health probe passes.
    Watch,
    /// A managed engine whose process still runs: health-checked and taken back without a
    /// restart (HEALTH_CHECKING).
    Adopt,
    /// A managed engine without a live process: started again on its GPUs (FAILED, restarting).
    Restart,
}

impl Fate {
    /// The status the engine is restored in, or `None` when it leaves the fleet.
    pub fn restored_status(self) -> Option<EngineStatus> {
        match self {
            Fate::Drop => None,
            Fate::Watch => Some(EngineStatus::Unhealthy),
            Fate::Adopt => Some(EngineStatus::HealthChecking),
            Fate::Restart => Some(EngineStatus::Failed),
        }
    }
}

/// The fate of one stored engine. Initial engines must exist, so a rollback or an interrupted
/// drain does not drop them (a scale-in never chooses them).
pub fn fate(e: StoredEngine) -> Fate {
    let initial = e.origin == EngineOrigin::Initial;
    let leaving = match e.status {
        EngineStatus::Removing | EngineStatus::Removed => true,
        EngineStatus::Draining => !initial,
        EngineStatus::Pending
        | EngineStatus::Creating
        | EngineStatus::HealthChecking
        | EngineStatus::WeightSyncing
        | EngineStatus::Ready
        | EngineStatus::Active
        | EngineStatus::Unhealthy
        | EngineStatus::Failed => false,
    };
    if leaving || e.scale_in_victim || (e.rolled_back && !initial) {
        Fate::Drop
    } else if e.origin == EngineOrigin::External {
        Fate::Watch
    } else if e.live {
        Fate::Adopt
    } else {
        Fate::Restart
    }
}

/// How a scale-out that was in flight when the manager stopped ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InterruptedScaleOut {
    /// Every engine was already ACTIVE (the manager died between activating them and recording
    /// the end): the operation ends ACTIVE.
    Complete,
    /// It ends FAILED: `rolled_back` (not activated) are rolled back, `kept` (activated) stay.
    Fail { kept: Vec<EngineId>, rolled_back: Vec<EngineId> },
}

/// Splits an interrupted scale-out's engines by whether they were ACTIVE.
pub fn interrupted_scale_out(engine_ids: &[EngineId], is_active: impl Fn(&str) -> bool) -> InterruptedScaleOut {
    let (kept, rolled_back): (Vec<EngineId>, Vec<EngineId>) = engine_ids.iter().cloned().partition(|id| is_active(id));
    if !kept.is_empty() && rolled_back.is_empty() {
        InterruptedScaleOut::Complete
    } else {
        InterruptedScaleOut::Fail { kept, rolled_back }
    }
}

/// How a re-adopted engine returns, given a weight update that was in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MidTurn {
    /// Not caught mid-turn: checked and taken back on the version it serves.
    No,
    /// Caught mid-turn and the update resumes: it waits in WEIGHT_SYNCING for its turn.
    HandOver,
    /// Caught mid-turn and the update cannot resume: restarted on the current version (a load
    /// sent before the crash may still change it).
    Restart,
}

pub fn mid_turn(caught_mid_turn: bool, update_resumes: bool) -> MidTurn {
    match (caught_mid_turn, update_resumes) {
        (false, _) => MidTurn::No,
        (true, true) => MidTurn::HandOver,
        (true, false) => MidTurn::Restart,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use EngineOrigin as O;
    use EngineStatus as S;

    fn stored(status: EngineStatus, origin: EngineOrigin, live: bool) -> StoredEngine {
        StoredEngine { status, origin, live, scale_in_victim: false, rolled_back: false }
    }

    #[test]
    fn fate_table() {
        let table = [
            (stored(S::Active, O::Dynamic, true), Fate::Adopt),
            (stored(S::Active, O::Dynamic, false), Fate::Restart),
            (stored(S::Failed, O::Initial, false), Fate::Restart),
            (stored(S::Active, O::External, false), Fate::Watch),
            (stored(S::Removing, O::Dynamic, true), Fate::Drop),
            (stored(S::Removed, O::External, false), Fate::Drop),
            (stored(S::Draining, O::Dynamic, true), Fate::Drop),
            (stored(S::Draining, O::Initial, true), Fate::Adopt),
            (StoredEngine { rolled_back: true, ..stored(S::Creating, O::Dynamic, true) }, Fate::Drop),
            (StoredEngine { rolled_back: true, ..stored(S::Creating, O::Initial, false) }, Fate::Restart),
            (StoredEngine { rolled_back: true, ..stored(S::HealthChecking, O::External, false) }, Fate::Drop),
            (StoredEngine { scale_in_victim: true, ..stored(S::Active, O::Dynamic, true) }, Fate::Drop),
        ];
        for (e, want) in table {
            assert_eq!(fate(e), want, "{e:?}");
        }
        assert_eq!(Fate::Watch.restored_status(), Some(S::Unhealthy));
        assert_eq!(Fate::Adopt.restored_status(), Some(S::HealthChecking));
        assert_eq!(Fate::Restart.restored_status(), Some(S::Failed));
    }

    #[test]
    fn an_interrupted_scale_out() {
        let (a, b) = (EngineId::of_seq(0), EngineId::of_seq(1));
        let ids = vec![a.clone(), b.clone()];
        assert_eq!(interrupted_scale_out(&ids, |_| true), InterruptedScaleOut::Complete);
        assert_eq!(
            interrupted_scale_out(&ids, |id| id == "engine_0"),
            InterruptedScaleOut::Fail { kept: vec![a], rolled_back: vec![b] }
        );
        assert_eq!(
            interrupted_scale_out(&ids, |_| false),
            InterruptedScaleOut::Fail { kept: vec![], rolled_back: ids.clone() }
        );
        // Nothing to activate is not a success.
        assert!(matches!(interrupted_scale_out(&[], |_| true), InterruptedScaleOut::Fail { .. }));
        assert_eq!(mid_turn(false, false), MidTurn::No);
        assert_eq!(mid_turn(true, true), MidTurn::HandOver);
        assert_eq!(mid_turn(true, false), MidTurn::Restart);
    }

    proptest! {
        /// An initial engine is dropped only when it was already being removed or a scale-in
        /// chose it; a removed engine never comes back; a kept engine's restored status is one
        /// the engine machine can leave (nothing is restored into REMOVING or REMOVED).
        #[test]
        fn fate_invariants(st in 0usize..11, origin in 0usize..3, live in any::<bool>(), victim in any::<bool>(), rolled in any::<bool>()) {
            let status = EngineStatus::ALL[st];
            let origin = [O::Initial, O::Dynamic, O::External][origin];
            let e = StoredEngine { status, origin, live, scale_in_victim: victim, rolled_back: rolled };
            let f = fate(e);
            if origin == O::Initial && f == Fate::Drop {
                prop_assert!(victim || matches!(status, S::Removing | S::Removed));
            }
            if matches!(status, S::Removing | S::Removed) { prop_assert_eq!(f, Fate::Drop); }
            if let Some(s) = f.restored_status() {
                prop_assert!(!matches!(s, S::Removing | S::Removed));
                prop_assert!(!s.is_routable(), "a restored engine proves itself before it is routed to");
            }
        }
    }
}
