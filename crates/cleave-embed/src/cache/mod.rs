//! DRAM caches of the SSD tier (docs/tiers.md): a row cache under one byte budget, split into
//! internal caches by row size as SDM does (a table of 512-byte rows cannot evict every 64-byte
//! row), a pooled-embedding cache, and Belady's offline optimum for benchmarks.

pub mod belady;
mod lru;
pub mod policy;
pub mod pooled;
mod sieve;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

pub use policy::{Policy, PolicyKind};

/// Bytes of bookkeeping a cached row costs besides its bytes (map entry, key, policy links),
/// charged to the budget so the budget bounds the real footprint.
pub const ROW_OVERHEAD: usize = 48;

/// A cheap hasher for integer keys (ids are not chosen by an adversary who could benefit
/// from collisions: a collision only costs time).
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = mix(self.0 ^ n);
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }
}

/// splitmix64's finaliser: every input bit moves every output bit.
#[inline]
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// (table number in its tier, global row id).
pub type RowKey = (u32, u64);

/// Rows of one size: a slab of `capacity` slots and an eviction policy.
pub struct SlotCache {
    row_bytes: usize,
    capacity: usize,
    map: IdMap<RowKey, u32>,
    keys: Vec<RowKey>,
    data: Vec<u8>,
    policy: Box<dyn Policy>,
    kind: PolicyKind,
}

