//! Weights from the trainer: the pure decisions behind a trainer-driven update and behind an
//! engine catching up with a version that has no checkpoint.
//!
//! A trainer update (SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`)
//! puts the trainer at rank 0 of an NCCL group and the engines behind it ([`plan_ranks`]); the
//! group is kept while its members stay the same and rebuilt under a new name when they change
//! ([`reuse_group`]). A version that reached the fleet this way exists only in the engines'
//! memory, so an engine that starts later copies it from a peer that serves it (SGLang's
//! `--load-format remote_instance`); [`pick_seed`] spreads such copies over the peers, since one
//! seed sends to one new engine at a time (a 2-rank group each).

/// Ranks of engines behind the trainer's rank 0: each engine's `rank_offset` (1 plus the TP
/// sizes of the engines before it) and the group's `world_size` (1 plus every TP size).
/// A TP size of 0 counts as 1 (an engine always holds at least one rank).
pub fn plan_ranks(tp_sizes: &[u32]) -> (Vec<u32>, u32) {
    let mut next = 1u32;
    let offsets = tp_sizes
        .iter()
        .map(|tp| {
            let at = next;
            next = next.saturating_add((*tp).max(1));
            at
        })
        .collect();
    (offsets, next)
}

/// Why a fleet cannot fill a group whose world size the trainer fixed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FillError {
    /// The world leaves no rank for an engine (it is 1 or 0).
    NoEngineRanks,
    /// The engines hold fewer ranks than the world leaves them (`have` of `need`).
    TooFew { have: u32, need: u32 },
    /// The engines' ranks, taken in order, step over the world's size: the first `engines`
    /// fill `at` ranks and the next one would pass `need`.
    Uneven { engines: usize, at: u32, need: u32 },
}

/// How many engines, taken in order, fill a group whose `world_size` the trainer fixed
/// (AReaL builds its group once, from its own allocation): their ranks must come to exactly
/// `world_size - 1`, the trainer being rank 0. The engines after them are not members.
pub fn fill_world(tp_sizes: &[u32], world_size: u32) -> Result<usize, FillError> {
    let need = world_size.saturating_sub(1);
    if need == 0 {
        return Err(FillError::NoEngineRanks);
    }
    let mut at = 0u32;
    for (i, tp) in tp_sizes.iter().enumerate() {
        let next = at.saturating_add((*tp).max(1));
        if next > need {
            return Err(FillError::Uneven { engines: i, at, need });
        }
        at = next;
        if at == need {
            return Ok(i + 1);
        }
    }
    Err(FillError::TooFew { have: at, need })
}

/// One member of a weight-update group as the group sees it: engine id, URL, TP size.
pub type Member<'a> = (&'a str, &'a str, u32);

/// Whether an update can use the existing group `current` (name, master address, members in
/// rank order) instead of building a new one: the trainer asks for that group by name
/// (`asked`, None when it holds no group), from the same master address, and the members
/// are exactly the same engines, at the same URLs, with the same TP sizes, in the same order.
pub fn reuse_group(
    current: Option<(&str, &str, &[Member<'_>])>,
    asked: Option<&str>,
    master_address: &str,
    members: &[Member<'_>],
) -> bool {
    match (current, asked) {
        (Some((name, address, had)), Some(asked)) => name == asked && address == master_address && had == members,
        _ => false,
    }
}

/// One engine a new engine could copy its weights from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedCandidate<'a> {
    pub engine_id: &'a str,
    /// Serving now (ACTIVE): a seed must be healthy and verified on its version.
    pub serving: bool,
    /// The version it serves, as last verified.
    pub version: Option<&'a str>,
    pub tp_size: u32,
    /// Engines copying from it right now.
    pub sending: u32,
}

/// The seed for an engine of `tp_size` that must start on `version`: a serving engine on that
/// version with the same TP size (SGLang's remote-instance loader needs the same layout), not
/// one of `tried` (seeds that already failed this engine), sending to the fewest engines now;
/// among equals the first in `candidates` order. None when there is no such engine.
pub fn pick_seed<'a>(candidates: &[SeedCandidate<'a>], version: &str, tp_size: u32, tried: &[&str]) -> Option<&'a str> {
    candidates
        .iter()
        .filter(|c| c.serving && c.version == Some(version) && c.tp_size == tp_size)
        .filter(|c| !tried.contains(&c.engine_id))
        .min_by_key(|c| c.sending)
        .map(|c| c.engine_id)
}

