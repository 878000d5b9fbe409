//! The long tail of a batch: which running requests the router moves, and where.
//!
//! A batch of rollouts ends unevenly: once the router has nothing left to send, some engines
//! run out of work while others still run several long generations, and the batch lasts as
//! long as the slowest of them. A request that moves (`crate::moves`: aborted where it runs,
//! continued elsewhere from its prompt and output so far) costs one prefill of that context on
//! its new engine and gains the rest of its decode on a less loaded one.
//!
//! [`plan`] decides, from a snapshot of the engines and the movable requests running on each:
//! - nothing while any request waits in the router (a freed slot is better filled with new work
//!   than with moved work);
//! - otherwise, among engines of one group (one weight version: a request never moves across
//!   versions here), while the most loaded engine has at least two requests more than the
//!   least loaded one and that one is under its cap, the request of the most loaded engine
//!   with the most expected work left moves to the least loaded. Every move narrows the gap,
//!   so a plan is finite and a request never moves back by the next plan of the same state;
//! - a request moves only when it is worth its prefill: at least [`MIN_LEFT`] tokens expected
//!   left, and at least one token left for every [`COST_RATIO`] tokens of context the new
//!   engine must prefill (an engine prefills hundreds of tokens in the time one request decodes
//!   one, and the move gains only part of each remaining step), and at most [`MAX_TAIL_MOVES`]
//!   times.
//!
//! Expected work left ([`expected_left`]): the learned length of the request's class (the
//! router's `crate::lengths::LengthEstimator`) less what it produced, and where it already ran
//! past that, as much again as it produced (lengths are heavy-tailed: the longer a generation
//! has run, the longer it is likely to go on); never more than its remaining budget.

/// One movable request running on an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Running {
    /// The caller's handle for it.
    pub key: u64,
    /// Output tokens produced so far (counted, or estimated from how long it ran).
    pub so_far: u64,
    /// Its expected output in all, when the router has learned one for its class.
    pub expected: Option<u64>,
    /// Its output budget in all (`max_new_tokens`).
    pub budget: u64,
    /// Prompt tokens: a move prefills these plus `so_far` again.
    pub prompt: u64,
    /// Times it already moved for the tail.
    pub tail_moves: u32,
}

/// One engine as [`plan`] sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Engine {
    /// Requests in flight on it (movable or not), as the router counts them.
    pub in_flight: usize,
    /// Most requests the router lets it hold.
    pub cap: usize,
    /// Engines of one group may take each other's requests (one weight version).
    pub group: u64,
    /// Its movable requests that may move now.
    pub running: Vec<Running>,
}

/// Move request `key` from engine `from` to engine `to` (indices into [`plan`]'s input).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    pub from: usize,
    pub key: u64,
    pub to: usize,
}

/// Fewest tokens a request must be expected to have left to move.
pub const MIN_LEFT: u64 = 64;

/// A move must expect at least one token left per this many tokens of context it prefills.
pub const COST_RATIO: u64 = 8;

/// Most times one request moves for the tail.
pub const MAX_TAIL_MOVES: u32 = 2;

/// The output a running request is expected to produce from now on (see the module docs).
pub fn expected_left(r: &Running) -> u64 {
    let budget_left = r.budget.saturating_sub(r.so_far);
    let guess = match r.expected {
        Some(e) if e > r.so_far => e - r.so_far,
        _ => r.so_far.max(MIN_LEFT),
    };
    guess.min(budget_left)
}

/// Whether moving `r` is worth the prefill of its context on another engine.
pub fn worth_moving(r: &Running) -> bool {
    let left = expected_left(r);
    r.tail_moves < MAX_TAIL_MOVES
        && left >= MIN_LEFT
        && left.saturating_mul(COST_RATIO) >= r.prompt.saturating_add(r.so_far)
}

