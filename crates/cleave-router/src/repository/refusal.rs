//! Why a repository or rollout call was refused, whatever door it came through; REST
//! answers with `http_status`, gRPC maps `why` to its code (front/grpc.rs).

use crate::error::{ErrorKind, RequestError};
use crate::repository::controller::ControllerError;

/// Why a repository or rollout call was refused; each door maps it to its status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    Invalid,
    NotFound,
    /// The model is loading, or a state the change needs is gone.
    Conflict,
    /// This deployment cannot do it (no repository controller).
    Precondition,
    Unavailable,
    Internal,
}

#[derive(Debug)]
pub struct Refusal {
    pub why: Why,
    pub message: String,
}

impl Refusal {
    pub fn new(why: Why, message: impl Into<String>) -> Refusal {
        Refusal {
            why,
            message: message.into(),
        }
    }

    pub fn http_status(&self) -> u16 {
        match self.why {
            Why::Invalid | Why::Precondition => 400,
            Why::NotFound => 404,
            Why::Conflict => 409,
            Why::Unavailable => 503,
            Why::Internal => 500,
        }
    }
}

impl From<RequestError> for Refusal {
    fn from(e: RequestError) -> Refusal {
        let why = match e.kind {
            ErrorKind::UnknownModel => Why::NotFound,
            _ => Why::Invalid,
        };
        Refusal::new(why, e.message)
    }
}

impl From<ControllerError> for Refusal {
    fn from(e: ControllerError) -> Refusal {
        let why = match e.status {
            404 => Why::NotFound,
            409 => Why::Conflict,
            400..=499 => Why::Invalid,
            502..=504 => Why::Unavailable,
            _ => Why::Internal,
        };
        Refusal::new(why, e.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controller_statuses_map_to_the_callers() {
        let why = |status| {
            Refusal::from(ControllerError {
                status,
                message: String::new(),
            })
            .why
        };
        assert_eq!(why(400), Why::Invalid);
        assert_eq!(why(404), Why::NotFound);
        assert_eq!(why(409), Why::Conflict);
        assert_eq!(why(507), Why::Internal);
        assert_eq!(why(502), Why::Unavailable);
    }
}
