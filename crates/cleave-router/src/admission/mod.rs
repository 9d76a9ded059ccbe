//! Admission control: decide, before a request's body is read, whether the router can still
//! meet its budget, and refuse at once (503 + Retry-After) when it cannot, so that under
//! overload the work that is accepted finishes in time instead of everything queueing.
//!
//! Two rules, chosen by the router's `admission` setting (docs/api.md, "Admission control"):
//! * `adaptive` (the default): an adaptive limit on the rows in flight to the backends
//!   (gradient.rs), with a CoDel-bounded wait for a slot (limiter.rs). A request is charged
//!   the mean request's rows at the door and topped up to its own rows once parsed.
//! * `estimate`: an estimate of the request's latency from stage averages against a share of
//!   its budget (estimate.rs).
//!
//! Both are under the `max_in_flight` cap, and both are off with `shed = false`.

mod estimate;
mod gradient;
mod limiter;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::backend::ranker::RankerPool;
pub use estimate::{decide, Estimate};
pub use gradient::{Gradient, Sample};
use limiter::Limiter;

/// Which rule sheds (the `admission` setting; the names are python/cleave/settings/choices.py's
/// ADMISSION_RULES).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Rule {
    #[default]
    Adaptive,
    Estimate,
}

impl Rule {
    pub const NAMES: [&'static str; 2] = ["adaptive", "estimate"];
}

/// Why a request was refused; the label of `cleave_router_shed_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShedReason {
    /// `max_connections` reached: the connection was refused by the front door.
    Connections,
    /// `max_in_flight` reached.
    InFlight,
    /// The estimated latency exceeds the request's budget (the estimate rule), or its
    /// budget is below the no-load latency of a request its size (the adaptive rule).
    Estimate,
    /// The adaptive limit on work in flight is reached (the adaptive rule).
    Limit,
}

