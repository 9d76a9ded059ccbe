//! The adaptive rule's arithmetic: a limit on the work in flight to the backends, in rows
//! (candidates; a 2,048-candidate request costs 2,048, a 100-candidate one 100), moved by the
//! gradient between a request size's usual latency and each finished request's latency (after
//! Netflix's Gradient2 and Envoy's adaptive concurrency filter).
//!
//! * Usual latency: per request size (log2 of its rows), a slow moving average of the
//!   latencies seen while less than half the limit was in use (so it measures the machine,
//!   not the queues the limit lets build), pulled down quickly when requests run much faster
//!   than it (the queues drained). On a machine slow for reasons more load does not change,
//!   the usual latency follows, and the limit does not collapse (measured: a limit compared
//!   with the least latency seen sank to one request per ranker on a busy machine and refused
//!   requests far below capacity).
//! * Each sample: `limit ← (1 − SMOOTHING) limit + SMOOTHING (limit × g + cost)` with
//!   `g = clamp(target / latency, 0.5, 1)`, `target = usual × TOLERANCE`, at least
//!   `TARGET_FLOOR` of and at most the `share × budget` the request's budget allows (the same
//!   share the estimate rule uses). The `cost` is the headroom: one more request of the
//!   sample's size, so the limit keeps probing upwards while latency holds.
//! * A sample taken while less than half the limit was in use says nothing about the limit:
//!   it is not applied (unless it missed its budget).
//! * A request that missed its budget is a sample with `g = 0.5`.
//! * Bounds: at least one request of the mean size per healthy ranker, at most
//!   `max_in_flight` requests of the largest size seen. Each `PROBE_AFTER` with nothing in
//!   flight and no sample doubles the limit (up to the bound), so a limit shrunk by a burst
//!   does not outlive it.
//! * The no-load latency (the least latency of the current and previous `WINDOW`, so an old
//!   one ages out, once `SURE_AFTER` requests of that size made it) is what a request's
//!   budget must cover to be admitted; the usual latency, what a waiting request must leave
//!   time for.

use std::time::{Duration, Instant};

use cleave_wire::SURE_AFTER;

/// How much slower than the usual latency a request may be before the limit shrinks
/// (Gradient2's default).
pub const TOLERANCE: f64 = 1.5;
/// The weight of one sample in the usual latency.
const USUAL_WEIGHT: f64 = 0.02;
/// A sample this many times faster than the usual latency pulls it down by `USUAL_DECAY`.
const DRAINED: f64 = 2.0;
const USUAL_DECAY: f64 = 0.95;
/// The latency target is at least this share of what the budget allows: a latency that far
/// within the budget is no reason to refuse work, however it compares with the usual one.
const TARGET_FLOOR: f64 = 0.2;
/// The weight of one sample's proposal in the limit.
const SMOOTHING: f64 = 0.2;
/// The windowed minimum's window.
pub const WINDOW: Duration = Duration::from_secs(5);
/// An idle limiter doubles its limit this often.
pub const PROBE_AFTER: Duration = Duration::from_secs(1);
const BUCKETS: usize = 32;
/// Until the first sample is applied, the limit is at least this many requests of the mean
/// size per healthy ranker: a fresh router knows nothing yet, and refusing a handful of
/// concurrent first requests would be a cold-start error (measured: 503s to 6 concurrent
/// requests on a just-started deployment).
const INITIAL_REQUESTS: f64 = 16.0;

/// One finished request, as the limit learns from it.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// Its rows.
    pub cost: u64,
    /// From its charge being topped up (parsed, about to look up) to its answer.
    pub latency: Duration,
    /// The most latency its budget allowed (`share × budget`).
    pub allowed: Duration,
    /// Rows in flight when it was topped up (itself included).
    pub in_flight: u64,
    /// It missed its budget.
    pub expired: bool,
}

