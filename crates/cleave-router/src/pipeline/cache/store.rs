//! The store: results by key, at most `limit` bytes, evicted by CLOCK (second chance). One
//! mutex: a lookup takes it once to read a request's items and once to insert its misses, so
//! the lock is held for hash probes and copies of a few rows, never across a shard call. The
//! limit moves while serving (policy.rs); lowering it evicts at once, so the bytes the cache
//! holds never exceed what the budget currently gives it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::key::Key;

/// An entry's fixed cost besides its values and its key's heap part: the map's slot, the
/// key, the Arc header, the CLOCK slot (an estimate, so that tiny rows are not counted free).
pub const ENTRY_OVERHEAD: usize = 96;

struct Slot {
    key: Key,
    values: Arc<[f32]>,
    referenced: bool,
    bytes: usize,
}

#[derive(Default)]
struct Inner {
    index: HashMap<Key, usize>,
    slots: Vec<Slot>,
    hand: usize,
    bytes: usize,
    limit: usize,
}

/// A byte-bounded map from keys to result rows.
#[derive(Default)]
pub struct Store {
    inner: Mutex<Inner>,
}

pub fn entry_bytes(key: &Key, values: usize) -> usize {
    ENTRY_OVERHEAD + key.item.heap_bytes() + values * 4
}

impl Store {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The values of each key held (`None`: a miss), marking the hits recently used.
    pub fn get_many<'a>(&self, keys: impl Iterator<Item = &'a Key>) -> Vec<Option<Arc<[f32]>>> {
        let mut inner = self.lock();
        keys.map(|k| {
            let i = *inner.index.get(k)?;
            let slot = &mut inner.slots[i];
            slot.referenced = true;
            Some(slot.values.clone())
        })
        .collect()
    }

    /// Inserts entries (an existing key keeps its values: they are equal by construction),
    /// evicting as needed; an entry larger than the limit is not kept.
    pub fn insert_many(&self, entries: impl IntoIterator<Item = (Key, Arc<[f32]>)>) {
        let mut inner = self.lock();
        for (key, values) in entries {
            let bytes = entry_bytes(&key, values.len());
            if bytes > inner.limit || inner.index.contains_key(&key) {
                continue;
            }
            let target = inner.limit - bytes;
            inner.evict_to(target);
            let i = inner.slots.len();
            inner.index.insert(key.clone(), i);
            inner.slots.push(Slot {
                key,
                values,
                referenced: false,
                bytes,
            });
            inner.bytes += bytes;
        }
    }

    /// Sets the limit; a lower one evicts at once.
    pub fn set_limit(&self, limit: usize) {
        let mut inner = self.lock();
        inner.limit = limit;
        inner.evict_to(limit);
    }

    /// (bytes held, limit, entries).
    pub fn size(&self) -> (usize, usize, usize) {
        let inner = self.lock();
        (inner.bytes, inner.limit, inner.slots.len())
    }

    /// Keeps only the entries `keep` says can still be asked for.
    pub fn retain(&self, keep: impl Fn(&Key) -> bool) {
        let mut inner = self.lock();
        let mut i = 0;
        while i < inner.slots.len() {
            if keep(&inner.slots[i].key) {
                i += 1;
            } else {
                inner.remove(i);
            }
        }
    }
}

impl Inner {
    /// Evicts until at most `target` bytes are held.
    fn evict_to(&mut self, target: usize) {
        while self.bytes > target && !self.slots.is_empty() {
            if self.hand >= self.slots.len() {
                self.hand = 0;
            }
            let slot = &mut self.slots[self.hand];
            if slot.referenced {
                slot.referenced = false;
                self.hand += 1;
            } else {
                self.remove(self.hand);
            }
        }
    }

    /// Removes slot `i` (the last slot moves into its place).
    fn remove(&mut self, i: usize) {
        let slot = self.slots.swap_remove(i);
        self.index.remove(&slot.key);
        self.bytes -= slot.bytes;
        if let Some(moved) = self.slots.get(i) {
            self.index.insert(moved.key.clone(), i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::key::Item;
    use super::*;

    fn key(id: i64) -> Key {
        Key {
            table: 0,
            epoch: 0,
            item: Item::Row(id),
        }
    }

    fn row(x: f32) -> Arc<[f32]> {
        vec![x; 4].into()
    }

    const ONE: usize = ENTRY_OVERHEAD + 16;

    #[test]
    fn holds_at_most_its_limit_and_gives_recent_entries_a_second_chance() {
        let s = Store::default();
        s.set_limit(3 * ONE);
        s.insert_many((0..3).map(|i| (key(i), row(i as f32))));
        assert_eq!(s.size(), (3 * ONE, 3 * ONE, 3));
        // 0 is used: inserting 3 evicts 1 (the first not used since the hand passed).
        assert!(s.get_many([key(0)].iter())[0].is_some());
        s.insert_many([(key(3), row(3.0))]);
        let got = s.get_many([key(0), key(1), key(2), key(3)].iter());
        let held: Vec<bool> = got.iter().map(Option::is_some).collect();
        assert_eq!(held, [true, false, true, true]);
        assert_eq!(&*got[3].clone().unwrap(), &[3.0; 4]);
        assert_eq!(s.size().0, 3 * ONE);
    }

    #[test]
    fn a_lower_limit_evicts_at_once_and_zero_holds_nothing() {
        let s = Store::default();
        s.set_limit(10 * ONE);
        s.insert_many((0..10).map(|i| (key(i), row(0.0))));
        s.set_limit(4 * ONE);
        assert_eq!(s.size(), (4 * ONE, 4 * ONE, 4));
        s.set_limit(0);
        assert_eq!(s.size(), (0, 0, 0));
        s.insert_many([(key(1), row(1.0))]);
        assert_eq!(s.size().2, 0, "nothing fits in a zero limit");
        assert!(s.get_many([key(1)].iter())[0].is_none());
    }

    #[test]
    fn retain_drops_what_can_never_hit() {
        let s = Store::default();
        s.set_limit(100 * ONE);
        s.insert_many((0..10).map(|i| (key(i), row(0.0))));
        s.retain(|k| matches!(k.item, Item::Row(id) if id % 2 == 0));
        assert_eq!(s.size().2, 5);
        let got = s.get_many((0..10).map(key).collect::<Vec<_>>().iter());
        for (i, g) in got.iter().enumerate() {
            assert_eq!(g.is_some(), i % 2 == 0);
        }
    }
}
