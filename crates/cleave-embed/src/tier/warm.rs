//! Warm-up: a starting shard reads the hottest rows of its SSD tables (from the access
//! profile, docs/tiers.md) into the row cache before it reports ready, so its first requests
//! hit DRAM rather than queue on the device. Run once every table is open: registering a table
//! re-splits the budget and empties the caches.

use std::collections::BTreeMap;

use super::Tier;
use crate::error::EmbedError;
use crate::table::Table;

/// Reads per device batch while warming (as deep as a lookup's batch).
const BATCH: usize = 256;

/// What [`warm_up`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WarmReport {
    /// Rows read into the row cache, per table.
    pub rows: BTreeMap<String, u64>,
    /// Hot rows left out: outside the rows this shard holds, or beyond the cache's capacity.
    pub skipped: u64,
}

/// Reads `tier`'s `warm_rows` of each of `tables` on the SSD tier into the row cache, hottest
/// first, at most as many rows as the cache of that row size holds (more would evict the
/// hottest). Counters are reset after, so hit rates describe serving. Tables without hot rows
/// start cold (logged).
pub fn warm_up(tier: &Tier, tables: &[Table]) -> Result<WarmReport, EmbedError> {
    let mut report = WarmReport::default();
    if tier.config().warm_rows.is_empty() {
        return Ok(report); // no profile: the caller has said the cache starts cold
    }
    let shape = tier.row_cache_shape();
    // Capacity left per row size, shared by the tables of that size in the order given.
    let mut room: BTreeMap<usize, usize> = shape.iter().map(|&(rb, cap, _)| (rb, cap)).collect();
    for table in tables.iter().filter(|t| t.store_kind() == "ssd") {
        let name = table.name();
        let Some(hot) = tier.config().warm_rows.get(name) else {
            tracing::info!(
                table = name,
                "no hottest rows in the access profile: starts cold"
            );
            continue;
        };
        let held = table.row_range();
        let left = room.entry(table.row_bytes()).or_insert(0);
        let mut seen = std::collections::HashSet::new();
        let ids: Vec<u64> = hot
            .iter()
            .copied()
            .filter(|id| held.contains(id) && seen.insert(*id))
            .take(*left)
            .collect();
        report.skipped += (hot.len() - ids.len()) as u64;
        *left -= ids.len();
        let mut buf = vec![0u8; BATCH * table.row_bytes()];
        for chunk in ids.chunks(BATCH) {
            // Each chunk's ids are distinct; read_rows caches every row it reads.
            let out = &mut buf[..chunk.len() * table.row_bytes()];
            table.store().read_rows(chunk, out)?;
        }
        report.rows.insert(name.to_owned(), ids.len() as u64);
    }
    let stats = tier.stats();
    tracing::info!(
        rows = ?report.rows,
        skipped = report.skipped,
        device_reads = stats.device_reads,
        "row cache warmed"
    );
    tier.reset_stats();
    Ok(report)
}
