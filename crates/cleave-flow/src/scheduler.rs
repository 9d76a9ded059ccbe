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
        }
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
        while let Some(head) = self.queue.peek() {
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
