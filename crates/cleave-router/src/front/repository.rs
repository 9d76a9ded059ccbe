//! The repository API's REST routes (KServe v2 / Triton's repository extension, docs/api.md
//! "Model repository"): the index, load and unload. They need the admin token when one is
//! set; a refusal is `{"error": ...}` with the status of its kind.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::admin::authorize;
use crate::app::App;
use crate::codec::json::json_bytes;
use crate::config::Version;
use crate::repository::{parse_version, Refusal, Why};

pub fn routes() -> axum::Router<Arc<App>> {
    axum::Router::new()
        .route("/v2/repository/index", post(index))
        .route("/v2/repository/models/{name}/load", post(load))
        .route("/v2/repository/models/{name}/unload", post(unload))
}

fn refused(r: Refusal) -> Response {
    let status = StatusCode::from_u16(r.http_status()).unwrap_or(StatusCode::BAD_REQUEST);
    json_bytes(status, json!({"error": r.message}).to_string().into_bytes())
}

fn ok(body: Value) -> Response {
    json_bytes(StatusCode::OK, body.to_string().into_bytes())
}

/// A body that may be empty, else a JSON object.
fn body_object(body: &[u8], expected: &str) -> Result<Map<String, Value>, Refusal> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(Refusal::new(
            Why::Invalid,
            format!("request body is {other}; expected {expected}"),
        )),
        Err(e) => Err(Refusal::new(
            Why::Invalid,
            format!("request body: {e}; expected {expected}"),
        )),
    }
}

async fn index(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    let run = async {
        let body = body_object(&body, r#"{} or {"ready": true}"#)?;
        let ready = match body.get("ready").cloned() {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => b,
            Some(other) => {
                return Err(Refusal::new(
                    Why::Invalid,
                    format!("ready is {other}; expected true or false"),
                ))
            }
        };
        app.repo.index(ready).await
    };
    match run.await {
        Ok(entries) => ok(json!(entries)),
        Err(r) => refused(r),
    }
}

#[derive(Deserialize)]
struct VersionQuery {
    version: Option<String>,
}

/// What a load or unload asks: `version` (query or parameter) and, for a load, the
/// `version_policy` of the `config` parameter.
#[derive(Debug)]
pub struct Change {
    pub version: Option<Version>,
    pub policy: Option<Value>,
}

/// Reads the parameters of a load or unload (REST body or gRPC map, as JSON values).
pub fn change(
    parameters: &Map<String, Value>,
    query_version: Option<&str>,
) -> Result<Change, Refusal> {
    let version = match (query_version, parameters.get("version")) {
        (Some(v), _) => Some(parse_version(v)?),
        (None, None | Some(Value::Null)) => None,
        (None, Some(Value::String(v))) => Some(parse_version(v)?),
        (None, Some(Value::Number(n))) => Some(parse_version(&n.to_string())?),
        (None, Some(other)) => {
            return Err(Refusal::new(
                Why::Invalid,
                format!("parameter version is {other}; expected a version such as \"3\""),
            ))
        }
    };
    let policy = match parameters.get("config") {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => {
            let config: Value = serde_json::from_str(text).map_err(|e| {
                Refusal::new(
                    Why::Invalid,
                    format!("parameter config is not JSON ({e}); expected a model config"),
                )
            })?;
            config.get("version_policy").cloned()
        }
        Some(other) => {
            return Err(Refusal::new(
                Why::Invalid,
                format!("parameter config is {other}; expected a JSON string"),
            ))
        }
    };
    Ok(Change { version, policy })
}

fn parameters(body: &[u8]) -> Result<Map<String, Value>, Refusal> {
    let expected = r#"{"parameters": {"config": "<JSON>", "version": "V"}} (both optional)"#;
    let body = body_object(body, expected)?;
    match body.get("parameters") {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(p)) => Ok(p.clone()),
        Some(other) => Err(Refusal::new(
            Why::Invalid,
            format!("parameters is {other}; expected {expected}"),
        )),
    }
}

async fn load(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    Query(query): Query<VersionQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    change_model(&app, &headers, &body, query, |app, c| async move {
        app.repo.load(&name, c.policy, c.version).await
    })
    .await
}

async fn unload(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    Query(query): Query<VersionQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    change_model(&app, &headers, &body, query, |app, c| async move {
        app.repo.unload(&name, c.version).await
    })
    .await
}

/// A load or unload: the admin token, the change its parameters and query ask for, `run` it
/// (to its end even if the client leaves: `App::change_repository`).
async fn change_model<F, R>(
    app: &Arc<App>,
    headers: &HeaderMap,
    body: &Bytes,
    query: VersionQuery,
    run: F,
) -> Response
where
    F: FnOnce(Arc<App>, Change) -> R,
    R: std::future::Future<Output = Result<(), Refusal>> + Send + 'static,
{
    if let Err(e) = authorize(app, headers) {
        return e.into_response();
    }
    let c = match parameters(body).and_then(|p| change(&p, query.version.as_deref())) {
        Ok(c) => c,
        Err(r) => return refused(r),
    };
    match app.change_repository(|app| run(app, c)).await {
        Ok(()) => ok(json!({})),
        Err(r) => refused(r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_parameters() {
        let p = |v: Value| v.as_object().unwrap().clone();
        let c = change(&p(json!({})), None).unwrap();
        assert_eq!((c.version, c.policy), (None, None));
        let c = change(&p(json!({"version": "3"})), None).unwrap();
        assert_eq!(c.version, Some(Version(3)));
        let c = change(&p(json!({"version": "3"})), Some("4")).unwrap();
        assert_eq!(c.version, Some(Version(4)));
        let config = json!({"version_policy": {"latest": {"num_versions": 2}}}).to_string();
        let c = change(&p(json!({"config": config})), None).unwrap();
        assert_eq!(c.policy, Some(json!({"latest": {"num_versions": 2}})));
        let e = change(&p(json!({"version": "v3"})), None).unwrap_err();
        assert!(
            e.message.contains("expected a decimal integer"),
            "{}",
            e.message
        );
        let e = change(&p(json!({"config": "{"})), None).unwrap_err();
        assert!(
            e.message.contains("parameter config is not JSON"),
            "{}",
            e.message
        );
        assert!(body_object(b"[1]", "{}").is_err());
        assert!(body_object(b"  ", "{}").unwrap().is_empty());
    }
}
