//! First come, first served: requests leave in the order they asked.

use std::collections::VecDeque;

use super::{IncastQueue, Pending};

#[derive(Debug, Default)]
pub struct Fcfs {
    queue: VecDeque<Pending>,
}

impl IncastQueue for Fcfs {
    fn push(&mut self, request: Pending) {
        self.queue.push_back(request);
    }

    fn peek(&self) -> Option<&Pending> {
        self.queue.front()
    }

    fn pop(&mut self) -> Option<Pending> {
        self.queue.pop_front()
    }

    fn remove(&mut self, id: u64, sender: u32) -> bool {
        let before = self.queue.len();
        self.queue.retain(|r| !(r.id == id && r.sender == sender));
        self.queue.len() != before
    }

    fn len(&self) -> usize {
        self.queue.len()
    }
}
