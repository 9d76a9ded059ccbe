//! A request's latency budget and trace id: fixed when its first byte arrives, read by every
//! stage after that.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::error::{RequestError, Stage};

/// A request's latency budget, fixed when it arrives, and the id that follows it through
/// every role (logs, wire frames, the client's `x-request-id`).
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    /// When the request arrived (its first byte, where the front door knows it).
    pub start: Instant,
    pub budget: Duration,
    pub trace_id: u64,
    /// The same instant on the wall clock, for the deadline other processes read.
    start_unix: Duration,
}

impl Budget {
    pub fn new(start: Instant, budget_ms: f64) -> Budget {
        let now_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Budget {
            start,
            budget: Duration::from_secs_f64(budget_ms / 1e3),
            trace_id: next_trace_id(),
            start_unix: now_unix.saturating_sub(start.elapsed()),
        }
    }

    pub fn left(&self) -> Duration {
        self.budget.saturating_sub(self.start.elapsed())
    }

    pub fn deadline_unix_us(&self) -> u64 {
        (self.start_unix + self.budget).as_micros() as u64
    }

    /// When the request arrived, Unix µs: the time its lookups read table versions at.
    pub fn start_unix_us(&self) -> u64 {
        self.start_unix.as_micros() as u64
    }

    /// The error for a budget that ran out in `stage`.
    pub fn expired(&self, stage: Stage) -> RequestError {
        RequestError::deadline(
            stage,
            self.budget.as_secs_f64() * 1e3,
            self.start.elapsed().as_secs_f64() * 1e3,
        )
    }

    /// Fails if the budget is spent, naming the stage that spent it.
    pub fn check(&self, stage: Stage) -> Result<(), RequestError> {
        if self.left().is_zero() {
            Err(self.expired(stage))
        } else {
            Ok(())
        }
    }
}

/// Unique per process and unlikely to repeat across processes: a per-process random start
/// (from the clock and the pid) plus a counter. Never 0, which the wire reads as "none".
fn next_trace_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static BASE: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let base = *BASE.get_or_init(|| {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        // A multiplicative hash spreads nearby seeds far apart.
        (nanos ^ ((std::process::id() as u64) << 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    });
    match base.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) {
        0 => 1,
        id => id,
    }
}
