//! The HTTP client of the repository controller (the launcher's process that stages
//! versions: docs/api.md, "Model repository"): `POST {base}/{index|load|release}` with a
//! JSON body, a JSON answer; 200 on success, else `{"error": "..."}` and a 4xx/5xx status.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request};
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// The largest answer read from the controller.
const MAX_ANSWER: usize = 16 << 20;

/// A refused or failed call: the controller's status (502 when it could not be reached or
/// answered nonsense) and its message.
#[derive(Debug)]
pub struct ControllerError {
    pub status: u16,
    pub message: String,
}

#[derive(Clone, Debug)]
pub struct Controller {
    /// `host:port`.
    authority: String,
    /// The path every call's name is appended to (it carries the controller's secret).
    base_path: String,
}

impl Controller {
    /// From its base URL, `http://HOST:PORT[/PATH]`.
    pub fn new(url: &str) -> Result<Controller, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            format!("repository_controller {url:?}: expected http://HOST:PORT/PATH")
        })?;
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        if authority.is_empty() {
            return Err(format!(
                "repository_controller {url:?}: expected http://HOST:PORT/PATH"
            ));
        }
        Ok(Controller {
            authority: authority.to_string(),
            base_path: path.trim_end_matches('/').to_string(),
        })
    }

    /// Calls `what` with `body`, within `timeout`.
    pub async fn call(
        &self,
        what: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<Value, ControllerError> {
        match tokio::time::timeout(timeout, self.exchange(what, body)).await {
            Ok(answer) => answer,
            Err(_) => Err(ControllerError {
                status: 504,
                message: format!(
                    "the repository controller did not answer {what} within {} ms",
                    timeout.as_millis()
                ),
            }),
        }
    }

    async fn exchange(&self, what: &str, body: &Value) -> Result<Value, ControllerError> {
        let unreachable = |e: String| ControllerError {
            status: 502,
            message: format!("repository controller ({what}): {e}"),
        };
        let stream = tokio::net::TcpStream::connect(&self.authority)
            .await
            .map_err(|e| unreachable(format!("cannot connect to {}: {e}", self.authority)))?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        tokio::spawn(conn);
        let path = match self.base_path.as_str() {
            "" => format!("/{what}"),
            base => format!("/{base}/{what}"),
        };
        let request = Request::post(path)
            .header(header::HOST, &self.authority)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))
            .map_err(|e| unreachable(e.to_string()))?;
        let response = send
            .send_request(request)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let status = response.status().as_u16();
        let bytes = axum::body::to_bytes(Body::new(response.into_body()), MAX_ANSWER)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let answer: Value = serde_json::from_slice(&bytes)
            .map_err(|e| unreachable(format!("answer is not JSON ({e})")))?;
        if status == 200 {
            return Ok(answer);
        }
        let message = (answer.get("error").and_then(Value::as_str))
            .map_or_else(|| answer.to_string(), str::to_string);
        Err(ControllerError { status, message })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_base_url_is_parsed() {
        let c = Controller::new("http://127.0.0.1:9/s3cret/").unwrap();
        assert_eq!(
            (c.authority.as_str(), c.base_path.as_str()),
            ("127.0.0.1:9", "s3cret")
        );
        let c = Controller::new("http://h:1").unwrap();
        assert_eq!(c.base_path, "");
        for bad in ["https://h:1/x", "h:1", "http:///x"] {
            assert!(Controller::new(bad)
                .unwrap_err()
                .contains("expected http://"));
        }
    }
}
