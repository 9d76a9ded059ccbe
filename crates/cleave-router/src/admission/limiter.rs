//! The adaptive rule's gate: charges requests against the gradient's limit (gradient.rs), and
//! lets a request that does not fit wait briefly for a slot, as Facebook's "Fail at Scale"
//! queues do (CoDel + adaptive LIFO):
//!
//! * a request waits at most `INTERVAL` (100 ms), or `TARGET` (5 ms) while the queue is
//!   standing (not empty for `INTERVAL`: overload, when waiting only adds latency), and never
//!   longer than its budget leaves after 1.5 times the usual service time: what would not finish in
//!   time is refused at once;
//! * a standing queue serves the newest first (its oldest are likely to miss their budgets
//!   anyway), an occasional one oldest first;
//!
//! The wait lets a slot freed by a finished request go straight to a request that is ready,
//! instead of idling until the next arrival (measured: docs/benchmarks.md).

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::gradient::{Gradient, Sample, TOLERANCE};

/// The longest wait, and how long the queue must stay non-empty to count as standing.
pub const INTERVAL: Duration = Duration::from_millis(100);
/// The longest wait while the queue is standing.
pub const TARGET: Duration = Duration::from_millis(5);

pub struct Limiter {
    state: Mutex<State>,
}

struct State {
    gradient: Gradient,
    waiting: VecDeque<Waiter>,
    /// When the queue was last empty.
    empty_at: Instant,
    next_id: u64,
}

struct Waiter {
    id: u64,
    rows: u64,
    grant: oneshot::Sender<()>,
}

/// Why a request was not let in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Full {
    pub limit: u64,
    pub in_flight: u64,
}

