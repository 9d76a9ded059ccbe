//! The estimate rule (`admission = "estimate"`): before a request's body is read, estimate its
//! latency and refuse it at once (503 + Retry-After) when that cannot meet its budget.
//!
//! The estimate of a new request's latency is the time it has already spent (since its first
//! byte), plus moving averages of reading + parsing, of the lookup stage and of the transfer
//! to and from a ranker, plus the wait at the rankers: the least (outstanding + 1) × time per
//! request over the healthy rankers (`RankerPool::expected_wait`), plus the requests admitted
//! here that have not reached a ranker yet, spread over the healthy rankers, plus, while a
//! ranker is busy, one batch's compute time (the batch in progress, which a new request
//! cannot join: measured, leaving it out made admitted requests miss their budgets).
//!
//! Averages only change when requests go through, so a router that sheds everything would
//! keep its estimate forever: when nothing is in flight and nothing was admitted or measured
//! for `PROBE_AFTER`, one request is admitted regardless, to measure again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{retry_after, RankerLoad, Shed, ShedReason, Stages};
use cleave_wire::Ewma;

/// How long an idle router that sheds by its estimate waits before admitting one request to
/// measure again.
const PROBE_AFTER: Duration = Duration::from_secs(1);

/// The stage averages the estimate adds up.
pub struct Estimate {
    /// The share of its budget a request's estimate may fill (`admit_share` in the config).
    admit_share: f64,
    /// Moving averages in µs (0: not measured yet).
    parse_us: Ewma,
    lookup_us: Ewma,
    transfer_us: Ewma,
    /// A ranker batch's compute time (the ranker reports the batch's, not the request's).
    batch_us: Ewma,
    /// When a request was last admitted or measured, in µs since `epoch`.
    last_activity_us: AtomicU64,
    epoch: Instant,
}

