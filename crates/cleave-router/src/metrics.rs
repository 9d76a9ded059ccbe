//! Prometheus metrics of the router: a latency histogram per stage, error counters by kind,
//! each ranker's load as the router sees it, and the front door's connections and shedding.
//!
//! Exported with the `prometheus` crate in its text format (version 0.0.4) on `GET /metrics`.
//! What the router records is the library's atomic types, resolved per label once so that an
//! observation is a few atomic adds; what other parts own (ranker loads, the front door's
//! counters) is read at the scrape and handed to the encoder as metric families of that scrape.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus::proto::MetricType;
use prometheus::{
    CounterVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
};

use cleave_shard::metrics::scrape_family;

use crate::error::{ErrorKind, Stage};

/// The `Content-Type` of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;

/// Bucket upper bounds in seconds: 50 µs to 10 s, about three per decade.
const BUCKETS: [f64; 16] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 10.0,
];

/// Counters the front door keeps for /metrics.
#[derive(Default)]
pub struct DoorStats {
    /// Open connections (refusals not included).
    pub open: Arc<AtomicUsize>,
    /// Connections refused because `max_connections` were open.
    pub refused: AtomicU64,
    pub header_timeouts: AtomicU64,
    pub idle_timeouts: AtomicU64,
}

/// The front door's and admission control's numbers at the time of a scrape.
#[derive(Clone, Debug, Default)]
pub struct FrontStats {
    pub in_flight: usize,
    /// The admission limit on `in_flight` (`max_in_flight`).
    pub max_in_flight: usize,
    /// The adaptive admission limit on rows in flight (none under the estimate rule).
    pub limit: Option<u64>,
    pub connections: usize,
    /// (reason, requests or connections refused).
    pub shed: Vec<(&'static str, u64)>,
    /// (reason, connections the router closed).
    pub closed: Vec<(&'static str, u64)>,
}

/// How a request body was written (the `protocol` label of the codec metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// KServe v2 JSON tensors.
    Json,
    /// KServe v2 with binary tensors (an `Inference-Header-Content-Length` body).
    Binary,
    /// The per-feature `rank` form.
    Rank,
    /// KServe v2 gRPC (protobuf decoding and encoding included).
    Grpc,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Json => "json",
            Protocol::Binary => "binary",
            Protocol::Rank => "rank",
            Protocol::Grpc => "grpc",
        }
    }
}

// Parsing and encoding run without an await, on one thread: two readings bound their CPU.
pub use cleave_wire::cpu::thread_cpu;

pub struct Metrics {
    registry: Registry,
    /// `cleave_router_codec_cpu_seconds_total` and `cleave_router_codec_total`.
    codec_cpu: CounterVec,
    codec_count: IntCounterVec,
    /// One per `Stage::ALL`, in its order.
    stages: Vec<Histogram>,
    /// One per `ErrorKind::ALL`, in its order.
    errors: Vec<IntCounter>,
    requests: IntCounter,
    admitted: IntCounter,
    expired_after_admission: IntCounter,
    /// The per-version families (docs/api.md, "Metrics"), resolved per version by `version`.
    by_version: VersionFamilies,
    /// CPU time (ns) of the send path to the rankers: packing each RANK payload and the
    /// ranker clients' writes (`ClientConfig::send_cpu`), whatever the transport.
    pub ranker_send_cpu: Arc<AtomicU64>,
    /// The embedding cache every version looks up through (set once, by the builder), here
    /// because every part that reports to it or reads it already holds the metrics.
    pub cache: std::sync::OnceLock<Arc<dyn CacheHandle>>,
}

/// What /metrics shows of the cache.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheStats {
    pub mode: &'static str,
    /// Rows and bags answered by the cache.
    pub hits: u64,
    /// Rows and bags sent to the shards (each distinct one of a request once).
    pub misses: u64,
    /// Ids the shards did not have to look up.
    pub ids_avoided: u64,
    /// Request and response bytes that did not cross the network.
    pub bytes_not_sent: u64,
    pub bytes: u64,
    pub limit: u64,
    pub entries: u64,
    /// The rankers' largest batch the memory budget allows beside the cache.
    pub ranker_max_batch: u64,
    /// The memory the cache and the batches share, and a batch row's share of it (as given,
    /// or as the rankers measured it at start).
    pub budget_bytes: u64,
    pub activation_bytes_per_sample: u64,
}

