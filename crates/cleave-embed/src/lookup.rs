//! Pooled lookups and gathers on one table: argument checks, then a kernel.
//!
//! Everything a caller passes is checked before a kernel runs (offsets, weights, buffer sizes,
//! every id against the table's row range), so the kernels can read rows without bounds checks.
//! On error, `out` and `counts` hold unspecified values.

use std::ops::Range;

use crate::error::EmbedError;
use crate::kernels::{self, Kernel};
pub use crate::pooling::Pooling;
use crate::table::Table;

/// One table's bags, PyTorch `embedding_bag` style.
///
/// `ids` are GLOBAL row ids; every id must lie in the table's `row_range()`. `offsets` has
/// bags + 1 entries: `offsets[0] == 0`, non-decreasing, last `== ids.len()`; bag `b` is
/// `ids[offsets[b]..offsets[b + 1]]`. `weights` (Sum only) has `ids.len()` entries.
#[derive(Debug, Clone, Copy)]
pub struct Bags<'a> {
    pub ids: &'a [i64],
    pub offsets: &'a [u32],
    pub weights: Option<&'a [f32]>,
}

impl Bags<'_> {
    /// Number of bags (`offsets.len() - 1`, 0 for empty offsets).
    pub fn len(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Pooled lookup into `out` (bags × dim f32, row-major) and `counts` (bags): the count of a
/// bag is its number of ids. Mean divides by the count; every pooling of an empty bag gives
/// zeros (PyTorch semantics). Runs on the calling thread with the best kernel of this CPU.
pub fn pool(
    table: &Table,
    bags: &Bags,
    pooling: Pooling,
    out: &mut [f32],
    counts: &mut [u32],
) -> Result<(), EmbedError> {
    pool_with(Kernel::best(), table, bags, pooling, out, counts)
}

/// [`pool`] with a chosen kernel (tests and benchmarks compare them).
pub fn pool_with(
    kernel: Kernel,
    table: &Table,
    bags: &Bags,
    pooling: Pooling,
    out: &mut [f32],
    counts: &mut [u32],
) -> Result<(), EmbedError> {
    kernel.require()?;
    check_bags(table, bags, pooling, out.len(), counts.len())?;
    pool_bag_range(kernel, table, bags, pooling, 0..bags.len(), out, counts)
}

/// Unpooled gather: `out` (ids.len() × dim f32) gets row `ids[i]` at position `i`.
pub fn gather(table: &Table, ids: &[i64], out: &mut [f32]) -> Result<(), EmbedError> {
    gather_with(Kernel::best(), table, ids, out)
}

/// [`gather`] with a chosen kernel.
pub fn gather_with(
    kernel: Kernel,
    table: &Table,
    ids: &[i64],
    out: &mut [f32],
) -> Result<(), EmbedError> {
    kernel.require()?;
    let expected = ids.len().checked_mul(table.dim());
    if expected != Some(out.len()) {
        return Err(EmbedError::bags(
            table.name(),
            format!(
                "gather output has {} floats, expected {} ids x dim {}",
                out.len(),
                ids.len(),
                table.dim()
            ),
        ));
    }
    check_ids(table, ids, 0)?;
    match table.view() {
        // SAFETY: every id was checked against the table's row range just above.
        Some(rows) => unsafe { kernels::gather_rows(kernel, &rows, ids, out) },
        None => crate::tiered::gather(kernel, table, ids, out)?,
    }
    Ok(())
}

/// Merges a shard's partial pool (`part`, `part_counts`) into `acc`, `acc_counts` (bags × dim).
/// Start from zeros and zero counts; `pooling` is the feature's pooling, the shards having run
/// [`Pooling::partial`] of it. Call [`finish`] once every shard is merged.
pub fn merge(
    pooling: Pooling,
    dim: usize,
    acc: &mut [f32],
    acc_counts: &mut [u32],
    part: &[f32],
    part_counts: &[u32],
) -> Result<(), EmbedError> {
    let bags = acc_counts.len();
    if part_counts.len() != bags || acc.len() != bags * dim || part.len() != bags * dim {
        return Err(EmbedError::bags(
            "<merge>",
            format!(
                "partial pool has {} counts and {} floats, expected {bags} counts and {} floats \
                 (bags {bags} x dim {dim})",
                part_counts.len(),
                part.len(),
                bags * dim
            ),
        ));
    }
    for b in 0..bags {
        let (into, from) = (
            &mut acc[b * dim..(b + 1) * dim],
            &part[b * dim..(b + 1) * dim],
        );
        match pooling {
            Pooling::Sum | Pooling::Mean => into.iter_mut().zip(from).for_each(|(a, p)| *a += p),
            // A shard without ids for this bag returns zeros that must not win the max.
            Pooling::Max if part_counts[b] == 0 => {}
            Pooling::Max if acc_counts[b] == 0 => into.copy_from_slice(from),
            Pooling::Max => into.iter_mut().zip(from).for_each(|(a, p)| *a = a.max(*p)),
        }
        acc_counts[b] += part_counts[b];
    }
    Ok(())
}

/// Completes merged partial pools: divides means by their merged counts.
pub fn finish(pooling: Pooling, dim: usize, acc: &mut [f32], counts: &[u32]) {
    if pooling == Pooling::Mean {
        divide_by_counts(dim, acc, counts);
    }
}

fn divide_by_counts(dim: usize, out: &mut [f32], counts: &[u32]) {
    for (row, &count) in out.chunks_exact_mut(dim).zip(counts) {
        if count > 1 {
            let n = count as f32;
            row.iter_mut().for_each(|v| *v /= n);
        }
    }
}

/// Checks everything about a job except the ids (which are checked per chunk, in parallel).
pub(crate) fn check_bags(
    table: &Table,
    bags: &Bags,
    pooling: Pooling,
    out_len: usize,
    counts_len: usize,
) -> Result<(), EmbedError> {
    let bad = |reason: String| Err(EmbedError::bags(table.name(), reason));
    let offsets = bags.offsets;
    let Some(&last) = offsets.last() else {
        return bad("offsets is empty, expected bags + 1 entries starting with 0".into());
    };
    if offsets[0] != 0 {
        return bad(format!("offsets[0] is {}, expected 0", offsets[0]));
    }
    if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return bad(format!(
            "offsets must be non-decreasing, but offsets[{}] = {} > offsets[{}] = {}",
            i,
            offsets[i],
            i + 1,
            offsets[i + 1]
        ));
    }
    if last as usize != bags.ids.len() {
        return bad(format!(
            "last offset is {last}, expected the number of ids {}",
            bags.ids.len()
        ));
    }
    if let Some(w) = bags.weights {
        if pooling != Pooling::Sum {
            return bad(format!(
                "per-sample weights need pooling \"sum\", found {:?}",
                pooling.as_str()
            ));
        }
        if w.len() != bags.ids.len() {
            return bad(format!(
                "weights has {} entries, expected one per id ({})",
                w.len(),
                bags.ids.len()
            ));
        }
    }
    let n = bags.len();
    if counts_len != n {
        return bad(format!(
            "counts has {counts_len} entries, expected one per bag ({n})"
        ));
    }
    if n.checked_mul(table.dim()) != Some(out_len) {
        return bad(format!(
            "output has {out_len} floats, expected bags {n} x dim {} = {}",
            table.dim(),
            n.saturating_mul(table.dim())
        ));
    }
    Ok(())
}

