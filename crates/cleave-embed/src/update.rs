//! Model updates (docs/tiers.md, "Updates"): the delta format, and writing a table's next
//! version as a whole table file, durably (temporary file, fsync, rename, fsync the directory).
//!
//! A new version is a new file in the table format of the bundle, so every store (mapped,
//! resident, SSD) and every kernel serves it unchanged, and a newly opened SSD store gets new
//! row-cache and pooled-cache keys: nothing cached of the old version can answer for the new.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::bundle::TableMeta;

/// The first bytes of a delta file.
pub const DELTA_MAGIC: [u8; 4] = *b"CLVD";
/// The delta format version this build reads.
pub const DELTA_VERSION: u16 = 1;
/// Bytes of the fixed header (before the table and dtype names).
pub const DELTA_HEADER: usize = 28;

/// What is wrong with an update; every message names the file, table, id or value.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("delta for table {table:?}: {reason}")]
    BadDelta { table: String, reason: String },
    #[error("new file for table {table:?}: expected {expected} bytes ({rows} rows of {row_bytes} bytes), got {found}")]
    BadFile {
        table: String,
        expected: u64,
        found: u64,
        rows: u64,
        row_bytes: usize,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> UpdateError + '_ {
    move |source| UpdateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A parsed delta: new stored rows for some ids of one table.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    pub table: String,
    pub dtype: String,
    pub dim: u32,
    pub row_bytes: u32,
    pub ids: Vec<u64>,
    /// `ids.len() * row_bytes` stored bytes, row `i` for `ids[i]`.
    pub rows: Vec<u8>,
}

impl Delta {
    /// Parses `bytes` (the whole delta) and checks it against `meta`: same table, dtype, dim
    /// and row size, every id below the table's row count, exactly the bytes the header says.
    pub fn parse(bytes: &[u8], meta: &TableMeta) -> Result<Delta, UpdateError> {
        let bad = |reason: String| UpdateError::BadDelta {
            table: meta.name.clone(),
            reason,
        };
        if bytes.len() < DELTA_HEADER {
            return Err(bad(format!(
                "truncated: {} bytes, shorter than the {DELTA_HEADER}-byte header",
                bytes.len()
            )));
        }
        if bytes[..4] != DELTA_MAGIC {
            return Err(bad(format!(
                "magic {:?}, expected {:?} (not a Cleave delta)",
                &bytes[..4],
                DELTA_MAGIC
            )));
        }
        let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let version = u16_at(4);
        if version != DELTA_VERSION {
            return Err(bad(format!(
                "format version {version}, this build reads {DELTA_VERSION}"
            )));
        }
        let (name_len, dtype_len) = (u16_at(6) as usize, u16_at(8) as usize);
        let (dim, row_bytes) = (u32_at(12), u32_at(16));
        let count = u64::from_le_bytes(bytes[20..28].try_into().unwrap());
        let names_end = DELTA_HEADER + name_len + dtype_len;
        let expected = (names_end as u128) + count as u128 * 8 + count as u128 * row_bytes as u128;
        if bytes.len() as u128 != expected {
            return Err(bad(format!(
                "truncated or padded: the header promises {count} rows of {row_bytes} bytes \
                 ({expected} bytes in all), the delta has {} bytes",
                bytes.len()
            )));
        }
        let text = |r: std::ops::Range<usize>| String::from_utf8_lossy(&bytes[r]).into_owned();
        let table = text(DELTA_HEADER..DELTA_HEADER + name_len);
        let dtype = text(DELTA_HEADER + name_len..names_end);
        if table != meta.name {
            return Err(bad(format!("the delta is for table {table:?}")));
        }
        if dtype != meta.dtype.as_str() || dim as usize != meta.dim {
            return Err(bad(format!(
                "shape {dtype} x {dim}, the table is {} x {}",
                meta.dtype.as_str(),
                meta.dim
            )));
        }
        if row_bytes as usize != meta.row_bytes {
            return Err(bad(format!(
                "rows of {row_bytes} bytes, the table's are {}",
                meta.row_bytes
            )));
        }
        let count = count as usize;
        let ids: Vec<u64> = bytes[names_end..names_end + 8 * count]
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id >= meta.rows) {
            return Err(bad(format!(
                "id {id} (entry {i}) is out of range: the table has {} rows",
                meta.rows
            )));
        }
        Ok(Delta {
            table,
            dtype,
            dim,
            row_bytes,
            ids,
            rows: bytes[names_end + 8 * count..].to_vec(),
        })
    }

    /// The delta's bytes (the inverse of [`Delta::parse`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(DELTA_HEADER + self.ids.len() * 8 + self.rows.len());
        out.extend_from_slice(&DELTA_MAGIC);
        out.extend_from_slice(&DELTA_VERSION.to_le_bytes());
        out.extend_from_slice(&(self.table.len() as u16).to_le_bytes());
        out.extend_from_slice(&(self.dtype.len() as u16).to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.dim.to_le_bytes());
        out.extend_from_slice(&self.row_bytes.to_le_bytes());
        out.extend_from_slice(&(self.ids.len() as u64).to_le_bytes());
        out.extend_from_slice(self.table.as_bytes());
        out.extend_from_slice(self.dtype.as_bytes());
        for id in &self.ids {
            out.extend_from_slice(&id.to_le_bytes());
        }
        out.extend_from_slice(&self.rows);
        out
    }
}

