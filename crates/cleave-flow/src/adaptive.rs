//! The adaptive incast window (docs/traffic.md, "Which way the window moves"). Each interval
//! the ranker measures congestion on its receiving sockets (out-of-order segments per MiB
//! received: drops at the queue in front of it) and the rate it achieved against the link
//! rate. Congestion above `high` halves the window: more bytes in flight than the link and its
//! queue hold only add queueing delay and drops. Congestion at or below `low` with requests
//! waiting and the link under-used grows it by one step: the window, not the network, is what
//! holds them back — but only after `grow_after` such intervals in a row: one message can fill
//! the link, so a short dip (the ranker off its core for a few ms) is no reason to add a
//! flow. Between the thresholds it holds, so it does not flap.

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// Out-of-order segments per MiB received at or above which the window shrinks.
    pub high: f64,
    /// At or below which it may grow.
    pub low: f64,
    /// Utilization (achieved / link rate) under which a backlog means the window is too small.
    pub target_utilization: f64,
    /// Consecutive intervals that must call for growth before the window grows.
    pub grow_after: u32,
}

impl Default for Thresholds {
    fn default() -> Thresholds {
        Thresholds {
            high: 2.0,
            low: 0.25,
            target_utilization: 0.9,
            grow_after: 3,
        }
    }
}

/// One interval's measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub congestion: f64,
    pub utilization: f64,
    /// Whether requests waited in the incast queue during the interval.
    pub backlog: bool,
}

#[derive(Debug, Clone)]
pub struct AdaptiveWindow {
    limit: u64,
    min: u64,
    max: u64,
    step: u64,
    thresholds: Thresholds,
    /// Intervals in a row that called for growth.
    wanting: u32,
}

impl AdaptiveWindow {
    /// Starts at `min`; `step` is the additive increase (one message is a good choice).
    pub fn new(min: u64, max: u64, step: u64, thresholds: Thresholds) -> AdaptiveWindow {
        let min = min.max(1);
        AdaptiveWindow {
            limit: min,
            min,
            max: max.max(min),
            step: step.max(1),
            thresholds,
            wanting: 0,
        }
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window after one interval's sample.
    pub fn observe(&mut self, s: Sample) -> u64 {
        let t = self.thresholds;
        let wants_more = s.congestion <= t.low && s.backlog && s.utilization < t.target_utilization;
        self.wanting = if wants_more { self.wanting + 1 } else { 0 };
        if s.congestion >= t.high {
            self.limit = (self.limit / 2).max(self.min);
        } else if self.wanting >= t.grow_after.max(1) {
            self.limit = self.limit.saturating_add(self.step).min(self.max);
            self.wanting = 0;
        }
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w() -> AdaptiveWindow {
        let grow_at_once = Thresholds {
            grow_after: 1,
            ..Thresholds::default()
        };
        AdaptiveWindow::new(8, 64, 8, grow_at_once)
    }

    #[test]
    fn grows_only_after_enough_intervals_in_a_row_call_for_it() {
        let mut a = AdaptiveWindow::new(8, 64, 8, Thresholds::default());
        let clear = Sample {
            congestion: 0.0,
            utilization: 0.5,
            backlog: true,
        };
        let busy_link = Sample {
            utilization: 0.95,
            ..clear
        };
        assert_eq!(a.observe(clear), 8);
        assert_eq!(a.observe(clear), 8);
        assert_eq!(a.observe(busy_link), 8); // the run is broken: count again
        assert_eq!(a.observe(clear), 8);
        assert_eq!(a.observe(clear), 8);
        assert_eq!(a.observe(clear), 16);
        assert_eq!(a.observe(clear), 16);
    }

    #[test]
    fn grows_when_clear_and_held_back_shrinks_on_congestion_holds_between() {
        let mut a = w();
        let clear = Sample {
            congestion: 0.0,
            utilization: 0.5,
            backlog: true,
        };
        assert_eq!(a.observe(clear), 16);
        assert_eq!(a.observe(clear), 24);
        let between = Sample {
            congestion: 1.0,
            utilization: 0.5,
            backlog: true,
        };
        assert_eq!(a.observe(between), 24);
        let busy_link = Sample {
            congestion: 0.0,
            utilization: 0.95,
            backlog: true,
        };
        assert_eq!(a.observe(busy_link), 24);
        let idle = Sample {
            congestion: 0.0,
            utilization: 0.1,
            backlog: false,
        };
        assert_eq!(a.observe(idle), 24);
        let congested = Sample {
            congestion: 10.0,
            utilization: 1.0,
            backlog: true,
        };
        assert_eq!(a.observe(congested), 12);
        assert_eq!(a.observe(congested), 8);
        assert_eq!(a.observe(congested), 8);
        for _ in 0..100 {
            a.observe(clear);
        }
        assert_eq!(a.limit(), 64);
    }
}
