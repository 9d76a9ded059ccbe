//! Bearer-token authentication of the client-facing ports (docs/security.md): with
//! `auth_token_file` set, every REST request (health probes and the admin API, which has its
//! own token, aside) and every gRPC call must carry `Authorization: Bearer <token>`. The
//! comparison takes the same time whatever the bytes sent, and the token is never logged or
//! echoed: errors say only that a token was missing or wrong.

use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use cleave_wire::auth::constant_time_eq;
use thiserror::Error;

/// Why a request was refused. The messages are what the client reads.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AuthError {
    #[error(
        "missing bearer token: this router needs the header \"Authorization: Bearer <token>\" \
         (gRPC: the metadata \"authorization\")"
    )]
    Missing,
    #[error("invalid bearer token: the token sent is not this router's")]
    Invalid,
}

/// A token, read once at start-up. `Debug` does not show it.
pub struct BearerToken {
    token: Vec<u8>,
}

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BearerToken({} bytes)", self.token.len())
    }
}

impl BearerToken {
    /// The token in `path`: its first line, trimmed; an empty one is refused.
    pub fn from_file(path: &Path) -> Result<BearerToken, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("auth_token_file {}: {e}", path.display()))?;
        let token = text.lines().next().unwrap_or("").trim();
        if token.is_empty() {
            return Err(format!(
                "auth_token_file {}: the file is empty; expected the bearer token on its first \
                 line",
                path.display()
            ));
        }
        Ok(BearerToken::new(token))
    }

    pub fn new(token: &str) -> BearerToken {
        BearerToken {
            token: token.as_bytes().to_vec(),
        }
    }

    /// Checks an `Authorization` header value.
    pub fn check(&self, header: Option<&[u8]>) -> Result<(), AuthError> {
        let value = header.ok_or(AuthError::Missing)?;
        let sent = strip_bearer(value).ok_or(AuthError::Missing)?;
        if constant_time_eq(sent, &self.token) {
            Ok(())
        } else {
            Err(AuthError::Invalid)
        }
    }

    pub fn check_headers(&self, headers: &HeaderMap) -> Result<(), AuthError> {
        self.check(headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()))
    }
}

/// The token after "Bearer " (the scheme's case does not matter, RFC 7235).
fn strip_bearer(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer ";
    (value.len() > SCHEME.len() && value[..SCHEME.len()].eq_ignore_ascii_case(SCHEME))
        .then(|| value[SCHEME.len()..].trim_ascii())
}

/// Paths served without the token: the probes of launchers and orchestrators, and the admin
/// API, which checks its own token.
fn is_open(path: &str) -> bool {
    matches!(
        path,
        "/live" | "/ready" | "/v2/health/live" | "/v2/health/ready"
    ) || path.starts_with("/admin/")
}

/// axum middleware: 401 with `WWW-Authenticate: Bearer` unless the token is right.
pub async fn require_token(
    State(token): State<Arc<BearerToken>>,
    request: Request,
    next: Next,
) -> Response {
    if is_open(request.uri().path()) {
        return next.run(request).await;
    }
    match token.check_headers(request.headers()) {
        Ok(()) => next.run(request).await,
        Err(e) => {
            tracing::warn!(path = request.uri().path(), error = %e, "request refused");
            let body = serde_json::json!({"error": e.to_string()}).to_string();
            let mut response =
                crate::codec::json::json_bytes(StatusCode::UNAUTHORIZED, body.into());
            let headers = response.headers_mut();
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            // The body was not read: the connection cannot be reused.
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_whole() {
        let t = BearerToken::new("s3cret-token");
        assert_eq!(t.check(Some(b"Bearer s3cret-token")), Ok(()));
        assert_eq!(t.check(Some(b"bearer s3cret-token ")), Ok(()));
        assert_eq!(t.check(None), Err(AuthError::Missing));
        assert_eq!(t.check(Some(b"Basic abc")), Err(AuthError::Missing));
        assert_eq!(t.check(Some(b"Bearer ")), Err(AuthError::Missing));
        for wrong in [
            &b"Bearer s3cret-toke"[..],
            b"Bearer s3cret-token2",
            b"Bearer S3cret-token",
            b"Bearer x",
        ] {
            assert_eq!(t.check(Some(wrong)), Err(AuthError::Invalid));
        }
        // Neither message nor Debug shows the token.
        assert!(!format!("{t:?}").contains("s3cret"));
        assert!(!AuthError::Invalid.to_string().contains("s3cret"));
    }

    #[test]
    fn probes_and_admin_are_open() {
        for open in ["/live", "/ready", "/v2/health/ready", "/admin/v1/members"] {
            assert!(is_open(open), "{open}");
        }
        for closed in [
            "/v2/models/dlrm/infer",
            "/metrics",
            "/v2",
            "/v2/models/dlrm",
        ] {
            assert!(!is_open(closed), "{closed}");
        }
    }

    #[test]
    fn token_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "abc123\n").unwrap();
        let t = BearerToken::from_file(&path).unwrap();
        assert_eq!(t.check(Some(b"Bearer abc123")), Ok(()));
        std::fs::write(&path, "\n").unwrap();
        assert!(BearerToken::from_file(&path)
            .unwrap_err()
            .contains("the file is empty"));
        assert!(BearerToken::from_file(&dir.path().join("nope"))
            .unwrap_err()
            .starts_with("auth_token_file"));
    }
}