/// A version a trainer put on the engines without the manager (an unmodified slime calling
/// SGLang itself): the fleet takes it as its own once every serving engine reports it. Given the
/// fleet's `current` version, the names the manager already knows (`known`), and what each
/// serving engine reports (`serving`, one entry per ACTIVE engine): the new version when they
/// all report the same one, it is not `current`, and its name is new; else None (no engines, a
/// fleet still in the middle of the trainer's update, or an engine that reports nothing).
pub fn observed_version<'a>(current: &str, known: &[&str], serving: &[Option<&'a str>]) -> Option<&'a str> {
    let first = (*serving.first()?)?;
    let all_same = serving.iter().all(|v| *v == Some(first));
    (all_same && first != current && !known.contains(&first)).then_some(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seed(id: &'static str, version: &'static str, sending: u32) -> SeedCandidate<'static> {
        SeedCandidate { engine_id: id, serving: true, version: Some(version), tp_size: 1, sending }
    }

    #[test]
    fn ranks_follow_sglangs_rule() {
        assert_eq!(plan_ranks(&[]), (vec![], 1));
        assert_eq!(plan_ranks(&[1]), (vec![1], 2));
        assert_eq!(plan_ranks(&[2, 1, 4]), (vec![1, 3, 4], 8));
        assert_eq!(plan_ranks(&[0, 2]), (vec![1, 2], 4), "a TP size of 0 counts as 1");
    }

    proptest! {
        #[test]
        fn ranks_never_overlap_and_fill_the_world(tps in proptest::collection::vec(0u32..16, 0..64)) {
            let (offsets, world) = plan_ranks(&tps);
            let mut next = 1;
            for (off, tp) in offsets.iter().zip(&tps) {
                prop_assert_eq!(*off, next);
                next += (*tp).max(1);
            }
            prop_assert_eq!(world, next);
        }
    }

    #[test]
    fn a_fixed_world_takes_the_first_engines_that_fill_it_exactly() {
        let table: [(&[u32], u32, Result<usize, FillError>); 8] = [
            (&[1, 1, 1], 3, Ok(2)),
            (&[1, 1], 3, Ok(2)),
            (&[2, 2, 2], 5, Ok(2)),
            (&[1], 3, Err(FillError::TooFew { have: 1, need: 2 })),
            (&[], 2, Err(FillError::TooFew { have: 0, need: 1 })),
            (&[2, 2], 4, Err(FillError::Uneven { engines: 1, at: 2, need: 3 })),
            (&[1, 1], 1, Err(FillError::NoEngineRanks)),
            (&[0, 0], 3, Ok(2)),
        ];
        for (i, (tps, world, want)) in table.into_iter().enumerate() {
            assert_eq!(fill_world(tps, world), want, "row {i}");
        }
    }

    proptest! {
        /// When it fills, the members' ranks are exactly the world's engine ranks, and the
        /// plan of those members gives the trainer's world size back.
        #[test]
        fn a_filled_world_is_exact(tps in proptest::collection::vec(0u32..8, 0..32), world in 0u32..64) {
            if let Ok(n) = fill_world(&tps, world) {
                prop_assert!(n >= 1 && n <= tps.len());
                prop_assert_eq!(plan_ranks(&tps[..n]).1, world);
            } else {
                // No prefix of the engines fills it.
                let fits = (1..=tps.len()).any(|n| plan_ranks(&tps[..n]).1 == world);
                prop_assert!(!fits);
            }
        }
    }

    #[test]
    fn the_fleet_takes_a_version_only_when_every_serving_engine_reports_it() {
        let known = ["v0", "v1"];
        let table: [(&[Option<&str>], Option<&str>); 7] = [
            (&[Some("t1"), Some("t1")], Some("t1")),
            (&[Some("t1"), Some("v1")], None),
            (&[Some("t1"), None], None),
            (&[Some("v1"), Some("v1")], None),
            (&[Some("v0"), Some("v0")], None),
            (&[], None),
            (&[Some("t1")], Some("t1")),
        ];
        for (i, (serving, want)) in table.into_iter().enumerate() {
            assert_eq!(observed_version("v1", &known, serving), want, "row {i}");
        }
    }

    #[test]
    fn a_group_is_reused_only_when_nothing_changed() {
        let a: [Member<'_>; 2] = [("e0", "u0", 1), ("e1", "u1", 1)];
        let moved: [Member<'_>; 2] = [("e0", "u0", 1), ("e1", "u9", 1)];
        let current = Some(("g_1", "10.0.0.1", &a[..]));
        let table = [
            (current, Some("g_1"), "10.0.0.1", &a[..], true),
            (current, None, "10.0.0.1", &a[..], false),
            (current, Some("g_0"), "10.0.0.1", &a[..], false),
            (current, Some("g_1"), "10.0.0.2", &a[..], false),
            (current, Some("g_1"), "10.0.0.1", &a[..1], false),
            (current, Some("g_1"), "10.0.0.1", &moved[..], false),
            (None, Some("g_1"), "10.0.0.1", &a[..], false),
        ];
        for (i, (cur, asked, addr, members, want)) in table.into_iter().enumerate() {
            assert_eq!(reuse_group(cur, asked, addr, members), want, "row {i}");
        }
    }

    #[test]
    fn seeds_are_spread_and_failed_ones_skipped() {
        let c = [seed("e0", "v1", 2), seed("e1", "v1", 0), seed("e2", "v0", 0), seed("e3", "v1", 0)];
        assert_eq!(pick_seed(&c, "v1", 1, &[]), Some("e1"), "the least busy, first among equals");
        assert_eq!(pick_seed(&c, "v1", 1, &["e1"]), Some("e3"));
        assert_eq!(pick_seed(&c, "v1", 1, &["e1", "e3"]), Some("e0"));
        assert_eq!(pick_seed(&c, "v1", 1, &["e0", "e1", "e3"]), None);
        assert_eq!(pick_seed(&c, "v2", 1, &[]), None, "nobody serves v2");
        assert_eq!(pick_seed(&c, "v1", 2, &[]), None, "no seed with the same TP size");
        let mut out = c.clone();
        out[1].serving = false;
        out[3].serving = false;
        assert_eq!(pick_seed(&out, "v1", 1, &[]), Some("e0"), "only serving engines are seeds");
    }

    proptest! {
        #[test]
        fn a_burst_spreads_over_every_seed(seeds in 1usize..8, burst in 0usize..64) {
            // Each pick adds one copy to the chosen seed: no seed ever carries two more than another.
            let names: Vec<String> = (0..seeds).map(|i| format!("e{i}")).collect();
            let mut sending = vec![0u32; seeds];
            for _ in 0..burst {
                let c: Vec<SeedCandidate<'_>> = names
                    .iter()
                    .zip(&sending)
                    .map(|(n, s)| SeedCandidate { engine_id: n, serving: true, version: Some("v"), tp_size: 1, sending: *s })
                    .collect();
                let chosen = pick_seed(&c, "v", 1, &[]).unwrap().to_string();
                let i = names.iter().position(|n| *n == chosen).unwrap();
                sending[i] += 1;
            }
            let (lo, hi) = (sending.iter().min().unwrap(), sending.iter().max().unwrap());
            prop_assert!(hi - lo <= 1, "{sending:?}");
        }
    }
}
