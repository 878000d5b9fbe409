use super::*;
use proptest::prelude::*;

#[test]
fn a_class_predicts_its_waiting_siblings() {
    let mut e = LengthEstimator::new(100);
    // Nothing seen: no prediction; the budget is all there is.
    assert_eq!(e.predict(Some(1), 4096), None);
    assert_eq!(e.expected(Some(1), 4096), 4096);
    e.observe(Some(1), 4096, 100, 1000);
    // One sibling and the fleet mean (the same answer): 1000.
    assert_eq!(e.predict(Some(1), 4096), Some(1000));
    e.observe(Some(2), 4096, 100, 200);
    // Class 1: (1000 + fleet mean 600) / 2; class 2: (200 + 600) / 2.
    assert_eq!(e.predict(Some(1), 4096), Some(800));
    assert_eq!(e.predict(Some(2), 4096), Some(400));
    // Never above the budget.
    assert_eq!(e.predict(Some(1), 300), Some(300));
    // An unseen class is expected at the fleet mean for KV, but is not predicted.
    assert_eq!(e.predict(Some(3), 4096), None);
    assert_eq!(e.expected(Some(3), 4096), 600);
    assert_eq!(e.expected(None, 4096), 600);
    assert_eq!(e.mean_footprint(), Some(700));
}

#[test]
fn members_still_generating_raise_their_class() {
    let mut e = LengthEstimator::new(100);
    // Five siblings start at 0; a fast one ends at 1 s with 100 tokens (100 tokens/s).
    for _ in 0..5 {
        e.started(Some(1), 0.0);
    }
    e.set_now(1.0);
    e.observe(Some(1), 4096, 0, 100);
    e.ended(Some(1), 0.0, Some(100));
    assert_eq!(e.class(1).map(|s| s.running), Some(4));
    // At 1 s the four running ones have at least 100 tokens: no more than the finished mean.
    assert_eq!(e.predict(Some(1), 4096), Some(100));
    // At 10 s they have at least 1000 each: (100 + 100 + 4 x 1000) / 6.
    e.set_now(10.0);
    assert_eq!(e.predict(Some(1), 4096), Some(700));
    // A running member counts at most at the budget; the clock never goes back.
    assert_eq!(e.predict(Some(1), 500), Some(367));
    e.set_now(2.0);
    assert_eq!(e.predict(Some(1), 4096), Some(700));
    // Members that end unanswered leave the running count; a class never finished is unknown.
    for _ in 0..4 {
        e.ended(Some(1), 0.0, None);
    }
    e.ended(Some(1), 0.0, None); // one too many: ignored
    assert_eq!(e.class(1).map(|s| (s.running, s.started_sum)), Some((0, 0.0)));
    assert_eq!(e.predict(Some(1), 4096), Some(100));
    // A class with a member generating and none finished: the fleet mean (100), and that
    // member at what it generated at least (6 s at 100 tokens/s).
    e.started(Some(2), 9.0);
    e.set_now(15.0);
    assert_eq!(e.predict(Some(2), 4096), Some(350));
}

#[test]
fn informative_budgets_win_over_predictions() {
    let mut e = LengthEstimator::new(100);
    for (class, len) in [(1, 300), (1, 50), (2, 900)] {
        e.observe(Some(class), len, 10, len);
    }
    assert!(e.budgets_are_lengths());
    assert_eq!(e.predict(Some(1), 2000), None);
    assert_eq!(e.expected(Some(1), 2000), 2000);
    assert_eq!(e.queue_priority(Some(1), 2000, false), 2000);
}

#[test]
fn queue_priority_table() {
    let mut e = LengthEstimator::new(100);
    e.observe(Some(7), 4096, 0, 100); // a short group
    e.observe(Some(8), 4096, 0, 3000); // a long group
                                       // (class, budget, session) -> priority
    let table = [
        ((Some(8), 4096, false), 2275),                // (3000 + mean 1550) / 2
        ((Some(7), 4096, false), 825),                 // (100 + 1550) / 2
        ((Some(9), 4096, false), 4096 | UNKNOWN_TIER), // unknown: above the known, by budget
        ((None, 4096, false), 4096 | UNKNOWN_TIER),    // no class
        ((Some(7), 50, false), 50),                    // capped by its budget
        ((Some(7), 4096, true), 825 | 1 << 63),        // session turns above all
    ];
    for ((class, budget, session), want) in table {
        assert_eq!(e.queue_priority(class, budget, session), want, "{class:?} {budget} {session}");
    }
    assert!(e.queue_priority(Some(8), 4096, false) > e.queue_priority(Some(7), 4096, false));
    // Before any answer: the budget.
    assert_eq!(LengthEstimator::new(10).queue_priority(Some(8), 4096, false), 4096 | UNKNOWN_TIER);
    // A class with members generating but none finished is still unknown.
    let mut e = LengthEstimator::new(10);
    e.started(Some(1), 0.0);
    e.observe(Some(2), 4096, 0, 100);
    assert_eq!(e.queue_priority(Some(1), 4096, false), 4096 | UNKNOWN_TIER);
    assert_eq!(e.queue_priority(Some(2), 4096, false), 100);
}

