//! KV pool accounting with a block-hash prefix cache (a radix cache in spirit).
//!
//! The pool holds `capacity` token slots. A slot is either
//! - free,
//! - private to a running request (its uncached prompt tail and generated tokens),
//! - in the prefix cache, as part of a 16-token block. A cached block is *locked* while a
//!   running request uses it, and *evictable* otherwise.
//!
//! Blocks are identified by a chained hash (block k's hash covers tokens `0..(k+1)*16`), so a
//! prompt's cached prefix is the longest run of its block hashes present in the cache.
//! Evictable blocks leave in LRU order (deepest first among equals), only when space is
//! needed. SGLang's `num_used_tokens` is `capacity - free - evictable`.

use crate::generator::mix64;
use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};

/// Tokens per cache block.
pub const BLOCK: usize = 16;

/// Extends `hashes` (chained block hashes of `seq`'s first `hashes.len()` full blocks) to
/// cover every full block of `seq`.
pub fn extend_block_hashes(hashes: &mut Vec<u64>, seq: &[u32]) {
    let full = seq.len() / BLOCK;
    while hashes.len() < full {
        let k = hashes.len();
        let mut h = hashes.last().copied().unwrap_or(0x6b76_5f72_6f6f_7400);
        for id in &seq[k * BLOCK..(k + 1) * BLOCK] {
            h = mix64(h ^ u64::from(*id));
        }
        hashes.push(h);
    }
}

#[derive(Debug)]
struct Block {
    /// Running requests using this block.
    refs: u32,
    /// Last time (pool tick) a request matched or inserted it.
    tick: u64,
    /// Position in its chain (0 = first block of a sequence).
    depth: u32,
}

/// The KV pool of one DP rank.
#[derive(Debug)]
pub struct KvPool {
    capacity: usize,
    private: usize,
    blocks: HashMap<u64, Block>,
    locked_blocks: usize,
    /// Evictable blocks ordered for eviction: oldest tick first, deeper first among equals.
    evictable: BTreeSet<(u64, Reverse<u32>, u64)>,
    tick: u64,
    cache_enabled: bool,
}

