//! The router's wait queue for engine slots (`--max-inflight-per-engine`).
//!
//! A request that finds every engine at its cap takes a [`Ticket`] and waits. Tickets are
//! ordered by `--queue-order`: arrival (`fifo`), or `longest_first` (the default): turns of
//! multi-turn sessions (requests with a session key) before one-shot requests, since the
//! session's next turn cannot start until this one ends, then the expected output length,
//! largest first, then how many siblings (requests of the same class: session or prompt) were
//! already waiting when it joined, then arrival. The expected length is the output budget
//! (`max_new_tokens`) until the router has seen answers of the request's class; then it is
//! what [`LengthEstimator::queue_priority`] predicts from them (its finished members, and how
//! long its running ones have been generating), and waiting requests move in the queue when an
//! answer ends ([`SlotQueue::ended`]: every waiter while at most [`REKEY_ALL_BELOW`] wait, else
//! those of its class) and, as running members age, every [`REKEY_EVERY`]. So for GRPO groups
//! that all ask for the same budget, one request of every group starts first (the sibling
//! rank), the groups whose first answers came back long go next, and the groups known to be
//! short are left for the end of the batch.
//!
//! When a request ends somewhere, [`SlotQueue::wake_next`] wakes the first ticket not already
//! woken, so freed slots go out in queue order, one wake per slot. A woken request that takes a
//! slot and sees another still free wakes the next one (a joining engine frees several at once);
//! one that cannot use any free slot (its weight-version pin excludes those engines) passes its
//! wake to the ticket behind it; one that leaves while woken (timeout, client gone) passes it on
//! too. Wake-ups that race are not lost: the router's waiters also re-check on every
//! routing-table change and every 50 ms, and then only the head of the queue proceeds, so order
//! holds.
//!
//! Longest-first is list scheduling by decreasing size: for a batch of rollouts submitted at
//! once it starts the long generations first, so the batch does not end with one engine
//! grinding through a long request that started late. The price is that short requests wait
//! behind long ones (at most `--request-timeout-secs`); use `fifo` for interactive traffic.
//!
//! The queue also owns the router's [`LengthEstimator`] (every answer is observed, with or
//! without a cap): the KV estimate of a request and the automatic per-engine cap read it.

use crate::foundation::locks::Locked;
use rollout_core::lengths::LengthEstimator;
use rollout_core::routing::QueueOrder;
use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;

/// Queue position: larger priority first, then fewer siblings already waiting, then arrival
/// (the arrival number also identifies the ticket).
type Key = (Reverse<u64>, u32, u64);

/// Classes the length estimator remembers per generation.
const LENGTH_CLASSES: usize = 100_000;

/// How often every waiting request's place is recomputed (predictions grow while a class's
/// members keep generating).
pub const REKEY_EVERY: f64 = 0.1;

/// Up to this many waiting requests, every answer recomputes every waiter's place; above it,
/// only its class's, and the others every [`REKEY_EVERY`].
pub const REKEY_ALL_BELOW: usize = 1024;

/// An answer, as the length estimator learns from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Answer {
    /// The request's output budget.
    pub budget: u64,
    /// Its prompt tokens.
    pub prompt: u64,
    /// Its output tokens.
    pub output: u64,
}

#[derive(Debug)]
struct Waiter {
    key: Key,
    notify: Arc<Notify>,
    woken: bool,
    class: Option<u64>,
    budget: u64,
    session: bool,
    so_far: Option<u64>,
}

#[derive(Debug)]
struct Inner {
    order: BTreeMap<Key, u64>,
    waiters: HashMap<u64, Waiter>,
    lengths: LengthEstimator,
    /// When every waiter's place was last recomputed (seconds on the queue's clock).
    rekeyed: f64,
}

impl Inner {
    /// Recomputes the place of the waiters of `class` (every waiter with None).
    fn rekey(&mut self, order: QueueOrder, class: Option<u64>) {
        if order != QueueOrder::LongestFirst {
            return;
        }
        let lengths = &self.lengths;
        let mut moved = Vec::new();
        for w in self.waiters.values_mut().filter(|w| class.is_none() || w.class == class) {
            let priority = match w.so_far {
                Some(n) => lengths.continuation_priority(w.class, w.budget, n, w.session),
                None => lengths.queue_priority(w.class, w.budget, w.session),
            };
            let key = (Reverse(priority), w.key.1, w.key.2);
            if key != w.key {
                moved.push((w.key, key));
                w.key = key;
            }
        }
        for (old, _) in &moved {
            self.order.remove(old);
        }
        for (_, new) in moved {
            self.order.insert(new, new.2);
        }
    }

