//! Rows on SSD: a table file opened with O_DIRECT, each missed row read as the smallest
//! block-aligned span that covers it, behind the tier's row cache.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::RowStore;
use crate::bundle::TableMeta;
use crate::error::EmbedError;
use crate::tier::io::{probe_block, AlignedBuf, Span};
use crate::tier::Tier;

pub struct SsdStore {
    tier: Arc<Tier>,
    /// This table's number in the tier (the first half of its row-cache keys).
    table: u32,
    /// Its row cache (by row size).
    class: usize,
    file: File,
    path: PathBuf,
    row_bytes: usize,
    /// The O_DIRECT read unit: 512 where the device allows, else 4096.
    block: usize,
}

impl SsdStore {
    /// Opens `path` (already checked to be `rows * row_bytes` long) for direct reads of rows
    /// `rows` of `meta`'s table and registers it with the tier's row cache.
    pub fn open(
        tier: &Arc<Tier>,
        path: &Path,
        meta: &TableMeta,
        rows: Range<u64>,
    ) -> Result<SsdStore, EmbedError> {
        let no_direct = |e: std::io::Error| EmbedError::NoDirectIo {
            path: path.to_path_buf(),
            source: e,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::EINVAL) => no_direct(e),
                _ => EmbedError::io(path, e),
            })?;
        let block = if meta.rows == 0 {
            4096
        } else {
            probe_block(&file).map_err(no_direct)?
        };
        let table_bytes = (rows.end - rows.start) * meta.row_bytes as u64;
        let class = tier.rows.register(meta.row_bytes, table_bytes);
        tracing::info!(
            table = %meta.name,
            path = %path.display(),
            block,
            io = tier.io_backend(),
            "table on the SSD tier"
        );
        Ok(SsdStore {
            table: tier.table_number(),
            tier: tier.clone(),
            class,
            file,
            path: path.to_path_buf(),
            row_bytes: meta.row_bytes,
            block,
        })
    }

    /// The block-aligned span covering global row `id`, and where the row starts in it.
    fn span(&self, id: u64) -> (Span, usize) {
        let b = self.block as u64;
        let start = id * self.row_bytes as u64;
        let end = start + self.row_bytes as u64;
        let offset = start / b * b;
        let len = (end.div_ceil(b) * b - offset) as usize;
        let skip = (start - offset) as usize;
        (
            Span {
                offset,
                len,
                need: skip + self.row_bytes,
            },
            skip,
        )
    }

    /// The largest span a row can need.
    fn slot_bytes(&self) -> usize {
        self.row_bytes.div_ceil(self.block) * self.block + self.block
    }
}

impl RowStore for SsdStore {
    fn kind(&self) -> &'static str {
        "ssd"
    }

    fn contiguous(&self) -> Option<&[u8]> {
        None
    }

    fn tier(&self) -> Option<&Tier> {
        Some(&self.tier)
    }

    fn version_key(&self) -> u64 {
        self.table as u64
    }

    fn would_read(&self, ids: &[i64]) -> bool {
        let cache = self.tier.rows.class(self.class);
        let cache = cache.lock().unwrap_or_else(|e| e.into_inner());
        ids.iter()
            .any(|&id| !cache.contains((self.table, id as u64)))
    }

    fn read_rows(&self, ids: &[u64], out: &mut [u8]) -> Result<(), EmbedError> {
        let rb = self.row_bytes;
        let counters = &self.tier.counters;
        let cache = self.tier.rows.class(self.class);
        let mut misses: Vec<usize> = Vec::new();
        {
            let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
            for (i, (&id, dst)) in ids.iter().zip(out.chunks_exact_mut(rb)).enumerate() {
                if !cache.get((self.table, id), dst) {
                    misses.push(i);
                }
            }
        }
        counters.rows.fetch_add(ids.len() as u64, Ordering::Relaxed);
        counters
            .row_hits
            .fetch_add((ids.len() - misses.len()) as u64, Ordering::Relaxed);
        if misses.is_empty() {
            return Ok(());
        }
        // Every miss of the call goes to the device in one submission.
        let slot = self.slot_bytes();
        let mut buf = AlignedBuf::new(misses.len() * slot);
        let spans: Vec<(Span, usize)> = misses.iter().map(|&i| self.span(ids[i])).collect();
        let just_spans: Vec<Span> = spans.iter().map(|s| s.0).collect();
        self.tier
            .io
            .read(&self.file, &just_spans, &mut buf, slot)
            .map_err(|e| EmbedError::io(&self.path, e))?;
        let device_bytes: usize = just_spans.iter().map(|s| s.len).sum();
        counters
            .device_reads
            .fetch_add(misses.len() as u64, Ordering::Relaxed);
        counters
            .device_bytes
            .fetch_add(device_bytes as u64, Ordering::Relaxed);
        counters
            .row_bytes_read
            .fetch_add((misses.len() * rb) as u64, Ordering::Relaxed);
        let data = buf.as_slice();
        let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
        for (k, &i) in misses.iter().enumerate() {
            let at = k * slot + spans[k].1;
            let row = &data[at..at + rb];
            out[i * rb..(i + 1) * rb].copy_from_slice(row);
            cache.insert((self.table, ids[i]), row);
        }
        Ok(())
    }
}