/// The router's embedding cache (pipeline/cache/) as the handlers and the pipeline use it;
/// a trait here so that this module does not import the pipeline.
pub trait CacheHandle: Send + Sync {
    fn stats(&self) -> CacheStats;
    /// One ranker reply: its batch's requests, this request's rows, the queue behind it.
    fn observe(&self, batch_requests: u64, rows: u64, queue_depth: u64);
    /// The rankers' largest batch (rows) now.
    fn max_batch(&self) -> usize;
    /// An update of `table` switches at `at_us` (Unix µs; 0: now): returns the new epoch.
    fn switch(&self, table: &str, at_us: u64) -> Result<u64, String>;
}

/// The score histogram's buckets: wide enough for logits, fine near probabilities' ends.
const SCORE_BUCKETS: [f64; 17] = [
    -10.0, -5.0, -2.0, -1.0, -0.5, 0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0, 2.0, 5.0, 10.0,
];

struct VersionFamilies {
    requests: IntCounterVec,
    errors: IntCounterVec,
    latency: HistogramVec,
    score: HistogramVec,
}

/// One served version's series, resolved once when the version is built.
pub struct VersionMetrics {
    requests: IntCounter,
    /// One per `ErrorKind::ALL`, in its order.
    errors: Vec<IntCounter>,
    latency: Histogram,
    score: Histogram,
}

impl VersionMetrics {
    pub fn request(&self) {
        self.requests.inc();
    }

    pub fn error(&self, kind: ErrorKind) {
        self.errors[kind as usize].inc();
    }

    pub fn answered(&self, total: Duration) {
        self.latency.observe(total.as_secs_f64());
    }

    /// Every value of the model's first output.
    pub fn scores(&self, values: &[f32]) {
        for &v in values {
            self.score.observe(v as f64);
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        // The definitions are constants: a failure is a bug, which every test that builds a
        // router would show at once.
        Self::new().expect("the router's metric definitions are valid")
    }
}

impl Metrics {
    fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let requests = IntCounter::new(
            "cleave_router_requests_total",
            "Inference requests received (infer and rank).",
        )?;
        registry.register(Box::new(requests.clone()))?;
        let admitted = IntCounter::new(
            "cleave_router_admitted_total",
            "Inference requests admission control let in (the others are counted by \
             cleave_router_shed_total).",
        )?;
        registry.register(Box::new(admitted.clone()))?;
        let expired_after_admission = IntCounter::new(
            "cleave_router_expired_after_admission_total",
            "Requests admitted that then missed their budget (answered 504): work wasted.",
        )?;
        registry.register(Box::new(expired_after_admission.clone()))?;
        let stages = HistogramVec::new(
            HistogramOpts::new(
                "cleave_router_stage_seconds",
                "Time a request spent per stage: parse (read, parse, validate), lookup (shard \
                 fan-out and merge), transfer (ranker round trip less its queue and compute), \
                 queue (ranker queue), compute (dense program), total.",
            )
            .buckets(BUCKETS.to_vec()),
            &["stage"],
        )?;
        registry.register(Box::new(stages.clone()))?;
        let errors = IntCounterVec::new(
            Opts::new(
                "cleave_router_errors_total",
                "Failed requests by kind of error.",
            ),
            &["kind"],
        )?;
        registry.register(Box::new(errors.clone()))?;
        let codec_cpu = CounterVec::new(
            Opts::new(
                "cleave_router_codec_cpu_seconds_total",
                "CPU time the router spent parsing request bodies (step=parse: JSON, binary \
                 framing, conversion to tensors, checks) and encoding responses \
                 (step=encode), by protocol (json, binary, rank).",
            ),
            &["step", "protocol"],
        )?;
        registry.register(Box::new(codec_cpu.clone()))?;
        let codec_count = IntCounterVec::new(
            Opts::new(
                "cleave_router_codec_total",
                "Bodies parsed (step=parse, errors included) and responses encoded \
                 (step=encode), by protocol: the denominators of \
                 cleave_router_codec_cpu_seconds_total.",
            ),
            &["step", "protocol"],
        )?;
        registry.register(Box::new(codec_count.clone()))?;
        let by_version = VersionFamilies::new(&registry)?;
        Ok(Self {
            by_version,
            codec_cpu,
            codec_count,
            stages: Stage::ALL
                .iter()
                .map(|s| stages.get_metric_with_label_values(&[s.as_str()]))
                .collect::<prometheus::Result<_>>()?,
            errors: ErrorKind::ALL
                .iter()
                .map(|k| errors.get_metric_with_label_values(&[k.as_str()]))
                .collect::<prometheus::Result<_>>()?,
            requests,
            admitted,
            expired_after_admission,
            registry,
            ranker_send_cpu: Arc::default(),
            cache: std::sync::OnceLock::new(),
        })
    }

