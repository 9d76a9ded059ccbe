//! Shard metrics, exported with the `prometheus` crate in its text format (version 0.0.4).
//!
//! Counters and the latency histogram are the library's atomic types, registered in a registry
//! of this shard's own (several shards may share a process in tests). The gauges that other
//! parts own (readiness, connections, tables) are read when [`Metrics::render`] is called and
//! handed to the encoder as metric families of that scrape.

use std::time::Duration;

use cleave_embed::TierStats;
use cleave_wire::ErrorCode;
use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// The `Content-Type` of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;

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

pub struct Metrics {
    registry: Registry,
    requests_ok: IntCounter,
    requests_error: IntCounter,
    /// One per entry of `CODES`, then "other"; resolved once so that recording is one atomic add.
    errors: Vec<IntCounter>,
    lookups: IntCounter,
    rows: IntCounter,
    request_bytes: IntCounter,
    response_bytes: IntCounter,
    in_flight: IntGauge,
    latency: Histogram,
}

/// Gauges read from elsewhere when rendering.
pub struct Gauges {
    pub ready: bool,
    pub connections: u64,
    pub frames_receiving: u64,
    pub tables: Vec<(String, u64, u64)>, // name, row_start, row_end
    /// Lookups received and waiting to start.
    pub queued: u64,
    /// Lookups answered `deadline` without being computed: already late when their turn
    /// came, and with less time left than a lookup takes (the server's counts).
    pub dropped_expired: u64,
    pub dropped_late: u64,
    /// Responses held until the router grants credit for them (docs/protocol.md, "Response
    /// credits"), and those whose deadline passed first.
    pub responses_held: u64,
    pub credit_expired: u64,
    /// Connections moved from a busy I/O thread to a less loaded one.
    pub connection_migrations: u64,
    /// SSD-tier lookups handed to a miss worker (they read from the device).
    pub lookups_deferred: u64,
    /// Each table's version (0: the bundle's; docs/tiers.md, "Updates").
    pub table_versions: Vec<(String, u64)>,
    /// UPDATE steps (stage chunk, switch, abort) that succeeded and that failed.
    pub update_steps: [u64; 2],
    /// The SSD tier's counters, when the tables are served from it (docs/tiers.md).
    pub tier: Option<TierStats>,
}

impl Default for Metrics {
    fn default() -> Self {
        // The definitions are constants: a failure is a bug, which every test that builds a
        // shard would show at once.
        Self::new().expect("the shard's metric definitions are valid")
    }
}

