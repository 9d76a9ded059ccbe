//! The router's configuration: JSON written by the launcher (`cleave serve`), read once.

use std::path::PathBuf;

use serde::Deserialize;

use crate::model::Mode;

/// Everything a router process needs. Times are in milliseconds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterConfig {
    /// The name clients use in `/v2/models/{name}/...`.
    pub model: String,
    /// The bundle directory (manifest.json is read; tables stay on the shards).
    pub bundle: PathBuf,
    #[serde(default = "default_host")]
    pub host: String,
    /// 0 picks a free port; the "ready" line says which.
    #[serde(default)]
    pub http_port: u16,
    /// The KServe v2 gRPC port; none: no gRPC. 0 picks a free port (the "ready" line says).
    #[serde(default)]
    pub grpc_port: Option<u16>,
    /// A file whose first line is the bearer token clients must send (REST and gRPC);
    /// none: no authentication. The token itself never appears in a config or plan.
    #[serde(default)]
    pub auth_token_file: Option<PathBuf>,
    /// TLS on the REST and gRPC ports: the server's PEM certificate chain and private key
    /// (both or neither); none: plain TCP.
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
    #[serde(default)]
    pub mode: ConfigMode,
    /// The range routing table: which shard holds which rows of which table.
    #[serde(default)]
    pub shards: Vec<ShardRoute>,
    /// Ranker addresses (`host:port`, `unix:/path` or `shm:/path`).
    pub rankers: Vec<String>,
    /// A request's latency budget when it names none.
    #[serde(default = "default_budget_ms")]
    pub budget_ms: f64,
    /// The largest budget a request may ask for.
    #[serde(default = "default_max_budget_ms")]
    pub max_budget_ms: f64,
    /// The largest request body accepted (bytes); larger gets 413.
    #[serde(default = "default_body_limit")]
    pub body_limit_bytes: usize,
    /// Connecting to a shard or ranker.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// How long start-up waits for every backend to answer before giving up.
    #[serde(default = "default_ready_timeout_ms")]
    pub ready_timeout_ms: u64,
    /// How often backends are probed for `/v2/health/ready`.
    #[serde(default = "default_health_interval_ms")]
    pub health_interval_ms: u64,
    /// Connections kept to each ranker.
    #[serde(default = "default_connections")]
    pub ranker_connections: usize,
    /// I/O threads for backend connections and HTTP, at most: see `threads_here`.
    #[serde(default = "default_threads")]
    pub threads: usize,
    /// A request head, once its first byte arrived, must arrive whole within this.
    #[serde(default = "default_header_timeout_ms")]
    pub header_timeout_ms: u64,
    /// A connection with no request in progress is closed after this.
    #[serde(default = "default_idle_timeout_ms")]
    pub idle_timeout_ms: u64,
    /// A body must keep arriving at this rate (after `body_grace_ms`), else 408.
    #[serde(default = "default_body_min_bytes_per_s")]
    pub body_min_bytes_per_s: u64,
    /// How long a body may take before its rate is held to `body_min_bytes_per_s`.
    #[serde(default = "default_body_grace_ms")]
    pub body_grace_ms: u64,
    /// Open client connections at most; one more is refused with 503.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Inference requests in progress at most (body read included); more are shed with 503.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// Shed a request at once when the admission rule says it cannot be served in time.
    #[serde(default = "default_shed")]
    pub shed: bool,
    /// The admission rule: an adaptive limit on the work in flight, or the latency estimate.
    #[serde(default)]
    pub admission: crate::admission::Rule,
    /// The share of its budget a request's estimated latency may fill when it is admitted;
    /// the rest absorbs the estimate's error (admission/estimate.rs).
    #[serde(default = "default_admit_share")]
    pub admit_share: f64,
    /// The longest Retry-After (seconds) a shed request is told to wait.
    #[serde(default = "default_max_retry_after_s")]
    pub max_retry_after_s: u64,
    /// The environment variable holding the admin API's bearer token; none: the admin API
    /// (/admin/v1/) needs no token. The token itself never appears in a config or plan.
    #[serde(default)]
    pub admin_token_env: Option<String>,
    /// Longest wait for one shard replica's answer; one that takes longer is retried once on
    /// another replica within the request's budget. 0: half of what is left of the budget.
    /// A range's only replica (or the retry) may always use the rest of the budget.
    #[serde(default)]
    pub shard_timeout_ms: u64,
    /// Lookup threads of the tables a router-held deployment opens in-process.
    #[serde(default = "default_held_threads")]
    pub held_threads: usize,
    /// Incast control (docs/traffic.md): ask a ranker's control port for a grant before
    /// sending it a fused payload of at least `incast_threshold_bytes`.
    #[serde(default)]
    pub incast_control: bool,
    #[serde(default = "default_incast_threshold")]
    pub incast_threshold_bytes: u64,
    /// Each ranker's control address (`host:port`), keyed by its data address in `rankers`.
    #[serde(default)]
    pub ranker_control: std::collections::HashMap<String, String>,
    /// Response credits from shards (docs/protocol.md, "Response credits"): each shard data
    /// connection's initial window in bytes, at least the largest shard response; none: off.
    #[serde(default)]
    pub response_credits: Option<u64>,
    /// The version of the top-level `model` (its `bundle`, `shards`, `rankers`).
    #[serde(default)]
    pub version: Version,
    /// More (model, version) pairs served from the start (disaggregated mode only).
    #[serde(default)]
    pub models: Vec<VersionConfig>,
    /// Base URL of the controller that stages versions (docs/api.md, "Model repository");
    /// none: the versions served are fixed at start.
    #[serde(default)]
    pub repository_controller: Option<String>,
    /// Where the rollout state is kept across restarts; none: not kept.
    #[serde(default)]
    pub rollout_file: Option<PathBuf>,
    /// The embedding cache in front of the shards (docs/cache.md): off, fixed or adaptive.
    #[serde(default)]
    pub cache: CacheMode,
    /// fixed: the cache's bytes; adaptive: its largest (0: the whole memory budget).
    #[serde(default)]
    pub cache_bytes: u64,
    /// The memory the cache and the rankers' batch activations share on the host; 0: none.
    #[serde(default)]
    pub memory_budget_bytes: u64,
    /// The rankers' activation bytes per row of a batch (measured by `cleave serve`).
    #[serde(default)]
    pub activation_bytes_per_sample: u64,
    /// Ranker replies in the adaptive cache's sliding window.
    #[serde(default = "default_cache_window")]
    pub cache_window: usize,
    /// The rankers' `max_batch` (rows), which the memory budget may lower.
    #[serde(default = "default_ranker_max_batch")]
    pub ranker_max_batch: usize,
}

