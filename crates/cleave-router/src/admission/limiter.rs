//! The adaptive rule's gate: charges requests against the gradient's limit (gradient.rs), and
//! lets a request that does not fit wait briefly for a slot, as Facebook's "Fail at Scale"
//! queues do (CoDel + adaptive LIFO):
//!
//! * a request waits at most `INTERVAL` (100 ms), or `TARGET` (5 ms) while the queue is
//!   standing (not empty for `INTERVAL`: overload, when waiting only adds latency), unless
//!   its budget has room for longer: it may always wait until the share of its budget that
//!   admission works to (`admit_share`) is used up but for 1.5 times the usual service time.
//!   A short stall of the machine leaves a queue standing for a while without any overload,
//!   and a request with a 1 s budget refused after 5 ms of it was refused for nothing
//!   (measured: refusals at 40% load after a 90 ms guest stall, and while a model version was
//!   unloaded, docs/benchmarks.md);
//! * never longer than its budget leaves after 1.5 times the usual service time: what would
//!   not finish in time is refused at once;
//! * a standing queue serves the newest first (its oldest are likely to miss their budgets
//!   anyway), an occasional one oldest first;
//!
//! The wait lets a slot freed by a finished request go straight to a request that is ready,
//! instead of idling until the next arrival (measured: docs/benchmarks.md).

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::gradient::{Gradient, Sample, TOLERANCE, WINDOW};

/// The longest wait, and how long the queue must stay non-empty to count as standing.
pub const INTERVAL: Duration = Duration::from_millis(100);
/// The longest wait while the queue is standing.
pub const TARGET: Duration = Duration::from_millis(5);

pub struct Limiter {
    state: Mutex<State>,
}