/// The update of one table: rows of some ids, or a whole new table file.
pub enum Change<'a> {
    Rows(&'a Delta),
    /// A file in the table format (exactly `rows * row_bytes` bytes).
    File(&'a Path),
}

/// Writes the next version of `meta`'s table to `dest`: `base` (the serving version's file)
/// with `change` applied. Written to a temporary file beside `dest`, fsynced, renamed, and the
/// directory fsynced, so after a crash `dest` is either absent or whole. A failure removes the
/// temporary file.
pub fn write_version(
    base: &Path,
    meta: &TableMeta,
    change: Change<'_>,
    dest: &Path,
) -> Result<(), UpdateError> {
    let dir = dest.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp",
        dest.file_name().unwrap_or_default().to_string_lossy()
    ));
    let result = write_tmp(base, meta, change, &tmp).and_then(|()| {
        std::fs::rename(&tmp, dest).map_err(io(dest))?;
        sync_dir(dir)
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn write_tmp(
    base: &Path,
    meta: &TableMeta,
    change: Change<'_>,
    tmp: &Path,
) -> Result<(), UpdateError> {
    let expected = meta.rows * meta.row_bytes as u64;
    let source = match change {
        Change::Rows(_) => base,
        Change::File(path) => path,
    };
    let found = std::fs::metadata(source).map_err(io(source))?.len();
    if found != expected {
        return Err(UpdateError::BadFile {
            table: meta.name.clone(),
            expected,
            found,
            rows: meta.rows,
            row_bytes: meta.row_bytes,
        });
    }
    let mut out = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(tmp)
        .map_err(io(tmp))?;
    let mut input = File::open(source).map_err(io(source))?;
    copy(&mut input, source, &mut out, tmp)?;
    if let Change::Rows(delta) = change {
        let rb = meta.row_bytes;
        for (i, &id) in delta.ids.iter().enumerate() {
            out.write_all_at(&delta.rows[i * rb..(i + 1) * rb], id * rb as u64)
                .map_err(io(tmp))?;
        }
    }
    out.sync_all().map_err(io(tmp))
}

fn copy(input: &mut File, from: &Path, out: &mut File, to: &Path) -> Result<(), UpdateError> {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = input.read(&mut buf).map_err(io(from))?;
        if n == 0 {
            return Ok(());
        }
        out.write_all(&buf[..n]).map_err(io(to))?;
    }
}

/// fsyncs a directory, so that a rename in it survives a crash.
pub fn sync_dir(dir: &Path) -> Result<(), UpdateError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// Writes `text` to `path` atomically and durably (temporary file, fsync, rename, fsync dir).
pub fn write_atomically(path: &Path, text: &[u8]) -> Result<(), UpdateError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().unwrap_or_default().to_string_lossy()
    ));
    let result = (|| {
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(text).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io(path))?;
        sync_dir(dir)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::TableDtype;

    fn meta(rows: u64, dim: usize) -> TableMeta {
        TableMeta {
            name: "t0".into(),
            file: "t0.bin".into(),
            rows,
            dim,
            dtype: TableDtype::Float32,
            row_bytes: 4 * dim,
            crc32: 0,
            source: None,
        }
    }

    fn delta(ids: Vec<u64>, dim: usize) -> Delta {
        let rows = ids
            .iter()
            .flat_map(|&id| {
                (0..dim).flat_map(move |j| (id as f32 * 100.0 + j as f32).to_le_bytes())
            })
            .collect();
        Delta {
            table: "t0".into(),
            dtype: "float32".into(),
            dim: dim as u32,
            row_bytes: 4 * dim as u32,
            ids,
            rows,
        }
    }

    #[test]
    fn a_delta_round_trips_and_is_applied_durably() {
        let dir = tempfile::tempdir().unwrap();
        let m = meta(5, 2);
        let base = dir.path().join("base.bin");
        std::fs::write(&base, vec![0u8; 40]).unwrap();
        let d = delta(vec![3, 1], 2);
        let parsed = Delta::parse(&d.to_bytes(), &m).unwrap();
        assert_eq!(parsed, d);
        let dest = dir.path().join("t0.v1.tbl");
        write_version(&base, &m, Change::Rows(&parsed), &dest).unwrap();
        let bytes = std::fs::read(&dest).unwrap();
        let row = |i: usize| &bytes[i * 8..(i + 1) * 8];
        assert_eq!(row(3), &d.rows[..8]);
        assert_eq!(row(1), &d.rows[8..]);
        assert_eq!(row(0), &[0u8; 8]);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            2,
            "no temporary left"
        );
    }

    #[test]
    fn bad_deltas_and_files_are_refused_naming_the_problem() {
        let m = meta(5, 2);
        let good = delta(vec![1], 2).to_bytes();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (good[..10].to_vec(), "shorter than the 28-byte header"),
            (good[..good.len() - 1].to_vec(), "truncated or padded"),
            (
                b"NOPE".iter().chain(&good[4..]).copied().collect(),
                "not a Cleave delta",
            ),
            (
                delta(vec![5], 2).to_bytes(),
                "id 5 (entry 0) is out of range",
            ),
            (delta(vec![1], 3).to_bytes(), "shape float32 x 3"),
        ];
        for (bytes, says) in cases {
            let err = Delta::parse(&bytes, &m).unwrap_err().to_string();
            assert!(err.contains(says), "{says}: {err}");
        }
        let dir = tempfile::tempdir().unwrap();
        let short = dir.path().join("short.bin");
        std::fs::write(&short, vec![0u8; 39]).unwrap();
        let dest = dir.path().join("t0.v1.tbl");
        let err = write_version(&short, &m, Change::File(&short), &dest)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("expected 40 bytes") && err.contains("got 39"),
            "{err}"
        );
        assert!(!dest.exists());
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary left"
        );
    }
}