impl SlotCache {
    fn new(row_bytes: usize, capacity: usize, policy: PolicyKind) -> SlotCache {
        SlotCache {
            row_bytes,
            capacity,
            map: IdMap::default(),
            keys: Vec::new(),
            // Grows as rows arrive, up to capacity * row_bytes.
            data: Vec::new(),
            policy: policy.build(capacity),
            kind: policy,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether `key` is cached; a look only (no hit for the policy).
    pub fn contains(&self, key: RowKey) -> bool {
        self.map.contains_key(&key)
    }

    /// Copies the cached row of `key` into `out` (row_bytes); false on a miss.
    pub fn get(&mut self, key: RowKey, out: &mut [u8]) -> bool {
        let Some(&slot) = self.map.get(&key) else {
            return false;
        };
        self.policy.touch(slot);
        let at = slot as usize * self.row_bytes;
        out.copy_from_slice(&self.data[at..at + self.row_bytes]);
        true
    }

    /// Caches `row` under `key`, evicting by the policy when full.
    pub fn insert(&mut self, key: RowKey, row: &[u8]) {
        if self.capacity == 0 || self.map.contains_key(&key) {
            return;
        }
        let slot = if self.keys.len() < self.capacity {
            self.keys.push(key);
            self.data.extend_from_slice(row);
            (self.keys.len() - 1) as u32
        } else {
            let slot = self.policy.evict();
            self.map.remove(&self.keys[slot as usize]);
            self.keys[slot as usize] = key;
            let at = slot as usize * self.row_bytes;
            self.data[at..at + self.row_bytes].copy_from_slice(row);
            slot
        };
        self.map.insert(key, slot);
        self.policy.insert(slot);
    }

    /// Forgets every row (after an update of a table).
    pub fn clear(&mut self) {
        self.map.clear();
        self.keys.clear();
        self.data.clear();
        self.policy = self.kind.build(self.capacity);
    }
}

struct Class {
    row_bytes: usize,
    /// Bytes of the tables of this row size; the budget is split in proportion.
    table_bytes: u64,
    cache: Arc<Mutex<SlotCache>>,
}

/// The row cache of a tier: one [`SlotCache`] per row size under one byte budget.
pub struct RowCache {
    budget: u64,
    policy: PolicyKind,
    classes: Mutex<Vec<Class>>,
}

impl RowCache {
    pub fn new(budget: u64, policy: PolicyKind) -> RowCache {
        RowCache {
            budget,
            policy,
            classes: Mutex::new(Vec::new()),
        }
    }

    pub fn policy(&self) -> PolicyKind {
        self.policy
    }

    fn classes(&self) -> MutexGuard<'_, Vec<Class>> {
        self.classes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `table_bytes` of rows of `row_bytes` and returns the class that caches them. The
    /// budget is re-split between the classes in proportion to their tables' bytes (tables
    /// are registered when opened, before any lookup, so the caches are still empty).
    pub fn register(&self, row_bytes: usize, table_bytes: u64) -> usize {
        let mut classes = self.classes();
        let index = match classes.iter().position(|c| c.row_bytes == row_bytes) {
            Some(i) => {
                classes[i].table_bytes += table_bytes;
                i
            }
            None => {
                classes.push(Class {
                    row_bytes,
                    table_bytes,
                    cache: Arc::new(Mutex::new(SlotCache::new(row_bytes, 0, self.policy))),
                });
                classes.len() - 1
            }
        };
        let total: u64 = classes.iter().map(|c| c.table_bytes.max(1)).sum();
        for class in classes.iter_mut() {
            let share =
                (self.budget as u128 * class.table_bytes.max(1) as u128 / total as u128) as usize;
            let capacity = share / (class.row_bytes + ROW_OVERHEAD);
            class.cache = Arc::new(Mutex::new(SlotCache::new(
                class.row_bytes,
                capacity,
                self.policy,
            )));
        }
        index
    }

    /// The cache of class `index` (from [`RowCache::register`]).
    pub fn class(&self, index: usize) -> Arc<Mutex<SlotCache>> {
        self.classes()[index].cache.clone()
    }

    /// (row bytes, capacity in rows, rows held) of every class.
    pub fn shape(&self) -> Vec<(usize, usize, usize)> {
        self.classes()
            .iter()
            .map(|c| {
                let cache = c.cache.lock().unwrap_or_else(|e| e.into_inner());
                (c.row_bytes, cache.capacity(), cache.len())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(v: u8) -> [u8; 8] {
        [v; 8]
    }

    #[test]
    fn slot_cache_keeps_at_most_its_capacity_and_returns_what_it_stored() {
        for kind in [PolicyKind::Lru, PolicyKind::Sieve] {
            let mut c = SlotCache::new(8, 4, kind);
            for id in 0..20u64 {
                c.insert((0, id), &row(id as u8));
                assert!(c.len() <= 4);
            }
            let mut out = [0u8; 8];
            let mut held = 0;
            for id in 0..20u64 {
                if c.get((0, id), &mut out) {
                    assert_eq!(out, row(id as u8), "{kind:?} id {id}");
                    held += 1;
                }
            }
            assert_eq!(held, 4, "{kind:?}");
        }
    }

    #[test]
    fn lru_evicts_the_least_recently_used_and_sieve_resists_a_scan() {
        let mut out = [0u8; 8];
        // LRU: touching 0 makes 1 the oldest.
        let mut lru = SlotCache::new(8, 3, PolicyKind::Lru);
        for id in 0..3 {
            lru.insert((0, id), &row(id as u8));
        }
        assert!(lru.get((0, 0), &mut out));
        lru.insert((0, 9), &row(9));
        assert!(!lru.get((0, 1), &mut out));
        assert!(lru.get((0, 0), &mut out));
        // SIEVE: a hot row hit between scans survives a scan of one-time rows.
        let mut sieve = SlotCache::new(8, 4, PolicyKind::Sieve);
        sieve.insert((0, 100), &row(1));
        for id in 0..50u64 {
            assert!(sieve.get((0, 100), &mut out), "hot row evicted at {id}");
            sieve.insert((1, id), &row(2));
        }
    }

    #[test]
    fn row_cache_splits_the_budget_by_row_size() {
        let cache = RowCache::new(1 << 20, PolicyKind::Sieve);
        let small = cache.register(64, 3 << 30);
        let large = cache.register(512, 1 << 30);
        assert_ne!(small, large);
        let shape = cache.shape();
        let bytes = |(rb, cap, _): (usize, usize, usize)| cap * (rb + ROW_OVERHEAD);
        let total: usize = shape.iter().map(|&s| bytes(s)).sum();
        assert!(total <= 1 << 20, "{shape:?}");
        // Three quarters of the budget to the 64-byte rows, by table bytes.
        assert!(bytes(shape[small]) > 2 * bytes(shape[large]), "{shape:?}");
    }
}