/// The limit and what is charged against it.
#[derive(Debug)]
pub struct Gradient {
    limit: f64,
    /// Rows charged by admitted requests.
    in_flight: u64,
    /// Requests holding a charge.
    requests: usize,
    /// Moving average of a request's rows: a request's charge before its body is read (0:
    /// none seen yet).
    mean_cost: f64,
    largest_cost: u64,
    max_in_flight: usize,
    /// Healthy rankers, at the last decision.
    healthy: usize,
    min: MinWindow,
    /// Per request size, the usual latency in µs (0: none seen).
    usual: [f64; BUCKETS],
    /// A sample has moved the limit.
    learnt: bool,
    last_sample: Instant,
    /// Per request size, when one was last admitted past the no-load check.
    admitted: [Option<Instant>; BUCKETS],
}

impl Gradient {
    pub fn new(max_in_flight: usize, now: Instant) -> Gradient {
        Gradient {
            limit: 1.0,
            in_flight: 0,
            requests: 0,
            mean_cost: 0.0,
            largest_cost: 1,
            max_in_flight: max_in_flight.max(1),
            healthy: 1,
            min: MinWindow::new(now),
            usual: [0.0; BUCKETS],
            learnt: false,
            last_sample: now,
            admitted: [None; BUCKETS],
        }
    }

