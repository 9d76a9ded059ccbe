//! AVX-512 kernel: a bag is pooled 64 columns at a time in up to four 16-float registers that
//! stay in registers across the bag's ids; the last register of a block uses a masked load and
//! store, so any dim works without a scalar tail. Rows are prefetched `distance` ids ahead.

use std::arch::x86_64::*;

use super::{prefetch_row_as, RowsView, PF_FOUR, PF_MANY, PF_THREE, PF_TWO};
use crate::bundle::TableDtype;
use crate::pooling::Pooling;

// Const-generic switches, so that each (dtype, mode, prefetch shape) compiles to its own loop.
const F32: u8 = 0;
const F16: u8 = 1;
const I8: u8 = 2;
const SUM: u8 = 0;
const WSUM: u8 = 1;
const MAX: u8 = 2;

/// See `kernels::pool_bags`.
///
/// # Safety
/// As `kernels::pool_bags`, and the CPU has AVX-512 F, BW and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn pool_bags(
    rows: &RowsView,
    ids: &[i64],
    offsets: &[u32],
    weights: Option<&[f32]>,
    pooling: Pooling,
    out: &mut [f32],
) {
    let w = weights.map_or(std::ptr::null(), <[f32]>::as_ptr);
    let mode = match (pooling, weights.is_some()) {
        (Pooling::Max, _) => MAX,
        (_, true) => WSUM,
        (_, false) => SUM,
    };
    // SAFETY: forwarded from the caller.
    unsafe {
        match (rows.dtype, mode) {
            (TableDtype::Float32, SUM) => bags_any_shape::<F32, SUM>(rows, ids, offsets, w, out),
            (TableDtype::Float32, WSUM) => bags_any_shape::<F32, WSUM>(rows, ids, offsets, w, out),
            (TableDtype::Float32, _) => bags_any_shape::<F32, MAX>(rows, ids, offsets, w, out),
            (TableDtype::Float16, SUM) => bags_any_shape::<F16, SUM>(rows, ids, offsets, w, out),
            (TableDtype::Float16, WSUM) => bags_any_shape::<F16, WSUM>(rows, ids, offsets, w, out),
            (TableDtype::Float16, _) => bags_any_shape::<F16, MAX>(rows, ids, offsets, w, out),
            (TableDtype::Int8Rowwise, SUM) => bags_any_shape::<I8, SUM>(rows, ids, offsets, w, out),
            (TableDtype::Int8Rowwise, WSUM) => {
                bags_any_shape::<I8, WSUM>(rows, ids, offsets, w, out)
            }
            (TableDtype::Int8Rowwise, _) => bags_any_shape::<I8, MAX>(rows, ids, offsets, w, out),
            // Nibbles are unpacked by the portable kernel (no SIMD path yet).
            (TableDtype::Int4Rowwise, _) => {
                super::scalar::pool_bags(rows, ids, offsets, weights, pooling, out)
            }
        }
    }
}

/// `bags` compiled for the table's prefetch shape.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn bags_any_shape<const DT: u8, const MODE: u8>(
    rows: &RowsView,
    ids: &[i64],
    offsets: &[u32],
    weights: *const f32,
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

#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn bags<const DT: u8, const MODE: u8, const PF: u8>(
    rows: &RowsView,
    ids: &[i64],
    offsets: &[u32],
    weights: *const f32,
    out: &mut [f32],
) {
    let dim = rows.dim;
    let first = offsets[0] as usize;
    let last = offsets[offsets.len() - 1] as usize;
    // SAFETY (whole body): ids[first..last] are checked ids of `rows`, `out` holds
    // (offsets.len() - 1) * dim floats, weights (if any) cover ids.
    unsafe {
        // The loop below prefetches `distance` ids ahead; start the first ones now.
        for p in first..last.min(first + rows.distance) {
            prefetch_row_as::<PF>(rows.row(*ids.get_unchecked(p)), rows.lines);
        }
        let out = out.as_mut_ptr();
        for b in 0..offsets.len() - 1 {
            let (s, e) = (
                *offsets.get_unchecked(b) as usize,
                *offsets.get_unchecked(b + 1) as usize,
            );
            let o = out.add(b * dim);
            if s == e {
                std::ptr::write_bytes(o, 0, dim);
                continue;
            }
            let mut c0 = 0;
            while c0 < dim {
                let width = (dim - c0).min(64);
                // Later blocks of a wide row find it in cache: the first block prefetched it.
                let pf = if c0 == 0 { last } else { 0 };
                match width.div_ceil(16) {
                    1 => block::<DT, MODE, 1, PF>(rows, ids, weights, s..e, c0, width, o, pf),
                    2 => block::<DT, MODE, 2, PF>(rows, ids, weights, s..e, c0, width, o, pf),
                    3 => block::<DT, MODE, 3, PF>(rows, ids, weights, s..e, c0, width, o, pf),
                    _ => block::<DT, MODE, 4, PF>(rows, ids, weights, s..e, c0, width, o, pf),
                }
                c0 += 64;
            }
        }
    }
}