impl Estimate {
    pub fn new(admit_share: f64) -> Estimate {
        Estimate {
            admit_share,
            parse_us: Ewma::default(),
            lookup_us: Ewma::default(),
            transfer_us: Ewma::default(),
            batch_us: Ewma::default(),
            last_activity_us: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    /// Feeds the averages from a request that went through.
    pub fn observe(&self, stages: Stages) {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        self.parse_us.update(us(stages.parse));
        self.lookup_us.update(us(stages.lookup));
        self.transfer_us.update(us(stages.transfer));
        self.batch_us.update(us(stages.batch));
        let now_us = self.epoch.elapsed().as_micros() as u64;
        self.last_activity_us.store(now_us, Ordering::Relaxed);
    }

    /// The latency a request would see if admitted now, with `in_flight` requests admitted
    /// before it, less the time already spent.
    pub fn estimate(&self, in_flight: usize, load: &RankerLoad) -> Duration {
        let us = |average: &Ewma| Duration::from_secs_f64(average.get() / 1e6);
        let ahead = (in_flight as u64).saturating_sub(load.outstanding);
        let in_progress = if load.outstanding > 0 {
            us(&self.batch_us)
        } else {
            Duration::ZERO
        };
        us(&self.parse_us)
            + us(&self.lookup_us)
            + us(&self.transfer_us)
            + in_progress
            + load.wait.unwrap_or_default()
            + load
                .per_request
                .saturating_mul(ahead.min(u32::MAX as u64) as u32)
    }

    /// Judges a request that has spent `elapsed` of `budget`, with `before` requests in
    /// flight (cap `max`). No healthy ranker: no judgement by the estimate, so that the
    /// request fails fast as `unavailable`, which says why.
    pub fn check(
        &self,
        before: usize,
        max: usize,
        elapsed: Duration,
        budget: Duration,
        load: &RankerLoad,
    ) -> Result<(), Shed> {
        let estimate = load.wait.map(|_| self.estimate(before, load));
        let decision = decide(before, max, elapsed, budget, estimate, self.admit_share);
        let now_us = self.epoch.elapsed().as_micros() as u64;
        let idle_for = now_us.saturating_sub(self.last_activity_us.load(Ordering::Relaxed));
        let probe = before == 0 && Duration::from_micros(idle_for) >= PROBE_AFTER;
        match decision {
            Err(shed) if !(probe && shed.reason == ShedReason::Estimate) => Err(shed),
            _ => {
                self.last_activity_us.store(now_us, Ordering::Relaxed);
                Ok(())
            }
        }
    }
}

/// The arithmetic of [`Admission::admit`]: `in_flight` requests are in progress (cap
/// `max`); the request has spent `elapsed` of `budget`; `estimate` is what it would still
/// take (`None`: do not judge by the estimate).
pub fn decide(
    in_flight: usize,
    max: usize,
    elapsed: Duration,
    budget: Duration,
    estimate: Option<Duration>,
    share: f64,
) -> Result<(), Shed> {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let drain = estimate.unwrap_or_default();
    if in_flight >= max {
        return Err(Shed {
            reason: ShedReason::InFlight,
            message: format!(
                "overloaded: {in_flight} requests in progress, the router's cap \
                 (max_in_flight) is {max}; retry later"
            ),
            retry_after_s: retry_after(drain),
        });
    }
    match estimate {
        Some(estimate) if elapsed + estimate > budget.mul_f64(share) => Err(Shed {
            reason: ShedReason::Estimate,
            message: format!(
                "overloaded: expected latency {:.1} ms ({:.1} ms spent, {:.1} ms estimated \
                 for queues and stages) exceeds {:.0}% of the budget of {:.1} ms; retry later \
                 or with a larger budget",
                ms(elapsed + estimate),
                ms(elapsed),
                ms(estimate),
                share * 100.0,
                ms(budget)
            ),
            retry_after_s: retry_after(estimate),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{Admission, Rule};

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn decides_by_cap_then_estimate() {
        assert_eq!(decide(0, 4, MS, 100 * MS, Some(50 * MS), 0.8), Ok(()));
        // 1 ms spent + 79 ms to go fills exactly the admitted share of the budget.
        assert_eq!(decide(3, 4, MS, 100 * MS, Some(79 * MS), 0.8), Ok(()));
        let e = decide(3, 4, 2 * MS, 100 * MS, Some(79 * MS), 0.8).unwrap_err();
        assert_eq!(e.reason, ShedReason::Estimate);
        assert!(
            e.message
                .contains("expected latency 81.0 ms (2.0 ms spent, 79.0 ms")
                && e.message.contains("exceeds 80% of the budget of 100.0 ms"),
            "{}",
            e.message
        );
        assert_eq!(e.retry_after_s, 1);
        let e = decide(4, 4, MS, 100 * MS, Some(MS), 0.8).unwrap_err();
        assert_eq!(e.reason, ShedReason::InFlight);
        assert!(
            e.message.contains("4 requests in progress"),
            "{}",
            e.message
        );
        assert!(e.message.contains("(max_in_flight) is 4"), "{}", e.message);
        // No estimate (shedding off, or no ranker healthy): only the cap applies.
        assert_eq!(decide(3, 4, 10 * MS, MS, None, 0.8), Ok(()));
    }

    #[test]
    fn retry_after_is_whole_seconds_from_the_drain_time() {
        assert_eq!(retry_after(Duration::ZERO), 1);
        assert_eq!(retry_after(300 * MS), 1);
        assert_eq!(retry_after(1001 * MS), 2);
        assert_eq!(retry_after(Duration::from_secs(3600)), 3600);
        let e = decide(0, 4, MS, 100 * MS, Some(Duration::from_millis(2500)), 0.8).unwrap_err();
        assert_eq!(e.retry_after_s, 3);
    }

    #[tokio::test]
    async fn retry_after_is_capped_by_max_retry_after_s() {
        let load = RankerLoad {
            wait: Some(Duration::from_secs(3600)),
            ..RankerLoad::default()
        };
        for (max, told) in [(60, 60), (5, 5)] {
            let a = Admission::new(10, true, Rule::Estimate, 0.8, max);
            let e = a.admit(Duration::ZERO, MS, &load).await.err().unwrap();
            assert_eq!((e.reason, e.retry_after_s), (ShedReason::Estimate, told));
        }
    }

    #[tokio::test]
    async fn estimate_adds_stages_wait_and_requests_ahead() {
        let a = Admission::new(10, true, Rule::Estimate, 0.8, 60);
        let stages = |parse| Stages {
            parse,
            lookup: 3 * MS,
            transfer: MS,
            batch: 7 * MS,
        };
        a.estimate.observe(stages(2 * MS));
        a.estimate.observe(stages(4 * MS)); // parse average: 2 + 0.2 × 2 = 2.4 ms
        let idle = RankerLoad {
            wait: Some(10 * MS),
            outstanding: 0,
            per_request: 5 * MS,
            healthy: 1,
        };
        assert_eq!(
            a.estimate.estimate(a.in_flight(), &idle),
            Duration::from_micros(2400 + 3000 + 1000 + 10_000)
        );
        // A busy ranker finishes its batch in progress first.
        let load = RankerLoad {
            outstanding: 1,
            ..idle
        };
        let busy = 2400 + 3000 + 1000 + 7000 + 10_000;
        assert_eq!(
            a.estimate.estimate(a.in_flight(), &load),
            Duration::from_micros(busy)
        );
        // Three admitted, one of them at a ranker: two more are ahead of a new request.
        let mut permits = Vec::new();
        for _ in 0..3 {
            permits.push(
                a.admit(Duration::ZERO, Duration::from_secs(1), &load)
                    .await
                    .unwrap(),
            );
        }
        assert_eq!(a.in_flight(), 3);
        assert_eq!(
            a.estimate.estimate(a.in_flight(), &load),
            Duration::from_micros(busy + 2 * 5000)
        );
        let e = a.admit(Duration::ZERO, 20 * MS, &load).await.err().unwrap();
        assert_eq!(e.reason, ShedReason::Estimate);
        assert_eq!(a.in_flight(), 3, "a refused request is not in flight");
        assert_eq!(a.shed_total(ShedReason::Estimate), 1);
        drop(permits);
        assert_eq!(a.in_flight(), 0);
        // Idle, but a request was admitted just now: the estimate still holds.
        assert!(a.admit(Duration::ZERO, MS, &load).await.is_err());
    }

    #[tokio::test]
    async fn an_idle_router_admits_one_request_to_measure_again() {
        let load = RankerLoad {
            wait: Some(MS),
            ..RankerLoad::default()
        };
        // Nothing admitted yet for a while (the epoch is "long ago" for the probe).
        let a = Admission {
            estimate: Estimate {
                epoch: Instant::now() - 2 * PROBE_AFTER,
                ..Estimate::new(0.8)
            },
            ..Admission::new(10, true, Rule::Estimate, 0.8, 60)
        };
        a.estimate.observe(Stages {
            parse: Duration::from_secs(5), // averages from a bad moment
            ..Stages::default()
        });
        a.estimate.last_activity_us.store(0, Ordering::Relaxed); // measured long ago
        let probe = a.admit(Duration::ZERO, 100 * MS, &load).await.unwrap();
        // While the probe is in flight, and right after it, the estimate applies again.
        assert!(a.admit(Duration::ZERO, 100 * MS, &load).await.is_err());
        drop(probe);
        assert!(a.admit(Duration::ZERO, 100 * MS, &load).await.is_err());
    }

    #[tokio::test]
    async fn cap_applies_and_permits_release() {
        let a = Admission::new(2, false, Rule::Estimate, 0.8, 60);
        let load = RankerLoad {
            wait: Some(Duration::from_secs(100)),
            ..RankerLoad::default()
        };
        let p1 = a.admit(Duration::ZERO, MS, &load).await.unwrap(); // shedding off: no estimate
        let _p2 = a.admit(Duration::ZERO, MS, &load).await.unwrap();
        let e = a.admit(Duration::ZERO, MS, &load).await.err().unwrap();
        assert_eq!(e.reason, ShedReason::InFlight);
        assert_eq!(a.shed_total(ShedReason::InFlight), 1);
        drop(p1);
        assert!(a.admit(Duration::ZERO, MS, &load).await.is_ok());
    }
}