    pub fn limit(&self) -> u64 {
        self.limit.round() as u64
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// What a request is charged before its rows are known.
    pub fn door_cost(&self) -> u64 {
        self.mean_cost.round().max(1.0) as u64
    }

    /// The latency a request of `cost` rows usually takes once admitted (zero until one of
    /// its size was measured).
    pub fn expected(&self, cost: u64) -> Duration {
        Duration::from_secs_f64(self.usual[bucket(cost)] / 1e6)
    }

    /// The least latency seen for a request of `cost` rows, in the last one or two windows.
    pub fn no_load(&self, cost: u64) -> Option<Duration> {
        let us = self.min.get(bucket(cost))?;
        Some(Duration::from_secs_f64(us / 1e6))
    }

    /// The no-load latency of a request of `cost` rows when the `left` of its budget is below
    /// it: the request would only expire. But a refusal measures nothing, so a minimum taken
    /// while the machine was busy would refuse every request of that size for up to two
    /// windows (measured: a router refused all of its requests under the parallel CI
    /// suite). So one goes through as a probe when nothing but its own `own` rows is in
    /// flight, no request of its size was admitted for `PROBE_AFTER`, and `left` is at least
    /// half the minimum: at most one request a second is risked, and only on a bet that the
    /// machine got up to twice as fast.
    pub fn beyond_reach(
        &self,
        cost: u64,
        left: Duration,
        own: u64,
        now: Instant,
    ) -> Option<Duration> {
        let no_load = self.no_load(cost).filter(|n| *n > left)?;
        let quiet = self.in_flight <= own;
        let stale = self.admitted[bucket(cost)]
            .is_none_or(|t| now.saturating_duration_since(t) >= PROBE_AFTER);
        let near = left * 2 >= no_load;
        (!(quiet && stale && near)).then_some(no_load)
    }

    /// A request of `cost` rows was admitted past the no-load check.
    pub fn admitted(&mut self, cost: u64, now: Instant) {
        self.admitted[bucket(cost)] = Some(now);
    }

    /// Brings the bounds and the idle probe up to date.
    pub fn refresh(&mut self, now: Instant, healthy: usize) {
        self.healthy = healthy.max(1);
        self.min.rotate(now);
        let idle = now.saturating_duration_since(self.last_sample);
        if self.requests == 0 && idle >= PROBE_AFTER {
            let periods = (idle.as_secs_f64() / PROBE_AFTER.as_secs_f64()).floor();
            self.limit *= 2f64.powf(periods.min(32.0));
            self.last_sample = now;
        }
        if !self.learnt {
            self.limit = self.limit.max(INITIAL_REQUESTS * self.floor());
        }
        self.limit = self.limit.clamp(self.floor(), self.ceiling());
    }

    fn floor(&self) -> f64 {
        self.healthy as f64 * self.mean_cost.max(1.0)
    }

    fn ceiling(&self) -> f64 {
        (self.max_in_flight as f64 * self.largest_cost as f64).max(self.floor())
    }

    /// Whether a new request of `rows` fits: under the limit, or (the floor) fewer requests
    /// than healthy rankers hold a charge, or, before any sample moved the limit, fewer than
    /// `INITIAL_REQUESTS` per healthy ranker whatever their sizes.
    pub fn fits(&self, rows: u64) -> bool {
        let fresh = !self.learnt && (self.requests as f64) < INITIAL_REQUESTS * self.healthy as f64;
        self.requests < self.healthy
            || fresh
            || (self.in_flight + rows) as f64 <= self.limit.round()
    }

    pub fn charge(&mut self, extra: u64, new: bool) {
        self.in_flight += extra;
        self.requests += usize::from(new);
    }

    /// Takes back a charge; `whole`: the request's last, it no longer holds any.
    pub fn uncharge(&mut self, extra: u64, whole: bool) {
        self.in_flight = self.in_flight.saturating_sub(extra);
        self.requests = self.requests.saturating_sub(usize::from(whole));
    }

    /// A request's rows became known: counts them in the mean size.
    pub fn sized(&mut self, rows: u64) {
        let rows_f = rows.max(1) as f64;
        self.mean_cost = if self.mean_cost == 0.0 {
            rows_f
        } else {
            self.mean_cost + 0.1 * (rows_f - self.mean_cost)
        };
        self.largest_cost = self.largest_cost.max(rows);
        if !self.learnt {
            // The start's limit follows the mean size: refreshed before the first request
            // was sized, it was one row per ranker, and that request's own answer would have
            // read as a limit in use.
            self.limit = self.limit.max(INITIAL_REQUESTS * self.floor());
        }
    }

    pub fn observe(&mut self, s: Sample, now: Instant) {
        self.min.rotate(now);
        self.last_sample = now;
        let us = s.latency.as_secs_f64().max(1e-6) * 1e6;
        let b = bucket(s.cost);
        let app_limited = (s.in_flight as f64) < self.limit / 2.0;
        if !s.expired {
            self.min.record(b, us);
            let usual = &mut self.usual[b];
            // Learnt only where the limit queues nothing, so that it measures the machine,
            // not the queues the limit lets build.
            if *usual == 0.0 {
                *usual = us;
            } else if app_limited {
                *usual += USUAL_WEIGHT * (us - *usual);
            }
            if *usual > DRAINED * us {
                *usual *= USUAL_DECAY;
            }
        }
        if app_limited && !s.expired {
            return;
        }
        let g = if s.expired {
            0.5
        } else {
            let allowed = s.allowed.as_secs_f64() * 1e6;
            let target = (self.usual[b] * TOLERANCE)
                .max(allowed * TARGET_FLOOR)
                .min(allowed);
            (target / us).clamp(0.5, 1.0)
        };
        self.learnt = true;
        let proposed = self.limit * g + s.cost as f64;
        self.limit = (1.0 - SMOOTHING) * self.limit + SMOOTHING * proposed;
        self.limit = self.limit.clamp(self.floor(), self.ceiling());
    }
}

/// Request sizes by powers of two: their no-load latencies differ.
fn bucket(cost: u64) -> usize {
    ((64 - cost.max(1).leading_zeros()) as usize).min(BUCKETS - 1)
}

/// The least latency (µs) per size over the current and the previous window, trusted once
/// `SURE_AFTER` samples of that size made it.
#[derive(Debug)]
struct MinWindow {
    current: Window,
    previous: Window,
    started: Instant,
}

#[derive(Clone, Copy, Debug)]
struct Window {
    least: [f64; BUCKETS],
    samples: [u32; BUCKETS],
}

impl Window {
    const EMPTY: Window = Window {
        least: [f64::INFINITY; BUCKETS],
        samples: [0; BUCKETS],
    };
}

impl MinWindow {
    fn new(now: Instant) -> MinWindow {
        MinWindow {
            current: Window::EMPTY,
            previous: Window::EMPTY,
            started: now,
        }
    }

    fn rotate(&mut self, now: Instant) {
        let age = now.saturating_duration_since(self.started);
        if age < WINDOW {
            return;
        }
        self.previous = if age < 2 * WINDOW {
            self.current
        } else {
            Window::EMPTY
        };
        self.current = Window::EMPTY;
        self.started = now;
    }

