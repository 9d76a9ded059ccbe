//! The pooled-embedding cache: the pooled sum of a whole bag, keyed by the table's version and
//! an order-invariant hash of the bag's (id, weight) multiset (SDM §4.3). It pays only where
//! it hits (SDM reports about 5%), so a miss costs one hash over the ids and one probe; the
//! entry keeps the sorted multiset, so a hash collision is never taken for a hit.

use std::sync::{Mutex, MutexGuard};

use super::{mix, IdMap, Policy, PolicyKind};

/// Bags with fewer ids are not worth an entry: their rows are in the row cache anyway.
pub const MIN_BAG: usize = 2;

struct Entry {
    key: u64,
    /// (id, weight bits) sorted: the multiset the key hashes.
    items: Box<[(i64, u32)]>,
    /// The kernel's pooled sum (a mean is divided afterwards).
    sum: Box<[f32]>,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.items.len() * 16 + self.sum.len() * 4 + 64
    }
}

struct Inner {
    map: IdMap<u64, u32>,
    entries: Vec<Option<Entry>>,
    free: Vec<u32>,
    policy: Box<dyn Policy>,
    used: usize,
}

/// A pooled-embedding cache under a byte budget (0 disables it).
pub struct PooledCache {
    budget: usize,
    inner: Mutex<Inner>,
}

/// The key of a bag: `table_version` (which table, at which version) and an order-invariant
/// hash of its (id, weight) pairs: a sum of mixed pairs, so any order gives the same key.
pub fn bag_key(table_version: u64, ids: &[i64], weights: Option<&[f32]>) -> u64 {
    let one = 1.0f32.to_bits();
    let mut h = 0u64;
    for (i, &id) in ids.iter().enumerate() {
        let w = weights.map_or(one, |w| w[i].to_bits());
        h = h.wrapping_add(mix(
            (id as u64) ^ ((w as u64) << 32 | w as u64).rotate_left(17)
        ));
    }
    mix(h ^ mix(table_version) ^ (ids.len() as u64).rotate_left(40))
}

fn items(ids: &[i64], weights: Option<&[f32]>) -> Vec<(i64, u32)> {
    let one = 1.0f32.to_bits();
    let mut v: Vec<(i64, u32)> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| (id, weights.map_or(one, |w| w[i].to_bits())))
        .collect();
    v.sort_unstable();
    v
}

impl PooledCache {
    pub fn new(budget: usize) -> PooledCache {
        // Slots for the smallest entries the budget could hold; bytes bound the rest.
        let slots = budget / 128;
        PooledCache {
            budget,
            inner: Mutex::new(Inner {
                map: IdMap::default(),
                entries: Vec::new(),
                free: Vec::new(),
                policy: PolicyKind::Sieve.build(slots),
                used: 0,
            }),
        }
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Copies the cached sum of the bag into `out` (dim floats); false on a miss.
    pub fn get(&self, key: u64, ids: &[i64], weights: Option<&[f32]>, out: &mut [f32]) -> bool {
        let mut inner = self.lock();
        let Some(&slot) = inner.map.get(&key) else {
            return false;
        };
        let Some(entry) = inner.entries[slot as usize].as_ref() else {
            return false;
        };
        if entry.sum.len() != out.len() || *entry.items != *items(ids, weights) {
            return false; // a hash collision
        }
        out.copy_from_slice(&entry.sum);
        inner.policy.touch(slot);
        true
    }

    /// Caches the pooled sum of a bag.
    pub fn insert(&self, key: u64, ids: &[i64], weights: Option<&[f32]>, sum: &[f32]) {
        let entry = Entry {
            key,
            items: items(ids, weights).into_boxed_slice(),
            sum: sum.into(),
        };
        let size = entry.bytes();
        let capacity = self.budget / 128;
        if size > self.budget || capacity == 0 {
            return;
        }
        let mut inner = self.lock();
        if inner.map.contains_key(&key) {
            return;
        }
        // Evict until the entry fits in bytes and in slots (each round frees one entry).
        for _ in 0..capacity {
            let full = inner.free.is_empty() && inner.entries.len() >= capacity;
            if inner.used + size <= self.budget && !full {
                break;
            }
            let victim = inner.policy.evict();
            if let Some(old) = inner.entries[victim as usize].take() {
                inner.used -= old.bytes();
                inner.map.remove(&old.key);
            }
            inner.free.push(victim);
        }
        if inner.used + size > self.budget {
            return;
        }
        let slot = match inner.free.pop() {
            Some(s) => s,
            None if inner.entries.len() < capacity => {
                inner.entries.push(None);
                (inner.entries.len() - 1) as u32
            }
            None => return,
        };
        inner.used += size;
        inner.map.insert(key, slot);
        inner.entries[slot as usize] = Some(entry);
        inner.policy.insert(slot);
    }

    /// Forgets every entry (after an update).
    pub fn clear(&self) {
        let mut inner = self.lock();
        let slots = self.budget / 128;
        inner.map.clear();
        inner.entries.clear();
        inner.free.clear();
        inner.used = 0;
        inner.policy = PolicyKind::Sieve.build(slots);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_ignores_order_but_not_ids_weights_or_version() {
        let k = bag_key(1, &[3, 5, 5, 9], None);
        assert_eq!(k, bag_key(1, &[5, 9, 3, 5], None));
        assert_ne!(k, bag_key(1, &[3, 5, 9, 9], None));
        assert_ne!(k, bag_key(2, &[3, 5, 5, 9], None));
        assert_ne!(k, bag_key(1, &[3, 5, 5, 9], Some(&[1.0, 1.0, 2.0, 1.0])));
        assert_eq!(k, bag_key(1, &[3, 5, 5, 9], Some(&[1.0; 4])));
    }

    #[test]
    fn pooled_cache_hits_the_same_multiset_and_stays_in_budget() {
        let cache = PooledCache::new(4096);
        let sum = [1.5f32, 2.5];
        let k = bag_key(0, &[1, 2], None);
        cache.insert(k, &[1, 2], None, &sum);
        let mut out = [0.0; 2];
        assert!(cache.get(k, &[2, 1], None, &mut out));
        assert_eq!(out, sum);
        // Same key, different multiset (a forced collision): not a hit.
        assert!(!cache.get(k, &[1, 3], None, &mut out));
        for i in 0..1000 {
            cache.insert(bag_key(0, &[i, i + 1], None), &[i, i + 1], None, &sum);
            assert!(cache.lock().used <= 4096);
        }
        assert!(!PooledCache::new(0).enabled());
    }
}
