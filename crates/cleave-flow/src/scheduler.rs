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
    /// With `with_measured_rate`: B learnt from granted messages' transfers.
    measured: Option<Measured>,
}

/// How fast granted messages actually arrive: each one's time from its grant to its
/// completion per byte, as a moving average. It replaces the configured link rate in
/// d = now + SLO − M/B once there is a sample: a link that moves a message faster than its
/// nominal rate (a shaper's burst, a faster path) would otherwise make expiry drop requests
/// that would still make their SLO, and a congested one slower than it would be granted late.
#[derive(Default)]
struct Measured {
    granted_ns: HashMap<(u32, u64), u64>,
    ns_per_byte: Option<f64>,
}

/// Weight of the newest transfer in the moving average.
const RATE_ALPHA: f64 = 0.2;

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
            measured: None,
        }
    }

    /// Learn B from granted messages' transfers (needs the clock of `with_expiry`): see
    /// [`Measured`].
    pub fn with_measured_rate(mut self) -> IncastScheduler {
        self.measured = Some(Measured::default());
        self
    }

    /// B now, bytes/s: the measured rate once there is one, else the configured link rate.
    pub fn rate_bytes_per_s(&self) -> f64 {
        match self.measured.as_ref().and_then(|m| m.ns_per_byte) {
            Some(ns) if ns > 0.0 => 1e9 / ns,
            _ => self.link_bytes_per_s,
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
        let start_by = start_by_ns(now_ns, slo_left_ns, bytes, self.rate_bytes_per_s());
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
            let now = self.clock.map(|c| c());
            if let (Some(m), Some(now)) = (self.measured.as_mut(), now) {
                if let Some(t0) = m.granted_ns.remove(&(sender, id)) {
                    let sample = now.saturating_sub(t0) as f64 / bytes.max(1) as f64;
                    m.ns_per_byte = Some(match m.ns_per_byte {
                        Some(avg) => avg + RATE_ALPHA * (sample - avg),
                        None => sample,
                    });
                }
            }
        }
        self.pump()
    }

    /// The sender will not send message `id` after all (its request gave up waiting, or the
    /// payload went elsewhere): a queued request leaves the queue, a granted one frees its
    /// space. An unknown (sender, id) changes nothing.
    pub fn withdraw(&mut self, sender: u32, id: u64) -> Vec<Grant> {
        if let Some(m) = self.measured.as_mut() {
            m.granted_ns.remove(&(sender, id)); // not sent: no transfer to learn from
        }
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
            if let Some(m) = self.measured.as_mut() {
                m.granted_ns.remove(&key);
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
            if let (Some(m), Some(now)) = (self.measured.as_mut(), now) {
                m.granted_ns.insert((p.sender, p.id), now);
            }
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

    static NOW_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    fn test_clock() -> u64 {
        NOW_NS.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn set_clock(ns: u64) {
        NOW_NS.store(ns, std::sync::atomic::Ordering::Relaxed);
    }

    #[test]
    fn a_measured_rate_replaces_the_configured_one_in_the_start_by_deadline() {
        // Configured 1 byte/µs: 1,000 bytes take 1 ms. They arrive in 0.1 ms instead.
        let mut s = IncastScheduler::new(1_000, Order::Edf, 1e6)
            .with_expiry(test_clock)
            .with_measured_rate();
        set_clock(0);
        assert_eq!(
            s.rate_bytes_per_s(),
            1e6,
            "no transfer yet: the configured rate"
        );
        assert_eq!(ids(&s.request(1, 1, 1_000, 10_000_000, 0)), vec![1]);
        set_clock(100_000);
        assert!(s.complete(1, 1).is_empty());
        assert_eq!(s.rate_bytes_per_s(), 1e7);
        // 1.5 ms of SLO left: start by 1.4 ms (measured), not 0.5 ms (configured).
        assert_eq!(ids(&s.request(1, 2, 1_000, 10_000_000, 100_000)), vec![2]);
        assert!(s.request(2, 3, 1_000, 1_500_000, 100_000).is_empty());
        set_clock(1_100_000); // 1 ms later: past the configured start-by, before the measured
        assert_eq!(ids(&s.complete(1, 2)), vec![3], "granted, not expired");
        assert!(s.take_expired().is_empty());
        // A withdrawn grant teaches nothing.
        assert!(s.withdraw(2, 3).is_empty());
        assert_eq!(s.measured.as_ref().map(|m| m.granted_ns.len()), Some(0));
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