/// The moves for the tail, given the engines and how many requests wait in the router.
pub fn plan(engines: &[Engine], waiting: usize) -> Vec<Move> {
    let mut moves = Vec::new();
    if waiting > 0 {
        return moves;
    }
    let mut groups: Vec<u64> = engines.iter().map(|e| e.group).collect();
    groups.sort_unstable();
    groups.dedup();
    let mut counts: Vec<usize> = engines.iter().map(|e| e.in_flight).collect();
    // Each engine's candidates, the most work left last (popped first).
    let mut candidates: Vec<Vec<(u64, u64)>> = engines
        .iter()
        .map(|e| {
            let mut c: Vec<(u64, u64)> =
                e.running.iter().filter(|r| worth_moving(r)).map(|r| (expected_left(r), r.key)).collect();
            c.sort_unstable();
            c
        })
        .collect();
    for group in groups {
        let members: Vec<usize> = (0..engines.len()).filter(|&i| engines[i].group == group).collect();
        loop {
            let from = members.iter().copied().filter(|&i| !candidates[i].is_empty()).max_by_key(|&i| (counts[i], i));
            let to = members.iter().copied().filter(|&i| counts[i] < engines[i].cap).min_by_key(|&i| (counts[i], i));
            let (Some(from), Some(to)) = (from, to) else { break };
            if counts[from] < counts[to] + 2 {
                break;
            }
            let Some((_, key)) = candidates[from].pop() else { break };
            counts[from] -= 1;
            counts[to] += 1;
            moves.push(Move { from, key, to });
        }
    }
    moves
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(key: u64, so_far: u64, expected: Option<u64>) -> Running {
        Running { key, so_far, expected, budget: 4096, prompt: 100, tail_moves: 0 }
    }

    fn engine(in_flight: usize, running: Vec<Running>) -> Engine {
        Engine { in_flight, cap: 32, group: 0, running }
    }

    #[test]
    fn expected_left_table() {
        let cases = [
            // (so_far, expected, budget, left)
            (100, Some(500), 4096, 400),
            (600, Some(500), 4096, 600), // past its class's length: as much again
            (10, None, 4096, 64),        // nothing known, barely started: the floor
            (1000, None, 4096, 1000),
            (4000, None, 4096, 96), // never past the budget
            (4096, Some(5000), 4096, 0),
        ];
        for (so_far, expected, budget, left) in cases {
            let r = Running { key: 0, so_far, expected, budget, prompt: 0, tail_moves: 0 };
            assert_eq!(expected_left(&r), left, "so_far {so_far} expected {expected:?} budget {budget}");
        }
    }

    #[test]
    fn worth_moving_table() {
        let base = Running { key: 0, so_far: 100, expected: Some(1100), budget: 4096, prompt: 100, tail_moves: 0 };
        assert!(worth_moving(&base));
        // Nearly done: not worth a prefill.
        assert!(!worth_moving(&Running { expected: Some(130), ..base }));
        // A huge context for little left: 200 left, 8 * 200 < 3000 + 100.
        assert!(!worth_moving(&Running { prompt: 3000, expected: Some(300), ..base }));
        // Moved often enough.
        assert!(!worth_moving(&Running { tail_moves: MAX_TAIL_MOVES, ..base }));
    }

    #[test]
    fn nothing_moves_while_requests_wait() {
        let engines = vec![engine(5, (0..5).map(|k| req(k, 100, Some(1000))).collect()), engine(0, vec![])];
        assert!(plan(&engines, 1).is_empty());
        assert_eq!(plan(&engines, 0).len(), 2);
    }

    #[test]
    fn the_longest_left_moves_to_the_idlest_engine() {
        let engines = vec![
            engine(4, vec![req(1, 100, Some(300)), req(2, 100, Some(2000)), req(3, 900, None), req(4, 50, Some(200))]),
            engine(3, vec![req(5, 100, Some(3000))]),
            engine(0, vec![]),
        ];
        let moves = plan(&engines, 0);
        // 4/3/0: engine 0's 2 (1900 left) goes to engine 2; then 3/3/1: engine 1's (it has the
        // higher index among the most loaded with candidates) goes too; then 3/2/2: done.
        assert_eq!(moves, vec![Move { from: 0, key: 2, to: 2 }, Move { from: 1, key: 5, to: 2 }]);
    }

    #[test]
    fn a_gap_of_one_moves_nothing() {
        let engines = vec![engine(2, vec![req(1, 100, Some(2000)), req(2, 100, Some(2000))]), engine(1, vec![])];
        assert!(plan(&engines, 0).is_empty());
    }

    #[test]
    fn moves_stay_within_a_group() {
        let mut other = engine(0, vec![]);
        other.group = 7;
        let engines = vec![engine(4, (0..4).map(|k| req(k, 100, Some(1000))).collect()), other];
        assert!(plan(&engines, 0).is_empty());
    }

    #[test]
    fn a_full_engine_takes_nothing() {
        let mut full = engine(2, vec![]);
        full.cap = 2;
        let engines = vec![engine(6, (0..6).map(|k| req(k, 100, Some(1000))).collect()), full];
        assert!(plan(&engines, 0).is_empty());
    }

    #[test]
    fn requests_not_worth_moving_stay() {
        let engines = vec![engine(4, (0..4).map(|k| req(k, 100, Some(120))).collect()), engine(0, vec![])];
        assert!(plan(&engines, 0).is_empty());
    }

    fn engines_strategy() -> impl Strategy<Value = Vec<Engine>> {
        let running = (0u64..3000, proptest::option::of(0u64..4000), 0u64..2000, 0u32..3);
        let eng = (0usize..12, 1usize..16, 0u64..2, proptest::collection::vec(running, 0..12));
        proptest::collection::vec(eng, 1..8).prop_map(|es| {
            let mut key = 0;
            es.into_iter()
                .map(|(extra, cap, group, rs)| {
                    let running: Vec<Running> = rs
                        .into_iter()
                        .map(|(so_far, expected, prompt, tail_moves)| {
                            key += 1;
                            Running { key, so_far, expected, budget: 4096, prompt, tail_moves }
                        })
                        .collect();
                    Engine { in_flight: running.len() + extra, cap, group, running }
                })
                .collect()
        })
    }

    proptest! {
        /// Every move takes a request worth moving from its own engine to a less loaded one of
        /// its group under its cap, each request at most once, and leaves no gap a later plan
        /// of the same counts could close by moving something back.
        #[test]
        fn moves_only_narrow_gaps(engines in engines_strategy()) {
            let moves = plan(&engines, 0);
            let mut counts: Vec<usize> = engines.iter().map(|e| e.in_flight).collect();
            let mut seen = std::collections::HashSet::new();
            for m in &moves {
                prop_assert!(seen.insert(m.key), "request {} moved twice", m.key);
                let r = engines[m.from].running.iter().find(|r| r.key == m.key);
                prop_assert!(r.is_some_and(worth_moving));
                prop_assert_eq!(engines[m.from].group, engines[m.to].group);
                prop_assert!(counts[m.from] >= counts[m.to] + 2);
                prop_assert!(counts[m.to] < engines[m.to].cap);
                counts[m.from] -= 1;
                counts[m.to] += 1;
            }
            let total_before: usize = engines.iter().map(|e| e.in_flight).sum();
            prop_assert_eq!(counts.iter().sum::<usize>(), total_before);
            prop_assert!(moves.len() <= engines.iter().map(|e| e.running.len()).sum::<usize>());
        }

        /// With a request waiting in the router nothing moves.
        #[test]
        fn waiting_requests_stop_every_move(engines in engines_strategy(), waiting in 1usize..100) {
            prop_assert!(plan(&engines, waiting).is_empty());
        }
    }
}
