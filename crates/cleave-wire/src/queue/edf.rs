//! Earliest deadline first (Prism §4.3): the request whose caller stops waiting soonest starts
//! first. Equal deadlines keep arrival order; requests without a deadline wait behind every
//! request that has one (they can never be late), in arrival order.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use super::{Queued, RequestQueue};

#[derive(Debug)]
pub struct Edf<T> {
    heap: BinaryHeap<Reverse<Entry<T>>>,
    next_seq: u64,
}

impl<T> Default for Edf<T> {
    fn default() -> Edf<T> {
        Edf {
            heap: BinaryHeap::new(),
            next_seq: 0,
        }
    }
}

/// Ordered by (deadline, arrival); the item itself takes no part in the order.
#[derive(Debug)]
struct Entry<T> {
    key: (u64, u64),
    item: T,
}

impl<T> PartialEq for Entry<T> {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl<T> Eq for Entry<T> {}

impl<T> PartialOrd for Entry<T> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<T> Ord for Entry<T> {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key.cmp(&other.key)
    }
}

impl<T: Queued + Send> RequestQueue<T> for Edf<T> {
    fn push(&mut self, item: T) {
        let deadline = match item.deadline_unix_us() {
            0 => u64::MAX,
            d => d,
        };
        self.heap.push(Reverse(Entry {
            key: (deadline, self.next_seq),
            item,
        }));
        self.next_seq += 1;
    }

    fn pop(&mut self) -> Option<T> {
        self.heap.pop().map(|Reverse(e)| e.item)
    }

    fn len(&self) -> usize {
        self.heap.len()
    }
}
