//! Embedding tables: one table file of a bundle, or a row range of it, and the set of tables a
//! shard holds. A table is its metadata plus a row store ([`crate::store`]): memory-mapped,
//! copied into huge-page-backed memory, or on SSD behind the DRAM caches of a [`Tier`].

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::{Advice, Mmap, MmapMut, MmapOptions};

use crate::bundle::{Manifest, TableDtype, TableMeta};
use crate::error::EmbedError;
use crate::kernels::RowsView;
use crate::store::{MemoryStore, RowStore, SsdStore};
use crate::tier::Tier;

/// Where a table's rows live once opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Residency {
    /// Map the file (page cache); opening is instant, pages fault in on first use.
    #[default]
    Mapped,
    /// Copy the rows into anonymous memory advised for transparent huge pages: opening reads
    /// the rows once, and random lookups then miss the TLB far less than on 4 KiB file pages.
    Resident,
}

/// How tables are opened.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Compute each table file's CRC-32 and compare with the manifest (reads every byte).
    pub verify_checksums: bool,
    pub residency: Residency,
    /// Prefetch rows this many ids ahead of the one being pooled (default: 12 KiB of rows
    /// ahead, or 16 ids for tables that fit in the cache; see docs/engine.md). A tuning knob
    /// for unusual memory systems.
    pub prefetch_distance: Option<usize>,
    /// Serve the rows from SSD behind this tier's DRAM caches (overrides `residency`).
    pub tier: Option<Arc<Tier>>,
}

/// One table, restricted to a range of its global row ids.
pub struct Table {
    meta: TableMeta,
    path: PathBuf,
    rows: Range<u64>,
    /// Where the rows `rows` live.
    store: Box<dyn RowStore>,
    prefetch_distance: usize,
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table")
            .field("name", &self.meta.name)
            .field("path", &self.path)
            .field("rows", &self.rows)
            .field("dim", &self.meta.dim)
            .field("dtype", &self.meta.dtype)
            .field("store", &self.store.kind())
            .finish()
    }
}

impl Table {
    /// Opens the rows `rows` (global ids, clipped to the table's size) of `meta`'s file,
    /// memory-mapped. The file must be exactly `rows * row_bytes` bytes.
    pub fn open(
        bundle_dir: &Path,
        meta: &TableMeta,
        rows: Range<u64>,
    ) -> Result<Table, EmbedError> {
        Table::open_with(bundle_dir, meta, rows, &OpenOptions::default())
    }

    /// [`Table::open`] with options (checksum verification, residency).
    pub fn open_with(
        bundle_dir: &Path,
        meta: &TableMeta,
        rows: Range<u64>,
        options: &OpenOptions,
    ) -> Result<Table, EmbedError> {
        let path = bundle_dir.join(&meta.file);
        let file = File::open(&path).map_err(|e| EmbedError::io(&path, e))?;
        let found = file.metadata().map_err(|e| EmbedError::io(&path, e))?.len();
        let expected = meta.rows * meta.row_bytes as u64;
        if found != expected {
            return Err(EmbedError::SizeMismatch {
                path,
                expected,
                found,
            });
        }
        if options.verify_checksums {
            let crc = file_crc32(&file).map_err(|e| EmbedError::io(&path, e))?;
            if crc != meta.crc32 {
                return Err(EmbedError::Checksum {
                    path,
                    expected: meta.crc32,
                    found: crc,
                });
            }
        }
        let start = rows.start.min(meta.rows);
        let rows = start..rows.end.clamp(start, meta.rows);
        let offset = rows.start * meta.row_bytes as u64;
        let len = usize::try_from((rows.end - rows.start) * meta.row_bytes as u64)
            .map_err(|_| EmbedError::io(&path, std::io::Error::other("row range too large")))?;
        let store: Box<dyn RowStore> = match (&options.tier, options.residency) {
            (Some(tier), _) if tier.on_ssd(&meta.name) => {
                Box::new(SsdStore::open(tier, &path, meta, rows.clone())?)
            }
            (_, Residency::Mapped) => {
                // SAFETY: bundles are immutable once written (docs/bundle.md: written to a
                // temporary directory and renamed), so the mapped bytes do not change under us.
                let map = unsafe { MmapOptions::new().offset(offset).len(len).map(&file) }
                    .map_err(|e| EmbedError::io(&path, e))?;
                // Lookups are random: read-ahead would only evict useful pages.
                let _ = map.advise(Advice::Random);
                Box::new(MemoryStore::new("mapped", map, rows.start, meta.row_bytes))
            }
            (_, Residency::Resident) => {
                let data =
                    read_resident(&file, offset, len).map_err(|e| EmbedError::io(&path, e))?;
                Box::new(MemoryStore::new(
                    "resident",
                    data,
                    rows.start,
                    meta.row_bytes,
                ))
            }
        };
        let prefetch_distance = options
            .prefetch_distance
            .unwrap_or_else(|| crate::kernels::prefetch_distance(meta.row_bytes, len as u64))
            .max(1);
        Ok(Table {
            meta: meta.clone(),
            path,
            rows,
            store,
            prefetch_distance,
        })
    }

    pub fn name(&self) -> &str {
        &self.meta.name
    }

    pub fn dim(&self) -> usize {
        self.meta.dim
    }

    pub fn dtype(&self) -> TableDtype {
        self.meta.dtype
    }

    /// Bytes of one stored row.
    pub fn row_bytes(&self) -> usize {
        self.meta.row_bytes
    }

    /// The global row ids this table holds.
    pub fn row_range(&self) -> Range<u64> {
        self.rows.clone()
    }

    /// How many ids ahead of use the kernels prefetch rows.
    pub fn prefetch_distance(&self) -> usize {
        self.prefetch_distance
    }

