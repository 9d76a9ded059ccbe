//! The log set-up of every Cleave executable (`cleave-shard`, `cleave-router`): `tracing`
//! events on stderr, as text for people or as one JSON object per line for collectors. The
//! level comes from `CLEAVE_LOG` (a `tracing` filter: `info`, `debug`,
//! `cleave_router=debug,info`, ...), `info` when unset. Per-request records are at `debug`,
//! so the hot path logs nothing at the default level.

use std::fmt;
use std::io::IsTerminal;
use std::str::FromStr;

use tracing_subscriber::EnvFilter;

/// The environment variable holding the filter.
pub const ENV: &str = "CLEAVE_LOG";

/// How events are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line, the event's fields (`trace_id` among them) at the top level.
    Json,
}

impl FromStr for LogFormat {
    type Err = LogError;

    fn from_str(s: &str) -> Result<LogFormat, LogError> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(LogError::Format(other.to_string())),
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("log format {0:?}: expected \"text\" or \"json\"")]
    Format(String),
    #[error("{ENV}={value:?} is not a log filter (expected e.g. \"info\" or \"cleave_router=debug,info\"): {reason}")]
    Filter { value: String, reason: String },
    #[error("a logger is already installed in this process")]
    AlreadySet,
}

/// Installs the process-wide subscriber; call once, first thing in `main`.
pub fn init(format: LogFormat) -> Result<(), LogError> {
    let value = std::env::var(ENV).unwrap_or_else(|_| "info".to_string());
    let filter = EnvFilter::try_new(&value).map_err(|e| LogError::Filter {
        value: value.clone(),
        reason: e.to_string(),
    })?;
    // Colours only for a person at a terminal, never into a pipe or a file.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
    };
    installed.map_err(|_| LogError::AlreadySet)
}

/// A trace id as logs write it: 16 hex digits, as in the router's `x-request-id` header.
pub fn trace_id(id: u64) -> String {
    format!("{id:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_and_a_bad_one_names_what_is_expected() {
        assert_eq!("json".parse::<LogFormat>().unwrap(), LogFormat::Json);
        assert_eq!("text".parse::<LogFormat>().unwrap(), LogFormat::Text);
        let err = "xml".parse::<LogFormat>().unwrap_err().to_string();
        assert!(err.contains("\"xml\"") && err.contains("\"json\""), "{err}");
    }

    #[test]
    fn trace_ids_are_sixteen_hex_digits() {
        assert_eq!(trace_id(0xab), "00000000000000ab");
    }
}
