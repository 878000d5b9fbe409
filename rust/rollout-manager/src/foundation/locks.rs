//! Locks taken in one way everywhere: a poisoned lock is taken anyway.
//!
//! A standard lock is poisoned when a thread panics while holding it. The manager has no
//! `unwrap` or `expect` outside tests, and every lock guards data whose invariants hold between
//! statements, so a poisoned lock holds consistent data; taking it anyway keeps one panic from
//! becoming a panic in every later user. clippy (`rust/rollout-manager/clippy.toml`) bans the
//! standard `lock`, `read` and `write`, so this is the one place that decides.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// [`Mutex::lock`], a poisoned lock taken anyway.
pub trait Locked<T: ?Sized> {
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> Locked<T> for Mutex<T> {
    #[expect(clippy::disallowed_methods, reason = "the one place a Mutex is locked")]
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// [`RwLock::read`] and [`RwLock::write`], a poisoned lock taken anyway.
pub trait RwLocked<T: ?Sized> {
    fn read_locked(&self) -> RwLockReadGuard<'_, T>;
    fn write_locked(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLocked<T> for RwLock<T> {
    #[expect(clippy::disallowed_methods, reason = "the one place an RwLock is read")]
    fn read_locked(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(PoisonError::into_inner)
    }

    #[expect(clippy::disallowed_methods, reason = "the one place an RwLock is written")]
    fn write_locked(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_lock_poisoned_by_a_panic_is_taken_with_its_data() {
        let m = Arc::new(Mutex::new(1));
        let rw = Arc::new(RwLock::new(2));
        let (m2, rw2) = (m.clone(), rw.clone());
        let panicked = std::thread::spawn(move || {
            let _m = m2.locked();
            let _w = rw2.write_locked();
            panic!("poisons both locks");
        })
        .join();
        assert!(panicked.is_err());
        assert!(m.is_poisoned() && rw.is_poisoned());
        *m.locked() += 1;
        *rw.write_locked() += 1;
        assert_eq!((*m.locked(), *rw.read_locked()), (2, 3));
    }
}
