//! Least-recently-used eviction.

use super::policy::{Policy, SlotList};

pub struct Lru {
    list: SlotList,
}

impl Lru {
    pub fn new(capacity: usize) -> Lru {
        Lru {
            list: SlotList::new(capacity),
        }
    }
}

impl Policy for Lru {
    fn touch(&mut self, slot: u32) {
        if self.list.head != slot {
            self.list.remove(slot);
            self.list.push_front(slot);
        }
    }

    fn insert(&mut self, slot: u32) {
        self.list.push_front(slot);
    }

    fn evict(&mut self) -> u32 {
        let victim = self.list.tail;
        self.list.remove(victim);
        victim
    }
}
