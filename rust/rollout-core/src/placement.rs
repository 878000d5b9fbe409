//! Placement of engines on the local pool of GPUs.
//!
//! The pool hands out GPU indices; an engine of tensor-parallel size K takes K of them. The
//! lowest free indices are used first, and a block of consecutive indices is preferred so that
//! a TP group shares a switch when the machine has one.

use std::collections::BTreeSet;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("need {needed} GPUs but only {free} of {total} are free (raise --gpus, or scale in first)")]
    Insufficient { needed: u32, free: u32, total: u32 },
    #[error("GPU {0} is not allocated")]
    NotAllocated(u32),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuPool {
    total: u32,
    used: BTreeSet<u32>,
}

impl GpuPool {
    pub fn new(total: u32) -> Self {
        Self { total, used: BTreeSet::new() }
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    pub fn free(&self) -> u32 {
        self.total - self.used.len() as u32
    }

    /// Takes `n` GPUs: a consecutive block when one exists, else the lowest free ones.
    pub fn allocate(&mut self, n: u32) -> Result<Vec<u32>, PlacementError> {
        if n > self.free() {
            return Err(PlacementError::Insufficient { needed: n, free: self.free(), total: self.total });
        }
        let free: Vec<u32> = (0..self.total).filter(|g| !self.used.contains(g)).collect();
        let block = free
            .windows(n as usize)
            .find(|w| w.last().zip(w.first()).is_some_and(|(l, f)| l - f + 1 == n))
            .map(<[u32]>::to_vec);
        let chosen = block.unwrap_or_else(|| free[..n as usize].to_vec());
        self.used.extend(chosen.iter().copied());
        Ok(chosen)
    }

    /// Returns GPUs to the pool. All of them must be allocated; otherwise nothing changes.
    pub fn release(&mut self, gpus: &[u32]) -> Result<(), PlacementError> {
        if let Some(g) = gpus.iter().find(|g| !self.used.contains(g)) {
            return Err(PlacementError::NotAllocated(*g));
        }
        for g in gpus {
            self.used.remove(g);
        }
        Ok(())
    }

    /// Marks specific GPUs as used (when re-adopting engines that already hold them).
    pub fn claim(&mut self, gpus: &[u32]) -> Result<(), PlacementError> {
        if gpus.iter().any(|g| *g >= self.total || self.used.contains(g)) {
            return Err(PlacementError::Insufficient {
                needed: gpus.len() as u32,
                free: self.free(),
                total: self.total,
            });
        }
        self.used.extend(gpus.iter().copied());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn allocates_lowest_blocks_and_reuses_released() {
        let mut pool = GpuPool::new(4);
        assert_eq!(pool.allocate(1).unwrap(), vec![0]);
        assert_eq!(pool.allocate(2).unwrap(), vec![1, 2]);
        pool.release(&[0]).unwrap();
        // A consecutive block is preferred over the lowest indices.
        let mut pool2 = GpuPool::new(4);
        pool2.claim(&[1]).unwrap();
        assert_eq!(pool2.allocate(2).unwrap(), vec![2, 3]);
        assert_eq!(pool.allocate(1).unwrap(), vec![0]);
        let err = pool.allocate(2).unwrap_err();
        assert_eq!(err, PlacementError::Insufficient { needed: 2, free: 1, total: 4 });
        assert!(err.to_string().contains("--gpus"));
    }

    #[test]
    fn release_of_unallocated_changes_nothing() {
        let mut pool = GpuPool::new(2);
        pool.allocate(1).unwrap();
        assert_eq!(pool.release(&[0, 1]), Err(PlacementError::NotAllocated(1)));
        assert_eq!(pool.free(), 1);
    }

    proptest! {
        #[test]
        fn never_double_allocates(ops in proptest::collection::vec((any::<bool>(), 1u32..4), 0..40)) {
            let mut pool = GpuPool::new(8);
            let mut held: Vec<Vec<u32>> = Vec::new();
            for (alloc, n) in ops {
                if alloc {
                    if let Ok(g) = pool.allocate(n) {
                        prop_assert_eq!(g.len() as u32, n);
                        for x in &g {
                            prop_assert!(held.iter().all(|h| !h.contains(x)));
                        }
                        held.push(g);
                    }
                } else if let Some(g) = held.pop() {
                    prop_assert!(pool.release(&g).is_ok());
                }
                let used: u32 = held.iter().map(|h| h.len() as u32).sum();
                prop_assert_eq!(pool.free(), 8 - used);
            }
        }
    }
}
