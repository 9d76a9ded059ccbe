//! First in, first out: requests start in the order they arrived.

use std::collections::VecDeque;

use super::{Queued, RequestQueue};

#[derive(Debug)]
pub struct Fifo<T>(VecDeque<T>);

impl<T> Default for Fifo<T> {
    fn default() -> Fifo<T> {
        Fifo(VecDeque::new())
    }
}

impl<T: Queued + Send> RequestQueue<T> for Fifo<T> {
    fn push(&mut self, item: T) {
        self.0.push_back(item);
    }

    fn pop(&mut self) -> Option<T> {
        self.0.pop_front()
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}