    /// The manifest entry of the whole table.
    pub fn meta(&self) -> &TableMeta {
        &self.meta
    }

    /// The table file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored bytes of the rows in [`Table::row_range`], back to back, if the table's
    /// store holds them in memory (None for a table on SSD).
    pub fn bytes(&self) -> Option<&[u8]> {
        self.store.contiguous()
    }

    /// The stored bytes of global row `id`, if this table holds it in memory.
    pub fn row(&self, id: u64) -> Option<&[u8]> {
        if !self.rows.contains(&id) {
            return None;
        }
        let start = (id - self.rows.start) as usize * self.meta.row_bytes;
        Some(&self.bytes()?[start..start + self.meta.row_bytes])
    }

    /// Where the rows live: "mapped", "resident" or "ssd".
    pub fn store_kind(&self) -> &'static str {
        self.store.kind()
    }

    /// The row store (the tiered lookup path reads rows through it).
    /// Whether a lookup of `ids` would read rows from the device now (an SSD-tier table
    /// whose row cache misses any of them); a lookup that would can be completed off the
    /// thread that received it.
    pub fn would_read(&self, ids: &[i64]) -> bool {
        self.store().would_read(ids)
    }

    pub(crate) fn store(&self) -> &dyn RowStore {
        self.store.as_ref()
    }

    /// The kernels' view of the rows, if they are in memory back to back.
    pub(crate) fn view(&self) -> Option<RowsView<'_>> {
        let bytes = self.store.contiguous()?;
        Some(RowsView::new(
            bytes,
            self.rows.start,
            self.meta.row_bytes,
            self.meta.dim,
            self.meta.dtype,
            self.prefetch_distance,
        ))
    }
}

/// Copies `len` bytes at `offset` of `file` into anonymous memory advised for huge pages.
fn read_resident(file: &File, offset: u64, len: usize) -> std::io::Result<Mmap> {
    let mut mem = MmapMut::map_anon(len)?;
    if len > 0 {
        // Best effort: without transparent huge pages the copy still works on 4 KiB pages.
        let _ = mem.advise(Advice::HugePage);
        let mut reader = file;
        std::io::Seek::seek(&mut reader, std::io::SeekFrom::Start(offset))?;
        reader.read_exact(&mut mem)?;
    }
    mem.make_read_only()
}

/// CRC-32 (IEEE, as zlib.crc32) of a whole file, read in large chunks.
fn file_crc32(file: &File) -> std::io::Result<u32> {
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut reader = file;
    std::io::Seek::seek(&mut reader, std::io::SeekFrom::Start(0))?;
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            return Ok(hasher.finalize());
        }
        hasher.update(&buf[..n]);
    }
}

/// The tables a shard holds, by name, in manifest order.
#[derive(Debug)]
pub struct TableSet {
    tables: Vec<Table>,
    by_name: HashMap<String, usize>,
}

impl TableSet {
    /// Opens `tables` (all if None) of the bundle, restricted to global rows `rows` (all if
    /// None; clipped to each table's size). Fails on the first table that is unknown, has the
    /// wrong size, or cannot be mapped.
    pub fn open(
        bundle_dir: &Path,
        tables: Option<&[String]>,
        rows: Option<Range<u64>>,
    ) -> Result<TableSet, EmbedError> {
        TableSet::open_with(bundle_dir, tables, rows, &OpenOptions::default())
    }

    /// [`TableSet::open`] with options (checksum verification, residency).
    pub fn open_with(
        bundle_dir: &Path,
        tables: Option<&[String]>,
        rows: Option<Range<u64>>,
        options: &OpenOptions,
    ) -> Result<TableSet, EmbedError> {
        let manifest = Manifest::load(bundle_dir)?;
        TableSet::open_manifest(bundle_dir, &manifest, tables, rows, options)
    }

    /// Like [`TableSet::open_with`] for a manifest already loaded.
    pub fn open_manifest(
        bundle_dir: &Path,
        manifest: &Manifest,
        tables: Option<&[String]>,
        rows: Option<Range<u64>>,
        options: &OpenOptions,
    ) -> Result<TableSet, EmbedError> {
        let metas: Vec<&TableMeta> = match tables {
            None => manifest.tables.iter().collect(),
            Some(names) => names
                .iter()
                .map(|name| {
                    manifest
                        .table(name)
                        .ok_or_else(|| EmbedError::UnknownTable {
                            name: name.clone(),
                            known: manifest.tables.iter().map(|t| t.name.clone()).collect(),
                        })
                })
                .collect::<Result<_, _>>()?,
        };
        let mut set = TableSet {
            tables: Vec::new(),
            by_name: HashMap::new(),
        };
        for meta in metas {
            if set.by_name.contains_key(&meta.name) {
                continue;
            }
            let range = rows.clone().unwrap_or(0..meta.rows);
            let table = Table::open_with(bundle_dir, meta, range, options)?;
            set.by_name.insert(meta.name.clone(), set.tables.len());
            set.tables.push(table);
        }
        Ok(set)
    }

    pub fn get(&self, name: &str) -> Option<&Table> {
        self.by_name.get(name).map(|&i| &self.tables[i])
    }

    /// The table called `name`, or [`EmbedError::UnknownTable`] listing the ones held.
    pub fn require(&self, name: &str) -> Result<&Table, EmbedError> {
        self.get(name).ok_or_else(|| EmbedError::UnknownTable {
            name: name.to_string(),
            known: self.names().map(str::to_string).collect(),
        })
    }

    pub fn iter(&self) -> impl Iterator<Item = &Table> {
        self.tables.iter()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tables.iter().map(Table::name)
    }

    pub fn len(&self) -> usize {
        self.tables.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }
}
