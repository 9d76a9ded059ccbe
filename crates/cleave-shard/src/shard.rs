//! A shard process: which tables and rows it holds, start-up (bind, open the tables, ready),
//! and a clean stop on SIGTERM/SIGINT after the requests in flight.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cleave_embed::{Engine, Manifest, OpenOptions, Table};
use cleave_wire::{Address, QueuePolicy, Server, ServerConfig};

use crate::http::HttpServer;
use crate::service::ShardService;
use crate::update::{self, Updates};

/// Which rows of each table a shard holds.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum RowSpec {
    /// Every row.
    #[default]
    All,
    /// The same global row range of every table (clipped to each table's size).
    Global(Range<u64>),
    /// A range per named table; only the named tables are held (unless `tables` says more).
    PerTable(Vec<(String, Range<u64>)>),
}

impl RowSpec {
    /// Parses `START:END` or `NAME=START:END[,NAME=START:END...]`.
    pub fn parse(s: &str) -> Result<RowSpec, String> {
        let range = |r: &str| -> Result<Range<u64>, String> {
            let (a, b) = r
                .split_once(':')
                .ok_or_else(|| format!("row range {r:?}: expected START:END"))?;
            let a: u64 = a
                .trim()
                .parse()
                .map_err(|_| format!("row range {r:?}: START {a:?} is not an integer >= 0"))?;
            let b: u64 = b
                .trim()
                .parse()
                .map_err(|_| format!("row range {r:?}: END {b:?} is not an integer >= 0"))?;
            if a > b {
                return Err(format!("row range {r:?}: START {a} is after END {b}"));
            }
            Ok(a..b)
        };
        if !s.contains('=') {
            return range(s).map(RowSpec::Global);
        }
        let mut out: Vec<(String, Range<u64>)> = Vec::new();
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let (name, r) = part
                .split_once('=')
                .ok_or_else(|| format!("rows {part:?}: expected NAME=START:END"))?;
            let name = name.trim().to_owned();
            if out.iter().any(|(n, _)| *n == name) {
                return Err(format!("rows: table {name:?} is given twice"));
            }
            out.push((name, range(r)?));
        }
        Ok(RowSpec::PerTable(out))
    }
}

/// How to run a shard.
#[derive(Clone, Debug)]
pub struct ShardConfig {
    pub bundle: PathBuf,
    /// Tables to hold (all, or those named by a per-table `rows`, if None).
    pub tables: Option<Vec<String>>,
    pub rows: RowSpec,
    pub listen: Address,
    /// Port of the HTTP server for /metrics, /ready, /live (none if None; 0 picks one).
    pub metrics_port: Option<u16>,
    /// Lookup threads (the engine's, an I/O thread counting as one).
    pub threads: usize,
    /// I/O threads that read requests and run lookups.
    pub io_threads: usize,
    /// A frame must arrive whole within this once started.
    pub frame_timeout: Duration,
    /// Largest request payload accepted.
    pub max_payload: u32,
    /// Copy tables into memory instead of mapping the files (see cleave_embed::Residency).
    pub resident: bool,
    /// The order in which received lookups start (docs/serving.md, "Queue policies").
    pub queue: QueuePolicy,
    /// Threads completing lookups that miss the SSD tier's row cache, off the I/O threads;
    /// 0: on the I/O thread that received the lookup.
    pub miss_threads: usize,
    /// Serve the tables from SSD behind this tier's DRAM caches (docs/tiers.md).
    pub tier: Option<std::sync::Arc<cleave_embed::Tier>>,
    /// Where this shard keeps model updates (docs/tiers.md, "Updates"); None: updates are
    /// refused.
    pub state_dir: Option<PathBuf>,
}

impl ShardConfig {
    pub fn new(bundle: PathBuf, listen: Address) -> ShardConfig {
        ShardConfig {
            bundle,
            tables: None,
            rows: RowSpec::All,
            listen,
            metrics_port: None,
            threads: 1,
            io_threads: 1,
            miss_threads: 8,
            frame_timeout: Duration::from_secs(10),
            max_payload: cleave_wire::frame::DEFAULT_MAX_PAYLOAD,
            resident: false,
            queue: QueuePolicy::Fifo,
            tier: None,
            state_dir: None,
        }
    }
}

/// Why a shard could not start; the message names the file, table or address.
#[derive(Debug)]
pub struct StartError(pub String);

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StartError {}