    /// The series of one served version.
    pub fn version(&self, model: &str, version: &str) -> VersionMetrics {
        let f = &self.by_version;
        let labels = [model, version];
        VersionMetrics {
            requests: f.requests.with_label_values(&labels),
            errors: ErrorKind::ALL
                .iter()
                .map(|k| f.errors.with_label_values(&[model, version, k.as_str()]))
                .collect(),
            latency: f.latency.with_label_values(&labels),
            score: f.score.with_label_values(&labels),
        }
    }

    /// Records time spent in `stage` (stages without a histogram are ignored).
    pub fn observe(&self, stage: Stage, d: Duration) {
        if let Some(h) = self.stages.get(stage as usize) {
            h.observe(d.as_secs_f64());
        }
    }

    /// Counts one parse or encode that started at thread CPU time `start` (`thread_cpu`).
    pub fn codec_cpu(&self, step: &str, protocol: Protocol, start: Duration) {
        self.codec_cpu_plus(step, protocol, start, Duration::ZERO);
    }

    /// As `codec_cpu`, with `more` CPU time spent elsewhere (gRPC's protobuf codec).
    pub fn codec_cpu_plus(&self, step: &str, protocol: Protocol, start: Duration, more: Duration) {
        let spent = thread_cpu().saturating_sub(start) + more;
        let labels = [step, protocol.as_str()];
        self.codec_cpu
            .with_label_values(&labels)
            .inc_by(spent.as_secs_f64());
        self.codec_count.with_label_values(&labels).inc();
    }

    pub fn error(&self, kind: ErrorKind) {
        self.errors[kind as usize].inc();
    }

    pub fn errors(&self, kind: ErrorKind) -> u64 {
        self.errors[kind as usize].get()
    }

    pub fn request(&self) {
        self.requests.inc();
    }

    pub fn admitted(&self) {
        self.admitted.inc();
    }

    pub fn expired_after_admission(&self) {
        self.expired_after_admission.inc();
    }

