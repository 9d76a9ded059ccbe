//! Admission control: before a request's body is read, decide whether the router can still
//! meet its budget, and refuse at once (503 + Retry-After) when it cannot, so that under
//! overload the work that is accepted finishes in time instead of everything queueing.
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

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::backend::ranker::RankerPool;
use cleave_wire::Ewma;

/// How long an idle router that sheds by its estimate waits before admitting one request to
/// measure again.
const PROBE_AFTER: Duration = Duration::from_secs(1);

/// Why a request was refused; the label of `cleave_router_shed_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShedReason {
    /// `max_connections` reached: the connection was refused by the front door.
    Connections,
    /// `max_in_flight` reached.
    InFlight,
    /// The estimated latency exceeds the request's budget.
    Estimate,
}

impl ShedReason {
    pub const ALL: [ShedReason; 3] = [
        ShedReason::Connections,
        ShedReason::InFlight,
        ShedReason::Estimate,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ShedReason::Connections => "connections",
            ShedReason::InFlight => "in_flight",
            ShedReason::Estimate => "estimate",
        }
    }
}

/// A refusal: why, in words, and when to come back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shed {
    pub reason: ShedReason,
    pub message: String,
    /// Whole seconds, at least 1.
    pub retry_after_s: u64,
}

/// What the rankers look like right now, as admission needs it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankerLoad {
    /// `RankerPool::expected_wait`: `None` when no ranker is healthy.
    pub wait: Option<Duration>,
    /// Requests currently sent to rankers and not answered.
    pub outstanding: u64,
    /// Mean time per request of the healthy rankers, divided by how many there are: what one
    /// more queued request adds to everyone's wait.
    pub per_request: Duration,
}

impl RankerLoad {
    pub fn of(pool: &RankerPool) -> RankerLoad {
        let rankers = pool.rankers();
        let healthy: Vec<_> = rankers.iter().filter(|r| r.is_healthy()).collect();
        let n = healthy.len().max(1) as f64;
        let mean_us = healthy.iter().map(|r| r.service_us()).sum::<f64>() / n;
        RankerLoad {
            wait: pool.expected_wait(),
            outstanding: pool.rankers().iter().map(|r| r.outstanding()).sum(),
            per_request: Duration::from_secs_f64(mean_us / n / 1e6),
        }
    }
}

/// Where one request's time went, for the averages.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stages {
    /// From the first byte to the inputs parsed.
    pub parse: Duration,
    /// Shard lookups (zero in monolithic mode).
    pub lookup: Duration,
    /// The ranker round trip less the ranker's queue and compute.
    pub transfer: Duration,
    /// The compute time of the ranker batch it was in.
    pub batch: Duration,
}

/// The router's admission state: requests in progress and the stage averages.
pub struct Admission {
    max_in_flight: usize,
    /// Whether to shed on the estimate (the in-flight cap always applies).
    shed: bool,
    /// The share of its budget a request's estimate may fill (`admit_share` in the config).
    admit_share: f64,
    /// The longest Retry-After a shed request is told (`max_retry_after_s` in the config).
    max_retry_after_s: u64,
    in_flight: AtomicUsize,
    /// f64 bits of moving averages in µs (0: not measured yet).
    parse_us: Ewma,
    lookup_us: Ewma,
    transfer_us: Ewma,
    /// A ranker batch's compute time (the ranker reports the batch's, not the request's).
    batch_us: Ewma,
    /// When a request was last admitted or measured, in µs since `epoch`.
    last_activity_us: AtomicU64,
    epoch: Instant,
    shed_total: [AtomicU64; ShedReason::ALL.len()],
}

