//! Which engines a scale-in to a target size removes: a pure rule.

use crate::ids::EngineId;
use crate::state::{EngineOrigin, EngineStatus};

/// An engine as the choice sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub engine_id: EngineId,
    /// Creation order.
    pub seq: u64,
    pub status: EngineStatus,
    pub origin: EngineOrigin,
    /// It holds ranks in a weight-update group the trainer fixed: NCCL cannot fill its place,
    /// so it stays as an initial engine does.
    pub held: bool,
}

/// The engines to remove so that `target` of the live ones remain (engines already REMOVING
/// or REMOVED do not count). Initial and held engines are never chosen; engines that serve
/// nothing (FAILED, UNHEALTHY, still starting) go first, then the newest (LIFO). Fewer are
/// chosen when only initial or held engines would be left to take.
pub fn victims(engines: &[Candidate], target: u32) -> Vec<EngineId> {
    let live: Vec<&Candidate> =
        engines.iter().filter(|e| !matches!(e.status, EngineStatus::Removing | EngineStatus::Removed)).collect();
    let excess = live.len().saturating_sub(target as usize);
    let mut removable: Vec<&Candidate> =
        live.into_iter().filter(|e| e.origin != EngineOrigin::Initial && !e.held).collect();
    removable.sort_by_key(|e| (e.status == EngineStatus::Active, std::cmp::Reverse(e.seq)));
    removable.into_iter().take(excess).map(|e| e.engine_id.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use EngineOrigin as O;
    use EngineStatus as S;

    fn engine(seq: u64, status: EngineStatus, origin: EngineOrigin) -> Candidate {
        Candidate { engine_id: EngineId::of_seq(seq), seq, status, origin, held: false }
    }

    #[test]
    fn newest_first_after_the_ones_that_serve_nothing() {
        let fleet = [
            engine(0, S::Active, O::Initial),
            engine(1, S::Active, O::Dynamic),
            engine(2, S::Active, O::Dynamic),
            engine(3, S::Failed, O::Dynamic),
            engine(4, S::Removing, O::Dynamic),
            engine(5, S::Active, O::External),
        ];
        // Five live engines.
        assert_eq!(victims(&fleet, 5), Vec::<EngineId>::new());
        assert_eq!(victims(&fleet, 4), ["engine_3"]);
        assert_eq!(victims(&fleet, 3), ["engine_3", "engine_5"]);
        assert_eq!(victims(&fleet, 1), ["engine_3", "engine_5", "engine_2", "engine_1"]);
        // The initial engine stays even below the target.
        assert_eq!(victims(&fleet, 0), ["engine_3", "engine_5", "engine_2", "engine_1"]);
    }

    #[test]
    fn an_engine_held_by_the_trainers_group_stays() {
        let mut fleet =
            vec![engine(0, S::Active, O::Initial), engine(1, S::Active, O::Dynamic), engine(2, S::Active, O::Dynamic)];
        fleet[2].held = true;
        assert_eq!(victims(&fleet, 2), ["engine_1"]);
        assert_eq!(victims(&fleet, 1), ["engine_1"], "only the engine nobody holds goes");
    }

    fn arb_engine() -> impl Strategy<Value = (EngineStatus, EngineOrigin, bool)> {
        (
            proptest::sample::select(EngineStatus::ALL.to_vec()),
            proptest::sample::select(vec![O::Initial, O::Dynamic, O::External]),
            proptest::bool::weighted(0.2),
        )
    }

    proptest! {
        /// Never an initial, held, removing or removed engine; never more than the excess; exactly
        /// the excess when enough engines can go; everything chosen that serves nothing comes
        /// before anything ACTIVE.
        #[test]
        fn victims_keep_the_rules(parts in proptest::collection::vec(arb_engine(), 0..24), target in 0u32..24) {
            let fleet: Vec<Candidate> =
                parts.iter().enumerate().map(|(i, (s, o, h))| Candidate { held: *h, ..engine(i as u64, *s, *o) }).collect();
            let chosen = victims(&fleet, target);
            let by_id = |id: &str| fleet.iter().find(|e| e.engine_id == id).cloned();
            let live = fleet.iter().filter(|e| !matches!(e.status, S::Removing | S::Removed)).count();
            let removable = fleet
                .iter()
                .filter(|e| !matches!(e.status, S::Removing | S::Removed) && e.origin != O::Initial && !e.held)
                .count();
            let excess = live.saturating_sub(target as usize);
            prop_assert_eq!(chosen.len(), excess.min(removable));
            let mut seen_active = false;
            for id in &chosen {
                let e = by_id(id).ok_or_else(|| TestCaseError::fail("unknown id"))?;
                prop_assert!(e.origin != O::Initial && !e.held);
                prop_assert!(!matches!(e.status, S::Removing | S::Removed));
                if e.status == S::Active {
                    seen_active = true;
                } else {
                    prop_assert!(!seen_active, "{} serves nothing but came after an ACTIVE one", id);
                }
            }
        }
    }
}