    fn record(&mut self, b: usize, us: f64) {
        self.current.least[b] = self.current.least[b].min(us);
        self.current.samples[b] = self.current.samples[b].saturating_add(1);
    }

    /// `None` until `SURE_AFTER` samples: a deployment's first requests are slow for reasons
    /// of their own (lazy set-up, cold caches), and one of them would refuse every request of
    /// its size for two windows but for one probe a second.
    fn get(&self, b: usize) -> Option<f64> {
        let samples = self.current.samples[b].saturating_add(self.previous.samples[b]);
        let least = self.current.least[b].min(self.previous.least[b]);
        (samples >= SURE_AFTER).then_some(least)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn sample(cost: u64, latency: Duration, in_flight: u64) -> Sample {
        Sample {
            cost,
            latency,
            allowed: Duration::from_secs(1),
            in_flight,
            expired: false,
        }
    }

    /// `SURE_AFTER` finished requests of `cost` rows, each with nothing else in flight.
    fn measured(g: &mut Gradient, cost: u64, latency: Duration, now: Instant) {
        for _ in 0..SURE_AFTER {
            g.observe(sample(cost, latency, 0), now);
        }
    }

    /// A limiter with one healthy ranker whose limit grew on fast 100-row requests.
    fn grown(now: Instant) -> Gradient {
        grown_on(2048, 200, now)
    }

    /// `samples` fast 100-row requests, each taken with the whole limit in use.
    fn grown_on(max_in_flight: usize, samples: usize, now: Instant) -> Gradient {
        let mut g = Gradient::new(max_in_flight, now);
        g.refresh(now, 1);
        g.sized(100);
        for _ in 0..samples {
            let busy = g.limit();
            g.observe(sample(100, 5 * MS, busy), now);
        }
        g
    }

    #[test]
    fn grows_while_latency_stays_at_the_usual() {
        let now = Instant::now();
        let mut g = Gradient::new(2048, now);
        g.refresh(now, 1);
        let start = g.limit();
        let g2 = grown(now);
        assert!(g2.limit() > 20 * 100, "{} from {start}", g2.limit());
        // A sample while less than half the limit is used does not grow it.
        let before = g2.limit();
        g.observe(sample(100, 5 * MS, 0), now);
        let mut g2 = g2;
        g2.observe(sample(100, 5 * MS, before / 4), now);
        assert_eq!(g2.limit(), before);
    }

    /// A sample with `in_flight` rows in use whose budget allows 100 ms (a floor of 20 ms).
    fn tight(latency: Duration, in_flight: u64) -> Sample {
        Sample {
            allowed: 100 * MS,
            ..sample(100, latency, in_flight)
        }
    }

    #[test]
    fn shrinks_when_latency_rises_under_load() {
        let now = Instant::now();
        let mut g = grown(now);
        let mut last = g.limit();
        for _ in 0..500 {
            g.observe(tight(40 * MS, last), now); // 40 ms against a target of 20: g = 0.5
            assert!(g.limit() <= last, "{} > {last}", g.limit());
            last = g.limit();
        }
        // At g = 0.5 the headroom of one request holds it at two requests.
        assert_eq!(last, 200);
    }

    #[test]
    fn a_slow_machine_at_low_load_becomes_the_usual_latency() {
        let now = Instant::now();
        let mut g = grown(now);
        for _ in 0..300 {
            g.observe(tight(40 * MS, 0), now); // little in flight: the machine is slow
        }
        let before = g.limit();
        g.observe(tight(40 * MS, before), now);
        assert!(g.limit() >= before, "{} < {before}", g.limit());
    }

    #[test]
    fn a_latency_far_within_the_budget_does_not_shrink_it() {
        let now = Instant::now();
        let mut g = grown(now);
        let before = g.limit();
        g.observe(sample(100, 40 * MS, before), now); // 8x the usual, 4% of 1 s
        assert!(g.limit() >= before, "{} < {before}", g.limit());
    }

    #[test]
    fn requests_past_their_budget_shrink_it_to_the_floor() {
        let now = Instant::now();
        let mut g = grown(now);
        // Two healthy rankers: the floor is two requests of the mean size (100 rows).
        g.refresh(now, 2);
        for _ in 0..100 {
            g.observe(
                Sample {
                    expired: true,
                    ..sample(100, 40 * MS, 10)
                },
                now,
            );
        }
        assert_eq!(g.limit(), 200);
    }

    #[test]
    fn a_fresh_limiter_admits_several_requests_per_ranker_until_it_learns() {
        let now = Instant::now();
        let mut g = Gradient::new(2048, now);
        g.sized(100);
        g.refresh(now, 2);
        assert_eq!(
            g.limit(),
            3200,
            "16 requests of 100 rows for each of 2 rankers"
        );
        g.observe(tight(5 * MS, 0), now); // at low load: the usual latency, the limit as it was
        assert_eq!(g.limit(), 3200);
        // Counted in requests, not rows: 32 requests larger than the mean go in (measured: 6
        // concurrent requests larger than the first ones, refused at 59 rows of 38).
        for _ in 0..32 {
            assert!(g.fits(300));
            g.charge(300, true);
        }
        assert!(!g.fits(300), "the 33rd waits");
        g.uncharge(32 * 300, false);
        g.requests = 0;
        for _ in 0..50 {
            g.observe(tight(40 * MS, 3200), now); // past the target under load: shrinks
        }
        g.refresh(now, 2);
        assert!(g.limit() < 3200, "{}", g.limit());
    }

    #[test]
    fn the_first_request_of_a_fresh_router_does_not_end_its_start() {
        // As the router calls it: the limit refreshed before the first request's rows are
        // known (no mean size yet), then its answer observed with only its own rows in
        // flight. That lone answer says nothing about the limit (measured: it set the limit
        // to two requests on a just-started router, whose third concurrent request of a
        // 6/s trickle was refused).
        let now = Instant::now();
        let mut g = Gradient::new(2048, now);
        g.refresh(now, 2);
        assert!(g.fits(32));
        g.charge(32, true);
        g.sized(32);
        g.observe(tight(200 * MS, 32), now);
        g.uncharge(32, true);
        g.refresh(now, 2);
        assert_eq!(
            g.limit(),
            1024,
            "16 requests of 32 rows for each of 2 rankers"
        );
        for _ in 0..32 {
            assert!(g.fits(32));
            g.charge(32, true);
        }
    }

    #[test]
    fn a_noisy_sample_while_little_is_in_flight_changes_nothing() {
        let now = Instant::now();
        let mut g = grown(now);
        let before = g.limit();
        g.observe(sample(100, 400 * MS, before / 4), now);
        assert_eq!(g.limit(), before);
    }

    #[test]
    fn never_above_max_in_flight_requests_of_the_largest_size() {
        let g = grown_on(4, 1000, Instant::now());
        assert_eq!(g.limit(), 400);
    }

    #[test]
    fn the_budget_bounds_the_latency_target() {
        let now = Instant::now();
        let mut g = grown(now);
        let before = g.limit();
        // Within twice the minimum, but past what the request's budget allows.
        let s = Sample {
            allowed: 6 * MS,
            ..sample(100, 9 * MS, before)
        };
        g.observe(s, now);
        assert!(g.limit() < before);
    }

    #[test]
    fn an_idle_limiter_recovers_from_a_burst_without_samples() {
        let now = Instant::now();
        let mut g = grown(now);
        for _ in 0..500 {
            let busy = g.limit();
            // Past what the budget allows (whatever the usual latency becomes): g = 0.5.
            let s = Sample {
                allowed: 10 * MS,
                ..sample(100, 100 * MS, busy)
            };
            g.observe(s, now);
        }
        // At g = 0.5 the headroom of one request holds it at two requests.
        let shrunk = g.limit();
        assert_eq!(shrunk, 200);
        // Three idle seconds (nothing in flight, no sample): doubled three times.
        g.refresh(now + 3 * PROBE_AFTER, 1);
        assert_eq!(g.limit(), 1600);
        // Not while a request is in flight.
        g.charge(100, true);
        g.refresh(now + 6 * PROBE_AFTER, 1);
        assert_eq!(g.limit(), 1600);
    }

    #[test]
    fn requests_cost_their_rows_and_the_floor_admits_one_per_ranker() {
        let now = Instant::now();
        let mut g = grown(now);
        g.limit = 1000.0;
        assert_eq!(g.door_cost(), 100);
        g.charge(100, true);
        g.charge(800, false); // topped up to 900 rows
        assert!(g.fits(100));
        assert!(!g.fits(101));
        // A 2,048-row request fits only alone (the floor: one request per ranker).
        g.uncharge(900, true);
        assert_eq!((g.in_flight(), g.fits(2048)), (0, true));
        g.charge(2048, true);
        assert!(!g.fits(1));
        // The door charge follows the sizes seen.
        for _ in 0..100 {
            g.sized(2048);
        }
        assert_eq!(g.door_cost(), 2048);
    }

    #[test]
    fn a_request_beyond_reach_goes_through_as_a_probe_once_a_second_when_idle() {
        let now = Instant::now();
        let mut g = Gradient::new(2048, now);
        measured(&mut g, 100, 30 * MS, now); // on a busy machine
        g.admitted(100, now);
        let left = 25 * MS;
        assert_eq!(g.beyond_reach(100, 30 * MS, 0, now), None, "within reach");
        assert_eq!(
            g.beyond_reach(100, left, 0, now),
            Some(30 * MS),
            "one just went through"
        );
        let later = now + PROBE_AFTER;
        assert_eq!(
            g.beyond_reach(100, left, 0, later),
            None,
            "idle for a second: a probe"
        );
        // Not while another request is in flight (its own charge aside), nor far out of reach.
        g.charge(100, true);
        assert_eq!(g.beyond_reach(100, left, 0, later), Some(30 * MS));
        assert_eq!(g.beyond_reach(100, left, 100, later), None);
        assert_eq!(g.beyond_reach(100, 14 * MS, 100, later), Some(30 * MS));
        // The probe's own measurement corrects the minimum.
        g.admitted(100, later);
        g.observe(sample(100, 5 * MS, 100), later);
        assert_eq!(g.beyond_reach(100, left, 100, later), None);
        assert_eq!(g.no_load(100), Some(5 * MS));
    }

    #[test]
    fn one_slow_first_request_does_not_refuse_the_next_ones() {
        // A deployment's first requests are slow (lazy set-up, cold caches, a starved
        // machine): one of them is no minimum to refuse by (measured: every single request
        // of a just-started deployment refused for seconds, but for one probe a second).
        let now = Instant::now();
        let mut g = Gradient::new(2048, now);
        g.observe(sample(100, 300 * MS, 0), now);
        g.admitted(100, now);
        assert_eq!(g.no_load(100), None, "one sample");
        assert_eq!(g.beyond_reach(100, 25 * MS, 0, now), None);
        for _ in 1..SURE_AFTER {
            g.observe(sample(100, 300 * MS, 0), now);
        }
        assert_eq!(
            g.beyond_reach(100, 25 * MS, 0, now),
            Some(300 * MS),
            "settled"
        );
    }

    #[test]
    fn the_minimum_ages_out_after_two_windows() {
        let now = Instant::now();
        let mut g = Gradient::new(2048, now);
        measured(&mut g, 100, MS, now);
        assert_eq!(g.no_load(100), Some(MS));
        measured(&mut g, 100, 10 * MS, now + WINDOW);
        assert_eq!(g.no_load(100), Some(MS), "the previous window still counts");
        measured(&mut g, 100, 10 * MS, now + 2 * WINDOW);
        assert_eq!(g.no_load(100), Some(10 * MS));
        assert_eq!(g.no_load(2048), None, "another size: not measured");
        // The usual latency moves slowly towards what is seen.
        let usual = g.expected(100);
        assert!(MS < usual && usual < 10 * MS, "{usual:?}");
    }
}