    /// Recomputes every waiter's place if the last time was [`REKEY_EVERY`] ago.
    fn rekey_if_stale(&mut self, order: QueueOrder, now: f64) {
        if now - self.rekeyed >= REKEY_EVERY {
            self.rekeyed = now;
            self.lengths.set_now(now);
            self.rekey(order, None);
        }
    }

    fn wake_first(&mut self, from: Bound<Key>) {
        for id in self.order.range((from, Bound::Unbounded)).map(|(_, id)| *id) {
            if let Some(w) = self.waiters.get_mut(&id) {
                if !w.woken {
                    w.woken = true;
                    w.notify.notify_one();
                    return;
                }
            }
        }
    }
}

/// One waiting request, as [`SlotQueue::join`] takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Joining {
    /// Its class (session key, else prompt hash), for learned lengths.
    pub class: Option<u64>,
    /// Its output budget in tokens.
    pub budget: u64,
    /// Whether it is a turn of a multi-turn session.
    pub session: bool,
    /// The output it already produced, when it continues a request generated in chunks: it
    /// waits under the output it is expected to have left
    /// (`LengthEstimator::continuation_priority`), not as a new request.
    pub so_far: Option<u64>,
}

#[derive(Debug)]
pub struct SlotQueue {
    order: QueueOrder,
    seq: AtomicU64,
    inner: Mutex<Inner>,
    /// The length estimator's clock.
    epoch: tokio::time::Instant,
}

impl SlotQueue {
    pub fn new(order: QueueOrder) -> Self {
        let inner = Inner {
            order: BTreeMap::new(),
            waiters: HashMap::new(),
            lengths: LengthEstimator::new(LENGTH_CLASSES),
            rekeyed: 0.0,
        };
        Self { order, seq: AtomicU64::new(0), inner: Mutex::new(inner), epoch: tokio::time::Instant::now() }
    }

    /// Seconds since the queue was made (the length estimator's clock).
    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing panics while holding it; recover a poisoned lock anyway.
        self.inner.locked()
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.lock().order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn priority(&self, lengths: &mut LengthEstimator, r: &Joining) -> u64 {
        lengths.set_now(self.now());
        match self.order {
            QueueOrder::Fifo => 0,
            QueueOrder::LongestFirst => match r.so_far {
                Some(n) => lengths.continuation_priority(r.class, r.budget, n, r.session),
                None => lengths.queue_priority(r.class, r.budget, r.session),
            },
        }
    }

    /// Queues a request.
    pub fn join(self: &Arc<Self>, r: Joining) -> Ticket {
        let id = self.seq.fetch_add(1, Ordering::Relaxed);
        let notify = Arc::new(Notify::new());
        let mut inner = self.lock();
        let rank = match (self.order, r.class) {
            (QueueOrder::LongestFirst, Some(c)) => {
                let n = inner.waiters.values().filter(|w| w.class == Some(c)).count();
                u32::try_from(n).unwrap_or(u32::MAX)
            }
            _ => 0,
        };
        let key = (Reverse(self.priority(&mut inner.lengths, &r)), rank, id);
        inner.order.insert(key, id);
        let waiter = Waiter {
            key,
            notify: notify.clone(),
            woken: false,
            class: r.class,
            budget: r.budget,
            session: r.session,
            so_far: r.so_far,
        };
        inner.waiters.insert(id, waiter);
        Ticket { queue: self.clone(), id, notify }
    }

    /// A slot freed: wakes the first waiter that is not already woken.
    pub fn wake_next(&self) {
        let now = self.now();
        let mut inner = self.lock();
        inner.rekey_if_stale(self.order, now);
        inner.wake_first(Bound::Unbounded);
    }

    /// A request of `class` was sent to an engine; returns when, for [`Self::ended`].
    pub fn started(&self, class: Option<u64>) -> f64 {
        let now = self.now();
        let mut inner = self.lock();
        inner.lengths.set_now(now);
        inner.lengths.started(class, now);
        now
    }

    /// A request of `class` sent at `at` ended, with `answer` if it answered: learn from it,
    /// and move the waiting requests of its class to their new places.
    pub fn ended(&self, class: Option<u64>, at: f64, answer: Option<Answer>) {
        let now = self.now();
        let mut inner = self.lock();
        inner.lengths.set_now(now);
        if let Some(a) = answer {
            inner.lengths.observe(class, a.budget, a.prompt, a.output);
        }
        inner.lengths.ended(class, at, answer.map(|a| a.output));
        if answer.is_some() && inner.waiters.len() <= REKEY_ALL_BELOW {
            // The fleet-wide mean moved too: every prediction may have changed.
            inner.rekey(self.order, None);
        } else if answer.is_some() && class.is_some() {
            inner.rekey(self.order, class);
        }
        inner.rekey_if_stale(self.order, now);
    }

