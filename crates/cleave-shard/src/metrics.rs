//! Shard metrics in the Prometheus text format (version 0.0.4).
//!
//! A handful of counters and one histogram do not need a metrics library with a global
//! registry: relaxed atomics here, rendered by [`Metrics::render`].

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cleave_wire::ErrorCode;

/// Upper bounds (seconds) of the latency histogram's buckets: 10 µs to 1 s.
const BUCKETS: [f64; 16] = [
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3,
    250e-3, 500e-3, 1.0,
];

/// Error codes counted by name (others count as "other").
const CODES: [ErrorCode; 6] = [
    ErrorCode::BadRequest,
    ErrorCode::NotFound,
    ErrorCode::OutOfRange,
    ErrorCode::NotReady,
    ErrorCode::UnknownKind,
    ErrorCode::Internal,
];

#[derive(Default)]
pub struct Metrics {
    requests_ok: AtomicU64,
    errors: [AtomicU64; CODES.len() + 1],
    lookups: AtomicU64,
    rows: AtomicU64,
    request_bytes: AtomicU64,
    response_bytes: AtomicU64,
    in_flight: AtomicU64,
    buckets: [AtomicU64; BUCKETS.len()],
    latency_sum_ns: AtomicU64,
    latency_count: AtomicU64,
}

/// Gauges read from elsewhere when rendering.
pub struct Gauges {
    pub ready: bool,
    pub connections: u64,
    pub frames_receiving: u64,
    pub tables: Vec<(String, u64, u64)>, // name, row_start, row_end
}

impl Metrics {
    /// A request has started (in-flight gauge).
    pub fn start(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// A request has been answered.
    pub fn finish(
        &self,
        outcome: Result<(u64, u64), ErrorCode>,
        request_bytes: usize,
        response_bytes: usize,
        took: Duration,
    ) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        match outcome {
            Ok((lookups, rows)) => {
                self.requests_ok.fetch_add(1, Ordering::Relaxed);
                self.lookups.fetch_add(lookups, Ordering::Relaxed);
                self.rows.fetch_add(rows, Ordering::Relaxed);
            }
            Err(code) => {
                let i = CODES.iter().position(|&c| c == code).unwrap_or(CODES.len());
                self.errors[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.request_bytes
            .fetch_add(request_bytes as u64, Ordering::Relaxed);
        self.response_bytes
            .fetch_add(response_bytes as u64, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        if let Some(b) = BUCKETS.iter().position(|&le| secs <= le) {
            self.buckets[b].fetch_add(1, Ordering::Relaxed);
        }
        self.latency_sum_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        self.latency_count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn render(&self, g: &Gauges) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut s = String::new();
        let n = "cleave_shard_requests_total";
        family(&mut s, n, "counter", "Lookup requests answered, by status.");
        let errors: u64 = self.errors.iter().map(get).sum();
        let _ = writeln!(s, "{n}{{status=\"ok\"}} {}", get(&self.requests_ok));
        let _ = writeln!(s, "{n}{{status=\"error\"}} {errors}");
        let n = "cleave_shard_errors_total";
        family(&mut s, n, "counter", "Error replies, by error code.");
        for (i, e) in self.errors.iter().enumerate() {
            let code = CODES.get(i).map_or("other", |c| c.name());
            let _ = writeln!(s, "{n}{{code=\"{code}\"}} {}", get(e));
        }
        for (n, help, v) in [
            (
                "cleave_shard_lookups_total",
                "Table lookups served (a request holds several).",
                &self.lookups,
            ),
            ("cleave_shard_rows_total", "Row ids looked up.", &self.rows),
            (
                "cleave_shard_request_bytes_total",
                "Request payload bytes received.",
                &self.request_bytes,
            ),
            (
                "cleave_shard_response_bytes_total",
                "Response payload bytes sent.",
                &self.response_bytes,
            ),
        ] {
            family(&mut s, n, "counter", help);
            let _ = writeln!(s, "{n} {}", get(v));
        }
        for (n, help, v) in [
            (
                "cleave_shard_requests_in_flight",
                "Requests being served.",
                get(&self.in_flight),
            ),
            (
                "cleave_shard_connections",
                "Open client connections.",
                g.connections,
            ),
            (
                "cleave_shard_frames_receiving",
                "Frames partly received.",
                g.frames_receiving,
            ),
            (
                "cleave_shard_ready",
                "1 once the tables are mapped; 0 before and while stopping.",
                g.ready as u64,
            ),
        ] {
            family(&mut s, n, "gauge", help);
            let _ = writeln!(s, "{n} {v}");
        }
        let n = "cleave_shard_table_rows";
        family(
            &mut s,
            n,
            "gauge",
            "Rows held per table (row_end - row_start).",
        );
        for (t, a, b) in &g.tables {
            let t = escape(t);
            let _ = writeln!(
                s,
                "{n}{{table=\"{t}\",row_start=\"{a}\",row_end=\"{b}\"}} {}",
                b - a
            );
        }
        let n = "cleave_shard_request_duration_seconds";
        family(
            &mut s,
            n,
            "histogram",
            "Time from a whole request frame to its reply being queued.",
        );
        let mut cumulative = 0;
        for (le, b) in BUCKETS.iter().zip(&self.buckets) {
            cumulative += get(b);
            let _ = writeln!(s, "{n}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let count = get(&self.latency_count);
        let _ = writeln!(s, "{n}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(s, "{n}_sum {}", get(&self.latency_sum_ns) as f64 / 1e9);
        let _ = writeln!(s, "{n}_count {count}");
        s
    }
}

fn family(s: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn escape(label: &str) -> String {
    label
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_a_cumulative_histogram() {
        let m = Metrics::default();
        m.start();
        m.finish(Ok((3, 100)), 10, 20, Duration::from_micros(30));
        m.start();
        m.finish(Err(ErrorCode::OutOfRange), 5, 7, Duration::from_millis(2));
        m.start();
        let text = m.render(&Gauges {
            ready: true,
            connections: 2,
            frames_receiving: 0,
            tables: vec![("t\"0".into(), 5, 10)],
        });
        for line in [
            "cleave_shard_requests_total{status=\"ok\"} 1",
            "cleave_shard_requests_total{status=\"error\"} 1",
            "cleave_shard_errors_total{code=\"out_of_range\"} 1",
            "cleave_shard_rows_total 100",
            "cleave_shard_request_bytes_total 15",
            "cleave_shard_requests_in_flight 1",
            "cleave_shard_connections 2",
            "cleave_shard_ready 1",
            "cleave_shard_table_rows{table=\"t\\\"0\",row_start=\"5\",row_end=\"10\"} 5",
            "cleave_shard_request_duration_seconds_bucket{le=\"0.00001\"} 0",
            "cleave_shard_request_duration_seconds_bucket{le=\"0.00005\"} 1",
            "cleave_shard_request_duration_seconds_bucket{le=\"0.0025\"} 2",
            "cleave_shard_request_duration_seconds_bucket{le=\"+Inf\"} 2",
            "cleave_shard_request_duration_seconds_count 2",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(text.contains("# TYPE cleave_shard_request_duration_seconds histogram"));
    }
}
