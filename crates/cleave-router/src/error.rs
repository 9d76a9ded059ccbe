//! What can go wrong with one request, as the client sees it: an HTTP status and a gRPC code
//! (one mapping, here), a kind (the label of the `cleave_router_errors_total` counter) and a message that names the input,
//! stage or backend and says what was expected and what arrived.

use std::fmt;

use axum::http::StatusCode;
use tonic::Code;

/// The stages of a request, in order; metrics and deadline errors name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Reading the body, parsing JSON, checking it against the manifest.
    Parse,
    /// Lookups on the shards and merging their partial pools.
    Lookup,
    /// Sending the payload to a ranker and getting its reply, less the ranker's own time.
    Transfer,
    /// Waiting in the ranker's queue.
    Queue,
    /// The dense program on the ranker.
    Compute,
    /// The whole request.
    Total,
    /// Waiting for a ranker's reply, when the router cannot tell transfer, queue and compute
    /// apart (deadline errors only; no histogram).
    Ranker,
    /// Admission control, before the body is read (shed requests only; no histogram).
    Admission,
    /// Waiting for a ranker's grant to send a large payload (incast control; deadline errors
    /// only; no histogram).
    IncastQueue,
}

impl Stage {
    pub const ALL: [Stage; 6] = [
        Stage::Parse,
        Stage::Lookup,
        Stage::Transfer,
        Stage::Queue,
        Stage::Compute,
        Stage::Total,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Parse => "parse",
            Stage::Lookup => "lookup",
            Stage::Transfer => "transfer",
            Stage::Queue => "queue",
            Stage::Compute => "compute",
            Stage::Total => "total",
            Stage::Ranker => "ranker",
            Stage::Admission => "admission",
            Stage::IncastQueue => "ranker incast queue",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The body is not JSON, or not the JSON shape the endpoint takes.
    InvalidJson,
    /// The body is over the configured limit.
    TooLarge,
    /// No model of that name is served here.
    UnknownModel,
    /// An input is missing, unknown, mistyped, misshapen, or holds bad ids or offsets.
    InvalidInput,
    /// The request's latency budget ran out.
    Deadline,
    /// A shard failed or could not be reached.
    Shard,
    /// A ranker failed, could not be reached, or replied with something unexpected.
    Ranker,
    /// No backend of a kind is available right now.
    Unavailable,
    /// Shed by admission control: the router is at its cap, or could not meet the budget.
    Overloaded,
    /// The body arrived slower than the router's minimum rate.
    BodyTimeout,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 10] = [
        ErrorKind::InvalidJson,
        ErrorKind::TooLarge,
        ErrorKind::UnknownModel,
        ErrorKind::InvalidInput,
        ErrorKind::Deadline,
        ErrorKind::Shard,
        ErrorKind::Ranker,
        ErrorKind::Unavailable,
        ErrorKind::Overloaded,
        ErrorKind::BodyTimeout,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidJson => "invalid_json",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::UnknownModel => "unknown_model",
            ErrorKind::InvalidInput => "invalid_input",
            ErrorKind::Deadline => "deadline",
            ErrorKind::Shard => "shard",
            ErrorKind::Ranker => "ranker",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::BodyTimeout => "body_timeout",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::InvalidJson | ErrorKind::InvalidInput => StatusCode::BAD_REQUEST,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::UnknownModel => StatusCode::NOT_FOUND,
            ErrorKind::Deadline => StatusCode::GATEWAY_TIMEOUT,
            ErrorKind::Shard | ErrorKind::Ranker => StatusCode::BAD_GATEWAY,
            ErrorKind::Unavailable | ErrorKind::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
        }
    }

    /// The gRPC status code: the usual mapping of the HTTP status. Shed requests keep
    /// UNAVAILABLE, the code clients retry.
    pub fn grpc_code(self) -> Code {
        match self {
            ErrorKind::InvalidJson | ErrorKind::InvalidInput => Code::InvalidArgument,
            ErrorKind::TooLarge => Code::ResourceExhausted,
            ErrorKind::UnknownModel => Code::NotFound,
            ErrorKind::Deadline | ErrorKind::BodyTimeout => Code::DeadlineExceeded,
            ErrorKind::Shard
            | ErrorKind::Ranker
            | ErrorKind::Unavailable
            | ErrorKind::Overloaded => Code::Unavailable,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestError {
    pub kind: ErrorKind,
    pub message: String,
    /// The stage the request was in (always set for deadline errors).
    pub stage: Option<Stage>,
}

impl RequestError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> RequestError {
        RequestError {
            kind,
            message: message.into(),
            stage: None,
        }
    }

    /// A problem with one named input.
    pub fn input(name: &str, problem: impl fmt::Display) -> RequestError {
        RequestError::new(
            ErrorKind::InvalidInput,
            format!("input {name:?}: {problem}"),
        )
    }

    pub fn invalid(problem: impl Into<String>) -> RequestError {
        RequestError::new(ErrorKind::InvalidInput, problem)
    }

    pub fn json(problem: impl fmt::Display) -> RequestError {
        RequestError::new(
            ErrorKind::InvalidJson,
            format!("invalid JSON body: {problem}"),
        )
    }

    pub fn deadline(stage: Stage, budget_ms: f64, spent_ms: f64) -> RequestError {
        RequestError {
            kind: ErrorKind::Deadline,
            message: format!(
                "latency budget of {budget_ms} ms ran out in stage {:?} after {spent_ms:.1} ms",
                stage.as_str()
            ),
            stage: Some(stage),
        }
    }

    pub fn at(mut self, stage: Stage) -> RequestError {
        self.stage = Some(stage);
        self
    }

    pub fn status(&self) -> StatusCode {
        self.kind.status()
    }
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for RequestError {}

/// How a request ended when it got no reply: its error, and when admission control shed it,
/// how long to wait before retrying (the REST `Retry-After`, the gRPC `RetryInfo`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub error: RequestError,
    /// Whole seconds, at least 1; `None` unless shed.
    pub retry_after_s: Option<u64>,
}

impl From<RequestError> for Failure {
    fn from(error: RequestError) -> Failure {
        Failure {
            error,
            retry_after_s: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_codes_follow_the_http_statuses() {
        for kind in ErrorKind::ALL {
            let expected = match kind.status().as_u16() {
                400 => Code::InvalidArgument,
                404 => Code::NotFound,
                413 => Code::ResourceExhausted,
                408 | 504 => Code::DeadlineExceeded,
                502 | 503 => Code::Unavailable,
                other => panic!("{kind:?}: no gRPC code for HTTP {other}"),
            };
            assert_eq!(kind.grpc_code(), expected, "{kind:?}");
        }
        assert_eq!(ErrorKind::Overloaded.grpc_code(), Code::Unavailable);
    }
}