    /// The expected output of the first `n` waiting requests, in queue order, for preemption
    /// (`rollout_core::tail::preempt`): only under `longest_first`, only requests whose length
    /// the router predicts from their class, and not session turns (they already go first).
    pub fn waiting_expected(&self, n: usize) -> Vec<u64> {
        if self.order != QueueOrder::LongestFirst {
            return Vec::new();
        }
        let inner = self.lock();
        inner
            .order
            .values()
            .filter_map(|id| inner.waiters.get(id))
            .filter(|w| !w.session)
            .filter_map(|w| inner.lengths.predict(w.class, w.budget))
            .take(n)
            .collect()
    }

    /// Reads the length estimator.
    pub fn lengths<T>(&self, f: impl FnOnce(&LengthEstimator) -> T) -> T {
        f(&self.lock().lengths)
    }
}

/// A request's place in the queue.
#[derive(Debug)]
pub struct Ticket {
    queue: Arc<SlotQueue>,
    id: u64,
    notify: Arc<Notify>,
}

impl Ticket {
    /// Waits for a wake and takes it (a wake sent while not waiting is kept, so none is lost).
    pub async fn woken(&self) {
        self.notify.notified().await;
        if let Some(w) = self.queue.lock().waiters.get_mut(&self.id) {
            w.woken = false;
        }
    }

    /// Whether this ticket is first in the queue.
    pub fn is_head(&self) -> bool {
        self.queue.lock().order.values().next() == Some(&self.id)
    }

    /// This request cannot use the free slot it was woken for: wake the first ticket behind it.
    pub fn pass_on(&self) {
        let mut inner = self.queue.lock();
        if let Some(key) = inner.waiters.get(&self.id).map(|w| w.key) {
            inner.wake_first(Bound::Excluded(key));
        }
    }
}