#[test]
fn memory_is_bounded_by_two_generations() {
    let mut e = LengthEstimator::new(2);
    e.observe(Some(1), 0, 0, 10);
    e.observe(Some(2), 0, 0, 10);
    e.observe(Some(3), 0, 0, 10); // 1 and 2 move to the previous generation
    assert!(e.class(1).is_some());
    e.observe(Some(1), 0, 0, 30); // seen again: carried into the current generation
    assert_eq!(e.class(1), Some(ClassStats { count: 2, sum: 40, max: 30, ..ClassStats::default() }));
    e.observe(Some(4), 0, 0, 10); // current {3, 1} was full: {3, 1} becomes previous
    e.observe(Some(5), 0, 0, 10); // current {4, 5}
    e.observe(Some(6), 0, 0, 10); // {4, 5} previous: 1, 2 and 3 are forgotten
    assert_eq!(e.class(2), None);
    assert_eq!(e.class(3), None);
    assert!(e.classes() <= 4);
}

#[test]
fn fleet_means_become_moving_averages() {
    let mut e = LengthEstimator::new(10);
    for _ in 0..1000 {
        e.observe(None, 0, 0, 100);
    }
    for _ in 0..2000 {
        e.observe(None, 0, 0, 1000);
    }
    // Recent answers dominate.
    assert!(e.mean_output().is_some_and(|m| m > 990), "{:?}", e.mean_output());
}

#[test]
fn auto_cap_table() {
    let r = |pool, running, max_running| EngineReport { pool_tokens: pool, running, max_running };
    let table = [
        // (report, footprint) -> cap
        ((r(16384, 0, 1024), None), 32),             // cold: the prior footprint of 512
        ((r(16384, 0, 1024), Some(700)), 23),        // the pool at the learned footprint
        ((r(16384, 30, 1024), Some(700)), 37),       // running more than that: running + a quarter
        ((r(163_840, 0, 1024), Some(700)), 234),     // a bigger engine gets a bigger cap
        ((r(163_840, 0, 48), Some(700)), 50),        // but not past its own running limit (+ margin)
        ((r(1000, 0, 0), Some(5000)), MIN_AUTO_CAP), // tiny pool: the floor
        ((r(0, 0, 0), Some(700)), 16),               // not reported yet: the fallback
    ];
    for ((report, footprint), want) in table {
        assert_eq!(auto_inflight_cap(report, footprint, 16), want, "{report:?} {footprint:?}");
    }
}

proptest! {
    /// Any sequence of observations: predictions never exceed the budget, memory stays bounded,
    /// nothing overflows or panics.
    #[test]
    fn predictions_stay_within_budget(
        obs in proptest::collection::vec((0u64..20, any::<u64>(), any::<u64>(), any::<u64>(), 0u8..3, -1e3f64..1e6), 0..200),
        budget in any::<u64>(),
        class in 0u64..25,
    ) {
        let mut e = LengthEstimator::new(8);
        for (c, b, p, o, what, t) in obs {
            match what {
                0 => e.observe(Some(c), b, p, o),
                1 => e.started(Some(c), t),
                _ => {
                    e.set_now(t);
                    e.ended(Some(c), t / 2.0, Some(o));
                }
            }
        }
        prop_assert!(e.classes() <= 16);
        if let Some(p) = e.predict(Some(class), budget) {
            prop_assert!(p <= budget);
        }
        prop_assert!(e.expected(Some(class), budget) <= budget);
    }

    /// Any report: a cap within [MIN_AUTO_CAP, max(...)], never a panic.
    #[test]
    fn auto_cap_is_bounded(pool in any::<u64>(), running in any::<u64>(), max_running in any::<u64>(),
                           footprint in proptest::option::of(any::<u64>())) {
        let cap = auto_inflight_cap(EngineReport { pool_tokens: pool, running, max_running }, footprint, 32);
        prop_assert!(cap >= MIN_AUTO_CAP);
    }
}

#[test]
fn a_continuation_queues_under_the_output_it_has_left() {
    let mut e = LengthEstimator::new(100);
    e.observe(Some(7), 4096, 0, 100); // a short group: 825 predicted (with the fleet mean)
    e.observe(Some(8), 4096, 0, 3000); // a long group: 2275
                                       // (class, budget, so_far, session) -> priority
    let table = [
        ((Some(8), 4096, 256, false), (2275 - 256) | CONTINUING_TIER), // its class's prediction, less its output
        ((Some(7), 4096, 256, false), (825 - 256) | CONTINUING_TIER),
        ((Some(7), 4096, 1024, false), 1024 | CONTINUING_TIER), // past its class: as much again
        ((Some(7), 4096, 4000, false), 96 | CONTINUING_TIER),   // never beyond its budget
        ((Some(9), 4096, 512, false), 512 | CONTINUING_TIER),   // unknown class: as much again
        ((Some(7), 4096, 1024, true), 1024 | CONTINUING_TIER | 1 << 63), // session turns above all
        ((Some(7), 4096, 4096, false), 1 | CONTINUING_TIER),    // nothing left: the floor
    ];
    for ((class, budget, so_far, session), want) in table {
        assert_eq!(e.continuation_priority(class, budget, so_far, session), want, "{class:?} {so_far}");
    }
    // A started request goes on before any that has not, of a known class or not, but not
    // before a session's turn.
    let least = e.continuation_priority(Some(7), 4096, 4096, false);
    assert!(least > e.queue_priority(Some(8), 4096, false));
    assert!(least > e.queue_priority(Some(9), 4096, false));
    assert!(least < e.queue_priority(Some(7), 10, true));
    // Informative budgets: the rest of the budget.
    let mut exact = LengthEstimator::new(100);
    for len in [300, 50, 900] {
        exact.observe(Some(1), len, 10, len);
    }
    assert_eq!(exact.continuation_priority(Some(1), 2000, 512, false), 1488);
    assert!(exact.continuation_priority(Some(1), 2000, 512, false) < exact.queue_priority(Some(1), 1500, false));
}
