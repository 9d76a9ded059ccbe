//! `cleave-shard`: one embedding shard process, without Python (docs/serving.md, "Executables
//! and images"). Serves lookups for some tables (and row ranges) of a bundle over the internal
//! protocol, with `/ready`, `/live` and `/metrics` on `--metrics-port`; prints
//! "ready ADDRESS metrics=URL tables=..." for people once its tables are mapped (nothing reads
//! it: launchers probe `/ready`); drains and exits 0 on SIGTERM/SIGINT.
//!
//! `--plan FILE --shard-index N` takes the rows and threads of the plan's `shards[N]` instead
//! of `--rows`/`--tables`/`--threads` (a Kubernetes StatefulSet pod passes its ordinal).
//!
//! Exit codes: 2 for a bad flag, a plan without entry N, or a bundle that is missing or lacks
//! the tables asked for; 1 when the shard cannot start otherwise (a table file that does not open, an address in
//! use).

use std::io::Write;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

mod plan;
mod profile;

use clap::Parser;
use cleave_embed::Manifest;
use cleave_shard::{RowSpec, Shard, ShardConfig};
use cleave_wire::log::{self, LogFormat};
use cleave_wire::{Address, QueuePolicy};

#[derive(Debug, Parser)]
#[command(name = "cleave-shard", version, about = "A Cleave embedding shard")]
#[command(args_override_self = true)] // a flag given twice: the last wins, as before
struct Args {
    /// Bundle directory (manifest.json, tables/).
    #[arg(long)]
    bundle: PathBuf,
    /// Comma-separated tables to hold (default: all, or those named in --rows).
    #[arg(long, value_delimiter = ',', conflicts_with = "plan")]
    tables: Option<Vec<String>>,
    /// Rows held: START:END (global ids, every table) or NAME=START:END,... per table.
    #[arg(long, value_parser = RowSpec::parse, conflicts_with = "plan")]
    rows: Option<RowSpec>,
    /// A deployment plan as JSON (docs/plan.md): hold the rows of its `shards[N]` and run
    /// with its threads (N is --shard-index).
    #[arg(long, requires = "shard_index")]
    plan: Option<PathBuf>,
    /// Which entry of the plan's `shards` this process is (0-based).
    #[arg(long, requires = "plan")]
    shard_index: Option<usize>,
    /// HOST:PORT (port 0 picks one) or unix:/path/to/socket.
    #[arg(long)]
    listen: Address,
    /// HTTP port for /metrics, /ready, /live on the listen host (0 picks one).
    #[arg(long)]
    metrics_port: Option<u16>,
    /// Lookup threads, an I/O thread included (default: the plan's, else 1).
    #[arg(long, value_parser = at_least_one)]
    threads: Option<NonZeroUsize>,
    /// Threads that own connections and run lookups.
    #[arg(long, default_value = "1", value_parser = at_least_one)]
    io_threads: NonZeroUsize,
    /// A started frame (or a new connection's HELLO) must arrive within this many seconds.
    #[arg(long, value_name = "SECONDS", default_value = "10", value_parser = seconds,
          allow_negative_numbers = true)]
    frame_timeout: Duration,
    /// Copy tables into memory instead of mapping the files.
    #[arg(long)]
    resident: bool,
    /// The order received lookups start in: "fifo" (arrival) or "edf" (earliest deadline).
    #[arg(long, default_value = "fifo", value_parser = queue_policy)]
    queue: QueuePolicy,
    /// Bytes of DRAM this shard may use for its tables (suffixes K, M, G: powers of 1024).
    /// Tables larger than it are read from SSD behind DRAM caches of this size
    /// (docs/tiers.md); tables that fit stay in DRAM. Default: the plan's, else no limit.
    #[arg(long, value_name = "BYTES", value_parser = bytes)]
    dram_budget: Option<u64>,
    /// Eviction policy of the SSD tier's row cache: sieve (scan-resistant) or lru.
    #[arg(long, default_value = "sieve")]
    cache_policy: cleave_embed::PolicyKind,
    /// SSD tier reads: auto (io_uring where the kernel allows, else pread), uring, pread.
    #[arg(long, default_value = "auto")]
    io: cleave_embed::IoMode,
    /// Tables read from SSD (the plan's placement, docs/tiers.md); the others stay in DRAM and
    /// their bytes come out of --dram-budget. Default: the plan's, else every table when they
    /// exceed the budget.
    #[arg(long, value_delimiter = ',')]
    ssd_tables: Option<Vec<String>>,
    /// An access profile (JSON, docs/tiers.md): its tables' hot_rows are read into the row
    /// cache before the shard reports ready. Default: the plan's, else the cache starts cold.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Directory where this shard keeps model updates (`cleave update`, docs/tiers.md
    /// "Updates"); created if missing. A restart serves the latest committed version from it.
    /// Default: the plan's, else updates are refused.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Threads that complete SSD-tier lookups missing the row cache, off the I/O threads
    /// (docs/tiers.md, "Asynchronous completion"): lookups whose reads are in flight at once.
    /// 0: misses are read on the I/O thread that received the lookup.
    #[arg(long, default_value = "8")]
    miss_threads: usize,
    /// Share of the DRAM budget for the pooled-embedding cache, in [0, 0.5].
    #[arg(long, default_value = "0")]
    pooled_cache_fraction: f64,
    /// Log lines as "text" or "json" (one object per line); the level is CLEAVE_LOG's.
    #[arg(long, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// A queue policy; an older name still works, with a warning on stderr.
