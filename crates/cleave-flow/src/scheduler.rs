//! The ranker's incast scheduler: requests-to-send come in, grants go out, never more bytes in
//! flight than the window allows. The queue's policy picks which delayed request goes next;
//! the head waits until it fits (no skipping ahead), so a large request is never starved by
//! smaller ones behind it.

use std::collections::HashMap;

use crate::queue::{start_by_ns, IncastQueue, Order, Pending};
use crate::window::IncastWindow;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub sender: u32,
    pub id: u64,
    pub bytes: u64,
}

pub struct IncastScheduler {
    window: IncastWindow,
    queue: Box<dyn IncastQueue>,
    link_bytes_per_s: f64,
    in_flight: HashMap<(u32, u64), u64>,
    seq: u64,
    /// With a clock, a request whose start-by deadline has passed when it reaches the head of
    /// the queue is dropped instead of granted: even at the full link rate it would arrive
    /// after its SLO, and sending it would only make the requests behind it late too.
    clock: Option<fn() -> u64>,
    expired: Vec<Pending>,
}

impl IncastScheduler {
    /// `window_bytes` = `u64::MAX` is no control; `link_bytes_per_s` is B in d = now + SLO − M/B.
    pub fn new(window_bytes: u64, order: Order, link_bytes_per_s: f64) -> IncastScheduler {
        IncastScheduler {
            window: IncastWindow::new(window_bytes),
            queue: order.queue(),
            link_bytes_per_s,
            in_flight: HashMap::new(),
            seq: 0,
            clock: None,
            expired: Vec::new(),
        }
    }

    /// Drop requests that can no longer meet their SLO, reading "now" (ns, the clock of
    /// `request`'s `now_ns`) from `clock`; `take_expired` gives them.
    pub fn with_expiry(mut self, clock: fn() -> u64) -> IncastScheduler {
        self.clock = Some(clock);
        self
    }

    /// The requests dropped as expired since the last call.
    pub fn take_expired(&mut self) -> Vec<Pending> {
        std::mem::take(&mut self.expired)
    }

