//! Lookups on a table whose rows are not in memory back to back (the SSD tier): the distinct
//! ids of the call are read once (de-duplication: a user's ids shared by every candidate cost
//! one read), copied into a staging buffer, and the ids renumbered into it, so the same SIMD
//! kernels pool them in the same order as from DRAM — bit for bit the same result. Whole bags
//! found in the pooled-embedding cache skip all of that.

use std::sync::atomic::Ordering;

use crate::cache::pooled::{bag_key, MIN_BAG};
use crate::error::EmbedError;
use crate::kernels::{self, Kernel, RowsView};
use crate::pooling::Pooling;
use crate::table::Table;

/// The distinct ids of `ids` read into a staging buffer, and `ids` renumbered into it.
struct Staged {
    rows: Vec<u8>,
    local: Vec<i64>,
}

fn stage(table: &Table, ids: &[i64]) -> Result<Staged, EmbedError> {
    let mut distinct: Vec<u64> = ids.iter().map(|&id| id as u64).collect();
    distinct.sort_unstable();
    distinct.dedup();
    let mut rows = vec![0u8; distinct.len() * table.row_bytes()];
    table.store().read_rows(&distinct, &mut rows)?;
    let local = ids
        .iter()
        .map(|&id| distinct.binary_search(&(id as u64)).unwrap_or(0) as i64)
        .collect();
    if let Some(tier) = table.store().tier() {
        tier.counters
            .ids
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
    }
    Ok(Staged { rows, local })
}

fn view<'a>(table: &Table, staged: &'a Staged) -> RowsView<'a> {
    RowsView::new(
        &staged.rows,
        0,
        table.row_bytes(),
        table.dim(),
        table.dtype(),
        table.prefetch_distance(),
    )
}

/// Unpooled gather from a tiered table; ids already checked.
pub(crate) fn gather(
    kernel: Kernel,
    table: &Table,
    ids: &[i64],
    out: &mut [f32],
) -> Result<(), EmbedError> {
    let staged = stage(table, ids)?;
    // SAFETY: every local id indexes a staged row; out has ids.len() * dim floats (checked).
    unsafe { kernels::gather_rows(kernel, &view(table, &staged), &staged.local, out) };
    Ok(())
}

/// `kernels::pool_bags` for a tiered table: bags `offsets` (positions in `ids`, whose ids were
/// checked), `pooling` Sum (weighted if `weights`) or Max.
pub(crate) fn pool_bags(
    kernel: Kernel,
    table: &Table,
    ids: &[i64],
    offsets: &[u32],
    weights: Option<&[f32]>,
    pooling: Pooling,
    out: &mut [f32],
) -> Result<(), EmbedError> {
    let dim = table.dim();
    let bags = offsets.len() - 1;
    let tier = table.store().tier();
    let pooled = tier.filter(|t| pooling == Pooling::Sum && t.pooled.enabled());
    let version = table.store().version_key();
    let bag = |b: usize| offsets[b] as usize..offsets[b + 1] as usize;
    // Keys of the bags the pooled cache can answer, and which did.
    let mut keys: Vec<Option<u64>> = vec![None; bags];
    let mut hit = vec![false; bags];
    if let Some(t) = pooled {
        let (mut lookups, mut hits) = (0u64, 0u64);
        for b in 0..bags {
            let r = bag(b);
            if r.len() < MIN_BAG {
                continue;
            }
            let w = weights.map(|w| &w[r.clone()]);
            let key = bag_key(version, &ids[r.clone()], w);
            keys[b] = Some(key);
            lookups += 1;
            if t.pooled
                .get(key, &ids[r], w, &mut out[b * dim..(b + 1) * dim])
            {
                hit[b] = true;
                hits += 1;
            }
        }
        t.counters
            .pooled_lookups
            .fetch_add(lookups, Ordering::Relaxed);
        t.counters.pooled_hits.fetch_add(hits, Ordering::Relaxed);
    }
    let (first, last) = (offsets[0] as usize, offsets[bags] as usize);
    if !hit.iter().any(|&h| h) {
        // The common case costs nothing more than the keys: pool every bag in place.
        let staged = stage(table, &ids[first..last])?;
        let shifted: Vec<u32> = offsets.iter().map(|&o| o - first as u32).collect();
        let w = weights.map(|w| &w[first..last]);
        // SAFETY: local ids index staged rows; offsets cover exactly `local`; sizes checked.
        unsafe {
            kernels::pool_bags(
                kernel,
                &view(table, &staged),
                &staged.local,
                &shifted,
                w,
                pooling,
                out,
            )
        };
    } else {
        // Pool only the bags that missed, then scatter them.
        let missed: Vec<usize> = (0..bags).filter(|&b| !hit[b]).collect();
        let mut m_ids = Vec::new();
        let mut m_weights = Vec::new();
        let mut m_offsets = vec![0u32];
        for &b in &missed {
            let r = bag(b);
            m_ids.extend_from_slice(&ids[r.clone()]);
            if let Some(w) = weights {
                m_weights.extend_from_slice(&w[r]);
            }
            m_offsets.push(m_ids.len() as u32);
        }
        let staged = stage(table, &m_ids)?;
        let mut m_out = vec![0.0f32; missed.len() * dim];
        // SAFETY: as above, for the compacted bags.
        unsafe {
            kernels::pool_bags(
                kernel,
                &view(table, &staged),
                &staged.local,
                &m_offsets,
                weights.map(|_| &m_weights[..]),
                pooling,
                &mut m_out,
            )
        };
        for (k, &b) in missed.iter().enumerate() {
            out[b * dim..(b + 1) * dim].copy_from_slice(&m_out[k * dim..(k + 1) * dim]);
        }
    }
    if let Some(t) = pooled {
        for b in 0..bags {
            if let (Some(key), false) = (keys[b], hit[b]) {
                let r = bag(b);
                let w = weights.map(|w| &w[r.clone()]);
                t.pooled
                    .insert(key, &ids[r], w, &out[b * dim..(b + 1) * dim]);
            }
        }
    }
    Ok(())
}
