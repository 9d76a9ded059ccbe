//! Portable kernel: plain Rust over byte slices, left to the compiler to vectorise. It is the
//! fallback on CPUs without AVX2 and the tail of the AVX2 kernel for dims not a multiple of 8.

use std::ops::Range;

use super::{f16_to_f32, prefetch_row, RowsView};
use crate::bundle::TableDtype;
use crate::pooling::Pooling;

/// See `kernels::pool_bags`.
///
/// # Safety
/// As `kernels::pool_bags`.
pub(super) unsafe fn pool_bags(
    rows: &RowsView,
    ids: &[i64],
    offsets: &[u32],
    weights: Option<&[f32]>,
    pooling: Pooling,
    out: &mut [f32],
) {
    let dim = rows.dim;
    let last = offsets[offsets.len() - 1] as usize;
    for (bag, out_row) in offsets.windows(2).zip(out.chunks_exact_mut(dim)) {
        let ids_of_bag = bag[0] as usize..bag[1] as usize;
        // SAFETY: forwarded from the caller.
        unsafe {
            pool_columns(
                rows,
                ids,
                weights,
                ids_of_bag,
                pooling,
                0..dim,
                out_row,
                last,
            )
        };
    }
}

/// Pools columns `cols` of one bag (`ids[bag]`) into `out` (`cols.len()` floats), prefetching
/// rows ahead while the position is below `prefetch_end` (0: no prefetch).
///
/// # Safety
/// The ids of the bag lie in `rows`; `bag` lies within `ids` (and `weights`); `cols` lies within
/// the dim.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(super) unsafe fn pool_columns(
    rows: &RowsView,
    ids: &[i64],
    weights: Option<&[f32]>,
    bag: Range<usize>,
    pooling: Pooling,
    cols: Range<usize>,
    out: &mut [f32],
    prefetch_end: usize,
) {
    let max = pooling == Pooling::Max;
    out.fill(if max && !bag.is_empty() {
        f32::NEG_INFINITY
    } else {
        0.0
    });
    let combine = |o: &mut f32, x: f32, w: f32| {
        if max {
            *o = o.max(x)
        } else {
            *o += w * x
        }
    };
    for p in bag {
        // SAFETY (all below): positions and ids were checked by the caller.
        let id = unsafe { *ids.get_unchecked(p) };
        if p + rows.distance < prefetch_end {
            let ahead = unsafe { *ids.get_unchecked(p + rows.distance) };
            prefetch_row(unsafe { rows.row(ahead) }, rows.lines);
        }
        let row = unsafe { std::slice::from_raw_parts(rows.row(id), rows.row_bytes) };
        let w = weights.map_or(1.0, |w| unsafe { *w.get_unchecked(p) });
        match rows.dtype {
            TableDtype::Float32 => {
                let bytes = &row[4 * cols.start..4 * cols.end];
                for (o, x) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    combine(o, f32::from_le_bytes([x[0], x[1], x[2], x[3]]), w);
                }
            }
            TableDtype::Float16 => {
                let bytes = &row[2 * cols.start..2 * cols.end];
                for (o, x) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    combine(o, f16_to_f32(u16::from_le_bytes([x[0], x[1]])), w);
                }
            }
            TableDtype::Int8Rowwise => {
                let (q, tail) = row.split_at(rows.dim);
                let scale = f32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
                let bias = f32::from_le_bytes([tail[4], tail[5], tail[6], tail[7]]);
                for (o, &q) in out.iter_mut().zip(&q[cols.clone()]) {
                    combine(o, q as f32 * scale + bias, w);
                }
            }
            TableDtype::Int4Rowwise => {
                let (q, tail) = row.split_at(rows.dim.div_ceil(2));
                let scale = f32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
                let bias = f32::from_le_bytes([tail[4], tail[5], tail[6], tail[7]]);
                for (o, c) in out.iter_mut().zip(cols.clone()) {
                    let nibble = (q[c / 2] >> (4 * (c % 2))) & 0x0f;
                    combine(o, nibble as f32 * scale + bias, w);
                }
            }
        }
    }
}
