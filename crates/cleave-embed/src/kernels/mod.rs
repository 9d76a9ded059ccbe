//! Lookup kernels: one file per instruction set, all with the same two entry points
//! (`pool_bags`, `gather_rows`). The best kernel the CPU supports is detected once.
//!
//! Kernels trust their input: the ids they are given were checked against the table's row
//! range, and the offsets, weights and output sizes by `lookup::check_bags`.

use std::sync::OnceLock;

use crate::bundle::TableDtype;
use crate::error::EmbedError;
use crate::pooling::Pooling;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod scalar;

/// An implementation of the lookup kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Portable Rust, auto-vectorised by the compiler.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C, 8 floats per instruction.
    Avx2,
    /// x86-64 AVX-512 (F, BW, VL), 16 floats per instruction, masked tails.
    Avx512,
}

impl Kernel {
    /// The fastest kernel this CPU supports, detected on first use.
    pub fn best() -> Kernel {
        static BEST: OnceLock<Kernel> = OnceLock::new();
        *BEST.get_or_init(|| {
            [Kernel::Avx512, Kernel::Avx2]
                .into_iter()
                .find(|k| k.is_available())
                .unwrap_or(Kernel::Scalar)
        })
    }

    /// Every kernel this CPU supports, slowest first.
    pub fn available() -> Vec<Kernel> {
        [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512]
            .into_iter()
            .filter(|k| k.is_available())
            .collect()
    }

    pub fn is_available(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512 => "avx512",
        }
    }

    /// `Ok` if this CPU can run the kernel.
    pub fn require(self) -> Result<(), EmbedError> {
        if self.is_available() {
            Ok(())
        } else {
            Err(EmbedError::Unsupported(format!(
                "kernel {:?} needs CPU features this machine lacks; available: {:?}",
                self.name(),
                Kernel::available()
                    .iter()
                    .map(|k| k.name())
                    .collect::<Vec<_>>()
            )))
        }
    }
}

impl std::str::FromStr for Kernel {
    type Err = String;

    fn from_str(s: &str) -> Result<Kernel, String> {
        match s {
            "scalar" => Ok(Kernel::Scalar),
            "avx2" => Ok(Kernel::Avx2),
            "avx512" => Ok(Kernel::Avx512),
            other => Err(format!(
                "kernel must be scalar, avx2 or avx512, found {other:?}"
            )),
        }
    }
}

/// What a kernel needs to know about a table.
#[derive(Clone, Copy)]
pub(crate) struct RowsView<'a> {
    /// Where row 0 would be: the table's bytes (rows `row_start..`) moved back by
    /// `row_start` rows, never dereferenced itself, so that finding a row is a multiply-add.
    origin: *const u8,
    /// The table's bytes, borrowed for as long as `origin` is used.
    bytes: std::marker::PhantomData<&'a [u8]>,
    pub row_bytes: usize,
    pub dim: usize,
    pub dtype: TableDtype,
    /// Prefetch the row of the id this many positions ahead of the one being pooled.
    pub distance: usize,
    pub lines: RowLines,
}

// SAFETY: `origin` only points into the shared, read-only table bytes this view borrows.
unsafe impl Send for RowsView<'_> {}
unsafe impl Sync for RowsView<'_> {}

impl<'a> RowsView<'a> {
    /// A view of `bytes`, the rows `row_start..` of a table back to back. Any row store
    /// that can present rows contiguously (a mapping, a copy, a request's staging buffer of
    /// rows read from SSD or the row cache) runs the same kernels through one of these.
    pub fn new(
        bytes: &'a [u8],
        row_start: u64,
        row_bytes: usize,
        dim: usize,
        dtype: TableDtype,
        distance: usize,
    ) -> RowsView<'a> {
        RowsView {
            bytes: std::marker::PhantomData,
            origin: bytes
                .as_ptr()
                .wrapping_sub((row_start as usize).wrapping_mul(row_bytes)),
            row_bytes,
            dim,
            dtype,
            distance: distance.max(1),
            lines: RowLines::of(row_bytes),
        }
    }

    /// Pointer to the row of global id `id`.
    ///
    /// # Safety
    /// `id` must lie in the rows this view holds.
    #[inline(always)]
    pub unsafe fn row(&self, id: i64) -> *const u8 {
        // `origin` + id * row_bytes lands inside `bytes` for the ids we hold, which is all a
        // wrapping offset needs to be dereferenced.
        self.origin
            .wrapping_add((id as usize).wrapping_mul(self.row_bytes))
    }
}

/// Rows of a table larger than this mostly come from DRAM; of a smaller one, mostly from the
/// last-level cache (32 MiB on the machines Cleave is tuned on).
const CACHED_TABLE_BYTES: u64 = 32 << 20;
/// DRAM latency is covered by keeping about this many bytes of rows in flight.
const DRAM_PREFETCH_BYTES: usize = 12 << 10;
/// Cached rows arrive sooner; prefetching further ahead only costs cache space.
const CACHED_PREFETCH_IDS: usize = 16;

