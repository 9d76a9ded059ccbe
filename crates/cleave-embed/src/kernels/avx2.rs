//! AVX2 kernel: a bag is pooled 64 columns at a time in up to eight 8-float registers that stay
//! in registers across the bag's ids. Columns past the last multiple of 8 go through the
//! scalar kernel. Rows are prefetched `distance` ids ahead.

use std::arch::x86_64::*;

use super::{prefetch_row_as, scalar, RowsView, PF_FOUR, PF_MANY, PF_THREE, PF_TWO};
use crate::bundle::TableDtype;
use crate::pooling::Pooling;

const F32: u8 = 0;
const F16: u8 = 1;
const I8: u8 = 2;
const SUM: u8 = 0;
const WSUM: u8 = 1;
const MAX: u8 = 2;

/// See `kernels::pool_bags`.
///
/// # Safety
/// As `kernels::pool_bags`, and the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pool_bags(
    rows: &RowsView,
    ids: &[i64],
    offsets: &[u32],
    weights: Option<&[f32]>,
    pooling: Pooling,
    out: &mut [f32],
) {
    let mode = match (pooling, weights.is_some()) {
        (Pooling::Max, _) => MAX,
        (_, true) => WSUM,
        (_, false) => SUM,
    };
    // SAFETY: forwarded from the caller.
    unsafe {
        match (rows.dtype, mode) {
            (TableDtype::Float32, SUM) => {
                bags_any_shape::<F32, SUM>(rows, ids, offsets, weights, out)
            }
            (TableDtype::Float32, WSUM) => {
                bags_any_shape::<F32, WSUM>(rows, ids, offsets, weights, out)
            }
            (TableDtype::Float32, _) => {
                bags_any_shape::<F32, MAX>(rows, ids, offsets, weights, out)
            }
            (TableDtype::Float16, SUM) => {
                bags_any_shape::<F16, SUM>(rows, ids, offsets, weights, out)
            }
            (TableDtype::Float16, WSUM) => {
                bags_any_shape::<F16, WSUM>(rows, ids, offsets, weights, out)
            }
            (TableDtype::Float16, _) => {
                bags_any_shape::<F16, MAX>(rows, ids, offsets, weights, out)
            }
            (TableDtype::Int8Rowwise, SUM) => {
                bags_any_shape::<I8, SUM>(rows, ids, offsets, weights, out)
            }
            (TableDtype::Int8Rowwise, WSUM) => {
                bags_any_shape::<I8, WSUM>(rows, ids, offsets, weights, out)
            }
            (TableDtype::Int8Rowwise, _) => {
                bags_any_shape::<I8, MAX>(rows, ids, offsets, weights, out)
            }
            // Nibbles are unpacked by the portable kernel (no SIMD path yet).
            (TableDtype::Int4Rowwise, _) => {
                scalar::pool_bags(rows, ids, offsets, weights, pooling, out)
            }
        }
    }
}

