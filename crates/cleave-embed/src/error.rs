//! The one error type of the engine. Every variant says what was expected, what arrived and
//! where (file, table, id, bag), so a shard can hand the message straight to its client.

use std::fmt;
use std::ops::Range;
use std::path::PathBuf;

/// Everything that can go wrong while opening a bundle's tables or running a lookup.
#[derive(Debug)]
pub enum EmbedError {
    /// A file could not be read or mapped.
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// `manifest.json` is not valid JSON or breaks a rule of docs/bundle.md.
    BadManifest { path: PathBuf, reason: String },
    /// The manifest's `format` is not `cleave-bundle`.
    WrongFormat {
        path: PathBuf,
        found: String,
        expected: &'static str,
    },
    /// The manifest was written by a newer Cleave than this reader.
    UnsupportedVersion {
        path: PathBuf,
        found: u64,
        supported: u32,
    },
    /// A table file's size is not `rows * row_bytes`.
    SizeMismatch {
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    /// A table file's CRC-32 differs from the manifest's.
    Checksum {
        path: PathBuf,
        expected: u32,
        found: u32,
    },
    /// A table name that the bundle (or this table set) does not hold.
    UnknownTable { name: String, known: Vec<String> },
    /// An id outside the rows this table holds.
    IdOutOfRange {
        table: String,
        id: i64,
        position: usize,
        range: Range<u64>,
    },
    /// Malformed offsets, weights or output buffers; the message names the argument.
    BadBags { table: String, reason: String },
    /// A table file that cannot be opened for direct (O_DIRECT) reads: its file system or
    /// device does not support them, so the SSD tier cannot serve it.
    NoDirectIo {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A request this build or CPU cannot serve (e.g. a kernel the CPU lacks).
    Unsupported(String),
}

impl fmt::Display for EmbedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EmbedError::Io { path, source } => write!(f, "{}: {source}", path.display()),
            EmbedError::BadManifest { path, reason } => {
                write!(f, "{}: bad manifest: {reason}", path.display())
            }
            EmbedError::WrongFormat {
                path,
                found,
                expected,
            } => write!(
                f,
                "{}: format is {found:?}, expected {expected:?} (not a Cleave bundle?)",
                path.display()
            ),
            EmbedError::UnsupportedVersion {
                path,
                found,
                supported,
            } => write!(
                f,
                "{}: bundle version {found} is newer than this reader supports \
                 (version {supported} or older); upgrade Cleave",
                path.display()
            ),
            EmbedError::SizeMismatch {
                path,
                expected,
                found,
            } => write!(
                f,
                "{}: table file has {found} bytes, expected {expected} (rows * row_bytes)",
                path.display()
            ),
            EmbedError::Checksum {
                path,
                expected,
                found,
            } => write!(
                f,
                "{}: CRC-32 is {found:#010x}, manifest says {expected:#010x} (corrupted file?)",
                path.display()
            ),
            EmbedError::UnknownTable { name, known } => {
                write!(f, "unknown table {name:?}; this set holds {known:?}")
            }
            EmbedError::IdOutOfRange {
                table,
                id,
                position,
                range,
            } => write!(
                f,
                "table {table:?}: id {id} at position {position} is outside rows [{}, {})",
                range.start, range.end
            ),
            EmbedError::BadBags { table, reason } => write!(f, "table {table:?}: {reason}"),
            EmbedError::NoDirectIo { path, source } => write!(
                f,
                "{}: cannot read with O_DIRECT ({source}); the SSD tier needs a file system \
                 and device that support direct I/O (not tmpfs): move the bundle or raise the \
                 DRAM budget above the tables' size",
                path.display()
            ),
            EmbedError::Unsupported(reason) => write!(f, "unsupported: {reason}"),
        }
    }
}

impl std::error::Error for EmbedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            EmbedError::Io { source, .. } | EmbedError::NoDirectIo { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl EmbedError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> EmbedError {
        EmbedError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn bags(table: &str, reason: impl Into<String>) -> EmbedError {
        EmbedError::BadBags {
            table: table.to_string(),
            reason: reason.into(),
        }
    }
}