/// How many ids ahead the kernels prefetch (tuned with `cleave bench lookup`, docs/engine.md):
/// 48 for 256-byte rows and 128 for 72-byte rows in DRAM, 16 for cache-resident tables.
pub(crate) fn prefetch_distance(row_bytes: usize, table_bytes: u64) -> usize {
    if table_bytes <= CACHED_TABLE_BYTES {
        CACHED_PREFETCH_IDS
    } else {
        (DRAM_PREFETCH_BYTES / row_bytes.max(1)).clamp(4, 128)
    }
}

/// Where to prefetch a row so that every cache line it spans is asked for: at offsets
/// 0, 64, ..., and the row's last byte. Computed once per table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowLines {
    /// Number of distinct prefetches per row (at least 1).
    pub count: usize,
    /// Offset of the last one.
    pub last: usize,
}

/// Prefetch shapes, a const parameter of the SIMD kernels so that the prefetches are
/// straight-line code: a loop of prefetches cost a third of the lookup rate on 256-byte rows,
/// and a branch per row splits the kernel's loop into blocks whose accumulators the compiler
/// then copies between registers (both measured on Zen 5).
pub(crate) const PF_TWO: u8 = 0; // rows over at most 2 lines: offsets 0 and last
pub(crate) const PF_THREE: u8 = 1; // 0, 64, last (e.g. 72-byte int8 rows of dim 64)
pub(crate) const PF_FOUR: u8 = 2; // 0, 64, 128, last (e.g. 256-byte float32 rows of dim 64)
pub(crate) const PF_MANY: u8 = 3; // more: every 64 bytes, then last

impl RowLines {
    pub fn of(row_bytes: usize) -> RowLines {
        let row_bytes = row_bytes.max(1);
        let steps = row_bytes.div_ceil(64);
        let (count, last) = if row_bytes.is_multiple_of(64) {
            // Rows start on a line (the mapping is page-aligned): one prefetch per line.
            (steps, row_bytes - 64)
        } else {
            (steps + 1, row_bytes - 1)
        };
        RowLines { count, last }
    }

    pub fn shape(&self) -> u8 {
        match self.count {
            0..=2 => PF_TWO,
            3 => PF_THREE,
            4 => PF_FOUR,
            _ => PF_MANY,
        }
    }
}

/// Asks the cache hierarchy for every cache line of the row at `row`, in prefetch shape
/// `SHAPE` (which must be `lines.shape()`).
#[inline(always)]
pub(crate) fn prefetch_row_as<const SHAPE: u8>(row: *const u8, lines: RowLines) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let at = |offset: usize| {
            // SAFETY: prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(offset) as *const i8) }
        };
        at(0);
        if SHAPE == PF_THREE {
            at(64);
        } else if SHAPE == PF_FOUR {
            at(64);
            at(128);
        } else if SHAPE == PF_MANY {
            let mut offset = 64;
            while offset < lines.last {
                at(offset);
                offset += 64;
            }
        }
        at(lines.last);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (row, lines);
}

/// [`prefetch_row_as`] with the shape looked up per call (scalar kernel, limit loop).
#[inline(always)]
pub(crate) fn prefetch_row(row: *const u8, lines: RowLines) {
    match lines.shape() {
        PF_TWO => prefetch_row_as::<PF_TWO>(row, lines),
        PF_THREE => prefetch_row_as::<PF_THREE>(row, lines),
        PF_FOUR => prefetch_row_as::<PF_FOUR>(row, lines),
        _ => prefetch_row_as::<PF_MANY>(row, lines),
    }
}