/// What a started shard reports (the CLI prints it on its ready line).
#[derive(Clone, Debug)]
pub struct ShardInfo {
    pub listen: Address,
    pub metrics: Option<SocketAddr>,
    pub tables: Vec<(String, Range<u64>)>,
}

impl fmt::Display for ShardInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.listen)?;
        if let Some(m) = self.metrics {
            write!(f, " metrics=http://{m}")?;
        }
        let tables: Vec<String> = self
            .tables
            .iter()
            .map(|(n, r)| format!("{n}={}:{}", r.start, r.end))
            .collect();
        write!(f, " tables={}", tables.join(","))
    }
}

/// A running shard.
pub struct Shard {
    server: Server,
    service: Arc<ShardService>,
    http: Option<HttpServer>,
    info: ShardInfo,
}

impl Shard {
    /// Binds the listen address and the metrics port (both answer at once: lookups with
    /// `not_ready`, /ready with 503), opens the tables, then turns ready.
    pub fn start(config: &ShardConfig) -> Result<Shard, StartError> {
        let service = Arc::new(ShardService::new(config.max_payload as usize));
        let server_config = ServerConfig {
            io_threads: config.io_threads.max(1),
            max_payload: config.max_payload,
            frame_timeout: config.frame_timeout,
            queue: config.queue,
            ..ServerConfig::default()
        };
        let server = Server::bind(&config.listen, service.clone(), server_config)
            .map_err(|e| StartError(format!("cannot listen on {}: {e}", config.listen)))?;
        service.attach_server(server.stats());
        let http = match config.metrics_port {
            None => None,
            Some(port) => {
                let addr = SocketAddr::new(metrics_host(&config.listen), port);
                let h = HttpServer::start(addr, service.clone(), server.stats())
                    .map_err(|e| StartError(format!("cannot serve metrics on {addr}: {e}")))?;
                Some(h)
            }
        };
        let tables = open_tables(config)?;
        let info = ShardInfo {
            listen: server.local_addr().clone(),
            metrics: http.as_ref().map(HttpServer::local_addr),
            tables: tables
                .iter()
                .map(|(t, _)| (t.name().to_owned(), t.row_range()))
                .collect(),
        };
        service.load_versions(tables, Engine::new(config.threads.max(1)));
        service.enable_updates(updates_for(config));
        let mut miss_threads = 0;
        if let Some(tier) = &config.tier {
            service.attach_tier(tier.clone());
            miss_threads = config.miss_threads;
        }
        service.start_workers(miss_threads);
        Ok(Shard {
            server,
            service,
            http,
            info,
        })
    }

    /// The tables and lookup engine of `config` without a server, answering
    /// [`ShardService::lookup`] in the caller's process (a router holding its shards, as
    /// Prism's CN does). `listen`, `metrics_port` and `io_threads` are not used.
    pub fn open_in_process(config: &ShardConfig) -> Result<Arc<ShardService>, StartError> {
        let service = Arc::new(ShardService::new(config.max_payload as usize));
        service.load_versions(open_tables(config)?, Engine::new(config.threads.max(1)));
        service.enable_updates(updates_for(config));
        Ok(service)
    }

    pub fn info(&self) -> &ShardInfo {
        &self.info
    }

    pub fn service(&self) -> &Arc<ShardService> {
        &self.service
    }

    /// Turns not ready, stops accepting, and lets connections finish what they started.
    pub fn shutdown(&self) {
        self.service.set_stopping();
        self.server.shutdown();
    }

    /// Shuts down if not yet and waits for the requests in flight (up to the server's drain
    /// timeout). Returns whether everything drained.
    pub fn join(self) -> bool {
        self.shutdown();
        let drained = self.server.join();
        drop(self.http);
        drained
    }

    /// Starts, calls `on_ready` with the shard's info, serves until SIGTERM or SIGINT, then
    /// drains. Signal handlers are installed before anything starts, so a signal during start-up
    /// is not lost either.
    pub fn run_until_signal(
        config: &ShardConfig,
        on_ready: impl FnOnce(&ShardInfo),
    ) -> Result<bool, StartError> {
        use tokio::signal::unix::{signal, SignalKind};
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| StartError(format!("cannot start a runtime: {e}")))?;
        let (mut term, mut int) = rt
            .block_on(async {
                Ok::<_, std::io::Error>((
                    signal(SignalKind::terminate())?,
                    signal(SignalKind::interrupt())?,
                ))
            })
            .map_err(|e| StartError(format!("cannot install signal handlers: {e}")))?;
        let shard = Shard::start(config)?;
        on_ready(shard.info());
        rt.block_on(async {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        });
        Ok(shard.join())
    }
}

