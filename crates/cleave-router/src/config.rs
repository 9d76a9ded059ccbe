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
    #[serde(default)]
    pub mode: ConfigMode,
    /// The range routing table: which shard holds which rows of which table.
    #[serde(default)]
    pub shards: Vec<ShardRoute>,
    /// Ranker addresses (`host:port` or `unix:/path`).
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
    /// I/O threads for backend connections and HTTP.
    #[serde(default = "default_threads")]
    pub threads: usize,
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
}

impl From<ConfigMode> for Mode {
    fn from(m: ConfigMode) -> Mode {
        match m {
            ConfigMode::Disaggregated => Mode::Disaggregated,
            ConfigMode::Monolithic => Mode::Monolithic,
        }
    }
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
    60_000
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

impl RouterConfig {
    /// Parses and checks the JSON; errors say which field is wrong and why.
    pub fn from_json(text: &str) -> Result<RouterConfig, String> {
        let c: RouterConfig =
            serde_json::from_str(text).map_err(|e| format!("router config: {e}"))?;
        c.check()?;
        Ok(c)
    }

    fn check(&self) -> Result<(), String> {
        let bad = |m: String| Err(format!("router config: {m}"));
        if self.model.is_empty() || self.model.contains('/') {
            return bad(format!(
                "model name {:?} must be non-empty without '/'",
                self.model
            ));
        }
        if self.rankers.is_empty() {
            return bad("\"rankers\" is empty; at least one ranker address is needed".into());
        }
        let mode: Mode = self.mode.into();
        if mode == Mode::Monolithic && !self.shards.is_empty() {
            return bad("monolithic mode takes no \"shards\"".into());
        }
        if !(self.budget_ms > 0.0 && self.budget_ms <= self.max_budget_ms) {
            return bad(format!(
                "budget_ms is {}, expected > 0 and at most max_budget_ms ({})",
                self.budget_ms, self.max_budget_ms
            ));
        }
        if self.body_limit_bytes == 0 {
            return bad("body_limit_bytes must be at least 1".into());
        }
        for r in &self.shards {
            if r.row_start >= r.row_end {
                return bad(format!(
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
}