impl ShedReason {
    pub const ALL: [ShedReason; 4] = [
        ShedReason::Connections,
        ShedReason::InFlight,
        ShedReason::Estimate,
        ShedReason::Limit,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ShedReason::Connections => "connections",
            ShedReason::InFlight => "in_flight",
            ShedReason::Estimate => "estimate",
            ShedReason::Limit => "limit",
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
    /// Healthy rankers.
    pub healthy: usize,
}

impl RankerLoad {
    pub fn of(pool: &RankerPool) -> RankerLoad {
        let rankers = pool.rankers();
        let healthy: Vec<_> = rankers.iter().filter(|r| r.is_healthy()).collect();
        let n = healthy.len().max(1) as f64;
        let mean_us = healthy.iter().map(|r| r.service_us()).sum::<f64>() / n;
        RankerLoad {
            wait: pool.expected_wait(),
            outstanding: rankers.iter().map(|r| r.outstanding()).sum(),
            per_request: Duration::from_secs_f64(mean_us / n / 1e6),
            healthy: healthy.len(),
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

/// The router's admission state.
pub struct Admission {
    max_in_flight: usize,
    /// Whether to shed by the rule (the in-flight cap always applies).
    shed: bool,
    rule: Rule,
    /// The share of its budget a request's latency may fill (`admit_share` in the config).
    admit_share: f64,
    /// The longest Retry-After a shed request is told (`max_retry_after_s` in the config).
    max_retry_after_s: u64,
    in_flight: AtomicUsize,
    estimate: Estimate,
    limiter: Limiter,
    shed_total: [AtomicU64; ShedReason::ALL.len()],
}

/// A request admitted: counts as in flight, and holds its charge on the adaptive limit,
/// until dropped.
pub struct Permit<'a> {
    admission: &'a Admission,
    /// Rows charged on the limiter (0: none).
    charged: u64,
    /// Set once its rows are charged: when, and the rows in flight then.
    sized: Option<(Instant, u64)>,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.admission.in_flight.fetch_sub(1, Ordering::Relaxed);
        if self.charged > 0 {
            self.admission.limiter.release(self.charged);
        }
    }
}

impl Admission {
    pub fn new(
        max_in_flight: usize,
        shed: bool,
        rule: Rule,
        admit_share: f64,
        max_retry_after_s: u64,
    ) -> Admission {
        Admission {
            max_in_flight,
            shed,
            rule,
            admit_share,
            max_retry_after_s,
            in_flight: AtomicUsize::new(0),
            estimate: Estimate::new(admit_share),
            limiter: Limiter::new(max_in_flight),
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

    /// The adaptive limit on rows in flight (`None` under the estimate rule).
    pub fn limit(&self) -> Option<u64> {
        (self.rule == Rule::Adaptive && self.shed).then(|| self.limiter.limit())
    }

    pub fn shed_total(&self, reason: ShedReason) -> u64 {
        self.shed_total[reason as usize].load(Ordering::Relaxed)
    }

    /// Counts a refusal made elsewhere (the front door's connection cap).
    pub fn count(&self, reason: ShedReason) {
        self.shed_total[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn refuse(&self, mut shed: Shed) -> Shed {
        self.count(shed.reason);
        shed.retry_after_s = shed.retry_after_s.min(self.max_retry_after_s);
        shed
    }

    /// Admits a request that has spent `elapsed` since its first byte and may take `budget`
    /// in all, or says why not. Under the adaptive rule it may wait briefly for a slot.
    pub async fn admit(
        &self,
        elapsed: Duration,
        budget: Duration,
        load: &RankerLoad,
    ) -> Result<Permit<'_>, Shed> {
        let before = self.in_flight.fetch_add(1, Ordering::Relaxed);
        let mut permit = Permit {
            admission: self,
            charged: 0,
            sized: None,
        };
        if self.shed && self.rule == Rule::Estimate {
            self.estimate
                .check(before, self.max_in_flight, elapsed, budget, load)
                .map_err(|s| self.refuse(s))?;
            return Ok(permit);
        }
        decide(before, self.max_in_flight, elapsed, budget, None, 1.0)
            .map_err(|s| self.refuse(s))?;
        // No healthy ranker: the request fails fast as `unavailable`, which says why.
        if self.shed && load.healthy > 0 {
            let cost = self.limiter.door_cost();
            let left = budget.saturating_sub(elapsed);
            // A budget that even an idle deployment cannot meet is refused at once, whatever
            // the load: admitted, it would only expire (but for a rare probe: gradient.rs).
            if let Some(no_load) = self.limiter.beyond_reach(cost, left, 0) {
                return Err(self.refuse(too_short(no_load, left)));
            }
            self.limiter
                .acquire(cost, left, load.healthy)
                .await
                .map_err(|f| self.refuse(limit_shed(f)))?;
            permit.charged = cost;
        }
        Ok(permit)
    }

    /// Tops a request's charge up (or down) to its `rows` once parsed, before any lookup; a
    /// request whose budget left is below the no-load latency of its size is refused.
    pub fn fit(&self, permit: &mut Permit<'_>, rows: u64, left: Duration) -> Result<(), Shed> {
        if permit.charged == 0 {
            return Ok(());
        }
        let rows = rows.max(1);
        self.limiter.sized(rows);
        if let Some(no_load) = self.limiter.beyond_reach(rows, left, permit.charged) {
            return Err(self.refuse(too_short(no_load, left)));
        }
        self.limiter.admitted(rows);
        // Never a wait here: a request that held its door charge while waiting for more
        // could wait on another doing the same (hold and wait), and both expire (measured:
        // 504s at the parse stage). Past the limit, the next arrivals wait instead.
        if rows > permit.charged {
            self.limiter.top_up(rows - permit.charged);
        } else {
            self.limiter.refund(permit.charged - rows);
        }
        permit.charged = rows;
        permit.sized = Some((Instant::now(), self.limiter.in_flight()));
        Ok(())
    }

    /// Learns from a request that went through; `budget` is its whole budget.
    pub fn observe(&self, permit: &Permit<'_>, stages: Stages, budget: Duration) {
        match self.rule {
            Rule::Estimate => self.estimate.observe(stages),
            Rule::Adaptive => self.sample(permit, budget, false),
        }
    }

    /// Learns from an admitted request that missed its budget.
    pub fn expired(&self, permit: &Permit<'_>, budget: Duration) {
        self.sample(permit, budget, true);
    }

    fn sample(&self, permit: &Permit<'_>, budget: Duration, expired: bool) {
        let Some((at, in_flight)) = permit.sized else {
            return;
        };
        self.limiter.observe(Sample {
            cost: permit.charged,
            latency: at.elapsed(),
            allowed: budget.mul_f64(self.admit_share),
            in_flight,
            expired,
        });
    }
}

fn limit_shed(full: limiter::Full) -> Shed {
    Shed {
        reason: ShedReason::Limit,
        message: format!(
            "overloaded: {} rows (candidates) in flight to the backends, their adaptive \
             limit is {}; retry later",
            full.in_flight, full.limit
        ),
        retry_after_s: 1,
    }
}

fn too_short(no_load: Duration, left: Duration) -> Shed {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Shed {
        reason: ShedReason::Estimate,
        message: format!(
            "the budget cannot be met: {:.1} ms of it left, and a request of this size takes \
             {:.1} ms with no load; retry with a larger budget",
            ms(left),
            ms(no_load)
        ),
        retry_after_s: 1,
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

    #[tokio::test]
    async fn a_budget_below_the_no_load_latency_is_refused_at_once() {
        let a = Admission::new(64, true, Rule::Adaptive, 0.5, 60);
        let load = RankerLoad {
            healthy: 1,
            ..Default::default()
        };
        let second = Duration::from_secs(1);
        // A no-load latency above zero, measured often enough to be trusted.
        for _ in 0..cleave_wire::SURE_AFTER {
            let mut permit = a.admit(Duration::ZERO, second, &load).await.unwrap();
            a.fit(&mut permit, 100, second).unwrap();
            a.observe(&permit, Stages::default(), second);
        }
        // All of its budget spent before admission: idle as the router is, it cannot be met.
        let e = a.admit(second, second, &load).await.err().unwrap();
        assert_eq!(e.reason, ShedReason::Estimate);
        assert!(
            e.message.contains("cannot be met: 0.0 ms of it left"),
            "{}",
            e.message
        );
        assert_eq!(a.shed_total(ShedReason::Estimate), 1);
        assert!(a.admit(Duration::ZERO, second, &load).await.is_ok());
    }

    /// The names are python/cleave/settings/choices.py's ADMISSION_RULES (through the
    /// generated settings.json: `python -m cleave.settings --write`).
    #[test]
    fn rule_names_are_the_settings_schemas() {
        let text = include_str!("../../../../deploy/helm/cleave/files/settings.json");
        let settings: serde_json::Value = serde_json::from_str(text).unwrap();
        let names: Vec<&str> = settings["choices"]["admission"]["names"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap())
            .collect();
        assert_eq!(names, Rule::NAMES);
        for name in Rule::NAMES {
            let rule: Rule = serde_json::from_value(serde_json::json!(name)).unwrap();
            assert_eq!(format!("{rule:?}").to_lowercase(), name);
        }
    }
}