    pub fn window(&self) -> &IncastWindow {
        &self.window
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// A request-to-send; the grants it (or nothing) allows now.
    pub fn request(
        &mut self,
        sender: u32,
        id: u64,
        bytes: u64,
        slo_left_ns: u64,
        now_ns: u64,
    ) -> Vec<Grant> {
        if self.in_flight.contains_key(&(sender, id)) {
            tracing::warn!(
                sender,
                id,
                "request-to-send repeats an id in flight; ignored"
            );
            return Vec::new();
        }
        let start_by = start_by_ns(now_ns, slo_left_ns, bytes, self.link_bytes_per_s);
        self.seq += 1;
        self.queue.push(Pending {
            id,
            sender,
            bytes,
            start_by_ns: start_by,
            seq: self.seq,
        });
        self.pump()
    }

    /// Every byte of a granted message arrived: its space frees, and the next requests may go.
    /// An unknown (sender, id) changes nothing.
    pub fn complete(&mut self, sender: u32, id: u64) -> Vec<Grant> {
        if let Some(bytes) = self.in_flight.remove(&(sender, id)) {
            self.window.release(bytes);
        }
        self.pump()
    }

    /// The sender will not send message `id` after all (its request gave up waiting, or the
    /// payload went elsewhere): a queued request leaves the queue, a granted one frees its
    /// space. An unknown (sender, id) changes nothing.
    pub fn withdraw(&mut self, sender: u32, id: u64) -> Vec<Grant> {
        if !self.queue.remove(id, sender) {
            if let Some(bytes) = self.in_flight.remove(&(sender, id)) {
                self.window.release(bytes);
            }
        }
        self.pump()
    }

    /// A sender went away: its queued requests go, its in-flight bytes free.
    pub fn sender_gone(&mut self, sender: u32) -> Vec<Grant> {
        let mine: Vec<(u32, u64)> = self
            .in_flight
            .keys()
            .filter(|k| k.0 == sender)
            .copied()
            .collect();
        for key in mine {
            if let Some(bytes) = self.in_flight.remove(&key) {
                self.window.release(bytes);
            }
        }
        // Rare (a disconnect), so draining and refilling the queue is cheap enough.
        let mut kept = Vec::with_capacity(self.queue.len());
        while let Some(p) = self.queue.pop() {
            if p.sender != sender {
                kept.push(p);
            }
        }
        for p in kept {
            self.queue.push(p);
        }
        self.pump()
    }

    /// A new window limit (the adaptive window); a larger one may grant at once.
    pub fn set_limit(&mut self, limit: u64) -> Vec<Grant> {
        self.window.set_limit(limit);
        self.pump()
    }

    fn pump(&mut self) -> Vec<Grant> {
        let mut grants = Vec::new();
        let now = self.clock.map(|c| c());
        while let Some(head) = self.queue.peek() {
            if now.is_some_and(|now| head.start_by_ns < now) {
                if let Some(p) = self.queue.pop() {
                    self.expired.push(p);
                }
                continue;
            }
            if !self.window.fits(head.bytes) {
                break;
            }
            let Some(p) = self.queue.pop() else { break };
            if self.in_flight.contains_key(&(p.sender, p.id)) {
                tracing::warn!(
                    sender = p.sender,
                    id = p.id,
                    "request-to-send repeats an id in flight; ignored"
                );
                continue;
            }
            self.window.admit(p.bytes);
            self.in_flight.insert((p.sender, p.id), p.bytes);
            grants.push(Grant {
                sender: p.sender,
                id: p.id,
                bytes: p.bytes,
            });
        }
        grants
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(grants: &[Grant]) -> Vec<u64> {
        grants.iter().map(|g| g.id).collect()
    }

    #[test]
    fn edf_grants_the_tightest_waiting_request_first() {
        // 1 byte/ns; the window holds one 10-byte message.
        let mut s = IncastScheduler::new(10, Order::Edf, 1e9);
        assert_eq!(ids(&s.request(1, 1, 10, 1_000, 0)), vec![1]);
        assert!(s.request(2, 2, 10, 500, 1).is_empty()); // loose
        assert!(s.request(3, 3, 10, 50, 2).is_empty()); // tight, asked later
        assert_eq!(ids(&s.complete(1, 1)), vec![3]);
        assert_eq!(ids(&s.complete(3, 3)), vec![2]);
    }

    #[test]
    fn a_message_larger_than_the_window_goes_alone() {
        let mut s = IncastScheduler::new(10, Order::Fcfs, 1e9);
        assert_eq!(ids(&s.request(1, 1, 50, 1_000, 0)), vec![1]);
        assert!(s.request(1, 2, 1, 1_000, 0).is_empty());
        assert_eq!(ids(&s.complete(1, 1)), vec![2]);
    }

    #[test]
    fn a_departed_sender_frees_its_space_and_its_queue() {
        let mut s = IncastScheduler::new(10, Order::Fcfs, 1e9);
        assert_eq!(ids(&s.request(1, 1, 10, 1_000, 0)), vec![1]);
        assert!(s.request(1, 2, 10, 1_000, 0).is_empty());
        assert!(s.request(2, 3, 10, 1_000, 0).is_empty());
        assert_eq!(ids(&s.sender_gone(1)), vec![3]);
        assert_eq!(s.queued(), 0);
        assert_eq!(s.window().in_flight(), 10);
        // An id already in flight is not granted twice.
        assert!(s.request(2, 3, 10, 1_000, 0).is_empty());
        assert!(s.complete(2, 3).is_empty());
        assert_eq!(s.window().in_flight(), 0);
        assert!(s.complete(9, 9).is_empty()); // unknown: nothing changes
    }

    #[test]
    fn a_withdrawn_request_leaves_the_queue_or_frees_its_space() {
        let mut s = IncastScheduler::new(10, Order::Fcfs, 1e9);
        assert_eq!(ids(&s.request(1, 1, 10, 1_000, 0)), vec![1]);
        assert!(s.request(2, 2, 10, 1_000, 0).is_empty());
        assert!(s.request(3, 3, 10, 1_000, 0).is_empty());
        assert!(s.withdraw(2, 2).is_empty()); // queued: it leaves, 3 still waits for space
        assert_eq!(s.queued(), 1);
        assert_eq!(ids(&s.withdraw(1, 1)), vec![3]); // granted: its space goes to 3
        assert!(s.withdraw(7, 7).is_empty()); // unknown: nothing changes
        assert_eq!(s.window().in_flight(), 10);
    }

    fn at_one_second() -> u64 {
        1_000_000_000
    }

    #[test]
    fn with_expiry_a_hopeless_request_is_dropped_not_granted() {
        // 1 byte/ns: 10 bytes take 10 ns. The clock says 1 s.
        let mut s = IncastScheduler::new(10, Order::Edf, 1e9).with_expiry(at_one_second);
        let now = at_one_second();
        assert_eq!(ids(&s.request(1, 1, 10, 1_000, now)), vec![1]);
        assert!(s.request(2, 2, 10, 5, now).is_empty()); // 5 ns left for 10 ns of transfer
        assert_eq!(
            ids(&s
                .take_expired()
                .iter()
                .map(|p| Grant {
                    sender: p.sender,
                    id: p.id,
                    bytes: p.bytes
                })
                .collect::<Vec<_>>()),
            vec![2]
        );
        assert!(s.request(3, 3, 10, 1_000, now).is_empty()); // waits; can still make it
        assert_eq!(ids(&s.complete(1, 1)), vec![3]);
        assert!(s.take_expired().is_empty());
    }
}