/// Pools columns `c0..c0 + width` (width in (16 * (NV - 1), 16 * NV]) of the non-empty bag
/// `ids[bag]` into `out[c0..]`.
///
/// Two ids at a time into two sets of accumulators, merged at the end: half the loop overhead
/// and two independent chains of adds for the out-of-order core.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn block<const DT: u8, const MODE: u8, const NV: usize, const PF: u8>(
    rows: &RowsView,
    ids: &[i64],
    weights: *const f32,
    bag: std::ops::Range<usize>,
    c0: usize,
    width: usize,
    out: *mut f32,
    prefetch_end: usize,
) {
    let tail = width - 16 * (NV - 1);
    let tail_mask: __mmask16 = if tail >= 16 {
        0xffff
    } else {
        (1u16 << tail) - 1
    };
    let init = if MODE == MAX {
        _mm512_set1_ps(f32::NEG_INFINITY)
    } else {
        _mm512_setzero_ps()
    };
    let (mut a, mut b) = ([init; NV], [init; NV]);
    let mut bias_sum = 0.0f32;
    let distance = rows.distance;
    // Ids whose row `distance` ahead is still to come prefetch it; the rest do not, so no
    // loop tests per id.
    let split = bag
        .end
        .min(prefetch_end.saturating_sub(distance))
        .max(bag.start);
    // SAFETY (whole body): see `bags`; masked loads never touch the masked-out bytes.
    unsafe {
        let prefetch = |p: usize| {
            prefetch_row_as::<PF>(rows.row(*ids.get_unchecked(p + distance)), rows.lines)
        };
        let mut p = bag.start;
        while p + 2 <= split {
            prefetch(p);
            prefetch(p + 1);
            bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p, c0, tail_mask, &mut a);
            bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p + 1, c0, tail_mask, &mut b);
            p += 2;
        }
        if p < split {
            // Even positions of the bag go to `a`, odd ones to `b`, wherever the prefetching
            // stops: the sum's order, and so its bits, never depend on how bags are chunked.
            prefetch(p);
            bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p, c0, tail_mask, &mut a);
            p += 1;
            if p < bag.end {
                bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p, c0, tail_mask, &mut b);
                p += 1;
            }
        }
        while p + 2 <= bag.end {
            bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p, c0, tail_mask, &mut a);
            bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p + 1, c0, tail_mask, &mut b);
            p += 2;
        }
        if p < bag.end {
            bias_sum += pool_row::<DT, MODE, NV>(rows, ids, weights, p, c0, tail_mask, &mut a);
        }
        for v in 0..NV {
            let m = if v + 1 == NV { tail_mask } else { 0xffff };
            let r = if MODE == MAX {
                _mm512_max_ps(a[v], b[v])
            } else if DT == I8 {
                _mm512_add_ps(_mm512_add_ps(a[v], b[v]), _mm512_set1_ps(bias_sum))
            } else {
                _mm512_add_ps(a[v], b[v])
            };
            _mm512_mask_storeu_ps(out.add(c0 + 16 * v), m, r);
        }
    }
}

/// Adds (or maxes) columns `c0..` of the row of `ids[p]` into `acc`; returns what the row adds
/// to the bias sum (int8 sums only, else 0).
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn pool_row<const DT: u8, const MODE: u8, const NV: usize>(
    rows: &RowsView,
    ids: &[i64],
    weights: *const f32,
    p: usize,
    c0: usize,
    tail_mask: __mmask16,
    acc: &mut [__m512; NV],
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
            let m = if v + 1 == NV { tail_mask } else { 0xffff };
            let col = c0 + 16 * v;
            let x = match DT {
                F32 => _mm512_maskz_loadu_ps(m, row.add(4 * col) as *const f32),
                F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, row.add(2 * col) as _)),
                _ => _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(
                    m,
                    row.add(col) as *const i8,
                ))),
            };
            acc[v] = match MODE {
                // q * scale + bias unfused, as docs/bundle.md defines the value.
                MAX if DT == I8 => _mm512_max_ps(
                    acc[v],
                    _mm512_add_ps(
                        _mm512_mul_ps(x, _mm512_set1_ps(scale)),
                        _mm512_set1_ps(bias),
                    ),
                ),
                MAX => _mm512_max_ps(acc[v], x),
                // For int8, sum(w * (q * scale + bias)) = sum(q * (scale * w)) + sum(w * bias):
                // one FMA per value, the biases summed once per row.
                _ if DT == I8 => _mm512_fmadd_ps(x, _mm512_set1_ps(scale * w), acc[v]),
                WSUM => _mm512_fmadd_ps(x, _mm512_set1_ps(w), acc[v]),
                _ => _mm512_add_ps(acc[v], x),
            };
        }
        if DT == I8 && MODE != MAX {
            w * bias
        } else {
            0.0
        }
    }
}
