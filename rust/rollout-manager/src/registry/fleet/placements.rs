//! The placements part of the registry (Ray mode): where each managed engine runs, and a
//! revision that every change bumps, so `GET /rollout/placements?after=` can wait for the next
//! one. The only ways to change a placement are the methods below, which all bump it.

use rollout_core::ids::EngineId;
use rollout_core::Placement;
use std::collections::BTreeMap;

/// The placement of every managed engine (and of removed ones until the shim says released),
/// by engine id.
#[derive(Debug, Default)]
pub struct Placements {
    map: BTreeMap<EngineId, Placement>,
    /// Bumped on every placement change.
    revision: u64,
}

impl Placements {
    pub fn get(&self, engine_id: &str) -> Option<&Placement> {
        self.map.get(engine_id)
    }

    /// Every placement, in engine id order.
    pub fn iter(&self) -> impl Iterator<Item = (&EngineId, &Placement)> {
        self.map.iter()
    }

    pub fn values(&self) -> impl Iterator<Item = &Placement> {
        self.map.values()
    }

    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// After a restart: continue past every revision the previous run handed out.
    pub fn continue_after(&mut self, revision: u64) {
        self.revision = self.revision.max(revision);
    }

    /// Sets the placement of its engine (its plan, or one read back from the store).
    pub fn set(&mut self, placement: Placement) {
        self.map.insert(placement.engine_id.clone(), placement);
        self.revision += 1;
    }

    /// Changes the placement of `engine_id` with `f`; false (nothing changed) when it has none.
    pub fn change(&mut self, engine_id: &str, f: impl FnOnce(&mut Placement)) -> bool {
        let Some(p) = self.map.get_mut(engine_id) else { return false };
        f(p);
        self.revision += 1;
        true
    }

    /// Runs `f` on the placement of `engine_id` (None when it has none); `f` says whether it
    /// changed the placement beside what it returns.
    pub fn change_if<R>(&mut self, engine_id: &str, f: impl FnOnce(&mut Placement) -> (R, bool)) -> Option<R> {
        let p = self.map.get_mut(engine_id)?;
        let (out, changed) = f(p);
        if changed {
            self.revision += 1;
        }
        Some(out)
    }

    pub fn contains_key(&self, engine_id: &str) -> bool {
        self.map.contains_key(engine_id)
    }

    /// Changes every placement `f` says it changed (returns true for).
    pub fn change_each(&mut self, mut f: impl FnMut(&EngineId, &mut Placement) -> bool) {
        let mut changed = false;
        for (id, p) in self.map.iter_mut() {
            changed |= f(id, p);
        }
        if changed {
            self.revision += 1;
        }
    }

    /// Forgets the placement of `engine_id`.
    pub fn remove(&mut self, engine_id: &str) -> Option<Placement> {
        let gone = self.map.remove(engine_id);
        if gone.is_some() {
            self.revision += 1;
        }
        gone
    }

    /// The placements the store keeps.
    pub(in crate::registry) fn rows(&self) -> &BTreeMap<EngineId, Placement> {
        &self.map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_change_bumps_the_revision_and_nothing_else_does() {
        let mut p = Placements::default();
        p.set(Placement::plan(&EngineId::of_seq(0), 1, false));
        assert_eq!(p.revision(), 1);
        assert!(p.change("engine_0", |pl| pl.unwant()));
        assert!(!p.change("nobody", |pl| pl.unwant()));
        assert_eq!(p.revision(), 2, "no placement, no change");
        assert_eq!(p.change_if("engine_0", |_| (7, false)), Some(7));
        assert_eq!(p.revision(), 2, "unchanged, not bumped");
        p.change_each(|_, _| false);
        assert_eq!(p.revision(), 2);
        p.change_each(|_, _| true);
        assert_eq!(p.revision(), 3);
        assert!(p.remove("engine_0").is_some() && p.remove("engine_0").is_none());
        assert_eq!(p.revision(), 4);
        p.continue_after(10);
        p.continue_after(3);
        assert_eq!(p.revision(), 10, "a restart never goes back");
    }
}