impl Metrics {
    fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let counter = |name: &str, help: &str| -> prometheus::Result<IntCounter> {
            let c = IntCounter::new(name, help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let requests = IntCounterVec::new(
            Opts::new(
                "cleave_shard_requests_total",
                "Lookup requests answered, by status.",
            ),
            &["status"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        let by_code = IntCounterVec::new(
            Opts::new("cleave_shard_errors_total", "Error replies, by error code."),
            &["code"],
        )?;
        registry.register(Box::new(by_code.clone()))?;
        let errors = CODES
            .iter()
            .map(|c| c.name())
            .chain(["other"])
            .map(|code| by_code.get_metric_with_label_values(&[code]))
            .collect::<prometheus::Result<_>>()?;
        let in_flight = IntGauge::new("cleave_shard_requests_in_flight", "Requests being served.")?;
        registry.register(Box::new(in_flight.clone()))?;
        let latency = Histogram::with_opts(
            HistogramOpts::new(
                "cleave_shard_request_duration_seconds",
                "Time from a whole request frame to its reply being queued.",
            )
            .buckets(BUCKETS.to_vec()),
        )?;
        registry.register(Box::new(latency.clone()))?;
        Ok(Self {
            requests_ok: requests.get_metric_with_label_values(&["ok"])?,
            requests_error: requests.get_metric_with_label_values(&["error"])?,
            errors,
            lookups: counter(
                "cleave_shard_lookups_total",
                "Table lookups served (a request holds several).",
            )?,
            rows: counter("cleave_shard_rows_total", "Row ids looked up.")?,
            request_bytes: counter(
                "cleave_shard_request_bytes_total",
                "Request payload bytes received.",
            )?,
            response_bytes: counter(
                "cleave_shard_response_bytes_total",
                "Response payload bytes sent.",
            )?,
            in_flight,
            latency,
            registry,
        })
    }

    /// A request has started (in-flight gauge).
    pub fn start(&self) {
        self.in_flight.inc();
    }

    /// A request has been answered.
    pub fn finish(
        &self,
        outcome: Result<(u64, u64), ErrorCode>,
        request_bytes: usize,
        response_bytes: usize,
        took: Duration,
    ) {
        self.in_flight.dec();
        match outcome {
            Ok((lookups, rows)) => {
                self.requests_ok.inc();
                self.lookups.inc_by(lookups);
                self.rows.inc_by(rows);
            }
            Err(code) => {
                self.requests_error.inc();
                let i = CODES.iter().position(|&c| c == code).unwrap_or(CODES.len());
                self.errors[i].inc();
            }
        }
        self.request_bytes.inc_by(request_bytes as u64);
        self.response_bytes.inc_by(response_bytes as u64);
        self.latency.observe(took.as_secs_f64());
    }

    /// The text exposition ([`CONTENT_TYPE`]) of the recorded metrics and of `g`.
    pub fn render(&self, g: &Gauges) -> String {
        let mut families = self.registry.gather();
        for (name, help, v) in [
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
            (
                "cleave_shard_queued",
                "Lookups received and waiting to start.",
                g.queued,
            ),
            (
                "cleave_shard_responses_held",
                "Responses computed and held until the router grants credit for them.",
                g.responses_held,
            ),
        ] {
            families.push(scrape_family(
                MetricType::GAUGE,
                name,
                help,
                [(vec![], v as f64)],
            ));
        }
        families.push(scrape_family(
            MetricType::COUNTER,
            "cleave_shard_dropped_total",
            "Lookups answered `deadline` and never computed: `expired` when already late at \
             their turn, `late` when less time was left than a lookup takes.",
            [
                (
                    vec![("reason", "expired".to_owned())],
                    g.dropped_expired as f64,
                ),
                (vec![("reason", "late".to_owned())], g.dropped_late as f64),
            ],
        ));
        families.push(scrape_family(
            MetricType::COUNTER,
            "cleave_shard_credit_expired_total",
            "Responses dropped (answered `deadline`) because no credit came before their \
             deadline.",
            [(vec![], g.credit_expired as f64)],
        ));
        families.push(scrape_family(
            MetricType::COUNTER,
            "cleave_shard_connection_migrations_total",
            "Connections moved from a busy I/O thread to the least-loaded one.",
            [(vec![], g.connection_migrations as f64)],
        ));
        families.push(scrape_family(
            MetricType::COUNTER,
            "cleave_shard_lookups_deferred_total",
            "SSD-tier lookups that missed the row cache, completed by a miss worker off the \
             I/O threads.",
            [(vec![], g.lookups_deferred as f64)],
        ));
        let versions = g
            .table_versions
            .iter()
            .map(|(t, v)| (vec![("table", t.clone())], *v as f64));
        families.push(scrape_family(
            MetricType::GAUGE,
            "cleave_shard_table_version",
            "Version of each table served (0: the bundle's).",
            versions,
        ));
        families.push(scrape_family(
            MetricType::COUNTER,
            "cleave_shard_update_steps_total",
            "UPDATE steps (stage chunk, switch, abort), by outcome.",
            [
                (vec![("outcome", "ok".to_owned())], g.update_steps[0] as f64),
                (
                    vec![("outcome", "error".to_owned())],
                    g.update_steps[1] as f64,
                ),
            ],
        ));
        if let Some(t) = &g.tier {
            for (name, help, v) in [
                ("ids", "Ids looked up in the SSD tier, with repeats.", t.ids),
                (
                    "rows",
                    "Distinct rows per lookup call, summed: what reaches the row cache.",
                    t.rows,
                ),
                ("row_hits", "Rows found in the DRAM row cache.", t.row_hits),
                (
                    "device_reads",
                    "Reads issued to the device (one per missed row).",
                    t.device_reads,
                ),
                (
                    "device_bytes",
                    "Bytes read from the device.",
                    t.device_bytes,
                ),
                (
                    "row_bytes_read",
                    "Bytes of rows the device reads delivered.",
                    t.row_bytes_read,
                ),
                (
                    "pooled_lookups",
                    "Bags looked up in the pooled-embedding cache.",
                    t.pooled_lookups,
                ),
                (
                    "pooled_hits",
                    "Bags the pooled-embedding cache answered.",
                    t.pooled_hits,
                ),
            ] {
                families.push(scrape_family(
                    MetricType::COUNTER,
                    &format!("cleave_shard_tier_{name}_total"),
                    help,
                    [(vec![], v as f64)],
                ));
            }
        }
        let tables = g.tables.iter().map(|(t, a, b)| {
            let labels = vec![
                ("table", t.clone()),
                ("row_start", a.to_string()),
                ("row_end", b.to_string()),
            ];
            (labels, b.saturating_sub(*a) as f64)
        });
        families.push(scrape_family(
            MetricType::GAUGE,
            "cleave_shard_table_rows",
            "Rows held per table (row_end - row_start).",
            tables,
        ));
        // A family without samples is refused by the encoder (a shard with no tables yet).
        families.retain(|f| !f.get_metric().is_empty());
        let mut text = String::with_capacity(4 << 10);
        if let Err(e) = prometheus::TextEncoder::new().encode_utf8(&families, &mut text) {
            text.push_str(&format!("# encoding the shard's metrics failed: {e}\n"));
        }
        text
    }
}

/// A gauge or counter family whose values are read at the scrape (the shard's and the
/// router's); labels keep the order given (the library's own vectors sort them by name).
pub fn scrape_family(
    kind: MetricType,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (Vec<(&'static str, String)>, f64)>,
) -> MetricFamily {
    let mut family = MetricFamily::default();
    family.set_name(name.into());
    family.set_help(help.into());
    family.set_field_type(kind);
    let metrics = samples
        .into_iter()
        .map(|(labels, value)| {
            let mut metric = Metric::default();
            if kind == MetricType::COUNTER {
                let mut counter = Counter::default();
                counter.set_value(value);
                metric.set_counter(counter);
            } else {
                let mut gauge = Gauge::default();
                gauge.set_value(value);
                metric.set_gauge(gauge);
            }
            metric.set_label(
                labels
                    .into_iter()
                    .map(|(k, v)| {
                        let mut pair = LabelPair::default();
                        pair.set_name(k.into());
                        pair.set_value(v);
                        pair
                    })
                    .collect(),
            );
            metric
        })
        .collect();
    family.set_metric(metrics);
    family
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_our_metrics_after_real_observations() {
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
            queued: 3,
            dropped_expired: 4,
            dropped_late: 5,
            responses_held: 6,
            credit_expired: 7,
            connection_migrations: 8,
            lookups_deferred: 11,
            table_versions: vec![("t\"0".into(), 2)],
            update_steps: [9, 1],
            tier: Some(TierStats {
                rows: 10,
                row_hits: 7,
                device_reads: 3,
                ..TierStats::default()
            }),
        });
        for line in [
            "cleave_shard_requests_total{status=\"ok\"} 1",
            "cleave_shard_requests_total{status=\"error\"} 1",
            "cleave_shard_errors_total{code=\"out_of_range\"} 1",
            "cleave_shard_errors_total{code=\"other\"} 0",
            "cleave_shard_lookups_total 3",
            "cleave_shard_rows_total 100",
            "cleave_shard_request_bytes_total 15",
            "cleave_shard_response_bytes_total 27",
            "cleave_shard_requests_in_flight 1",
            "cleave_shard_connections 2",
            "cleave_shard_frames_receiving 0",
            "cleave_shard_ready 1",
            "cleave_shard_queued 3",
            "cleave_shard_dropped_total{reason=\"expired\"} 4",
            "cleave_shard_dropped_total{reason=\"late\"} 5",
            "cleave_shard_responses_held 6",
            "cleave_shard_credit_expired_total 7",
            "cleave_shard_connection_migrations_total 8",
            "cleave_shard_lookups_deferred_total 11",
            "cleave_shard_table_version{table=\"t\\\"0\"} 2",
            "cleave_shard_update_steps_total{outcome=\"ok\"} 9",
            "cleave_shard_update_steps_total{outcome=\"error\"} 1",
            "cleave_shard_tier_rows_total 10",
            "cleave_shard_tier_row_hits_total 7",
            "cleave_shard_tier_device_reads_total 3",
            "# TYPE cleave_shard_tier_device_reads_total counter",
            "# TYPE cleave_shard_dropped_total counter",
            "cleave_shard_table_rows{table=\"t\\\"0\",row_start=\"5\",row_end=\"10\"} 5",
            "cleave_shard_request_duration_seconds_bucket{le=\"0.00001\"} 0",
            "cleave_shard_request_duration_seconds_bucket{le=\"0.00005\"} 1",
            "cleave_shard_request_duration_seconds_bucket{le=\"0.0025\"} 2",
            "cleave_shard_request_duration_seconds_bucket{le=\"1\"} 2",
            "cleave_shard_request_duration_seconds_bucket{le=\"+Inf\"} 2",
            "cleave_shard_request_duration_seconds_count 2",
            "# TYPE cleave_shard_request_duration_seconds histogram",
            "# TYPE cleave_shard_requests_total counter",
            "# TYPE cleave_shard_ready gauge",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

    #[test]
    fn a_shard_without_tables_renders_the_rest() {
        let text = Metrics::default().render(&Gauges {
            ready: false,
            connections: 0,
            frames_receiving: 0,
            tables: vec![],
            queued: 0,
            dropped_expired: 0,
            dropped_late: 0,
            responses_held: 0,
            credit_expired: 0,
            connection_migrations: 0,
            lookups_deferred: 0,
            table_versions: vec![],
            update_steps: [0, 0],
            tier: None,
        });
        assert!(text.lines().any(|l| l == "cleave_shard_ready 0"), "{text}");
        assert!(!text.contains("cleave_shard_table_rows"), "{text}");
        assert!(!text.contains("cleave_shard_tier"), "{text}");
        assert!(!text.contains("encoding"), "{text}");
    }
}