impl Drop for Ticket {
    /// Leaves the queue; a wake sent to it and not taken goes to the next waiter.
    fn drop(&mut self) {
        let mut inner = self.queue.lock();
        if let Some(w) = inner.waiters.remove(&self.id) {
            inner.order.remove(&w.key);
            if w.woken {
                inner.wake_first(Bound::Unbounded);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn j(budget: u64, session: bool) -> Joining {
        Joining { class: None, budget, session, so_far: None }
    }

    /// A request of `class` starts and answers `output` tokens.
    fn answer(q: &SlotQueue, class: u64, output: u64) {
        let at = q.started(Some(class));
        q.ended(Some(class), at, Some(Answer { budget: 4096, prompt: 100, output }));
    }

    fn sibling(class: u64) -> Joining {
        Joining { class: Some(class), budget: 4096, session: false, so_far: None }
    }

    async fn is_woken(t: &Ticket) -> bool {
        tokio::time::timeout(Duration::from_millis(20), t.woken()).await.is_ok()
    }

    #[tokio::test]
    async fn a_continuing_request_goes_before_fresh_ones_and_the_longest_left_first() {
        let q = Arc::new(SlotQueue::new(QueueOrder::LongestFirst));
        answer(&q, 7, 100); // a short group
        answer(&q, 8, 3000); // a long group
        let fresh_unknown = q.join(sibling(9));
        let fresh_long = q.join(sibling(8));
        let short_left = q.join(Joining { so_far: Some(512), ..sibling(7) }); // about 300 left
        let long_left = q.join(Joining { so_far: Some(512), ..sibling(8) }); // about 1760 left
        assert!(long_left.is_head(), "the continuation with the most left goes first");
        drop(long_left);
        assert!(short_left.is_head(), "any continuation before any request not started");
        drop(short_left);
        assert!(fresh_unknown.is_head());
        drop((fresh_unknown, fresh_long));
        // A session's turn still goes first.
        let turn = q.join(Joining { session: true, ..sibling(7) });
        let going_on = q.join(Joining { so_far: Some(512), ..sibling(8) });
        assert!(turn.is_head());
        drop((turn, going_on));
        assert!(q.is_empty());
    }

    #[tokio::test]
    async fn fifo_wakes_in_arrival_order_one_per_slot() {
        let q = Arc::new(SlotQueue::new(QueueOrder::Fifo));
        let a = q.join(j(10, false));
        let b = q.join(j(500, false));
        let c = q.join(j(100, false));
        assert!(a.is_head());
        q.wake_next();
        q.wake_next();
        assert!(is_woken(&a).await);
        assert!(is_woken(&b).await, "a second slot wakes the second waiter");
        assert!(!is_woken(&c).await, "one wake per slot");
        drop(a); // both took a slot
        drop(b);
        assert!(!is_woken(&c).await, "leaving after taking the wake hands nothing on");
        assert!(c.is_head());
        assert_eq!(q.len(), 1);
    }

    #[tokio::test]
    async fn longest_first_orders_by_size_then_arrival() {
        let q = Arc::new(SlotQueue::new(QueueOrder::LongestFirst));
        let small = q.join(j(10, false));
        let big = q.join(j(500, false));
        let big2 = q.join(j(500, false));
        assert!(big.is_head());
        q.wake_next();
        assert!(is_woken(&big).await);
        assert!(!is_woken(&big2).await && !is_woken(&small).await);
        drop(big); // took the slot
        q.wake_next();
        assert!(is_woken(&big2).await, "ties go by arrival");
        assert!(!is_woken(&small).await);
        drop(big2);
        q.wake_next();
        assert!(is_woken(&small).await);
    }

    #[tokio::test]
    async fn longest_first_serves_session_turns_before_one_shot_requests() {
        let q = Arc::new(SlotQueue::new(QueueOrder::LongestFirst));
        let big = q.join(j(4000, false));
        let turn = q.join(j(50, true));
        assert!(turn.is_head());
        drop(turn);
        assert!(big.is_head());
        let fifo = Arc::new(SlotQueue::new(QueueOrder::Fifo));
        let first = fifo.join(j(1, false));
        let _turn = fifo.join(j(4000, true));
        assert!(first.is_head(), "fifo ignores sizes and sessions");
    }

    #[tokio::test]
    async fn a_waiter_that_cannot_use_its_slot_passes_it_behind_it() {
        let q = Arc::new(SlotQueue::new(QueueOrder::Fifo));
        let pinned = q.join(j(1, false));
        let other = q.join(j(1, false));
        q.wake_next();
        assert!(is_woken(&pinned).await);
        pinned.pass_on();
        assert!(is_woken(&other).await);
        assert!(!is_woken(&pinned).await, "its own pass-on does not wake it again");
        q.wake_next();
        assert!(is_woken(&pinned).await, "a later slot goes to the head again");
    }

    #[tokio::test]
    async fn a_wake_not_taken_is_handed_on_when_its_waiter_leaves() {
        let q = Arc::new(SlotQueue::new(QueueOrder::Fifo));
        let a = q.join(j(1, false));
        let b = q.join(j(1, false));
        q.wake_next();
        drop(a); // e.g. timed out before it ran
        assert!(is_woken(&b).await);
        drop(b);
        assert!(q.is_empty());
    }

    #[tokio::test]
    async fn a_woken_waiter_is_not_woken_twice_until_it_takes_the_wake() {
        let q = Arc::new(SlotQueue::new(QueueOrder::Fifo));
        let a = q.join(j(1, false));
        let b = q.join(j(1, false));
        q.wake_next();
        q.wake_next(); // a has a wake pending: the second slot goes to b
        assert!(is_woken(&b).await);
        assert!(is_woken(&a).await);
        q.wake_next(); // both took theirs: the head again
        assert!(is_woken(&a).await);
    }

    #[tokio::test]
    async fn equal_budgets_probe_every_group_then_follow_learned_lengths() {
        let q = Arc::new(SlotQueue::new(QueueOrder::LongestFirst));
        // Two GRPO groups of three, all with the same budget, arriving group by group.
        let a: Vec<Ticket> = (0..3).map(|_| q.join(sibling(1))).collect();
        let b: Vec<Ticket> = (0..3).map(|_| q.join(sibling(2))).collect();
        // One request of each group first (the sibling rank), in arrival order.
        assert!(a[0].is_head());
        drop(a);
        let a: Vec<Ticket> = (0..2).map(|_| q.join(sibling(1))).collect();
        assert!(b[0].is_head(), "group 2's first request before group 1's later ones");
        // Group 1 answers short, group 2 long: group 2's waiting requests go first.
        answer(&q, 1, 50);
        answer(&q, 2, 3000);
        assert!(b[0].is_head());
        drop(b);
        assert!(a[0].is_head());
        // Learned, not told: a class still unknown outranks a known short one.
        let c = q.join(sibling(3));
        assert!(c.is_head());
        answer(&q, 3, 10);
        assert!(a[0].is_head());
        assert_eq!(q.len(), 3);
        assert!(q.lengths(|l| l.mean_output()).is_some());
    }

    #[tokio::test]
    async fn fifo_learns_lengths_but_keeps_arrival_order() {
        let q = Arc::new(SlotQueue::new(QueueOrder::Fifo));
        let first = q.join(sibling(1));
        let _second = q.join(sibling(2));
        answer(&q, 2, 4000);
        answer(&q, 1, 1);
        assert!(first.is_head());
        assert_eq!(q.lengths(|l| l.mean_output()), Some(2001));
    }
}
