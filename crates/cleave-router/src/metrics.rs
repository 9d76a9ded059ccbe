//! Prometheus metrics of the router: a latency histogram per stage, error counters by kind,
//! each ranker's load as the router sees it, and the front door's connections and shedding. Lock-free counters; rendered on `GET /metrics`
//! in the Prometheus text format (version 0.0.4).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::error::{ErrorKind, Stage};

/// Bucket upper bounds in seconds: 50 µs to 10 s, about three per decade.
const BUCKETS: [f64; 16] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 10.0,
];

#[derive(Default)]
pub struct Histogram {
    /// Non-cumulative counts per bucket; the last slot is +Inf.
    buckets: [AtomicU64; BUCKETS.len() + 1],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(BUCKETS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            cumulative += b.load(Ordering::Relaxed);
            let le = BUCKETS.get(i).map_or("+Inf".to_string(), |v| v.to_string());
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
        }
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count());
    }
}

/// The front door's and admission control's numbers at the time of a scrape.
#[derive(Clone, Debug, Default)]
pub struct FrontStats {
    pub in_flight: usize,
    pub connections: usize,
    /// (reason, requests or connections refused).
    pub shed: Vec<(&'static str, u64)>,
    /// (reason, connections the router closed).
    pub closed: Vec<(&'static str, u64)>,
}

#[derive(Default)]
pub struct Metrics {
    stages: [Histogram; Stage::ALL.len()],
    errors: [AtomicU64; ErrorKind::ALL.len()],
    requests: AtomicU64,
}

impl Metrics {
    /// Records time spent in `stage` (stages without a histogram are ignored).
    pub fn observe(&self, stage: Stage, d: Duration) {
        if let Some(h) = self.stages.get(stage as usize) {
            h.observe(d);
        }
    }

    fn stage(&self, stage: Stage) -> &Histogram {
        &self.stages[stage as usize]
    }

    pub fn error(&self, kind: ErrorKind) {
        self.errors[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn errors(&self, kind: ErrorKind) -> u64 {
        self.errors[kind as usize].load(Ordering::Relaxed)
    }

    pub fn request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// The text exposition; `rankers` are (address, outstanding, EWMA latency in seconds).
    pub fn render(&self, rankers: &[(String, u64, f64)], front: &FrontStats) -> String {
        let mut out = String::with_capacity(8 << 10);
        out.push_str(
            "# HELP cleave_router_requests_total Inference requests received (infer and rank).\n\
             # TYPE cleave_router_requests_total counter\n",
        );
        let _ = writeln!(
            out,
            "cleave_router_requests_total {}",
            self.requests.load(Ordering::Relaxed)
        );
        out.push_str(
            "# HELP cleave_router_stage_seconds Time a request spent per stage: parse (read, \
             parse, validate), lookup (shard fan-out and merge), transfer (ranker round trip \
             less its queue and compute), queue (ranker queue), compute (dense program), total.\n\
             # TYPE cleave_router_stage_seconds histogram\n",
        );
        for stage in Stage::ALL {
            let labels = format!("stage=\"{}\"", stage.as_str());
            self.stage(stage)
                .render(&mut out, "cleave_router_stage_seconds", &labels);
        }
        out.push_str(
            "# HELP cleave_router_errors_total Failed requests by kind of error.\n\
             # TYPE cleave_router_errors_total counter\n",
        );
        for kind in ErrorKind::ALL {
            let _ = writeln!(
                out,
                "cleave_router_errors_total{{kind=\"{}\"}} {}",
                kind.as_str(),
                self.errors(kind)
            );
        }
        out.push_str(
            "# HELP cleave_router_ranker_outstanding Requests sent to a ranker and not yet answered.\n\
             # TYPE cleave_router_ranker_outstanding gauge\n",
        );
        for (addr, outstanding, _) in rankers {
            let _ = writeln!(
                out,
                "cleave_router_ranker_outstanding{{ranker=\"{addr}\"}} {outstanding}"
            );
        }
        out.push_str(
            "# HELP cleave_router_ranker_latency_seconds Moving average of a ranker's queue + \
             compute time, as it reports them.\n\
             # TYPE cleave_router_ranker_latency_seconds gauge\n",
        );
        for (addr, _, ewma) in rankers {
            let _ = writeln!(
                out,
                "cleave_router_ranker_latency_seconds{{ranker=\"{addr}\"}} {ewma}"
            );
        }
        render_front(&mut out, front);
        out
    }
}

fn render_front(out: &mut String, front: &FrontStats) {
    let _ = write!(
        out,
        "# HELP cleave_router_in_flight Inference requests admitted and not answered yet.\n\
         # TYPE cleave_router_in_flight gauge\n\
         cleave_router_in_flight {}\n\
         # HELP cleave_router_connections Open client connections.\n\
         # TYPE cleave_router_connections gauge\n\
         cleave_router_connections {}\n",
        front.in_flight, front.connections
    );
    out.push_str(
        "# HELP cleave_router_shed_total Requests (or connections) refused at once with 503, \
         by reason: connections (max_connections), in_flight (max_in_flight), estimate (the \
         expected latency exceeded the budget).\n\
         # TYPE cleave_router_shed_total counter\n",
    );
    for (reason, n) in &front.shed {
        let _ = writeln!(out, "cleave_router_shed_total{{reason=\"{reason}\"}} {n}");
    }
    out.push_str(
        "# HELP cleave_router_connections_closed_total Connections the router closed by a \
         timeout: header_timeout (a request head did not arrive whole in time), idle_timeout.\n\
         # TYPE cleave_router_connections_closed_total counter\n",
    );
    for (reason, n) in &front.closed {
        let _ = writeln!(
            out,
            "cleave_router_connections_closed_total{{reason=\"{reason}\"}} {n}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let m = Metrics::default();
        m.observe(Stage::Lookup, Duration::from_micros(30));
        m.observe(Stage::Lookup, Duration::from_millis(3));
        m.observe(Stage::Lookup, Duration::from_secs(60));
        m.error(ErrorKind::Shard);
        let front = FrontStats {
            in_flight: 3,
            connections: 5,
            shed: vec![("estimate", 4)],
            closed: vec![("idle_timeout", 1)],
        };
        let text = m.render(&[("127.0.0.1:9".into(), 2, 0.004)], &front);
        assert!(
            text.contains("cleave_router_stage_seconds_bucket{stage=\"lookup\",le=\"0.00005\"} 1")
        );
        assert!(
            text.contains("cleave_router_stage_seconds_bucket{stage=\"lookup\",le=\"0.005\"} 2")
        );
        assert!(text.contains("cleave_router_stage_seconds_bucket{stage=\"lookup\",le=\"10\"} 2"));
        assert!(text.contains("cleave_router_stage_seconds_bucket{stage=\"lookup\",le=\"+Inf\"} 3"));
        assert!(text.contains("cleave_router_stage_seconds_count{stage=\"lookup\"} 3"));
        assert!(text.contains("cleave_router_stage_seconds_count{stage=\"parse\"} 0"));
        assert!(text.contains("cleave_router_errors_total{kind=\"shard\"} 1"));
        assert!(text.contains("cleave_router_ranker_outstanding{ranker=\"127.0.0.1:9\"} 2"));
        assert!(text.contains("\ncleave_router_in_flight 3\n"));
        assert!(text.contains("\ncleave_router_connections 5\n"));
        assert!(text.contains("cleave_router_shed_total{reason=\"estimate\"} 4\n"));
        assert!(text.contains("cleave_router_connections_closed_total{reason=\"idle_timeout\"} 1"));
    }
}