/// A request admitted: counts as in flight until dropped.
pub struct Permit<'a>(&'a Admission);

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Admission {
    pub fn new(
        max_in_flight: usize,
        shed: bool,
        admit_share: f64,
        max_retry_after_s: u64,
    ) -> Admission {
        Admission {
            max_in_flight,
            shed,
            admit_share,
            max_retry_after_s,
            in_flight: AtomicUsize::new(0),
            parse_us: Ewma::default(),
            lookup_us: Ewma::default(),
            transfer_us: Ewma::default(),
            batch_us: Ewma::default(),
            last_activity_us: AtomicU64::new(0),
            epoch: Instant::now(),
            shed_total: Default::default(),
        }
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The limit on [`Admission::in_flight`].
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    pub fn shed_total(&self, reason: ShedReason) -> u64 {
        self.shed_total[reason as usize].load(Ordering::Relaxed)
    }

    /// Counts a refusal made elsewhere (the front door's connection cap).
    pub fn count(&self, reason: ShedReason) {
        self.shed_total[reason as usize].fetch_add(1, Ordering::Relaxed);
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

    /// The latency a request would see if admitted now, less the time already spent.
    pub fn estimate(&self, load: &RankerLoad) -> Duration {
        let us = |average: &Ewma| Duration::from_secs_f64(average.get() / 1e6);
        let ahead = (self.in_flight() as u64).saturating_sub(load.outstanding);
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

    /// Admits a request that has spent `elapsed` since its first byte and may take `budget`
    /// in all, or says why not.
    pub fn admit(
        &self,
        elapsed: Duration,
        budget: Duration,
        load: &RankerLoad,
    ) -> Result<Permit<'_>, Shed> {
        let estimate = self.estimate(load);
        let before = self.in_flight.fetch_add(1, Ordering::Relaxed);
        let permit = Permit(self);
        // No healthy ranker: let the request fail fast as `unavailable`, which says why.
        let decision = decide(
            before,
            self.max_in_flight,
            elapsed,
            budget,
            load.wait.map(|_| estimate).filter(|_| self.shed),
            self.admit_share,
        );
        let now_us = self.epoch.elapsed().as_micros() as u64;
        let idle_for = now_us.saturating_sub(self.last_activity_us.load(Ordering::Relaxed));
        let probe = before == 0 && Duration::from_micros(idle_for) >= PROBE_AFTER;
        match decision {
            Err(mut shed) if !(probe && shed.reason == ShedReason::Estimate) => {
                drop(permit);
                self.count(shed.reason);
                shed.retry_after_s = shed.retry_after_s.min(self.max_retry_after_s);
                Err(shed)
            }
            _ => {
                self.last_activity_us.store(now_us, Ordering::Relaxed);
                Ok(permit)
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

/// Whole seconds until the queues should have drained: at least 1 (the admission caps it at
/// `max_retry_after_s`).
pub fn retry_after(drain: Duration) -> u64 {
    (drain.as_secs_f64().ceil() as u64).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn retry_after_is_capped_by_max_retry_after_s() {
        let load = RankerLoad {
            wait: Some(Duration::from_secs(3600)),
            ..RankerLoad::default()
        };
        for (max, told) in [(60, 60), (5, 5)] {
            let a = Admission::new(10, true, 0.8, max);
            let e = a.admit(Duration::ZERO, MS, &load).err().unwrap();
            assert_eq!((e.reason, e.retry_after_s), (ShedReason::Estimate, told));
        }
    }

    #[test]
    fn estimate_adds_stages_wait_and_requests_ahead() {
        let a = Admission::new(10, true, 0.8, 60);
        let stages = |parse| Stages {
            parse,
            lookup: 3 * MS,
            transfer: MS,
            batch: 7 * MS,
        };
        a.observe(stages(2 * MS));
        a.observe(stages(4 * MS)); // parse average: 2 + 0.2 × 2 = 2.4 ms
        let idle = RankerLoad {
            wait: Some(10 * MS),
            outstanding: 0,
            per_request: 5 * MS,
        };
        assert_eq!(
            a.estimate(&idle),
            Duration::from_micros(2400 + 3000 + 1000 + 10_000)
        );
        // A busy ranker finishes its batch in progress first.
        let load = RankerLoad {
            outstanding: 1,
            ..idle
        };
        let busy = 2400 + 3000 + 1000 + 7000 + 10_000;
        assert_eq!(a.estimate(&load), Duration::from_micros(busy));
        // Three admitted, one of them at a ranker: two more are ahead of a new request.
        let permits: Vec<_> = (0..3)
            .map(|_| {
                a.admit(Duration::ZERO, Duration::from_secs(1), &load)
                    .unwrap()
            })
            .collect();
        assert_eq!(a.in_flight(), 3);
        assert_eq!(a.estimate(&load), Duration::from_micros(busy + 2 * 5000));
        let e = a.admit(Duration::ZERO, 20 * MS, &load).err().unwrap();
        assert_eq!(e.reason, ShedReason::Estimate);
        assert_eq!(a.in_flight(), 3, "a refused request is not in flight");
        assert_eq!(a.shed_total(ShedReason::Estimate), 1);
        drop(permits);
        assert_eq!(a.in_flight(), 0);
        // Idle, but a request was admitted just now: the estimate still holds.
        assert!(a.admit(Duration::ZERO, MS, &load).is_err());
    }

    #[test]
    fn an_idle_router_admits_one_request_to_measure_again() {
        let a = Admission::new(10, true, 0.8, 60);
        a.observe(Stages {
            parse: Duration::from_secs(5), // averages from a bad moment
            ..Stages::default()
        });
        let load = RankerLoad {
            wait: Some(MS),
            ..RankerLoad::default()
        };
        // Nothing admitted yet for a while (the epoch is "long ago" for the probe).
        let a = Admission {
            epoch: Instant::now() - 2 * PROBE_AFTER,
            ..a
        };
        let probe = a.admit(Duration::ZERO, 100 * MS, &load).unwrap();
        // While the probe is in flight, and right after it, the estimate applies again.
        assert!(a.admit(Duration::ZERO, 100 * MS, &load).is_err());
        drop(probe);
        assert!(a.admit(Duration::ZERO, 100 * MS, &load).is_err());
    }

    #[test]
    fn cap_applies_and_permits_release() {
        let a = Admission::new(2, false, 0.8, 60);
        let load = RankerLoad {
            wait: Some(Duration::from_secs(100)),
            ..RankerLoad::default()
        };
        let p1 = a.admit(Duration::ZERO, MS, &load).unwrap(); // shedding off: no estimate
        let _p2 = a.admit(Duration::ZERO, MS, &load).unwrap();
        let e = a.admit(Duration::ZERO, MS, &load).err().unwrap();
        assert_eq!(e.reason, ShedReason::InFlight);
        assert_eq!(a.shed_total(ShedReason::InFlight), 1);
        drop(p1);
        assert!(a.admit(Duration::ZERO, MS, &load).is_ok());
    }
}