impl KvPool {
    pub fn new(capacity: usize, cache_enabled: bool) -> Self {
        Self {
            capacity,
            private: 0,
            blocks: HashMap::new(),
            locked_blocks: 0,
            evictable: BTreeSet::new(),
            tick: 0,
            cache_enabled,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Slots held by running requests: private slots plus locked cache blocks.
    pub fn used(&self) -> usize {
        self.private + self.locked_blocks * BLOCK
    }

    /// Slots a request could get right now (free plus evictable).
    pub fn available(&self) -> usize {
        self.capacity.saturating_sub(self.used())
    }

    /// Slots in the prefix cache that no running request uses.
    pub fn evictable_tokens(&self) -> usize {
        (self.blocks.len() - self.locked_blocks) * BLOCK
    }

    /// Slots held by the prefix cache (locked or not).
    pub fn cached_tokens(&self) -> usize {
        self.blocks.len() * BLOCK
    }

    fn free(&self) -> usize {
        self.capacity.saturating_sub(self.private + self.blocks.len() * BLOCK)
    }

    /// How many leading blocks of `hashes` (at most `max_blocks`) are cached, and how many of
    /// those are currently evictable (locking them takes them out of `available`).
    pub fn peek_match(&self, hashes: &[u64], max_blocks: usize) -> (usize, usize) {
        if !self.cache_enabled {
            return (0, 0);
        }
        let mut matched = 0;
        let mut evictable = 0;
        for h in hashes.iter().take(max_blocks) {
            match self.blocks.get(h) {
                Some(b) => {
                    matched += 1;
                    if b.refs == 0 {
                        evictable += 1;
                    }
                }
                None => break,
            }
        }
        (matched, evictable)
    }

    /// Locks the first `n` blocks of `hashes` (which must be cached, see [`Self::peek_match`]).
    pub fn lock(&mut self, hashes: &[u64]) {
        self.tick += 1;
        for h in hashes {
            if let Some(b) = self.blocks.get_mut(h) {
                if b.refs == 0 {
                    self.evictable.remove(&(b.tick, Reverse(b.depth), *h));
                    self.locked_blocks += 1;
                }
                b.refs += 1;
                b.tick = self.tick;
            }
        }
    }

    /// Releases locks taken by [`Self::lock`].
    pub fn unlock(&mut self, hashes: &[u64]) {
        for h in hashes {
            if let Some(b) = self.blocks.get_mut(h) {
                if b.refs == 0 {
                    continue;
                }
                b.refs -= 1;
                if b.refs == 0 {
                    self.locked_blocks -= 1;
                    self.evictable.insert((b.tick, Reverse(b.depth), *h));
                }
            }
        }
    }

    /// Takes `n` private slots, evicting cache blocks if needed. False (and nothing taken) if
    /// `n` exceeds what is available.
    pub fn alloc(&mut self, n: usize) -> bool {
        if n > self.available() {
            return false;
        }
        while self.free() < n {
            let Some(&key) = self.evictable.iter().next() else {
                return false;
            };
            self.evictable.remove(&key);
            self.blocks.remove(&key.2);
        }
        self.private += n;
        true
    }

    /// Returns `n` private slots.
    pub fn release(&mut self, n: usize) {
        self.private = self.private.saturating_sub(n);
    }

    /// A request finished (or was retracted): `hashes` are the block hashes of the tokens it
    /// holds KV for, of which the first `locked` are locks it took and the rest are covered by
    /// its `private` slots. New blocks move from private slots into the cache; the rest of
    /// the private slots are freed.
    pub fn finish_request(&mut self, hashes: &[u64], locked: usize, private: usize) {
        let locked = locked.min(hashes.len());
        self.unlock(&hashes[..locked]);
        let mut private = private;
        if self.cache_enabled {
            self.tick += 1;
            for (i, h) in hashes.iter().enumerate().skip(locked) {
                if private < BLOCK {
                    break;
                }
                if let Some(b) = self.blocks.get_mut(h) {
                    // Already cached (another request inserted it): our copy is just freed.
                    if b.refs == 0 {
                        self.evictable.remove(&(b.tick, Reverse(b.depth), *h));
                        b.tick = self.tick;
                        self.evictable.insert((b.tick, Reverse(b.depth), *h));
                    } else {
                        b.tick = self.tick;
                    }
                    continue;
                }
                let depth = u32::try_from(i).unwrap_or(u32::MAX);
                self.blocks.insert(*h, Block { refs: 0, tick: self.tick, depth });
                self.evictable.insert((self.tick, Reverse(depth), *h));
                private -= BLOCK;
                self.private = self.private.saturating_sub(BLOCK);
            }
        }
        self.release(private);
    }

    /// Drops every evictable block. False (nothing dropped) if some block is locked.
    pub fn flush(&mut self) -> bool {
        if self.locked_blocks > 0 {
            return false;
        }
        self.blocks.clear();
        self.evictable.clear();
        true
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn seq(start: u32, len: usize) -> Vec<u32> {
        (start..start + len as u32).collect()
    }

    fn hashes(s: &[u32]) -> Vec<u64> {
        let mut h = Vec::new();
        extend_block_hashes(&mut h, s);
        h
    }

    #[test]
    fn hashes_are_chained_and_extendable() {
        let s = seq(0, 50);
        let all = hashes(&s);
        assert_eq!(all.len(), 3);
        let mut part = hashes(&s[..20]);
        assert_eq!(part.len(), 1);
        extend_block_hashes(&mut part, &s);
        assert_eq!(part, all);
        // Same block contents behind a different prefix hash differently.
        let mut other = s.clone();
        other[0] = 999;
        assert_ne!(hashes(&other)[1], all[1]);
    }

    #[test]
    fn alloc_release_accounting() {
        let mut p = KvPool::new(100, true);
        assert!(p.alloc(60));
        assert_eq!(p.used(), 60);
        assert_eq!(p.available(), 40);
        assert!(!p.alloc(41));
        assert_eq!(p.used(), 60);
        p.release(60);
        assert_eq!(p.used(), 0);
    }

    #[test]
    fn finished_request_is_cached_then_matched() {
        let mut p = KvPool::new(1000, true);
        let s = seq(10, 40); // 2 full blocks + 8
        let h = hashes(&s);
        assert!(p.alloc(40));
        p.finish_request(&h, 0, 40);
        assert_eq!(p.used(), 0);
        assert_eq!(p.cached_tokens(), 32);
        assert_eq!(p.evictable_tokens(), 32);
        assert_eq!(p.available(), 1000);

        let (m, e) = p.peek_match(&h, 10);
        assert_eq!((m, e), (2, 2));
        p.lock(&h[..m]);
        assert_eq!(p.used(), 32);
        assert_eq!(p.evictable_tokens(), 0);
        assert!(!p.flush(), "locked blocks cannot be flushed");
        assert!(p.alloc(8));
        p.finish_request(&h, m, 8);
        assert_eq!(p.used(), 0);
        assert_eq!(p.cached_tokens(), 32);
        assert!(p.flush());
        assert_eq!(p.cached_tokens(), 0);
    }

    #[test]
    fn eviction_makes_room_lru_first() {
        let mut p = KvPool::new(64, true);
        let a = seq(0, 32);
        let b = seq(100, 32);
        let (ha, hb) = (hashes(&a), hashes(&b));
        assert!(p.alloc(32));
        p.finish_request(&ha, 0, 32);
        assert!(p.alloc(32));
        p.finish_request(&hb, 0, 32);
        assert_eq!(p.cached_tokens(), 64);
        // Touch `a` so `b` is the older one.
        p.lock(&ha);
        p.unlock(&ha);
        assert!(p.alloc(16));
        assert_eq!(p.peek_match(&ha, 10).0, 2, "a survives");
        assert_eq!(p.peek_match(&hb, 10).0, 1, "b's deepest block went first");
        assert!(p.alloc(48));
        assert_eq!(p.cached_tokens(), 0);
        assert_eq!(p.used(), 64);
        assert!(!p.alloc(1));
    }

    #[test]
    fn disabled_cache_never_matches() {
        let mut p = KvPool::new(100, false);
        let s = seq(0, 32);
        let h = hashes(&s);
        assert!(p.alloc(32));
        p.finish_request(&h, 0, 32);
        assert_eq!(p.cached_tokens(), 0);
        assert_eq!(p.used(), 0);
        assert_eq!(p.peek_match(&h, 10), (0, 0));
    }

    #[test]
    fn duplicate_insert_frees_the_copy() {
        let mut p = KvPool::new(200, true);
        let s = seq(0, 32);
        let h = hashes(&s);
        assert!(p.alloc(32));
        assert!(p.alloc(32));
        p.finish_request(&h, 0, 32);
        p.finish_request(&h, 0, 32);
        assert_eq!(p.used(), 0);
        assert_eq!(p.cached_tokens(), 32);
    }
}