struct State {
    gradient: Gradient,
    budgets: LeastBudget,
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
                budgets: LeastBudget::new(now),
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
    /// of the budget allows; `share_left`: what is left of the share of its budget admission
    /// works to (`admit_share` × budget, less the time it spent before the door).
    pub async fn acquire(
        &self,
        rows: u64,
        left: Duration,
        share_left: Duration,
        healthy: usize,
    ) -> Result<(), Full> {
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
            // expire), and at most INTERVAL (TARGET in a standing queue) or what the share
            // of its budget leaves, whichever is longer: a wait up to the whole budget ends
            // late in it (measured: 504s and a p99 near the budget).
            let service = s.gradient.expected(rows).mul_f64(TOLERANCE);
            let slack = left.saturating_sub(service);
            let cap = if standing { TARGET } else { INTERVAL };
            let wait = slack.min(cap.max(share_left.saturating_sub(service)));
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

    /// A request's rows and whole budget became known (its body was read).
    pub fn sized(&self, rows: u64, budget: Duration) {
        let mut s = self.lock();
        s.gradient.sized(rows);
        s.budgets.record(budget, Instant::now());
    }

    /// The least budget of the requests sized lately: what a request whose budget is in its
    /// body, unread at the door, is taken to have while it waits there (None: none sized).
    pub fn least_budget(&self) -> Option<Duration> {
        self.lock().budgets.get(Instant::now())
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

/// The least budget over the current and the previous `WINDOW`: the least, so that a request
/// taken to have it never waits at the door past what its real budget allows.
struct LeastBudget {
    current: Option<Duration>,
    previous: Option<Duration>,
    started: Instant,
}

impl LeastBudget {
    fn new(now: Instant) -> LeastBudget {
        LeastBudget {
            current: None,
            previous: None,
            started: now,
        }
    }

    fn rotate(&mut self, now: Instant) {
        let age = now.saturating_duration_since(self.started);
        if age >= WINDOW {
            self.previous = if age < 2 * WINDOW { self.current } else { None };
            self.current = None;
            self.started = now;
        }
    }

    fn record(&mut self, budget: Duration, now: Instant) {
        self.rotate(now);
        self.current = Some(self.current.map_or(budget, |c| c.min(budget)));
    }

    fn get(&mut self, now: Instant) -> Option<Duration> {
        self.rotate(now);
        match (self.current, self.previous) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
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

    const SECOND: Duration = Duration::from_secs(1);

    #[tokio::test]
    async fn a_request_that_does_not_fit_waits_for_a_slot_or_is_refused() {
        // A fresh limiter (one ranker, no size seen) holds 16 requests: 16 of one row.
        let l = Limiter::new(64);
        for _ in 0..16 {
            assert_eq!(l.acquire(1, SECOND, Duration::ZERO, 1).await, Ok(()));
        }
        // No budget left to wait: refused at once.
        let e = l
            .acquire(1, Duration::ZERO, Duration::ZERO, 1)
            .await
            .unwrap_err();
        assert_eq!((e.in_flight, e.limit), (16, 16));
        // With budget: it waits, and gets the room the first one frees.
        let l = std::sync::Arc::new(l);
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move { l.acquire(1, SECOND, Duration::ZERO, 1).await })
        };
        while l.lock().waiting.is_empty() {
            tokio::task::yield_now().await;
        }
        l.release(1);
        assert_eq!(waiter.await.unwrap(), Ok(()));
        assert_eq!(l.in_flight(), 16);
        // Full again, and nothing frees room: it gives up after INTERVAL (its budget would
        // allow more), and leaves the queue.
        let e = l.acquire(1, SECOND, Duration::ZERO, 1).await;
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
            let mut held = std::pin::pin!(l.acquire(1, SECOND, Duration::ZERO, 1));
            assert_eq!(held.as_mut().poll(&mut cx), Poll::Ready(Ok(())));
        }
        // Many more than the limit's worth of clients that leave just after their grant.
        for _ in 0..40 {
            {
                let mut waiter = Box::pin(l.acquire(1, SECOND, Duration::ZERO, 1));
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
            let mut next = std::pin::pin!(l.acquire(1, SECOND, Duration::ZERO, 1));
            assert_eq!(next.as_mut().poll(&mut cx), Poll::Ready(Ok(())));
        }
        // A waiter dropped before any grant leaves the queue.
        {
            let mut waiter = Box::pin(l.acquire(1, SECOND, Duration::ZERO, 1));
            assert!(waiter.as_mut().poll(&mut cx).is_pending());
        }
        assert!(l.lock().waiting.is_empty());
        assert_eq!(l.in_flight(), 16);
    }

    #[test]
    fn the_door_takes_the_least_budget_of_the_last_one_or_two_windows() {
        let t0 = Instant::now();
        let mut least = LeastBudget::new(t0);
        assert_eq!(least.get(t0), None);
        least.record(SECOND, t0);
        least.record(Duration::from_millis(250), t0);
        assert_eq!(least.get(t0 + WINDOW), Some(Duration::from_millis(250)));
        // Aged out after two windows with no smaller budget seen.
        least.record(SECOND, t0 + WINDOW);
        assert_eq!(least.get(t0 + 2 * WINDOW), Some(SECOND));
        assert_eq!(least.get(t0 + 4 * WINDOW), None);
    }

    /// A queue left standing by a stall of the machine (no overload) refused requests with a
    /// 1 s budget after 5 ms of waiting; one whose budget's share has room waits for it.
    #[tokio::test(start_paused = true)]
    async fn a_standing_queue_lets_a_request_wait_within_its_budgets_share() {
        let l = Limiter::new(64);
        for _ in 0..16 {
            assert_eq!(l.acquire(1, SECOND, Duration::ZERO, 1).await, Ok(()));
        }
        // A queue that has stood for INTERVAL: one request waiting all along.
        let (grant, _waiting) = oneshot::channel();
        {
            let mut s = l.lock();
            s.waiting.push_back(Waiter {
                id: u64::MAX,
                rows: 1,
                grant,
            });
            s.empty_at = Instant::now() - INTERVAL;
        }
        // No share of its budget left: TARGET, as "Fail at Scale"'s standing queues.
        let start = tokio::time::Instant::now();
        assert!(l.acquire(1, SECOND, Duration::ZERO, 1).await.is_err());
        assert_eq!(start.elapsed(), TARGET);
        // 300 ms of its share left: it waits for them before it is refused.
        let start = tokio::time::Instant::now();
        let share = Duration::from_millis(300);
        assert!(l.acquire(1, SECOND, share, 1).await.is_err());
        assert_eq!(start.elapsed(), share);
        // Never past what its whole budget leaves.
        let start = tokio::time::Instant::now();
        let left = Duration::from_millis(50);
        assert!(l.acquire(1, left, share, 1).await.is_err());
        assert_eq!(start.elapsed(), left);
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
        assert_eq!(l.acquire(16, SECOND, Duration::ZERO, 1).await, Ok(()));
        // 14 ms left: 4 ms more than the usual latency, less than 1.5 times it. Waiting, it
        // would likely expire: it is refused at once.
        let start = tokio::time::Instant::now();
        assert!(l
            .acquire(1, Duration::from_millis(14), Duration::ZERO, 1)
            .await
            .is_err());
        assert_eq!(start.elapsed(), Duration::ZERO);
        // 20 ms left: it waits its 5 ms of slack, then gives up.
        assert!(l
            .acquire(1, Duration::from_millis(20), Duration::ZERO, 1)
            .await
            .is_err());
        assert_eq!(start.elapsed(), Duration::from_millis(5));
    }
}
