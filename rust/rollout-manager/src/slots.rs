//! The router's wait queue for engine slots (`--max-inflight-per-engine`).
//!
//! A request that finds every engine at its cap takes a [`Ticket`] and waits. Tickets are
//! ordered by `--queue-order`: arrival (`fifo`), or `longest_first`: turns of multi-turn
//! sessions (requests with a session key) before one-shot requests, since the session's next
//! turn cannot start until this one ends, then the output budget (`max_new_tokens`), largest
//! first, then arrival. The budget, not the prompt, is what makes a generation long: prefill is
//! a small part of a request's time. When a request ends
//! somewhere, [`SlotQueue::wake_next`] wakes the first ticket not already woken, so freed slots
//! go out in queue order, one wake per slot. A woken request that takes a slot and sees another
//! still free wakes the next one (a joining engine frees several at once); one that cannot use
//! any free slot (its weight-version pin excludes those engines) passes its wake to the ticket
//! behind it; one that leaves while woken (timeout, client gone) passes it on too. Wake-ups that
//! race are not lost: the router's waiters also re-check on every routing-table change and every
//! 50 ms, and then only the head of the queue proceeds, so order holds.
//!
//! Longest-first is list scheduling by decreasing size: for a batch of rollouts submitted at
//! once it starts the long generations first, so the batch does not end with one engine
//! grinding through a long request that started late. The price is that short requests wait
//! behind long ones (at most `--request-timeout-secs`); use `fifo` for interactive traffic.

use rollout_core::routing::{QueueOrder, MAX_ESTIMATE_TOKENS};
use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;

/// Queue position: larger priority first, then arrival.
type Key = (Reverse<u64>, u64);

#[derive(Debug)]
struct Waiter {
    notify: Arc<Notify>,
    woken: bool,
}

#[derive(Debug)]
pub struct SlotQueue {
    order: QueueOrder,
    seq: AtomicU64,
    waiters: Mutex<BTreeMap<Key, Waiter>>,
}

impl SlotQueue {
    pub fn new(order: QueueOrder) -> Self {
        Self { order, seq: AtomicU64::new(0), waiters: Mutex::new(BTreeMap::new()) }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<Key, Waiter>> {
        // Nothing panics while holding it; recover a poisoned lock anyway.
        self.waiters.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues a request whose output budget is `budget` tokens; `session`: it has a session key.
    pub fn join(self: &Arc<Self>, budget: u64, session: bool) -> Ticket {
        let priority = match self.order {
            QueueOrder::Fifo => 0,
            // Budgets are at most 2^40 (`MAX_ESTIMATE_TOKENS`): the top bit is free for sessions.
            QueueOrder::LongestFirst => budget.min(MAX_ESTIMATE_TOKENS) | (u64::from(session) << 63),
        };
        let key = (Reverse(priority), self.seq.fetch_add(1, Ordering::Relaxed));
        let notify = Arc::new(Notify::new());
        self.lock().insert(key, Waiter { notify: notify.clone(), woken: false });
        Ticket { queue: self.clone(), key, notify }
    }

    /// A slot freed: wakes the first waiter that is not already woken.
    pub fn wake_next(&self) {
        Self::wake_first(self.lock().iter_mut());
    }

    fn wake_first<'a>(waiters: impl Iterator<Item = (&'a Key, &'a mut Waiter)>) {
        if let Some((_, w)) = waiters.into_iter().find(|(_, w)| !w.woken) {
            w.woken = true;
            w.notify.notify_one();
        }
    }
}

/// A request's place in the queue.
#[derive(Debug)]
pub struct Ticket {
    queue: Arc<SlotQueue>,
    key: Key,
    notify: Arc<Notify>,
}

impl Ticket {
    /// Waits for a wake and takes it (a wake sent while not waiting is kept, so none is lost).
    pub async fn woken(&self) {
        self.notify.notified().await;
        if let Some(w) = self.queue.lock().get_mut(&self.key) {
            w.woken = false;
        }
    }

    /// Whether this ticket is first in the queue.
    pub fn is_head(&self) -> bool {
        self.queue.lock().keys().next() == Some(&self.key)
    }

    /// This request cannot use the free slot it was woken for: wake the first ticket behind it.
    pub fn pass_on(&self) {
        let mut waiters = self.queue.lock();
        SlotQueue::wake_first(waiters.range_mut((Bound::Excluded(self.key), Bound::Unbounded)));
    }
}

impl Drop for Ticket {
    /// Leaves the queue; a wake sent to it and not taken goes to the next waiter.
    fn drop(&mut self) {
        let mut waiters = self.queue.lock();
        if waiters.remove(&self.key).is_some_and(|w| w.woken) {
            SlotQueue::wake_first(waiters.iter_mut());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn is_woken(t: &Ticket) -> bool {
        tokio::time::timeout(Duration::from_millis(20), t.woken()).await.is_ok()
    }

    #[tokio::test]
    async fn fifo_wakes_in_arrival_order_one_per_slot() {
        let q = Arc::new(SlotQueue::new(QueueOrder::Fifo));
        let a = q.join(10, false);
        let b = q.join(500, false);
        let c = q.join(100, false);
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
        let small = q.join(10, false);
        let big = q.join(500, false);
        let big2 = q.join(500, false);
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
        let big = q.join(4000, false);
        let turn = q.join(50, true);
        assert!(turn.is_head());
        drop(turn);
        assert!(big.is_head());
        let fifo = Arc::new(SlotQueue::new(QueueOrder::Fifo));
        let first = fifo.join(1, false);
        let _turn = fifo.join(4000, true);
        assert!(first.is_head(), "fifo ignores sizes and sessions");
    }

    #[tokio::test]
    async fn a_waiter_that_cannot_use_its_slot_passes_it_behind_it() {
        let q = Arc::new(SlotQueue::new(QueueOrder::Fifo));
        let pinned = q.join(1, false);
        let other = q.join(1, false);
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
        let a = q.join(1, false);
        let b = q.join(1, false);
        q.wake_next();
        drop(a); // e.g. timed out before it ran
        assert!(is_woken(&b).await);
        drop(b);
        assert!(q.is_empty());
    }

    #[tokio::test]
    async fn a_woken_waiter_is_not_woken_twice_until_it_takes_the_wake() {
        let q = Arc::new(SlotQueue::new(QueueOrder::Fifo));
        let a = q.join(1, false);
        let b = q.join(1, false);
        q.wake_next();
        q.wake_next(); // a has a wake pending: the second slot goes to b
        assert!(is_woken(&b).await);
        assert!(is_woken(&a).await);
        q.wake_next(); // both took theirs: the head again
        assert!(is_woken(&a).await);
    }
}
