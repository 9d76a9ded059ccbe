//! The memory limit of a lookup, for benchmarks: the least work that still reads every byte
//! of every looked-up row, with software prefetch. A pooled lookup cannot beat it on the same
//! table and ids, so `cleave bench lookup` reports the engine's rate as a fraction of it.

use crate::error::EmbedError;
use crate::kernels::{prefetch_row, prefetch_row_as, RowsView, PF_FOUR, PF_MANY, PF_THREE, PF_TWO};
use crate::lookup::check_ids;
use crate::table::Table;

/// Reads the rows of `ids` (xor-folding each row's bytes into one word, so the reads cannot be
/// optimised away), prefetching the row `distance` ids ahead (the engine's distance if None),
/// split evenly over `threads` threads. Returns the folded word.
pub fn gather_sum_prefetch(
    table: &Table,
    ids: &[i64],
    threads: usize,
    distance: Option<usize>,
) -> Result<u64, EmbedError> {
    check_ids(table, ids, 0)?;
    let mut rows = table.view().ok_or_else(|| {
        EmbedError::Unsupported(format!(
            "table {:?} is on the SSD tier; the memory-limit loop needs rows in memory",
            table.name()
        ))
    })?;
    rows.distance = distance.unwrap_or(rows.distance).max(1);
    let threads = threads.clamp(1, ids.len().max(1));
    let per_thread = ids.len().div_ceil(threads).max(1);
    let rows = &rows;
    let folded = std::thread::scope(|scope| {
        let handles: Vec<_> = ids
            .chunks(per_thread)
            .skip(1)
            .map(|part| scope.spawn(move || fold_rows(rows, part)))
            .collect();
        let mine = ids
            .chunks(per_thread)
            .next()
            .map_or(0, |part| fold_rows(rows, part));
        handles
            .into_iter()
            .fold(mine, |acc, h| acc ^ h.join().unwrap_or(0))
    });
    Ok(folded)
}

fn fold_rows(rows: &RowsView, ids: &[i64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: ids were checked by the caller; the CPU has AVX-512 F.
        return unsafe {
            match rows.row_bytes / 64 {
                0 => fold_rows_shaped::<0>(rows, ids),
                1 => fold_rows_shaped::<1>(rows, ids),
                2 => fold_rows_shaped::<2>(rows, ids),
                3 => fold_rows_shaped::<3>(rows, ids),
                4 => fold_rows_shaped::<4>(rows, ids),
                _ => fold_rows_portable(rows, ids),
            }
        };
    }
    // SAFETY: ids were checked by the caller.
    unsafe { fold_rows_portable(rows, ids) }
}

/// `fold_rows_avx512` with the table's prefetch shape as a constant, as in the kernels.
///
/// # Safety
/// As `fold_rows_avx512`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fold_rows_shaped<const FULL: usize>(rows: &RowsView, ids: &[i64]) -> u64 {
    // SAFETY: forwarded.
    unsafe {
        match rows.lines.shape() {
            PF_TWO => fold_rows_avx512::<FULL, PF_TWO>(rows, ids),
            PF_THREE => fold_rows_avx512::<FULL, PF_THREE>(rows, ids),
            PF_FOUR => fold_rows_avx512::<FULL, PF_FOUR>(rows, ids),
            _ => fold_rows_avx512::<FULL, PF_MANY>(rows, ids),
        }
    }
}

/// Rows of `FULL` whole 64-byte chunks and a tail of under 64 bytes: one unmasked 64-byte load
/// per chunk into registers, the tail read as 8-byte words (a masked load reaching past the
/// row into an untouched page can be slow).
///
/// # Safety
/// Every id lies in `rows`; `rows.row_bytes / 64 == FULL`; the CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fold_rows_avx512<const FULL: usize, const PF: u8>(rows: &RowsView, ids: &[i64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_si512(); FULL];
    let mut tail_acc = 0u64;
    let (n, distance, row_bytes) = (ids.len(), rows.distance, rows.row_bytes);
    // SAFETY (whole body): ids are checked; loads stay inside each row.
    unsafe {
        for &id in ids.iter().take(distance) {
            prefetch_row_as::<PF>(rows.row(id), rows.lines);
        }
        let mut fold = |p: usize| {
            let row = rows.row(*ids.get_unchecked(p));
            for (c, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_xor_si512(*acc, _mm512_loadu_si512(row.add(64 * c) as _));
            }
            let mut at = 64 * FULL;
            while at + 8 <= row_bytes {
                tail_acc ^= (row.add(at) as *const u64).read_unaligned();
                at += 8;
            }
            for (i, at) in (at..row_bytes).enumerate() {
                tail_acc ^= (*row.add(at) as u64) << (8 * i);
            }
        };
        // As in the kernels: ids with a row `distance` ahead prefetch it, the rest do not, and
        // two ids per iteration.
        let split = n.saturating_sub(distance);
        let mut p = 0;
        while p + 2 <= split {
            prefetch_row_as::<PF>(rows.row(*ids.get_unchecked(p + distance)), rows.lines);
            prefetch_row_as::<PF>(rows.row(*ids.get_unchecked(p + 1 + distance)), rows.lines);
            fold(p);
            fold(p + 1);
            p += 2;
        }
        for p in p..n {
            if p < split {
                prefetch_row_as::<PF>(rows.row(*ids.get_unchecked(p + distance)), rows.lines);
            }
            fold(p);
        }
        let all = acc
            .iter()
            .fold(_mm512_setzero_si512(), |x, &a| _mm512_xor_si512(x, a));
        let mut words = [0u64; 8];
        _mm512_storeu_si512(words.as_mut_ptr() as *mut _, all);
        words.iter().fold(tail_acc, |x, &w| x ^ w)
    }
}

/// # Safety
/// Every id lies in `rows`.
unsafe fn fold_rows_portable(rows: &RowsView, ids: &[i64]) -> u64 {
    let mut acc = [0u64; 4];
    for &id in ids.iter().take(rows.distance) {
        // SAFETY: checked ids.
        prefetch_row(unsafe { rows.row(id) }, rows.lines);
    }
    for (p, &id) in ids.iter().enumerate() {
        if let Some(&ahead) = ids.get(p + rows.distance) {
            // SAFETY: checked ids.
            prefetch_row(unsafe { rows.row(ahead) }, rows.lines);
        }
        // SAFETY: checked ids.
        let row = unsafe { std::slice::from_raw_parts(rows.row(id), rows.row_bytes) };
        let mut words = row.chunks_exact(32);
        for block in &mut words {
            for (a, w) in acc.iter_mut().zip(block.chunks_exact(8)) {
                *a ^= u64::from_le_bytes(w.try_into().unwrap_or_default());
            }
        }
        for (i, &b) in words.remainder().iter().enumerate() {
            acc[0] ^= (b as u64) << (8 * (i % 8));
        }
    }
    acc.iter().fold(0, |x, &a| x ^ a)
}
