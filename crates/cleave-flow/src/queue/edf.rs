//! Earliest deadline first (Prism, Algorithm 2): a request's deadline is the latest time it can
//! start and still arrive within its SLO, d = now + SLO − M/B. Ties go to the earlier arrival.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::{IncastQueue, Pending};

/// Prism's d = now + SLO − M/B in ns, for `bytes` at `link_bytes_per_s`. Saturates rather
/// than wrapping: an SLO shorter than the transfer gives a deadline before now.
pub fn start_by_ns(now_ns: u64, slo_ns: u64, bytes: u64, link_bytes_per_s: f64) -> u64 {
    let transfer_ns = if link_bytes_per_s > 0.0 {
        (bytes as f64 / link_bytes_per_s * 1e9).min(u64::MAX as f64) as u64
    } else {
        u64::MAX
    };
    now_ns.saturating_add(slo_ns).saturating_sub(transfer_ns)
}

#[derive(Debug, PartialEq, Eq)]
struct Entry(Pending);

impl Ord for Entry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.0.start_by_ns, self.0.seq).cmp(&(other.0.start_by_ns, other.0.seq))
    }
}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

#[derive(Debug, Default)]
pub struct Edf {
    heap: BinaryHeap<Reverse<Entry>>,
}

impl IncastQueue for Edf {
    fn push(&mut self, request: Pending) {
        self.heap.push(Reverse(Entry(request)));
    }

    fn peek(&self) -> Option<&Pending> {
        self.heap.peek().map(|Reverse(Entry(p))| p)
    }

    fn pop(&mut self) -> Option<Pending> {
        self.heap.pop().map(|Reverse(Entry(p))| p)
    }

    fn remove(&mut self, id: u64, sender: u32) -> bool {
        let before = self.heap.len();
        self.heap
            .retain(|Reverse(Entry(r))| !(r.id == id && r.sender == sender));
        self.heap.len() != before
    }

    fn len(&self) -> usize {
        self.heap.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_is_now_plus_slo_minus_transfer() {
        // 8 MiB at 1 Gbit/s (125e6 B/s) takes 67.108864 ms.
        let d = start_by_ns(1_000_000_000, 500_000_000, 8 << 20, 125e6);
        assert_eq!(d, 1_000_000_000 + 500_000_000 - 67_108_864);
        assert_eq!(start_by_ns(0, 1, 8 << 20, 125e6), 0);
    }
}
