//! The long tail of a batch: which running requests the router moves, and where ([`plan`]),
//! and which it sends back to its queue to make room for much longer ones ([`preempt`]).
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
//!   versions here), while the most loaded engine holds at least twice the requests of the
//!   least loaded one plus two, and that one is under its cap, the request of the most loaded
//!   engine with the most expected work left moves to the least loaded. Engines that are about
//!   equally busy keep their requests: a request decodes barely faster in a batch a little
//!   smaller, and its prefill stalls the batch it joins. Every move narrows the gap, so a plan
//!   is finite and a request never moves back by the next plan of the same state;
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
    /// Whether that expectation rests on finished answers of its class (not only on how long
    /// its running members have run).
    pub known: bool,
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

/// Whether an engine running `from` requests should give one to an engine running `to`.
pub fn wide_gap(from: usize, to: usize) -> bool {
    from >= 2 * to + 2
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
            if !wide_gap(counts[from], counts[to]) {
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

/// A waiting request's output must be expected at least this many times a running request's
/// expected output left for that one to make room for it ([`preempt`]).
pub const PREEMPT_FACTOR: u64 = 2;

/// The running requests to stop and send back to the router's queue so that waiting requests
/// expected to be much longer start now ("preempt"), given the engines and the expected output
/// of the first requests waiting in the router, in queue order.
///
/// Longest-first ordering starts the groups known to be long first, but it learns which groups
/// are long while every slot is taken, and a long request that waits for a slot ends the batch
/// late. A running request whose expected output left ([`expected_left`]: a request that ran
/// past its class's length is expected to go on as long again, so the long member of a short
/// class is not the one to stop) is at most 1/[`PREEMPT_FACTOR`] of a waiting one's expected
/// output gives up its slot: it is aborted, keeps its output so far, waits in the queue
/// under its own expected length, and continues from where it stopped (a move) when a slot
/// frees. Nothing is preempted while any engine has a free slot (the waiting request takes it),
/// a request is chosen only when its class's length is learned from answers (`known`), when it is worth
/// moving ([`worth_moving`]), and the least work left goes first; each waiting request takes
/// at most one.
pub fn preempt(engines: &[Engine], waiting: &[u64]) -> Vec<(usize, u64)> {
    let mut chosen = Vec::new();
    if waiting.is_empty() || engines.iter().any(|e| e.in_flight < e.cap) {
        return chosen;
    }
    let mut victims: Vec<(u64, usize, u64)> = engines
        .iter()
        .enumerate()
        .flat_map(|(i, e)| {
            e.running.iter().filter(|r| r.known && worth_moving(r)).map(move |r| (expected_left(r), i, r.key))
        })
        .collect();
    // The shortest expected last (popped first).
    victims.sort_unstable_by(|a, b| b.cmp(a));
    for &w in waiting {
        match victims.last() {
            Some(&(p, i, key)) if p.saturating_mul(PREEMPT_FACTOR) <= w => {
                victims.pop();
                chosen.push((i, key));
            }
            _ => break,
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(key: u64, so_far: u64, expected: Option<u64>) -> Running {
        Running { key, so_far, expected, known: expected.is_some(), budget: 4096, prompt: 100, tail_moves: 0 }
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
            let r = Running { key: 0, so_far, expected, known: true, budget, prompt: 0, tail_moves: 0 };
            assert_eq!(expected_left(&r), left, "so_far {so_far} expected {expected:?} budget {budget}");
        }
    }

    #[test]
    fn worth_moving_table() {
        let base = Running {
            key: 0,
            so_far: 100,
            expected: Some(1100),
            known: true,
            budget: 4096,
            prompt: 100,
            tail_moves: 0,
        };
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
        // higher index among the most loaded with candidates) is not twice 1 plus 2: done.
        assert_eq!(moves, vec![Move { from: 0, key: 2, to: 2 }]);
    }

    #[test]
    fn a_gap_of_one_moves_nothing() {
        let engines = vec![engine(2, vec![req(1, 100, Some(2000)), req(2, 100, Some(2000))]), engine(1, vec![])];
        assert!(plan(&engines, 0).is_empty());
    }

    #[test]
    fn wide_gap_table() {
        for (from, to, wide) in
            [(2, 0, true), (1, 0, false), (3, 1, false), (4, 1, true), (20, 17, false), (20, 9, true)]
        {
            assert_eq!(wide_gap(from, to), wide, "{from} -> {to}");
        }
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

    #[test]
    fn preempt_table() {
        let full = |running: Vec<Running>| Engine { in_flight: 2, cap: 2, group: 0, running };
        let short = req(1, 100, Some(300));
        let long = req(2, 100, Some(2000));
        let unknown = req(3, 100, None);
        // A waiting request six times the short one's work left (200) takes its slot.
        assert_eq!(preempt(&[full(vec![short, long])], &[1200]), vec![(0, 1)]);
        // Not twice its work left: nothing.
        assert!(preempt(&[full(vec![short, long])], &[300]).is_empty());
        // A free slot somewhere: the waiting request takes that instead.
        let mut roomy = full(vec![]);
        roomy.in_flight = 1;
        assert!(preempt(&[full(vec![short, long]), roomy], &[1200]).is_empty());
        // A member of a short class that already ran long: expected to go on, not a victim.
        let ran_long = req(5, 900, Some(300));
        assert!(preempt(&[full(vec![ran_long, long])], &[1200]).is_empty());
        // Lengths unknown, or guessed only from running members: never a victim.
        assert!(preempt(&[full(vec![unknown, long])], &[1200]).is_empty());
        let guessed = Running { known: false, ..short };
        assert!(preempt(&[full(vec![guessed, long])], &[1200]).is_empty());
        // Three waiting, two victims fit: the least work left goes first, across engines.
        let other = req(4, 100, Some(200));
        assert_eq!(preempt(&[full(vec![short]), full(vec![other])], &[1200, 1000, 10]), vec![(1, 4), (0, 1)]);
        // Nothing waits: nothing.
        assert!(preempt(&[full(vec![short])], &[]).is_empty());
    }

    fn engines_strategy() -> impl Strategy<Value = Vec<Engine>> {
        let running = (0u64..3000, proptest::option::of(0u64..4000), 0u64..2000, 0u32..3, any::<bool>());
        let eng = (0usize..12, 1usize..16, 0u64..2, proptest::collection::vec(running, 0..12));
        proptest::collection::vec(eng, 1..8).prop_map(|es| {
            let mut key = 0;
            es.into_iter()
                .map(|(extra, cap, group, rs)| {
                    let running: Vec<Running> = rs
                        .into_iter()
                        .map(|(so_far, expected, prompt, tail_moves, known)| {
                            key += 1;
                            Running { key, so_far, expected, known, budget: 4096, prompt, tail_moves }
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
                prop_assert!(wide_gap(counts[m.from], counts[m.to]));
                prop_assert!(counts[m.to] < engines[m.to].cap);
                counts[m.from] -= 1;
                counts[m.to] += 1;
            }
            let total_before: usize = engines.iter().map(|e| e.in_flight).sum();
            prop_assert_eq!(counts.iter().sum::<usize>(), total_before);
            prop_assert!(moves.len() <= engines.iter().map(|e| e.running.len()).sum::<usize>());
        }

        /// Preemption chooses each running request at most once, only ones worth moving with a
        /// known length at most 1/PREEMPT_FACTOR of the waiting request it makes room for, never
        /// more than wait, and only when every engine is full.
        #[test]
        fn preemption_is_bounded(engines in engines_strategy(), waiting in proptest::collection::vec(0u64..8000, 0..10)) {
            let mut waiting = waiting;
            waiting.sort_unstable_by(|a, b| b.cmp(a));
            let chosen = preempt(&engines, &waiting);
            prop_assert!(chosen.len() <= waiting.len());
            if !chosen.is_empty() {
                prop_assert!(engines.iter().all(|e| e.in_flight >= e.cap));
            }
            let mut seen = std::collections::HashSet::new();
            for (&(i, key), &w) in chosen.iter().zip(&waiting) {
                prop_assert!(seen.insert(key));
                let r = engines[i].running.iter().find(|r| r.key == key);
                prop_assert!(r.is_some_and(|r| r.known && worth_moving(r) && expected_left(r) * PREEMPT_FACTOR <= w));
            }
        }

        /// With a request waiting in the router nothing moves.
        #[test]
        fn waiting_requests_stop_every_move(engines in engines_strategy(), waiting in 1usize..100) {
            prop_assert!(plan(&engines, waiting).is_empty());
        }
    }
}