/// The cache's mode (`cache` in the router's config).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    #[default]
    Off,
    Fixed,
    Adaptive,
}

impl CacheMode {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheMode::Off => "off",
            CacheMode::Fixed => "fixed",
            CacheMode::Adaptive => "adaptive",
        }
    }
}

fn default_cache_window() -> usize {
    64
}

fn default_ranker_max_batch() -> usize {
    256
}

/// A model version: a decimal integer, written as a string in JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version(pub u64);

impl Default for Version {
    fn default() -> Version {
        Version(1)
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::str::FromStr for Version {
    type Err = String;
    fn from_str(s: &str) -> Result<Version, String> {
        let digits = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        match s.parse() {
            Ok(v) if digits => Ok(Version(v)),
            _ => Err(format!(
                "version {s:?} is not a version: expected a decimal integer such as \"3\""
            )),
        }
    }
}

impl serde::Serialize for Version {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Version {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Version, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// One (model, version) the router serves: its bundle and backends.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VersionConfig {
    pub model: String,
    pub version: Version,
    pub bundle: PathBuf,
    #[serde(default)]
    pub shards: Vec<ShardRoute>,
    pub rankers: Vec<String>,
    #[serde(default)]
    pub ranker_control: std::collections::HashMap<String, String>,
}

/// Rows `[row_start, row_end)` of `table` live on the shard at `addr`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardRoute {
    pub table: String,
    pub row_start: u64,
    pub row_end: u64,
    pub addr: String,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConfigMode {
    #[default]
    Disaggregated,
    Monolithic,
    /// Disaggregated, with the tables held in the router's process instead of shards.
    #[serde(rename = "router-held")]
    RouterHeld,
}

impl From<ConfigMode> for Mode {
    fn from(m: ConfigMode) -> Mode {
        match m {
            ConfigMode::Disaggregated | ConfigMode::RouterHeld => Mode::Disaggregated,
            ConfigMode::Monolithic => Mode::Monolithic,
        }
    }
}

fn default_incast_threshold() -> u64 {
    crate::backend::incast::DEFAULT_THRESHOLD
}
fn default_held_threads() -> usize {
    1
}
fn default_host() -> String {
    "127.0.0.1".into()
}
fn default_budget_ms() -> f64 {
    1000.0
}
fn default_max_budget_ms() -> f64 {
    60_000.0
}
fn default_body_limit() -> usize {
    64 << 20
}
fn default_connect_timeout_ms() -> u64 {
    1000
}
fn default_ready_timeout_ms() -> u64 {
    120_000 // `cleave serve`'s ready_timeout_s
}
fn default_health_interval_ms() -> u64 {
    1000
}
fn default_connections() -> usize {
    2
}
fn default_threads() -> usize {
    2
}
fn default_header_timeout_ms() -> u64 {
    10_000
}
fn default_idle_timeout_ms() -> u64 {
    60_000
}
fn default_body_min_bytes_per_s() -> u64 {
    16 << 10
}
fn default_body_grace_ms() -> u64 {
    2_000
}
fn default_max_connections() -> usize {
    16_384
}
fn default_max_in_flight() -> usize {
    2_048
}
fn default_shed() -> bool {
    true
}
fn default_admit_share() -> f64 {
    0.5
}
fn default_max_retry_after_s() -> u64 {
    60
}

impl RouterConfig {
    /// Parses and checks the JSON; errors say which field is wrong and why.
    pub fn from_json(text: &str) -> Result<RouterConfig, String> {
        let c: RouterConfig =
            serde_json::from_str(text).map_err(|e| format!("router config: {e}"))?;
        c.check()?;
        Ok(c)
    }

    /// The threads to start of each kind (HTTP workers, backend I/O): `threads`, but no more
    /// than the cores this process may run on (its CPU affinity, its cgroup's quota), of which
    /// there are `cores`. More only take turns on the same cores, and each hand-off between
    /// them is a context switch (measured on one core: 0.75–0.91× the router CPU per request
    /// with one of each than with two; docs/benchmarks.md, "Thirtieth session").
    pub fn threads_here(&self, cores: usize) -> usize {
        self.threads.clamp(1, cores.max(1))
    }

    /// Every (model, version) served at start: the top-level one first, then `models`.
    pub fn served(&self) -> Vec<VersionConfig> {
        let top = VersionConfig {
            model: self.model.clone(),
            version: self.version,
            bundle: self.bundle.clone(),
            shards: self.shards.clone(),
            rankers: self.rankers.clone(),
            ranker_control: self.ranker_control.clone(),
        };
        std::iter::once(top).chain(self.models.clone()).collect()
    }

    fn check(&self) -> Result<(), String> {
        let bad = |m: String| Err(format!("router config: {m}"));
        if !self.models.is_empty() && self.mode != ConfigMode::Disaggregated {
            return bad(format!(
                "\"models\" (more model versions) needs mode \"disaggregated\", not {:?}",
                self.mode
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for v in self.served() {
            v.check(self.incast_control)
                .map_err(|m| format!("router config: {m}"))?;
            if !seen.insert((v.model.clone(), v.version)) {
                return bad(format!("{}/{} is configured twice", v.model, v.version));
            }
        }
        if !(self.admit_share > 0.0 && self.admit_share <= 1.0) {
            return bad(format!(
                "admit_share is {}, expected a share of the budget in (0, 1]",
                self.admit_share
            ));
        }
        let mode: Mode = self.mode.into();
        if mode == Mode::Monolithic && !self.shards.is_empty() {
            return bad("monolithic mode takes no \"shards\"".into());
        }
        if self.mode == ConfigMode::RouterHeld && !self.shards.is_empty() {
            return bad(
                "mode \"router-held\" takes no \"shards\": the router holds every table".into(),
            );
        }
        if !(self.budget_ms > 0.0 && self.budget_ms <= self.max_budget_ms) {
            return bad(format!(
                "budget_ms is {}, expected > 0 and at most max_budget_ms ({})",
                self.budget_ms, self.max_budget_ms
            ));
        }
        if self.response_credits == Some(0) {
            return bad(
                "response_credits is 0: leave it out to turn credits off, or give the initial \
                 window in bytes (at least the largest shard response)"
                    .into(),
            );
        }
        if self.body_limit_bytes == 0 {
            return bad("body_limit_bytes must be at least 1".into());
        }
        self.check_cache().or_else(bad)?;
        let at_least_one = [
            ("max_retry_after_s", self.max_retry_after_s),
            ("header_timeout_ms", self.header_timeout_ms),
            ("idle_timeout_ms", self.idle_timeout_ms),
            ("body_min_bytes_per_s", self.body_min_bytes_per_s),
            ("max_connections", self.max_connections as u64),
            ("max_in_flight", self.max_in_flight as u64),
        ];
        for (key, value) in at_least_one {
            if value == 0 {
                return bad(format!("{key} is 0, expected at least 1"));
            }
        }
        Ok(())
    }
}

impl RouterConfig {
    /// The cache's settings, checked (docs/cache.md, "Settings").
    fn check_cache(&self) -> Result<(), String> {
        let mode = self.cache.as_str();
        if self.cache != CacheMode::Off && self.mode != ConfigMode::Disaggregated {
            return Err(format!(
                "cache {mode:?} needs mode \"disaggregated\": it saves lookups sent to shard \
                 processes, and this router has none"
            ));
        }
        if self.cache == CacheMode::Fixed && self.cache_bytes == 0 {
            return Err("cache \"fixed\" needs cache_bytes, its size in bytes (> 0)".into());
        }
        if self.cache == CacheMode::Adaptive && self.memory_budget_bytes == 0 {
            return Err(
                "cache \"adaptive\" needs memory_budget_bytes, the memory the cache \
                        and the rankers' batches share (> 0)"
                    .into(),
            );
        }
        if self.cache == CacheMode::Adaptive && self.activation_bytes_per_sample == 0 {
            return Err(
                "cache \"adaptive\" needs activation_bytes_per_sample (> 0): the \
                        rankers' memory per row of a batch (cleave serve fills it in from \
                        the rankers' own measurement)"
                    .into(),
            );
        }
        if self.memory_budget_bytes > 0 && self.cache_bytes > self.memory_budget_bytes {
            return Err(format!(
                "cache_bytes ({}) is more than memory_budget_bytes ({}): the cache lives in \
                 that budget",
                self.cache_bytes, self.memory_budget_bytes
            ));
        }
        if self.cache_window == 0 || self.ranker_max_batch == 0 {
            return Err(format!(
                "cache_window ({}) and ranker_max_batch ({}) must be at least 1",
                self.cache_window, self.ranker_max_batch
            ));
        }
        Ok(())
    }
}

impl VersionConfig {
    /// The checks each served version passes, whether configured at start or loaded later.
    pub fn check(&self, incast_control: bool) -> Result<(), String> {
        if self.model.is_empty() || self.model.contains('/') {
            return Err(format!(
                "model name {:?} must be non-empty without '/'",
                self.model
            ));
        }
        if self.rankers.is_empty() {
            return Err(format!(
                "\"rankers\" of {}/{} is empty; at least one ranker address is needed",
                self.model, self.version
            ));
        }
        if incast_control {
            if let Some(r) = self
                .rankers
                .iter()
                .find(|r| !self.ranker_control.contains_key(*r))
            {
                return Err(format!(
                    "incast_control is on but ranker {r} has no control address in \
                     \"ranker_control\" (expected {{\"{r}\": \"HOST:PORT\"}})"
                ));
            }
        }
        for r in &self.shards {
            if r.row_start >= r.row_end {
                return Err(format!(
                    "shard {} for table {:?}: rows [{}, {}) are empty",
                    r.addr, r.table, r.row_start, r.row_end
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The serde defaults above are the settings schema's (python/cleave/settings): the JSON
    /// the launcher writes for a default config, generated into the chart's settings.json by
    /// `python -m cleave.settings --write`, parses to the same config as no keys at all.
    #[test]
    fn defaults_are_the_settings_schemas() {
        let text = include_str!("../../../deploy/helm/cleave/files/settings.json");
        let settings: serde_json::Value = serde_json::from_str(text).unwrap();
        let required = serde_json::json!({"model": "m", "bundle": "b", "rankers": ["a:1"]});
        let mut written = settings["router_json"].clone();
        written
            .as_object_mut()
            .unwrap()
            .extend(required.as_object().unwrap().clone());
        let bare = RouterConfig::from_json(&required.to_string()).unwrap();
        let full = RouterConfig::from_json(&written.to_string()).unwrap();
        assert_eq!(format!("{bare:#?}"), format!("{full:#?}"));
    }

    #[test]
    fn threads_are_capped_at_the_cores_the_router_may_run_on() {
        let mut c = RouterConfig::from_json(r#"{"model": "m", "bundle": "b", "rankers": ["a:1"]}"#)
            .unwrap();
        assert_eq!(c.threads, 2); // the default
        assert_eq!(c.threads_here(1), 1); // pinned to one core (taskset, a quota of 1)
        assert_eq!(c.threads_here(2), 2);
        assert_eq!(c.threads_here(16), 2); // more cores do not add threads
        c.threads = 8;
        assert_eq!(c.threads_here(4), 4);
        assert_eq!(c.threads_here(0), 1); // never none
    }

    #[test]
    fn defaults_and_checks() {
        let c = RouterConfig::from_json(
            r#"{"model": "dlrm", "bundle": "b", "rankers": ["127.0.0.1:1"],
                "shards": [{"table": "t0", "row_start": 0, "row_end": 5, "addr": "h:1"}]}"#,
        )
        .unwrap();
        assert_eq!(c.mode, ConfigMode::Disaggregated);
        assert_eq!(c.http_port, 0);
        assert_eq!(c.budget_ms, 1000.0);
        // The defaults python/cleave/launch/config.py writes ("" is written as null).
        assert_eq!(
            (c.admin_token_env.as_deref(), c.shard_timeout_ms),
            (None, 0)
        );

        let e = RouterConfig::from_json(r#"{"model": "m", "bundle": "b", "rankers": []}"#);
        assert!(e.unwrap_err().contains("at least one ranker"));
        let e =
            RouterConfig::from_json(r#"{"model": "m", "bundle": "b", "rankers": ["a:1"], "x": 1}"#);
        assert!(e.unwrap_err().contains("unknown field `x`"));
        let e = RouterConfig::from_json(
            r#"{"model": "m", "bundle": "b", "rankers": ["a:1"], "mode": "monolithic",
                "shards": [{"table": "t0", "row_start": 0, "row_end": 5, "addr": "h:1"}]}"#,
        );
        assert!(e.unwrap_err().contains("monolithic mode takes no"));
        let held = RouterConfig::from_json(
            r#"{"model": "m", "bundle": "b", "rankers": ["a:1"], "mode": "router-held"}"#,
        )
        .unwrap();
        assert_eq!((held.mode, held.held_threads), (ConfigMode::RouterHeld, 1));
        let e = RouterConfig::from_json(
            r#"{"model": "m", "bundle": "b", "rankers": ["a:1"], "mode": "router-held",
                "shards": [{"table": "t0", "row_start": 0, "row_end": 5, "addr": "h:1"}]}"#,
        );
        assert!(e
            .unwrap_err()
            .contains("\"router-held\" takes no \"shards\""));
        let e = RouterConfig::from_json(
            r#"{"model": "m", "bundle": "b", "rankers": ["a:1"],
                "shards": [{"table": "t0", "row_start": 5, "row_end": 5, "addr": "h:1"}]}"#,
        );
        assert!(e.unwrap_err().contains("are empty"));
        let e = RouterConfig::from_json(
            r#"{"model": "m", "bundle": "b", "rankers": ["a:1"], "budget_ms": 0}"#,
        );
        assert!(e.unwrap_err().contains("budget_ms is 0"));
    }

    #[test]
    fn front_door_defaults_and_checks() {
        let base = r#""model": "m", "bundle": "b", "rankers": ["a:1"]"#;
        let c = RouterConfig::from_json(&format!("{{{base}}}")).unwrap();
        assert_eq!((c.header_timeout_ms, c.idle_timeout_ms), (10_000, 60_000));
        assert_eq!((c.body_min_bytes_per_s, c.body_grace_ms), (16_384, 2_000));
        assert_eq!(
            (c.max_connections, c.max_in_flight, c.shed),
            (16_384, 2_048, true)
        );
        for key in [
            "header_timeout_ms",
            "idle_timeout_ms",
            "body_min_bytes_per_s",
            "max_connections",
            "max_in_flight",
        ] {
            let e = RouterConfig::from_json(&format!("{{{base}, \"{key}\": 0}}")).unwrap_err();
            assert!(
                e.contains(&format!("{key} is 0, expected at least 1")),
                "{e}"
            );
        }
        assert_eq!(c.admission, crate::admission::Rule::Adaptive);
        let c = RouterConfig::from_json(&format!("{{{base}, \"admission\": \"estimate\"}}"));
        assert_eq!(c.unwrap().admission, crate::admission::Rule::Estimate);
        let e = RouterConfig::from_json(&format!("{{{base}, \"admission\": \"lifo\"}}"));
        let e = e.unwrap_err();
        assert!(
            e.contains("unknown variant `lifo`, expected `adaptive` or `estimate`"),
            "{e}"
        );
        let e = RouterConfig::from_json(&format!("{{{base}, \"max_in_flight\": -1}}"));
        assert!(e.unwrap_err().contains("expected usize"));
        let c = RouterConfig::from_json(&format!("{{{base}, \"body_grace_ms\": 0}}")).unwrap();
        assert_eq!(c.body_grace_ms, 0);
    }

    #[test]
    fn incast_control_needs_every_rankers_control_address() {
        let base = r#""model": "m", "bundle": "b", "rankers": ["a:1", "b:1"]"#;
        let c = RouterConfig::from_json(&format!("{{{base}}}")).unwrap();
        assert_eq!(
            (c.incast_control, c.incast_threshold_bytes),
            (false, 65_536)
        );
        let e = RouterConfig::from_json(&format!(
            "{{{base}, \"incast_control\": true, \"ranker_control\": {{\"a:1\": \"a:2\"}}}}"
        ))
        .unwrap_err();
        assert!(e.contains("ranker b:1 has no control address"), "{e}");
        let c = RouterConfig::from_json(&format!(
            "{{{base}, \"incast_control\": true, \"incast_threshold_bytes\": 1, \
             \"ranker_control\": {{\"a:1\": \"a:2\", \"b:1\": \"b:2\"}}}}"
        ))
        .unwrap();
        assert_eq!(c.ranker_control["b:1"], "b:2");
    }
}

#[cfg(test)]
mod version_tests {
    use super::*;

    #[test]
    fn versions_are_decimal_integers() {
        assert_eq!("12".parse::<Version>().unwrap(), Version(12));
        for bad in ["", "v1", "1.0", "-1", "+1", "99999999999999999999999"] {
            let e = bad.parse::<Version>().unwrap_err();
            assert!(e.contains("expected a decimal integer"), "{bad}: {e}");
        }
    }

    #[test]
    fn more_versions_in_the_config() {
        let base = r#""model": "m", "bundle": "b", "rankers": ["a:1"]"#;
        let c = RouterConfig::from_json(&format!("{{{base}}}")).unwrap();
        assert_eq!((c.version, c.models.len()), (Version(1), 0));
        let c = RouterConfig::from_json(&format!(
            r#"{{{base}, "version": "2", "models": [{{"model": "m", "version": "3",
                "bundle": "b3", "shards": [], "rankers": ["a:2"]}}]}}"#
        ))
        .unwrap();
        let served: Vec<(String, Version)> = c
            .served()
            .into_iter()
            .map(|v| (v.model, v.version))
            .collect();
        assert_eq!(served, [("m".into(), Version(2)), ("m".into(), Version(3))]);
        let e = RouterConfig::from_json(&format!(r#"{{{base}, "version": "two"}}"#));
        assert!(e.unwrap_err().contains("expected a decimal integer"));
        let e = RouterConfig::from_json(&format!(
            r#"{{{base}, "models": [{{"model": "m", "version": "1", "bundle": "b",
                "rankers": ["a:1"]}}]}}"#
        ));
        assert!(e.unwrap_err().contains("m/1 is configured twice"));
        let e = RouterConfig::from_json(&format!(
            r#"{{{base}, "mode": "monolithic", "models": [{{"model": "m", "version": "2",
                "bundle": "b", "rankers": ["a:1"]}}]}}"#
        ));
        assert!(e
            .unwrap_err()
            .contains("\"models\" (more model versions) needs mode"));
        let e = RouterConfig::from_json(&format!(
            r#"{{{base}, "models": [{{"model": "m", "version": "2", "bundle": "b",
                "rankers": ["a:1"], "extra": 1}}]}}"#
        ));
        assert!(e.unwrap_err().contains("unknown field `extra`"));
    }
}
