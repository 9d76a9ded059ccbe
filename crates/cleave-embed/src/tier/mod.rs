//! The SSD tier: tables too large for DRAM are read from SSD with O_DIRECT (io_uring, or
//! positioned reads where io_uring is unavailable), behind a DRAM row cache split by row size
//! and a pooled-embedding cache, all under one byte budget (docs/tiers.md).

pub mod io;
mod warm;

pub use warm::{warm_up, WarmReport};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::cache::pooled::PooledCache;
use crate::cache::{PolicyKind, RowCache};
use crate::error::EmbedError;
use io::{Io, IoMode};

/// The smallest DRAM budget a tier accepts: below it the caches hold too few rows to matter
/// and the budget is more likely a unit mistake (bytes, not MiB).
pub const MIN_BUDGET: u64 = 1 << 20;

/// How a tier is set up.
#[derive(Debug, Clone)]
pub struct TierConfig {
    /// Bytes of DRAM for the caches (row cache and pooled cache together).
    pub dram_budget: u64,
    pub policy: PolicyKind,
    pub io: IoMode,
    /// Share of the budget for the pooled-embedding cache (0 disables it).
    pub pooled_fraction: f64,
    /// Threads of the positioned-read fallback.
    pub io_threads: usize,
    /// The tables read from SSD (a plan's placement, docs/tiers.md); None: every table of a
    /// shard that has a tier. The others stay in DRAM (mapped or resident).
    pub ssd_tables: Option<Vec<String>>,
    /// Hottest rows per table, hottest first, read into the row cache before the shard
    /// reports ready ([`warm_up`]).
    pub warm_rows: HashMap<String, Vec<u64>>,
}

impl TierConfig {
    pub fn new(dram_budget: u64) -> TierConfig {
        TierConfig {
            dram_budget,
            policy: PolicyKind::default(),
            io: IoMode::Auto,
            pooled_fraction: 0.0,
            io_threads: 8,
            ssd_tables: None,
            warm_rows: HashMap::new(),
        }
    }
}

/// Counters of a tier since it was created or last reset.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TierStats {
    /// Ids looked up (with repeats).
    pub ids: u64,
    /// Distinct rows per lookup call, summed: what reaches the row cache after de-duplication.
    pub rows: u64,
    pub row_hits: u64,
    /// Reads issued to the device (one per missed row).
    pub device_reads: u64,
    /// Bytes read from the device.
    pub device_bytes: u64,
    /// Bytes of rows those reads delivered (device_bytes / this = read amplification).
    pub row_bytes_read: u64,
    /// Bags looked up in the pooled cache, and how many hit.
    pub pooled_lookups: u64,
    pub pooled_hits: u64,
}

impl TierStats {
    pub fn row_hit_rate(&self) -> f64 {
        ratio(self.row_hits, self.rows)
    }

    pub fn pooled_hit_rate(&self) -> f64 {
        ratio(self.pooled_hits, self.pooled_lookups)
    }

    pub fn read_amplification(&self) -> f64 {
        ratio(self.device_bytes, self.row_bytes_read)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub ids: AtomicU64,
    pub rows: AtomicU64,
    pub row_hits: AtomicU64,
    pub device_reads: AtomicU64,
    pub device_bytes: AtomicU64,
    pub row_bytes_read: AtomicU64,
    pub pooled_lookups: AtomicU64,
    pub pooled_hits: AtomicU64,
}

/// DRAM caches and SSD reader shared by the tables of one shard.
pub struct Tier {
    config: TierConfig,
    pub(crate) rows: RowCache,
    pub(crate) pooled: PooledCache,
    pub(crate) io: Io,
    pub(crate) counters: Counters,
    next_table: AtomicU32,
}

impl std::fmt::Debug for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tier")
            .field("config", &self.config)
            .field("io", &self.io.name())
            .finish()
    }
}

impl Tier {
    /// A tier with `config`'s budget; fails on a budget under [`MIN_BUDGET`] or if the
    /// requested I/O backend cannot be set up.
    pub fn new(config: TierConfig) -> Result<Arc<Tier>, EmbedError> {
        if config.dram_budget < MIN_BUDGET {
            return Err(EmbedError::Unsupported(format!(
                "DRAM budget {} bytes is below the minimum of {MIN_BUDGET} bytes (1 MiB) for \
                 the SSD tier's caches",
                config.dram_budget
            )));
        }
        if !(0.0..=0.5).contains(&config.pooled_fraction) {
            return Err(EmbedError::Unsupported(format!(
                "pooled cache fraction must lie in [0, 0.5], found {}",
                config.pooled_fraction
            )));
        }
        let io = Io::new(config.io, config.io_threads).map_err(|e| {
            EmbedError::Unsupported(format!("I/O backend {:?} cannot be set up: {e}", config.io))
        })?;
        let pooled_bytes = (config.dram_budget as f64 * config.pooled_fraction) as u64;
        let tier = Tier {
            rows: RowCache::new(config.dram_budget - pooled_bytes, config.policy),
            pooled: PooledCache::new(pooled_bytes as usize),
            io,
            counters: Counters::default(),
            next_table: AtomicU32::new(0),
            config,
        };
        tracing::info!(
            budget = tier.config.dram_budget,
            policy = tier.config.policy.as_str(),
            io = tier.io.name(),
            pooled_bytes,
            "SSD tier ready"
        );
        Ok(Arc::new(tier))
    }