/// `bags` compiled for the table's prefetch shape.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bags_any_shape<const DT: u8, const MODE: u8>(
    rows: &RowsView,
    ids: &[i64],
    offsets: &[u32],
    weights: Option<&[f32]>,
    out: &mut [f32],
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match rows.lines.shape() {
            PF_TWO => bags::<DT, MODE, PF_TWO>(rows, ids, offsets, weights, out),
            PF_THREE => bags::<DT, MODE, PF_THREE>(rows, ids, offsets, weights, out),
            PF_FOUR => bags::<DT, MODE, PF_FOUR>(rows, ids, offsets, weights, out),
            _ => bags::<DT, MODE, PF_MANY>(rows, ids, offsets, weights, out),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bags<const DT: u8, const MODE: u8, const PF: u8>(
    rows: &RowsView,
    ids: &[i64],
    offsets: &[u32],
    weights: Option<&[f32]>,
    out: &mut [f32],
) {
    let dim = rows.dim;
    let full = dim / 8 * 8;
    let pooling = if MODE == MAX {
        Pooling::Max
    } else {
        Pooling::Sum
    };
    let w = weights.map_or(std::ptr::null(), <[f32]>::as_ptr);
    let first = offsets[0] as usize;
    let last = offsets[offsets.len() - 1] as usize;
    // SAFETY (whole body): ids[first..last] are checked ids of `rows`, `out` holds
    // (offsets.len() - 1) * dim floats, weights (if any) cover ids.
    unsafe {
        for p in first..last.min(first + rows.distance) {
            prefetch_row_as::<PF>(rows.row(*ids.get_unchecked(p)), rows.lines);
        }
        for (b, out_row) in out.chunks_exact_mut(dim).enumerate() {
            let (s, e) = (
                *offsets.get_unchecked(b) as usize,
                *offsets.get_unchecked(b + 1) as usize,
            );
            if s == e {
                out_row.fill(0.0);
                continue;
            }
            let o = out_row.as_mut_ptr();
            let mut c0 = 0;
            while c0 < full {
                let pf = if c0 == 0 { last } else { 0 };
                match (full - c0).min(64) / 8 {
                    1 => block::<DT, MODE, 1, PF>(rows, ids, w, s..e, c0, o, pf),
                    2 => block::<DT, MODE, 2, PF>(rows, ids, w, s..e, c0, o, pf),
                    3 => block::<DT, MODE, 3, PF>(rows, ids, w, s..e, c0, o, pf),
                    4 => block::<DT, MODE, 4, PF>(rows, ids, w, s..e, c0, o, pf),
                    5 => block::<DT, MODE, 5, PF>(rows, ids, w, s..e, c0, o, pf),
                    6 => block::<DT, MODE, 6, PF>(rows, ids, w, s..e, c0, o, pf),
                    7 => block::<DT, MODE, 7, PF>(rows, ids, w, s..e, c0, o, pf),
                    _ => block::<DT, MODE, 8, PF>(rows, ids, w, s..e, c0, o, pf),
                }
                c0 += 64;
            }
            if full < dim {
                // Without a SIMD block (dim < 8) this is the only pass: let it prefetch.
                let pf = if full == 0 { last } else { 0 };
                let tail = &mut out_row[full..];
                scalar::pool_columns(rows, ids, weights, s..e, pooling, full..dim, tail, pf);
            }
        }
    }
}

/// Pools columns `c0..c0 + 8 * NV` of the non-empty bag `ids[bag]` into `out[c0..]`, two ids
/// at a time into two sets of accumulators (as the AVX-512 kernel).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block<const DT: u8, const MODE: u8, const NV: usize, const PF: u8>(
    rows: &RowsView,
    ids: &[i64],
    weights: *const f32,
    bag: std::ops::Range<usize>,
    c0: usize,
    out: *mut f32,
    prefetch_end: usize,
) {
    let init = if MODE == MAX {
        _mm256_set1_ps(f32::NEG_INFINITY)
    } else {
        _mm256_setzero_ps()
    };
    let (mut a, mut b) = ([init; NV], [init; NV]);
    let mut bias_sum = 0.0f32;
    let distance = rows.distance;
    let split = bag
        .end
        .min(prefetch_end.saturating_sub(distance))
        .max(bag.start);
    // SAFETY (whole body): see `bags`; every load reads columns below `dim / 8 * 8`.
    unsafe {
        let prefetch = |p: usize| {
            prefetch_row_as::<PF>(rows.row(*ids.get_unchecked(p + distance)), rows.lines)
        };
        let mut p = bag.start;
        while p + 2 <= split {
            prefetch(p);
            prefetch(p + 1);
            bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p, c0, &mut a);
            bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p + 1, c0, &mut b);
            p += 2;
        }
        if p < split {
            // Even positions of the bag go to `a`, odd ones to `b`, wherever the prefetching
            // stops: the sum's order, and so its bits, never depend on how bags are chunked.
            prefetch(p);
            bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p, c0, &mut a);
            p += 1;
            if p < bag.end {
                bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p, c0, &mut b);
                p += 1;
            }
        }
        while p + 2 <= bag.end {
            bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p, c0, &mut a);
            bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p + 1, c0, &mut b);
            p += 2;
        }
        if p < bag.end {
            bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p, c0, &mut a);
        }
        for v in 0..NV {
            let r = if MODE == MAX {
                _mm256_max_ps(a[v], b[v])
            } else if DT == I8 {
                _mm256_add_ps(_mm256_add_ps(a[v], b[v]), _mm256_set1_ps(bias_sum))
            } else {
                _mm256_add_ps(a[v], b[v])
            };
            _mm256_storeu_ps(out.add(c0 + 8 * v), r);
        }
    }
}

/// Adds (or maxes) columns `c0..c0 + 8 * NV` of the row of `ids[p]` into `acc`; returns what
/// the row adds to the bias sum (int8 sums only, else 0).
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn pool_row<const DT: u8, const MODE: u8, const NV: usize>(
    rows: &RowsView,
    ids: &[i64],
    weights: *const f32,
    p: usize,
    c0: usize,
    acc: &mut [__m256; NV],
) -> f32 {
    // SAFETY (whole body): see `bags`.
    unsafe {
        let row = rows.row(*ids.get_unchecked(p));
        let w = if MODE == WSUM { *weights.add(p) } else { 1.0 };
        let (scale, bias) = if DT == I8 {
            let tail = row.add(rows.dim) as *const f32;
            (tail.read_unaligned(), tail.add(1).read_unaligned())
        } else {
            (1.0, 0.0)
        };
        for v in 0..NV {
            let col = c0 + 8 * v;
            let x = match DT {
                F32 => _mm256_loadu_ps(row.add(4 * col) as *const f32),
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * col) as *const __m128i)),
                _ => _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                    row.add(col) as *const __m128i
                ))),
            };
            acc[v] = match MODE {
                MAX if DT == I8 => _mm256_max_ps(
                    acc[v],
                    _mm256_add_ps(
                        _mm256_mul_ps(x, _mm256_set1_ps(scale)),
                        _mm256_set1_ps(bias),
                    ),
                ),
                MAX => _mm256_max_ps(acc[v], x),
                _ if DT == I8 => _mm256_fmadd_ps(x, _mm256_set1_ps(scale * w), acc[v]),
                WSUM => _mm256_fmadd_ps(x, _mm256_set1_ps(w), acc[v]),
                _ => _mm256_add_ps(acc[v], x),
            };
        }
        if DT == I8 && MODE != MAX {
            w * bias
        } else {
            0.0
        }
    }
}
