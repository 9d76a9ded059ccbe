//! Errors a client call reports. Each names the peer's address.

use std::fmt;
use std::io;
use std::time::Duration;

use crate::addr::Address;
use crate::frame::ErrorCode;

#[derive(Debug)]
pub enum WireError {
    /// The TCP/Unix connect failed or timed out.
    Connect { addr: Address, source: io::Error },
    /// The peer refused or garbled the HELLO exchange.
    Handshake { addr: Address, reason: String },
    /// No response within the call's timeout.
    Timeout { addr: Address, after: Duration },
    /// The connection closed (or broke) before the response arrived.
    Closed { addr: Address, reason: String },
    /// The peer answered with an error frame.
    Remote {
        addr: Address,
        code: ErrorCode,
        message: String,
    },
    /// The request is larger than the peer accepts.
    TooLarge { addr: Address, len: usize, max: u32 },
    /// The peer sent bytes that are not a valid frame sequence.
    Protocol { addr: Address, reason: String },
}

impl WireError {
    /// The peer this error concerns.
    pub fn addr(&self) -> &Address {
        match self {
            WireError::Connect { addr, .. }
            | WireError::Handshake { addr, .. }
            | WireError::Timeout { addr, .. }
            | WireError::Closed { addr, .. }
            | WireError::Remote { addr, .. }
            | WireError::TooLarge { addr, .. }
            | WireError::Protocol { addr, .. } => addr,
        }
    }

    /// The error code of a remote error frame, if this is one.
    pub fn remote_code(&self) -> Option<ErrorCode> {
        match self {
            WireError::Remote { code, .. } => Some(*code),
            _ => None,
        }
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Connect { addr, source } => write!(f, "{addr}: cannot connect: {source}"),
            WireError::Handshake { addr, reason } => write!(f, "{addr}: handshake failed: {reason}"),
            WireError::Timeout { addr, after } => {
                write!(f, "{addr}: no response within {:.3} s", after.as_secs_f64())
            }
            WireError::Closed { addr, reason } => {
                write!(f, "{addr}: connection closed before the response: {reason}")
            }
            WireError::Remote { addr, code, message } => {
                write!(f, "{addr}: error {code}: {message}")
            }
            WireError::TooLarge { addr, len, max } => write!(
                f,
                "{addr}: request payload of {len} bytes exceeds the peer's frame limit of {max} bytes"
            ),
            WireError::Protocol { addr, reason } => write!(f, "{addr}: protocol error: {reason}"),
        }
    }
}

impl std::error::Error for WireError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WireError::Connect { source, .. } => Some(source),
            _ => None,
        }
    }
}
