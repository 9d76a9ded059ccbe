//! Row stores: where a table's rows live. The lookup path asks a store for its rows back to
//! back ([`RowStore::contiguous`]: mapped and resident tables) and otherwise for copies of the
//! distinct rows of a call ([`RowStore::read_rows`]: the SSD tier); either way the same SIMD
//! kernels pool them.

mod ssd;

use memmap2::Mmap;

use crate::error::EmbedError;
pub use ssd::SsdStore;

/// A table's rows.
pub trait RowStore: Send + Sync {
    /// "mapped", "resident" or "ssd".
    fn kind(&self) -> &'static str;
    /// The rows back to back, if the store holds them in memory.
    fn contiguous(&self) -> Option<&[u8]>;
    /// Copies rows `ids` (global, held by the table; distinct) to `out`, row `i` at
    /// `i * row_bytes`.
    fn read_rows(&self, ids: &[u64], out: &mut [u8]) -> Result<(), EmbedError>;
    /// Whether reading `ids` (global, unchecked) would go to the device: false for rows in
    /// memory; for the SSD tier, whether any of them misses the row cache now.
    fn would_read(&self, _ids: &[i64]) -> bool {
        false
    }
    /// The tier whose caches this store reads through, if any.
    fn tier(&self) -> Option<&crate::tier::Tier> {
        None
    }
    /// The cache key prefix of this table's pooled results (changes with the table's version).
    fn version_key(&self) -> u64 {
        0
    }
}

/// Rows in memory: a file mapping or an anonymous copy.
pub struct MemoryStore {
    kind: &'static str,
    data: Mmap,
    row_start: u64,
    row_bytes: usize,
}

impl MemoryStore {
    pub fn new(kind: &'static str, data: Mmap, row_start: u64, row_bytes: usize) -> MemoryStore {
        MemoryStore {
            kind,
            data,
            row_start,
            row_bytes,
        }
    }
}

impl RowStore for MemoryStore {
    fn kind(&self) -> &'static str {
        self.kind
    }

    fn contiguous(&self) -> Option<&[u8]> {
        Some(&self.data)
    }

    fn read_rows(&self, ids: &[u64], out: &mut [u8]) -> Result<(), EmbedError> {
        let rb = self.row_bytes;
        for (id, dst) in ids.iter().zip(out.chunks_exact_mut(rb)) {
            let at = (id - self.row_start) as usize * rb;
            dst.copy_from_slice(&self.data[at..at + rb]);
        }
        Ok(())
    }
}
