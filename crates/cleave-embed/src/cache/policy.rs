//! The eviction policy of a cache of fixed slots: which resident slot to give up when a new
//! entry needs one. One file per policy; the cache calls them under its lock.

use std::str::FromStr;

/// A policy tracks slots `0..capacity`; the cache tells it about hits and inserts and asks it
/// for a victim when every slot is taken.
pub trait Policy: Send {
    /// A resident slot was hit.
    fn touch(&mut self, slot: u32);
    /// `slot` now holds a new entry.
    fn insert(&mut self, slot: u32);
    /// Chooses a resident slot to evict and forgets it. Only called with at least one
    /// resident slot.
    fn evict(&mut self) -> u32;
}

/// The policies a cache can be built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PolicyKind {
    /// Least recently used: a hit moves the entry to the front of a list.
    Lru,
    /// SIEVE (Zhang et al., NSDI '24): FIFO order plus a visited bit that a moving hand
    /// clears; scan-resistant, and a hit only sets a bit.
    #[default]
    Sieve,
}

impl PolicyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Sieve => "sieve",
        }
    }

    /// A new policy for `capacity` slots.
    pub fn build(self, capacity: usize) -> Box<dyn Policy> {
        match self {
            PolicyKind::Lru => Box::new(super::lru::Lru::new(capacity)),
            PolicyKind::Sieve => Box::new(super::sieve::Sieve::new(capacity)),
        }
    }
}

impl FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<PolicyKind, String> {
        match s {
            "lru" => Ok(PolicyKind::Lru),
            "sieve" => Ok(PolicyKind::Sieve),
            other => Err(format!(
                "cache policy must be \"lru\" or \"sieve\", found {other:?}"
            )),
        }
    }
}

/// A doubly-linked list over slot numbers (no allocation per entry), shared by the policies.
#[derive(Debug)]
pub(crate) struct SlotList {
    prev: Vec<u32>,
    next: Vec<u32>,
    pub head: u32,
    pub tail: u32,
}

pub(crate) const NIL: u32 = u32::MAX;

impl SlotList {
    pub fn new(capacity: usize) -> SlotList {
        SlotList {
            prev: vec![NIL; capacity],
            next: vec![NIL; capacity],
            head: NIL,
            tail: NIL,
        }
    }

    pub fn push_front(&mut self, slot: u32) {
        let s = slot as usize;
        self.prev[s] = NIL;
        self.next[s] = self.head;
        if self.head != NIL {
            self.prev[self.head as usize] = slot;
        } else {
            self.tail = slot;
        }
        self.head = slot;
    }

    pub fn remove(&mut self, slot: u32) {
        let s = slot as usize;
        let (p, n) = (self.prev[s], self.next[s]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.tail = p;
        }
        self.prev[s] = NIL;
        self.next[s] = NIL;
    }

    /// The slot towards the head from `slot` (NIL at the head).
    pub fn prev(&self, slot: u32) -> u32 {
        self.prev[slot as usize]
    }
}