    pub fn config(&self) -> &TierConfig {
        &self.config
    }

    /// Whether table `name` is read from SSD (else it stays in DRAM).
    pub fn on_ssd(&self, name: &str) -> bool {
        self.config
            .ssd_tables
            .as_ref()
            .is_none_or(|names| names.iter().any(|n| n == name))
    }

    /// "io_uring" or "pread".
    pub fn io_backend(&self) -> &'static str {
        self.io.name()
    }

    /// A number for a newly opened table (part of its cache keys).
    pub(crate) fn table_number(&self) -> u32 {
        self.next_table.fetch_add(1, Ordering::Relaxed)
    }

    /// (row bytes, capacity in rows, rows held) of each internal row cache.
    pub fn row_cache_shape(&self) -> Vec<(usize, usize, usize)> {
        self.rows.shape()
    }

    pub fn stats(&self) -> TierStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TierStats {
            ids: get(&c.ids),
            rows: get(&c.rows),
            row_hits: get(&c.row_hits),
            device_reads: get(&c.device_reads),
            device_bytes: get(&c.device_bytes),
            row_bytes_read: get(&c.row_bytes_read),
            pooled_lookups: get(&c.pooled_lookups),
            pooled_hits: get(&c.pooled_hits),
        }
    }

    /// Zeroes the counters (benchmarks read the steady state after a warm-up).
    pub fn reset_stats(&self) {
        let c = &self.counters;
        for a in [
            &c.ids,
            &c.rows,
            &c.row_hits,
            &c.device_reads,
            &c.device_bytes,
            &c.row_bytes_read,
            &c.pooled_lookups,
            &c.pooled_hits,
        ] {
            a.store(0, Ordering::Relaxed);
        }
    }
}

/// The device's random-read rate at `read_bytes` per read (rounded up to the O_DIRECT block):
/// `reads` reads at random block-aligned offsets of the file at `path`, `queue_depth` in
/// flight per thread on `threads` threads, through backend `mode`. Returns (reads per
/// second, the backend used). `cleave bench tier` sets the tier's miss rate against it.
pub fn measure_read_iops(
    path: &std::path::Path,
    read_bytes: usize,
    reads: usize,
    queue_depth: usize,
    mode: IoMode,
    threads: usize,
) -> Result<(f64, &'static str), EmbedError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| EmbedError::NoDirectIo {
            path: path.to_path_buf(),
            source: e,
        })?;
    let block = io::probe_block(&file).map_err(|e| EmbedError::NoDirectIo {
        path: path.to_path_buf(),
        source: e,
    })?;
    let len = read_bytes.max(1).div_ceil(block) * block;
    let size = file.metadata().map_err(|e| EmbedError::io(path, e))?.len();
    let blocks = size.saturating_sub(len as u64) / block as u64;
    if blocks == 0 {
        return Err(EmbedError::Unsupported(format!(
            "{}: {size} bytes is too small to measure random reads of {len} bytes",
            path.display()
        )));
    }
    let io = Io::new(mode, 1).map_err(|e| EmbedError::io(path, e))?;
    let (threads, depth) = (threads.max(1), queue_depth.clamp(1, 256));
    let per_thread = reads.div_ceil(threads).max(1);
    let start = std::time::Instant::now();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (io, file) = (&io, &file);
                scope.spawn(move || -> std::io::Result<()> {
                    let mut state = crate::cache::mix(t as u64 + 1);
                    let mut buf = io::AlignedBuf::new(depth * len);
                    let mut done = 0;
                    while done < per_thread {
                        let n = depth.min(per_thread - done);
                        let spans: Vec<io::Span> = (0..n)
                            .map(|_| {
                                state = crate::cache::mix(state);
                                io::Span {
                                    offset: (state % blocks) * block as u64,
                                    len,
                                    need: len,
                                }
                            })
                            .collect();
                        io.read(file, &spans, &mut buf, len)?;
                        done += n;
                    }
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("read thread panicked")))
        })
    })
    .map_err(|e| EmbedError::io(path, e))?;
    let seconds = start.elapsed().as_secs_f64().max(1e-9);
    Ok(((per_thread * threads) as f64 / seconds, io.name()))
}