/// Whether every id lies in `[start, start + len)`: one unsigned maximum over the ids (an id
/// below `start`, or negative, wraps to a huge offset), compiled for the widest vectors the
/// CPU has because it runs over every id of every lookup.
pub(crate) fn ids_in_range(ids: &[i64], start: u64, len: u64) -> bool {
    #[inline(always)]
    fn max_offset(ids: &[i64], start: u64) -> u64 {
        ids.iter()
            .fold(0, |m, &id| m.max((id as u64).wrapping_sub(start)))
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn max_offset_avx512(ids: &[i64], start: u64) -> u64 {
        max_offset(ids, start)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn max_offset_avx2(ids: &[i64], start: u64) -> u64 {
        max_offset(ids, start)
    }
    if ids.is_empty() {
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F.
            return unsafe { max_offset_avx512(ids, start) } < len;
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { max_offset_avx2(ids, start) } < len;
        }
    }
    max_offset(ids, start) < len
}

/// Pools bags into `out` with `pooling` Sum (weighted if `weights`) or Max; Mean is a Sum the
/// caller divides. `offsets` are this call's bag boundaries as positions in `ids` and
/// `weights` (which are the whole job's); `out` has `(offsets.len() - 1) * dim` floats.
/// Empty bags give zeros.
///
/// # Safety
/// Every id in `ids[offsets[0]..offsets[last]]` lies in `rows`; offsets are non-decreasing and
/// within `ids` (and `weights`); `out` has the size above; the CPU supports `kernel`.
pub(crate) unsafe fn pool_bags(
    kernel: Kernel,
    rows: &RowsView,
    ids: &[i64],
    offsets: &[u32],
    weights: Option<&[f32]>,
    pooling: Pooling,
    out: &mut [f32],
) {
    debug_assert_eq!(out.len(), (offsets.len() - 1) * rows.dim);
    // SAFETY: forwarded from the caller.
    unsafe {
        match kernel {
            Kernel::Scalar => scalar::pool_bags(rows, ids, offsets, weights, pooling, out),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => avx2::pool_bags(rows, ids, offsets, weights, pooling, out),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => avx512::pool_bags(rows, ids, offsets, weights, pooling, out),
            #[cfg(not(target_arch = "x86_64"))]
            _ => scalar::pool_bags(rows, ids, offsets, weights, pooling, out),
        }
    }
}

/// Copies (dequantising) row `ids[i]` to `out[i * dim..]`.
///
/// # Safety
/// Every id lies in `rows`; `out` has `ids.len() * dim` floats; the CPU supports `kernel`.
pub(crate) unsafe fn gather_rows(kernel: Kernel, rows: &RowsView, ids: &[i64], out: &mut [f32]) {
    debug_assert_eq!(out.len(), ids.len() * rows.dim);
    // A gather is a sum over bags of one id each: 0 + x is exactly x.
    let offsets: Vec<u32> = (0..=ids.len() as u32).collect();
    // SAFETY: forwarded from the caller; the offsets cover exactly `ids`.
    unsafe { pool_bags(kernel, rows, ids, &offsets, None, Pooling::Sum, out) }
}

/// IEEE half to single precision (exact), for kernels without a hardware conversion.
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let mant = (h & 0x3ff) as u32;
    let bits = match (exp, mant) {
        (0, 0) => sign,
        // Subnormal half: value = mant * 2^-24, exact in f32.
        (0, _) => {
            // Subnormal half: mant * 2^-24, exact in f32.
            let v = mant as f32 * f32::from_bits(0x3380_0000);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, _) => sign | 0x7fc0_0000 | (mant << 13),
        _ => sign | ((exp + 112) << 23) | (mant << 13),
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every half, against its definition (and the CPU's conversion where it has one).
    #[test]
    fn f16_to_f32_is_exact_for_every_half() {
        for h in 0..=u16::MAX {
            let got = f16_to_f32(h);
            let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
            let (exp, mant) = (((h >> 10) & 0x1f) as i32, (h & 0x3ff) as f64);
            match exp {
                0x1f if mant == 0.0 => assert_eq!(got, sign as f32 * f32::INFINITY),
                0x1f => assert!(got.is_nan(), "{h:#x}"),
                0 => assert_eq!(got as f64, sign * mant * 2f64.powi(-24), "{h:#x}"),
                _ => assert_eq!(
                    got as f64,
                    sign * (1.0 + mant / 1024.0) * 2f64.powi(exp - 15)
                ),
            }
            assert_eq!(got.is_sign_negative(), h & 0x8000 != 0, "{h:#x}");
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("f16c") && !got.is_nan() {
                // SAFETY: the CPU has F16C.
                let hw = unsafe { hardware_f16(h) };
                assert_eq!(got.to_bits(), hw.to_bits(), "{h:#x}");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "f16c")]
    unsafe fn hardware_f16(h: u16) -> f32 {
        use std::arch::x86_64::*;
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(h as i16)))
    }

    #[test]
    fn row_lines_cover_every_line_a_row_spans() {
        for row_bytes in 1..700 {
            let lines = RowLines::of(row_bytes);
            // The offsets prefetch_row_as visits for the row's shape.
            let offsets: Vec<usize> = match lines.shape() {
                PF_TWO => vec![0, lines.last],
                PF_THREE => vec![0, 64, lines.last],
                PF_FOUR => vec![0, 64, 128, lines.last],
                _ => (0..lines.last).step_by(64).chain([lines.last]).collect(),
            };
            assert!(
                offsets.windows(2).all(|w| w[0] <= w[1]),
                "{row_bytes}: {offsets:?}"
            );
            // Rows of whole lines start on a line; others may start anywhere in one.
            let starts = if row_bytes % 64 == 0 {
                vec![0]
            } else {
                (0..64).collect()
            };
            for start in starts {
                let wanted: Vec<usize> = (start / 64..=(start + row_bytes - 1) / 64).collect();
                let mut got: Vec<usize> = offsets.iter().map(|o| (start + o) / 64).collect();
                got.dedup();
                assert_eq!(got, wanted, "row_bytes {row_bytes}, start {start}");
            }
        }
    }

    #[test]
    fn prefetch_distance_stays_in_bounds() {
        assert_eq!(prefetch_distance(256, 1 << 20), 16);
        assert_eq!(prefetch_distance(256, 1 << 31), 48);
        assert_eq!(prefetch_distance(72, 1 << 31), 128);
        assert_eq!(prefetch_distance(1 << 20, 1 << 40), 4);
    }

    #[test]
    fn kernels_report_their_availability() {
        assert!(Kernel::available().contains(&Kernel::Scalar));
        assert!(Kernel::best().is_available());
        for k in [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512] {
            assert_eq!(k.require().is_ok(), k.is_available());
            assert_eq!(k.name().parse::<Kernel>(), Ok(k));
        }
    }
}
