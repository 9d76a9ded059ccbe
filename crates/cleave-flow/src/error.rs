//! Errors of the control channel: each says what was expected and what arrived.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ControlError {
    #[error("control frame: expected magic 0x4346 (\"CF\"), got 0x{got:04x}")]
    BadMagic { got: u16 },
    #[error("control frame: expected version {expected}, got {got}")]
    BadVersion { expected: u8, got: u8 },
    #[error("control frame: unknown message kind {kind} (expected 1..=6)")]
    UnknownKind { kind: u8 },
    #[error("control frame: body of {got} bytes exceeds the limit of {limit}")]
    Oversized { got: u32, limit: u32 },
    #[error("control frame: {kind} needs a body of {expected} bytes, got {got}")]
    BadLength {
        kind: &'static str,
        expected: String,
        got: u32,
    },
    #[error("control frame: error text is not UTF-8")]
    BadText,
    #[error("control connection: {0}")]
    Io(String),
}

impl From<std::io::Error> for ControlError {
    fn from(err: std::io::Error) -> Self {
        ControlError::Io(err.to_string())
    }
}