fn queue_policy(s: &str) -> Result<QueuePolicy, String> {
    let (policy, alias) = QueuePolicy::parse_name(s).map_err(|e| e.to_string())?;
    if let Some(alias) = alias {
        let name = policy.as_str();
        eprintln!("cleave-shard: warning: --queue {alias:?} is deprecated, use {name:?}");
    }
    Ok(policy)
}

fn at_least_one(s: &str) -> Result<NonZeroUsize, String> {
    let n: usize = s
        .parse()
        .map_err(|_| format!("expected a whole number, got {s:?}"))?;
    NonZeroUsize::new(n).ok_or_else(|| format!("expected at least 1, got {s}"))
}

/// A byte count: digits with an optional K, M or G (powers of 1024).
fn bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, shift) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 10),
        Some('M') => (&t[..t.len() - 1], 20),
        Some('G') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("expected bytes (digits, optionally K, M or G), got {s:?}"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{s:?} is too many bytes"))
}

/// Bytes of the rows this shard will hold, per table (every table it names, clipped).
fn held_bytes(config: &ShardConfig) -> Result<Vec<(String, u64)>, String> {
    let manifest = Manifest::load(&config.bundle).map_err(|e| e.to_string())?;
    let mut held = Vec::new();
    for t in &manifest.tables {
        let named = match (&config.tables, &config.rows) {
            (Some(names), _) => names.contains(&t.name),
            (None, RowSpec::PerTable(per)) => per.iter().any(|(n, _)| *n == t.name),
            (None, _) => true,
        };
        if !named {
            continue;
        }
        let range = match &config.rows {
            RowSpec::All => 0..t.rows,
            RowSpec::Global(r) => r.clone(),
            RowSpec::PerTable(per) => per
                .iter()
                .find(|(n, _)| *n == t.name)
                .map_or(0..t.rows, |(_, r)| r.clone()),
        };
        let rows = range
            .end
            .min(t.rows)
            .saturating_sub(range.start.min(t.rows));
        held.push((t.name.clone(), rows * t.row_bytes as u64));
    }
    Ok(held)
}

/// Where the tier's settings come from: the flags, else the plan.
struct TierInput {
    budget: u64,
    ssd_tables: Option<Vec<String>>,
    profile: Option<PathBuf>,
}

/// The SSD tier for `input`'s budget (None: the held tables fit in DRAM). With a placement
/// (`ssd_tables`), only those tables go to SSD and the rest's bytes come out of the budget.
fn tier_for(
    config: &ShardConfig,
    input: &TierInput,
    args: &Args,
) -> Result<Option<std::sync::Arc<cleave_embed::Tier>>, String> {
    let per_table = held_bytes(config)?;
    let held: u64 = per_table.iter().map(|(_, b)| b).sum();
    let budget = input.budget;
    let mut cache_budget = budget;
    match &input.ssd_tables {
        None if held <= budget => {
            tracing::info!(held, budget, "tables fit in the DRAM budget: all in DRAM");
            return Ok(None);
        }
        None => tracing::info!(held, budget, "tables exceed the DRAM budget: SSD tier"),
        Some(ssd) => {
            let in_dram: u64 = per_table
                .iter()
                .filter(|(n, _)| !ssd.contains(n))
                .map(|(_, b)| b)
                .sum();
            cache_budget = budget.saturating_sub(in_dram);
            if cache_budget < cleave_embed::tier::MIN_BUDGET {
                return Err(format!(
                    "--dram-budget {budget}: the tables kept in DRAM hold {in_dram} bytes, \
                     leaving {cache_budget} bytes for the SSD tier's caches; expected at least \
                     {} (raise the budget or put more tables in --ssd-tables)",
                    cleave_embed::tier::MIN_BUDGET
                ));
            }
            tracing::info!(
                ?ssd,
                in_dram,
                cache_budget,
                "placement: these tables on SSD"
            );
        }
    }
    let mut tier = cleave_embed::TierConfig::new(cache_budget);
    tier.policy = args.cache_policy;
    tier.io = args.io;
    tier.pooled_fraction = args.pooled_cache_fraction;
    tier.ssd_tables = input.ssd_tables.clone();
    match &input.profile {
        Some(path) => tier.warm_rows = profile::hot_rows(path).map_err(|e| e.to_string())?,
        None => tracing::info!("no access profile (--profile): the row cache starts cold"),
    }
    cleave_embed::Tier::new(tier)
        .map(Some)
        .map_err(|e| format!("--dram-budget: {e}"))
}