    /// The text exposition ([`CONTENT_TYPE`]); `rankers` are (address, outstanding, EWMA
    /// latency in seconds).
    pub fn render(&self, rankers: &[(String, u64, f64)], front: &FrontStats) -> String {
        let mut families = self.registry.gather();
        let by_ranker = |value: fn(&(String, u64, f64)) -> f64| {
            rankers
                .iter()
                .map(move |r| (vec![("ranker", r.0.clone())], value(r)))
        };
        families.push(scrape_family(
            MetricType::GAUGE,
            "cleave_router_ranker_outstanding",
            "Requests sent to a ranker and not yet answered.",
            by_ranker(|r| r.1 as f64),
        ));
        families.push(scrape_family(
            MetricType::GAUGE,
            "cleave_router_ranker_latency_seconds",
            "Moving average of a ranker's queue + compute time, as it reports them.",
            by_ranker(|r| r.2),
        ));
        families.push(scrape_family(
            MetricType::COUNTER,
            "cleave_router_ranker_send_cpu_seconds_total",
            "CPU time of the send path to the rankers: packing each payload (into a buffer, \
             or on shm straight into a slot) and the socket writes.",
            // Like the other ranker families: none for a router without rankers.
            (!rankers.is_empty()).then(|| {
                (
                    vec![],
                    self.ranker_send_cpu.load(Ordering::Relaxed) as f64 / 1e9,
                )
            }),
        ));
        families.push(scrape_family(
            MetricType::GAUGE,
            "cleave_router_in_flight",
            "Inference requests admitted and not answered yet.",
            [(vec![], front.in_flight as f64)],
        ));
        families.push(scrape_family(
            MetricType::GAUGE,
            "cleave_router_max_in_flight",
            "The admission limit on cleave_router_in_flight (max_in_flight).",
            [(vec![], front.max_in_flight as f64)],
        ));
        families.push(scrape_family(
            MetricType::GAUGE,
            "cleave_router_admission_limit",
            "The adaptive admission limit on rows (candidates) in flight to the backends \
             (admission = \"adaptive\").",
            front.limit.map(|l| (vec![], l as f64)),
        ));
        families.push(scrape_family(
            MetricType::GAUGE,
            "cleave_router_connections",
            "Open client connections.",
            [(vec![], front.connections as f64)],
        ));
        families.push(scrape_family(
            MetricType::GAUGE,
            "cleave_router_heap_live_bytes",
            "Heap bytes allocated and not freed (a leak grows it; pages the allocator keeps \
             for reuse do not). Absent where the process does not count them.",
            crate::heap::live_bytes().map(|n| (vec![], n as f64)),
        ));
        let by_reason = |counts: &[(&'static str, u64)]| {
            counts
                .iter()
                .map(|&(reason, n)| (vec![("reason", reason.to_string())], n as f64))
                .collect::<Vec<_>>()
        };
        families.push(scrape_family(
            MetricType::COUNTER,
            "cleave_router_shed_total",
            "Requests (or connections) refused at once with 503, by reason: connections \
             (max_connections), in_flight (max_in_flight), estimate (the expected latency \
             exceeded the budget), limit (the adaptive limit on work in flight).",
            by_reason(&front.shed),
        ));
        families.push(scrape_family(
            MetricType::COUNTER,
            "cleave_router_connections_closed_total",
            "Connections the router closed by a timeout: header_timeout (a request head did \
             not arrive whole in time), idle_timeout.",
            by_reason(&front.closed),
        ));
        if let Some(cache) = self.cache.get() {
            cache_families(&cache.stats(), &mut families);
        }
        // A family without samples is refused by the encoder (no rankers yet).
        families.retain(|f| !f.get_metric().is_empty());
        let mut text = String::with_capacity(8 << 10);
        if let Err(e) = prometheus::TextEncoder::new().encode_utf8(&families, &mut text) {
            text.push_str(&format!("# encoding the router's metrics failed: {e}\n"));
        }
        text
    }
}

/// The cache's series (docs/cache.md, "Metrics"), read at the scrape.
fn cache_families(s: &CacheStats, families: &mut Vec<prometheus::proto::MetricFamily>) {
    let one = |v: u64| [(vec![], v as f64)];
    for (kind, name, help, value) in [
        (
            MetricType::COUNTER,
            "cleave_router_cache_hits_total",
            "Rows and pooled bags the router's cache answered.",
            s.hits,
        ),
        (
            MetricType::COUNTER,
            "cleave_router_cache_misses_total",
            "Rows and pooled bags sent to the shards through the cache (each distinct one of a \
          request once).",
            s.misses,
        ),
        (
            MetricType::COUNTER,
            "cleave_router_cache_lookups_avoided_total",
            "Ids the shards did not look up because the cache answered.",
            s.ids_avoided,
        ),
        (
            MetricType::COUNTER,
            "cleave_router_cache_bytes_not_sent_total",
            "Lookup request and response bytes that did not cross the network.",
            s.bytes_not_sent,
        ),
        (
            MetricType::GAUGE,
            "cleave_router_cache_bytes",
            "Bytes the cache holds.",
            s.bytes,
        ),
        (
            MetricType::GAUGE,
            "cleave_router_cache_limit_bytes",
            "The cache's current limit (fixed, or the adaptive policy's).",
            s.limit,
        ),
        (
            MetricType::GAUGE,
            "cleave_router_cache_entries",
            "Rows and bags held.",
            s.entries,
        ),
        (
            MetricType::GAUGE,
            "cleave_router_ranker_max_batch",
            "The rankers' largest batch (rows) the memory budget allows beside the cache.",
            s.ranker_max_batch,
        ),
    ] {
        families.push(scrape_family(kind, name, help, one(value)));
    }
}

impl VersionFamilies {
    fn new(registry: &Registry) -> prometheus::Result<VersionFamilies> {
        let labels = &["model", "version"];
        let requests = IntCounterVec::new(
            Opts::new(
                "cleave_router_version_requests_total",
                "Inference requests routed to each model version.",
            ),
            labels,
        )?;
        let errors = IntCounterVec::new(
            Opts::new(
                "cleave_router_version_errors_total",
                "Failed requests of each model version, by kind of error.",
            ),
            &["model", "version", "kind"],
        )?;
        let latency = HistogramVec::new(
            HistogramOpts::new(
                "cleave_router_version_latency_seconds",
                "Total latency of the answered requests of each model version.",
            )
            .buckets(BUCKETS.to_vec()),
            labels,
        )?;
        let score = HistogramVec::new(
            HistogramOpts::new(
                "cleave_router_version_score",
                "Values of the first output of each model version's answers (a canary's \
                 distribution against the default's).",
            )
            .buckets(SCORE_BUCKETS.to_vec()),
            labels,
        )?;
        for c in [&requests, &errors] {
            registry.register(Box::new(c.clone()))?;
        }
        for h in [&latency, &score] {
            registry.register(Box::new(h.clone()))?;
        }
        Ok(VersionFamilies {
            requests,
            errors,
            latency,
            score,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_our_metrics_after_real_observations() {
        let m = Metrics::default();
        m.observe(Stage::Lookup, Duration::from_micros(30));
        m.observe(Stage::Lookup, Duration::from_millis(3));
        m.observe(Stage::Lookup, Duration::from_secs(60));
        // Stages without a histogram are ignored, not counted elsewhere.
        m.observe(Stage::Admission, Duration::from_millis(1));
        m.error(ErrorKind::Shard);
        m.request();
        m.admitted();
        m.expired_after_admission();
        m.codec_cpu("parse", Protocol::Binary, thread_cpu());
        m.ranker_send_cpu.fetch_add(2_500_000, Ordering::Relaxed);
        let front = FrontStats {
            in_flight: 3,
            max_in_flight: 64,
            limit: Some(1200),
            connections: 5,
            shed: vec![("estimate", 4)],
            closed: vec![("idle_timeout", 1)],
        };
        let text = m.render(&[("127.0.0.1:9".into(), 2, 0.004)], &front);
        for line in [
            "cleave_router_requests_total 1",
            "cleave_router_stage_seconds_bucket{stage=\"lookup\",le=\"0.00005\"} 1",
            "cleave_router_stage_seconds_bucket{stage=\"lookup\",le=\"0.005\"} 2",
            "cleave_router_stage_seconds_bucket{stage=\"lookup\",le=\"10\"} 2",
            "cleave_router_stage_seconds_bucket{stage=\"lookup\",le=\"+Inf\"} 3",
            "cleave_router_stage_seconds_count{stage=\"lookup\"} 3",
            "cleave_router_stage_seconds_count{stage=\"parse\"} 0",
            "cleave_router_stage_seconds_count{stage=\"total\"} 0",
            "cleave_router_errors_total{kind=\"shard\"} 1",
            "cleave_router_errors_total{kind=\"overloaded\"} 0",
            "cleave_router_ranker_outstanding{ranker=\"127.0.0.1:9\"} 2",
            "cleave_router_ranker_latency_seconds{ranker=\"127.0.0.1:9\"} 0.004",
            "cleave_router_in_flight 3",
            "cleave_router_max_in_flight 64",
            "cleave_router_admission_limit 1200",
            "cleave_router_admitted_total 1",
            "cleave_router_expired_after_admission_total 1",
            "cleave_router_codec_total{protocol=\"binary\",step=\"parse\"} 1",
            "cleave_router_connections 5",
            "cleave_router_ranker_send_cpu_seconds_total 0.0025",
            "cleave_router_shed_total{reason=\"estimate\"} 4",
            "cleave_router_connections_closed_total{reason=\"idle_timeout\"} 1",
            "# TYPE cleave_router_stage_seconds histogram",
            "# TYPE cleave_router_shed_total counter",
            "# TYPE cleave_router_in_flight gauge",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert_eq!(m.errors(ErrorKind::Shard), 1);
        assert!(!text.contains("stage=\"admission\""), "{text}");
    }

    #[test]
    fn a_router_without_rankers_renders_the_rest() {
        let text = Metrics::default().render(&[], &FrontStats::default());
        assert!(
            text.lines().any(|l| l == "cleave_router_in_flight 0"),
            "{text}"
        );
        assert!(!text.contains("cleave_router_ranker"), "{text}");
        assert!(!text.contains("encoding"), "{text}");
    }

    #[test]
    fn thread_cpu_counts_work() {
        let start = thread_cpu();
        let mut x = 0u64;
        // Enough work to cross the clock's resolution; black_box keeps it from folding away.
        for i in 0..2_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        assert!(thread_cpu() > start, "{x}");
    }
}