/// The metrics server listens on the listen address's host (loopback for Unix sockets).
fn metrics_host(listen: &Address) -> IpAddr {
    match listen {
        Address::Tcp(a) | Address::Mptcp(a) => a
            .to_socket_addrs()
            .ok()
            .and_then(|mut it| it.next())
            .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |s| s.ip()),
        Address::Unix(_) | Address::Shm(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
    }
}

fn open_options(config: &ShardConfig) -> OpenOptions {
    OpenOptions {
        residency: if config.resident {
            cleave_embed::Residency::Resident
        } else {
            cleave_embed::Residency::Mapped
        },
        tier: config.tier.clone(),
        ..OpenOptions::default()
    }
}

fn updates_for(config: &ShardConfig) -> Updates {
    Updates::new(
        config.state_dir.clone(),
        config.bundle.clone(),
        Manifest::load(&config.bundle).ok(),
        open_options(config),
    )
}

/// The tables of `config`, each at its latest committed version (the bundle's, 0, unless
/// the state directory holds an update).
fn open_tables(config: &ShardConfig) -> Result<Vec<(Table, u64)>, StartError> {
    let manifest = Manifest::load(&config.bundle).map_err(|e| StartError(e.to_string()))?;
    let known: Vec<&str> = manifest.tables.iter().map(|t| t.name.as_str()).collect();
    let names: Vec<String> = match (&config.tables, &config.rows) {
        (Some(names), _) => names.clone(),
        (None, RowSpec::PerTable(per)) => per.iter().map(|(n, _)| n.clone()).collect(),
        (None, _) => known.iter().map(|s| s.to_string()).collect(),
    };
    if let RowSpec::PerTable(per) = &config.rows {
        if let Some((n, _)) = per.iter().find(|(n, _)| !names.contains(n)) {
            return Err(StartError(format!(
                "--rows names table {n:?}, which is not among --tables {names:?}"
            )));
        }
    }
    let options = open_options(config);
    let committed = match &config.state_dir {
        Some(dir) => update::replay(dir).map_err(StartError)?,
        None => Default::default(),
    };
    let mut tables = Vec::with_capacity(names.len());
    let mut versions = Vec::with_capacity(names.len());
    for name in &names {
        let meta = manifest.table(name).ok_or_else(|| {
            StartError(format!(
                "table {name:?} is not in {}; the bundle has {known:?}",
                config.bundle.join("manifest.json").display()
            ))
        })?;
        let rows = match &config.rows {
            RowSpec::All => 0..meta.rows,
            RowSpec::Global(r) => r.clone(),
            RowSpec::PerTable(per) => per
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0..meta.rows, |(_, r)| r.clone()),
        };
        let (table, version) = match (committed.get(name), &config.state_dir) {
            (Some(c), Some(dir)) => {
                let meta = update::committed_meta(meta, c);
                tracing::info!(table = %name, version = c.version, "serving an updated version");
                (Table::open_with(dir, &meta, rows, &options), c.version)
            }
            _ => (Table::open_with(&config.bundle, meta, rows, &options), 0),
        };
        tables.push(table.map_err(|e| StartError(e.to_string()))?);
        versions.push(version);
    }
    if let Some(tier) = &config.tier {
        // Before ready: the first requests should hit the row cache (docs/tiers.md).
        cleave_embed::tier::warm_up(tier, &tables).map_err(|e| StartError(e.to_string()))?;
    }
    Ok(tables.into_iter().zip(versions).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_row_specs() {
        assert_eq!(RowSpec::parse("5:10"), Ok(RowSpec::Global(5..10)));
        assert_eq!(
            RowSpec::parse("a=0:5,b=5:5"),
            Ok(RowSpec::PerTable(vec![
                ("a".into(), 0..5),
                ("b".into(), 5..5)
            ]))
        );
        for (bad, says) in [
            ("5", "expected START:END"),
            ("x:3", "START \"x\""),
            ("3:-1", "END \"-1\""),
            ("9:3", "START 9 is after END 3"),
            ("a=1:2,a=3:4", "given twice"),
            ("a=1:2,b", "expected NAME=START:END"),
        ] {
            let err = RowSpec::parse(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