impl Limiter {
    pub fn new(max_in_flight: usize) -> Limiter {
        let now = Instant::now();
        Limiter {
            state: Mutex::new(State {
                gradient: Gradient::new(max_in_flight, now),
                waiting: VecDeque::new(),
                empty_at: now,
                next_id: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn limit(&self) -> u64 {
        self.lock().gradient.limit()
    }

    /// The least latency a request of `rows` was measured to take, when the `left` of its
    /// budget is below it (gradient.rs: a probe may go through); `own`: rows it holds.
    pub fn beyond_reach(&self, rows: u64, left: Duration, own: u64) -> Option<Duration> {
        self.lock()
            .gradient
            .beyond_reach(rows, left, own, Instant::now())
    }

    /// A new request's charge before its body is read.
    pub fn door_cost(&self) -> u64 {
        self.lock().gradient.door_cost()
    }

    /// Charges a new request's `rows` (its door charge), waiting for room within what `left`
    /// of the budget allows.
    pub async fn acquire(&self, rows: u64, left: Duration, healthy: usize) -> Result<(), Full> {
        let (id, granted, wait) = {
            let mut s = self.lock();
            let now = Instant::now();
            s.gradient.refresh(now, healthy);
            if s.waiting.is_empty() && s.gradient.fits(rows) {
                s.gradient.charge(rows, true);
                return Ok(());
            }
            let full = s.full();
            let standing = !s.waiting.is_empty() && now - s.empty_at >= INTERVAL;
            // What its budget leaves after the tolerated service time (1.5 times the usual:
            // a request served in its usual time is the median, and half of those would
            // expire), and at most INTERVAL (TARGET in a standing queue): a longer
            // wait ends late in its budget (measured: waits up to the whole budget ran into
            // 504s and a p99 near the budget).
            let slack = left.saturating_sub(s.gradient.expected(rows).mul_f64(TOLERANCE));
            let wait = slack.min(if standing { TARGET } else { INTERVAL });
            // No cap on how many wait: each waits a bounded time, and `max_in_flight` bounds
            // them all (a cap of the limit's worth of requests refused arrivals at 0.4× capacity
            // whenever the limit sat near its floor: measured).
            if wait.is_zero() {
                return Err(full);
            }
            if s.waiting.is_empty() {
                s.empty_at = now;
            }
            let (grant, granted) = oneshot::channel();
            let id = s.next_id;
            s.next_id += 1;
            s.waiting.push_back(Waiter { id, rows, grant });
            (id, granted, wait)
        };
        // Dropped while it waits (the client left: hyper drops the request's future), the
        // wait gives back what it was granted: a grant sent to a future that never looks
        // at it again would stay charged forever, and enough of them fill the limit with
        // requests that do not exist, so that every later one is refused.
        let mut wait_guard = Waiting {
            limiter: self,
            id,
            rows,
            granted,
            settled: false,
        };
        if let Ok(Ok(())) = tokio::time::timeout(wait, &mut wait_guard.granted).await {
            wait_guard.settled = true;
            return Ok(());
        }
        // Granted between the timer and this lock, or still waiting: decided under the lock.
        wait_guard.settled = true;
        let mut s = self.lock();
        if wait_guard.granted.try_recv().is_ok() {
            return Ok(());
        }
        s.waiting.retain(|w| w.id != id);
        Err(s.full())
    }

    /// Gives back a request's whole charge, and lets waiting requests in.
    pub fn release(&self, cost: u64) {
        let mut s = self.lock();
        s.gradient.uncharge(cost, true);
        s.grant(Instant::now());
    }

    /// Adds to a request's charge, limit or not.
    pub fn top_up(&self, extra: u64) {
        self.lock().gradient.charge(extra, false);
    }

    /// Takes back part of a request's charge (it is smaller than charged at the door).
    pub fn refund(&self, extra: u64) {
        let mut s = self.lock();
        s.gradient.uncharge(extra, false);
        s.grant(Instant::now());
    }

    pub fn sized(&self, rows: u64) {
        self.lock().gradient.sized(rows);
    }

    pub fn admitted(&self, rows: u64) {
        self.lock().gradient.admitted(rows, Instant::now());
    }

    pub fn in_flight(&self) -> u64 {
        self.lock().gradient.in_flight()
    }

    pub fn observe(&self, sample: Sample) {
        let mut s = self.lock();
        let now = Instant::now();
        s.gradient.observe(sample, now);
        s.grant(now);
    }
}

/// A request waiting in `acquire`; settles its place if the wait is dropped unfinished.
struct Waiting<'a> {
    limiter: &'a Limiter,
    id: u64,
    rows: u64,
    granted: oneshot::Receiver<()>,
    /// Set once `acquire` decided the outcome itself.
    settled: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let mut s = self.limiter.lock();
        if self.granted.try_recv().is_ok() {
            // Charged for this request by `grant`; nobody will release it: give it back.
            s.gradient.uncharge(self.rows, true);
            s.grant(Instant::now());
        } else {
            let id = self.id;
            s.waiting.retain(|w| w.id != id);
        }
    }
}

impl State {
    fn full(&self) -> Full {
        Full {
            limit: self.gradient.limit(),
            in_flight: self.gradient.in_flight(),
        }
    }

    /// Lets waiting requests in while they fit: newest first while the queue is standing.
    fn grant(&mut self, now: Instant) {
        loop {
            let standing = now - self.empty_at >= INTERVAL;
            let next = if standing {
                self.waiting.back()
            } else {
                self.waiting.front()
            };
            let Some(w) = next else {
                self.empty_at = now;
                return;
            };
            // One whose request was dropped (the client left) is skipped.
            if !w.grant.is_closed() && !self.gradient.fits(w.rows) {
                return;
            }
            let w = if standing {
                self.waiting.pop_back()
            } else {
                self.waiting.pop_front()
            };
            let Some(w) = w else { return };
            if w.grant.is_closed() {
                continue;
            }
            self.gradient.charge(w.rows, true);
            if w.grant.send(()).is_err() {
                self.gradient.uncharge(w.rows, true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_that_does_not_fit_waits_for_a_slot_or_is_refused() {
        // A fresh limiter (one ranker, no size seen) holds 16 requests: 16 of one row.
        let l = Limiter::new(64);
        for _ in 0..16 {
            assert_eq!(l.acquire(1, Duration::from_secs(1), 1).await, Ok(()));
        }
        // No budget left to wait: refused at once.
        let e = l.acquire(1, Duration::ZERO, 1).await.unwrap_err();
        assert_eq!((e.in_flight, e.limit), (16, 16));
        // With budget: it waits, and gets the room the first one frees.
        let l = std::sync::Arc::new(l);
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move { l.acquire(1, Duration::from_secs(1), 1).await })
        };
        while l.lock().waiting.is_empty() {
            tokio::task::yield_now().await;
        }
        l.release(1);
        assert_eq!(waiter.await.unwrap(), Ok(()));
        assert_eq!(l.in_flight(), 16);
        // Full again, and nothing frees room: it gives up after INTERVAL (its budget would
        // allow more), and leaves the queue.
        let e = l.acquire(1, Duration::from_secs(1), 1).await;
        assert!(e.is_err());
        assert!(l.lock().waiting.is_empty());
    }

    /// The overload wedge (docs/benchmarks.md, "Pass-by-reference between co-located roles"):
    /// a request granted a slot while it waited, whose client left before it looked at the
    /// grant, kept its charge; after the limit's worth of those every request was refused.
    #[test]
    fn a_wait_dropped_after_its_grant_gives_the_charge_back() {
        use std::future::Future;
        use std::task::{Context, Poll, Waker};

        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let _enter = rt.enter();
        let l = Limiter::new(64);
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..16 {
            let mut held = std::pin::pin!(l.acquire(1, Duration::from_secs(1), 1));
            assert_eq!(held.as_mut().poll(&mut cx), Poll::Ready(Ok(())));
        }
        // Many more than the limit's worth of clients that leave just after their grant.
        for _ in 0..40 {
            {
                let mut waiter = Box::pin(l.acquire(1, Duration::from_secs(1), 1));
                assert!(
                    waiter.as_mut().poll(&mut cx).is_pending(),
                    "the limit is full"
                );
                assert_eq!(l.lock().waiting.len(), 1);
                l.release(1); // a request finishes: its slot is granted to the waiter
                assert_eq!(l.in_flight(), 16, "charged to the waiter");
                drop(waiter); // its client left before the grant was looked at
            }
            assert_eq!(l.in_flight(), 15, "the grant came back");
            assert!(l.lock().waiting.is_empty());
            let mut next = std::pin::pin!(l.acquire(1, Duration::from_secs(1), 1));
            assert_eq!(next.as_mut().poll(&mut cx), Poll::Ready(Ok(())));
        }
        // A waiter dropped before any grant leaves the queue.
        {
            let mut waiter = Box::pin(l.acquire(1, Duration::from_secs(1), 1));
            assert!(waiter.as_mut().poll(&mut cx).is_pending());
        }
        assert!(l.lock().waiting.is_empty());
        assert_eq!(l.in_flight(), 16);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_waits_only_if_it_can_still_finish_at_a_tolerated_latency() {
        let l = Limiter::new(64);
        l.observe(Sample {
            cost: 1,
            latency: Duration::from_millis(10), // the usual latency of a 1-row request
            allowed: Duration::from_secs(1),
            in_flight: 16,
            expired: false,
        });
        assert_eq!(l.acquire(16, Duration::from_secs(1), 1).await, Ok(()));
        // 14 ms left: 4 ms more than the usual latency, less than 1.5 times it. Waiting, it
        // would likely expire: it is refused at once.
        let start = tokio::time::Instant::now();
        assert!(l.acquire(1, Duration::from_millis(14), 1).await.is_err());
        assert_eq!(start.elapsed(), Duration::ZERO);
        // 20 ms left: it waits its 5 ms of slack, then gives up.
        assert!(l.acquire(1, Duration::from_millis(20), 1).await.is_err());
        assert_eq!(start.elapsed(), Duration::from_millis(5));
    }
}