/// Fails on the first id outside the table's row range; `base` is the position of `ids[0]`
/// in the caller's array, for the message.
pub(crate) fn check_ids(table: &Table, ids: &[i64], base: usize) -> Result<(), EmbedError> {
    let range = table.row_range();
    let (start, len) = (range.start, range.end - range.start);
    // One compare per id: an id below `start` (or negative) wraps to a huge offset.
    // Fast vectorised pass; the position is only searched for on failure.
    if !kernels::ids_in_range(ids, start, len) {
        let bad = |&id: &i64| (id as u64).wrapping_sub(start) >= len;
        let position = ids.iter().position(bad).unwrap_or(0);
        return Err(EmbedError::IdOutOfRange {
            table: table.name().to_string(),
            id: ids[position],
            position: base + position,
            range,
        });
    }
    Ok(())
}

/// Pools bags `range` of a job whose offsets, weights and sizes were checked by
/// [`check_bags`]; `out` and `counts` are the slices of those bags only.
pub(crate) fn pool_bag_range(
    kernel: Kernel,
    table: &Table,
    bags: &Bags,
    pooling: Pooling,
    range: Range<usize>,
    out: &mut [f32],
    counts: &mut [u32],
) -> Result<(), EmbedError> {
    let offsets = &bags.offsets[range.start..range.end + 1];
    let (first, last) = (offsets[0] as usize, offsets[offsets.len() - 1] as usize);
    check_ids(table, &bags.ids[first..last], first)?;
    for (count, w) in counts.iter_mut().zip(offsets.windows(2)) {
        *count = w[1] - w[0];
    }
    let kernel_pooling = if pooling == Pooling::Max {
        Pooling::Max
    } else {
        Pooling::Sum
    };
    match table.view() {
        // SAFETY: the ids these offsets cover were checked just above; offsets, weights and
        // the output size were checked by check_bags.
        Some(rows) => unsafe {
            kernels::pool_bags(
                kernel,
                &rows,
                bags.ids,
                offsets,
                bags.weights,
                kernel_pooling,
                out,
            )
        },
        None => crate::tiered::pool_bags(
            kernel,
            table,
            bags.ids,
            offsets,
            bags.weights,
            kernel_pooling,
            out,
        )?,
    }
    if pooling == Pooling::Mean {
        divide_by_counts(table.dim(), out, counts);
    }
    Ok(())
}
