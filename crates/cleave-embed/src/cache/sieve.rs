//! SIEVE eviction (Zhang et al., "SIEVE is Simpler than LRU", NSDI '24): entries stay in
//! insertion order; a hit sets a visited bit; the hand walks from the oldest entry towards the
//! newest, clearing visited bits, and evicts the first unvisited entry. A scan of one-time rows
//! passes through without pushing out the rows that are hit again.

use super::policy::{Policy, SlotList, NIL};

pub struct Sieve {
    list: SlotList,
    visited: Vec<bool>,
    /// Where the last eviction stopped (NIL: start from the tail).
    hand: u32,
}

impl Sieve {
    pub fn new(capacity: usize) -> Sieve {
        Sieve {
            list: SlotList::new(capacity),
            visited: vec![false; capacity],
            hand: NIL,
        }
    }
}

impl Policy for Sieve {
    fn touch(&mut self, slot: u32) {
        self.visited[slot as usize] = true;
    }

    fn insert(&mut self, slot: u32) {
        self.visited[slot as usize] = false;
        self.list.push_front(slot);
    }

    fn evict(&mut self) -> u32 {
        let mut hand = if self.hand == NIL {
            self.list.tail
        } else {
            self.hand
        };
        // Each step clears a bit, so two passes over the entries always find a victim.
        for _ in 0..2 * self.visited.len() + 1 {
            if !self.visited[hand as usize] {
                break;
            }
            self.visited[hand as usize] = false;
            hand = match self.list.prev(hand) {
                NIL => self.list.tail,
                p => p,
            };
        }
        let next = self.list.prev(hand);
        self.hand = next;
        self.list.remove(hand);
        hand
    }
}