fn seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("expected seconds (a number), got {s:?}"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("expected seconds > 0, got {s}"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// The operator's input, checked before anything starts so that it exits 2 like a bad flag:
/// the bundle's manifest opens and holds every table named. (Shard::start checks the same
/// again; what only it finds, such as a port in use, exits 1.)
fn check_input(config: &ShardConfig, ssd_tables: Option<&[String]>) -> Result<(), String> {
    let manifest = Manifest::load(&config.bundle).map_err(|e| e.to_string())?;
    let known: Vec<&str> = manifest.tables.iter().map(|t| t.name.as_str()).collect();
    let per_table: Vec<&str> = match &config.rows {
        RowSpec::PerTable(per) => per.iter().map(|(n, _)| n.as_str()).collect(),
        _ => Vec::new(),
    };
    if let Some(names) = &config.tables {
        if let Some(n) = per_table.iter().find(|n| !names.iter().any(|t| t == *n)) {
            return Err(format!(
                "--rows names table {n:?}, which is not among --tables {names:?}"
            ));
        }
    }
    let ssd = ssd_tables.unwrap_or_default();
    if let Some(n) = ssd.iter().find(|n| !known.contains(&n.as_str())) {
        return Err(format!(
            "--ssd-tables names table {n:?}, which is not in {}; the bundle has {known:?}",
            config.bundle.join("manifest.json").display()
        ));
    }
    let named = config.tables.iter().flatten().map(String::as_str);
    if let Some(n) = named
        .chain(per_table.iter().copied())
        .find(|n| !known.contains(n))
    {
        return Err(format!(
            "table {n:?} is not in {}; the bundle has {known:?}",
            config.bundle.join("manifest.json").display()
        ));
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse(); // exits 2 naming the flag on bad input
    if let Err(e) = log::init(args.log_format) {
        eprintln!("cleave-shard: {e}");
        return ExitCode::from(2);
    }
    let mut config = ShardConfig::new(args.bundle.clone(), args.listen.clone());
    config.tables = args.tables.clone().map(|t| {
        t.into_iter()
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect()
    });
    config.rows = args.rows.clone().unwrap_or_default();
    config.threads = 1;
    let mut planned_budget = None;
    let (mut planned_ssd, mut planned_profile) = (None, None);
    let mut planned_state = None;
    if let (Some(path), Some(index)) = (&args.plan, args.shard_index) {
        match plan::planned_shard(path, index) {
            Ok(planned) => {
                tracing::info!(shard = %planned.name, index, "rows and threads from the plan");
                config.rows = planned.rows;
                config.threads = planned.threads;
                planned_budget = Some(planned.dram_budget).filter(|&b| b > 0);
                (planned_ssd, planned_profile) = (planned.ssd_tables, planned.profile);
                planned_state = planned.state_dir;
            }
            Err(e) => {
                tracing::error!(error = %e, "bad input");
                return ExitCode::from(2);
            }
        }
    }
    if let Some(threads) = args.threads {
        config.threads = threads.get(); // the flag overrides the plan
    }
    config.metrics_port = args.metrics_port;
    config.io_threads = args.io_threads.get();
    config.miss_threads = args.miss_threads;
    config.frame_timeout = args.frame_timeout;
    config.resident = args.resident;
    config.queue = args.queue;
    config.state_dir = args.state_dir.clone().or(planned_state);
    let ssd_tables = args.ssd_tables.clone().or(planned_ssd);
    if let Err(e) = check_input(&config, ssd_tables.as_deref()) {
        tracing::error!(error = %e, "bad input");
        return ExitCode::from(2);
    }
    let input = args.dram_budget.or(planned_budget).map(|budget| TierInput {
        budget,
        ssd_tables,
        profile: args.profile.clone().or(planned_profile),
    });
    if input.is_none() && (args.ssd_tables.is_some() || args.profile.is_some()) {
        tracing::error!("--ssd-tables and --profile need --dram-budget (or a plan's)");
        return ExitCode::from(2);
    }
    if let Some(input) = input {
        match tier_for(&config, &input, &args) {
            Ok(tier) => config.tier = tier,
            Err(e) => {
                tracing::error!(error = %e, "bad input");
                return ExitCode::from(2);
            }
        }
    }
    let result = Shard::run_until_signal(&config, |info| {
        tracing::info!(address = %info.listen, "ready");
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "ready {info}");
        let _ = out.flush();
    });
    match result {
        Ok(drained) => {
            if !drained {
                tracing::warn!("stopped before every request in flight was answered");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(error = %e, "cannot start");
            ExitCode::FAILURE
        }
    }
}
