//! Which engine a session or a prompt was last sent to.
//!
//! Two generations of a hash map bound the memory: lookups read the current generation, then
//! the previous one; when the current one holds `capacity` keys it becomes the previous one and
//! a fresh one starts. Keys unused for two generations are forgotten. The lock is held for one
//! map operation and never across an `.await`.

use crate::foundation::locks::Locked;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

type Generation = HashMap<u64, Arc<str>>;

pub struct Affinity {
    capacity: usize,
    /// (current, previous) generation.
    maps: Mutex<(Generation, Generation)>,
}

/// The affinity key of a session id (kept apart from prompt hashes by a tag).
pub fn session_key(id: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    "session".hash(&mut h);
    id.hash(&mut h);
    h.finish()
}

impl Affinity {
    pub fn new(capacity: usize) -> Self {
        Self { capacity: capacity.max(1), maps: Mutex::new((HashMap::new(), HashMap::new())) }
    }

    pub fn get(&self, key: u64) -> Option<Arc<str>> {
        let maps = self.maps.locked();
        maps.0.get(&key).or_else(|| maps.1.get(&key)).cloned()
    }

    pub fn put(&self, key: u64, engine_id: &str) {
        let mut maps = self.maps.locked();
        if maps.0.len() >= self.capacity {
            let current = std::mem::take(&mut maps.0);
            maps.1 = current;
        }
        maps.0.insert(key, Arc::from(engine_id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_and_forgets_after_two_generations() {
        let a = Affinity::new(2);
        a.put(1, "e0");
        a.put(2, "e1");
        a.put(3, "e2"); // 1 and 2 move to the previous generation
        assert_eq!(a.get(1).as_deref(), Some("e0"));
        a.put(4, "e3");
        a.put(5, "e4"); // 1 and 2 are forgotten
        assert_eq!(a.get(1), None);
        assert_eq!(a.get(5).as_deref(), Some("e4"));
        assert_ne!(session_key("a"), session_key("b"));
    }
}
