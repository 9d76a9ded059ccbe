//! The REST door's routes (docs/api.md): KServe v2 endpoints, the per-feature `rank` form,
//! health, metrics, and the membership admin API (admin.rs). An inference request's head is
//! read here (its budget header, binary header, encoding) and its codec chosen; the envelope
//! (envelope.rs) does the rest, reading the body under the bounds of body.rs once admitted.
//! Every failure becomes a JSON `{"error": ...}` with the status of its kind; nothing a
//! client sends can take the process down.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use cleave_wire::health::Health;
use serde_json::json;

use crate::admin;
use crate::app::App;
use crate::codec::binary_tensor::header_length;
use crate::codec::json::{error_response, json_bytes, RankForm};
use crate::codec::kserve::model_metadata;
use crate::codec::kserve_rest::Kserve;
use crate::envelope::{self, Head, BUDGET_HEADER, KEY_HEADER};
use crate::error::{ErrorKind, RequestError};
use crate::front::body::{discard, read_body};
use crate::front::conn::Arrival;

pub fn routes(app: Arc<App>) -> axum::Router {
    axum::Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/live", get(live))
        .route("/ready", get(ready))
        .route("/v2/models/{name}", get(metadata))
        .route("/v2/models/{name}/ready", get(model_ready))
        .route("/v2/models/{name}/infer", post(infer))
        .route("/v2/models/{name}/rank", post(rank))
        .route(
            "/v2/models/{name}/versions/{version}",
            get(version_metadata),
        )
        .route(
            "/v2/models/{name}/versions/{version}/ready",
            get(version_ready),
        )
        .route(
            "/v2/models/{name}/versions/{version}/infer",
            post(version_infer),
        )
        .route(
            "/v2/models/{name}/versions/{version}/rank",
            post(version_rank),
        )
        .route("/metrics", get(metrics))
        .merge(admin::routes())
        .merge(crate::front::repository::routes())
        .fallback(|| async {
            error_response(
                &RequestError::new(
                    ErrorKind::UnknownModel,
                    "no such endpoint; see docs/api.md for the routes this router serves",
                )
                .into(),
            )
        })
        .with_state(app)
}

#[derive(Clone, Copy)]
enum Form {
    Infer,
    Rank,
}

async fn infer(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    request: Request,
) -> Response {
    inference(&app, (name, None), request, Form::Infer).await
}

async fn rank(State(app): State<Arc<App>>, Path(name): Path<String>, request: Request) -> Response {
    inference(&app, (name, None), request, Form::Rank).await
}

async fn version_infer(
    State(app): State<Arc<App>>,
    Path((name, version)): Path<(String, String)>,
    request: Request,
) -> Response {
    inference(&app, (name, Some(version)), request, Form::Infer).await
}

async fn version_rank(
    State(app): State<Arc<App>>,
    Path((name, version)): Path<(String, String)>,
    request: Request,
) -> Response {
    inference(&app, (name, Some(version)), request, Form::Rank).await
}

/// Reads the head, picks the codec, and hands the request to the envelope. A body the
/// envelope did not ask for (the request was refused or failed first) is discarded when that
/// is cheap, so that the connection stays usable; otherwise the response closes it.
async fn inference(
    app: &App,
    (model, version): (String, Option<String>),
    request: Request,
    form: Form,
) -> Response {
    // Without the front door (tests calling the routes directly), the handler's start.
    let arrival = request
        .extensions()
        .get::<Arrival>()
        .map_or_else(Instant::now, |a| a.0);
    let (parts, body) = request.into_parts();
    // Checked before the body is read: a bad header is the client's mistake however long
    // the body is.
    let binary = header_length(&parts.headers).map_err(|e| RequestError::invalid(e.to_string()));
    let asked = header_budget(&parts.headers).and_then(|asked| {
        binary.as_ref().map_err(Clone::clone)?;
        check_identity_encoding(&parts.headers)?;
        Ok(asked)
    });
    let binary = binary.ok().flatten();
    let key =
        (parts.headers.get(KEY_HEADER)).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let head = Head {
        model,
        version,
        key,
        arrival,
        asked,
        message_read: false,
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let (mut unread, read_whole) = (Some(body), &AtomicBool::new(false));
    let receive = |until| {
        let body = unread.take().unwrap_or_default();
        async move {
            let read = read_body(body, declared, &app.body, until, arrival).await;
            read_whole.store(read.is_ok(), Ordering::Relaxed);
            read
        }
    };
    let mut response = match (form, binary) {
        (Form::Infer, binary_header) => {
            envelope::handle(app, &Kserve { binary_header }, head, receive).await
        }
        (Form::Rank, binary_header) => {
            envelope::handle(app, &RankForm { binary_header }, head, receive).await
        }
    };
    let reusable = match unread {
        Some(body) => discard(body, declared).await,
        None => read_whole.load(Ordering::Relaxed),
    };
    if !reusable {
        let close = HeaderValue::from_static("close");
        response.headers_mut().insert(header::CONNECTION, close);
    }
    response
}

async fn server_metadata() -> Response {
    let body = json!({"name": "cleave", "version": env!("CARGO_PKG_VERSION"), "extensions": ["binary_tensor_data"]});
    json_bytes(StatusCode::OK, body.to_string().into_bytes())
}

fn health_response(health: &Health, status: StatusCode) -> Response {
    json_bytes(status, health.to_json().into_bytes())
}

/// 200 while the process runs; the body is the current health, for information.
async fn live(State(app): State<Arc<App>>) -> Response {
    health_response(&app.health(), StatusCode::OK)
}

fn readiness(app: &App) -> Response {
    let health = app.health();
    let status =
        StatusCode::from_u16(health.http_status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    health_response(&health, status)
}

async fn ready(State(app): State<Arc<App>>) -> Response {
    readiness(&app)
}

async fn model_ready(State(app): State<Arc<App>>, Path(name): Path<String>) -> Response {
    match app.repo.registry.ready(&name, None) {
        Ok(_) => readiness(&app),
        Err(e) => error_response(&e.into()),
    }
}

async fn version_ready(
    State(app): State<Arc<App>>,
    Path((name, version)): Path<(String, String)>,
) -> Response {
    match app.repo.registry.ready(&name, Some(&version)) {
        Ok(_) => readiness(&app),
        Err(e) => error_response(&e.into()),
    }
}

async fn metadata(State(app): State<Arc<App>>, Path(name): Path<String>) -> Response {
    versioned_metadata(&app, &name, None)
}

async fn version_metadata(
    State(app): State<Arc<App>>,
    Path((name, version)): Path<(String, String)>,
) -> Response {
    versioned_metadata(&app, &name, Some(&version))
}

/// The named (else the default) version's metadata; the default's lists every READY version.
fn versioned_metadata(app: &App, name: &str, version: Option<&str>) -> Response {
    let router = match app.repo.registry.ready(name, version) {
        Ok(router) => router,
        Err(e) => return error_response(&e.into()),
    };
    let mut body = model_metadata(&router.model);
    if version.is_none() {
        let ready = app.repo.registry.ready_versions(name);
        body["versions"] = ready.iter().map(|v| v.to_string()).collect();
    }
    json_bytes(StatusCode::OK, body.to_string().into_bytes())
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    // A ranker serving several versions is one series.
    let mut loads: Vec<(String, u64, f64)> = Vec::new();
    for router in app.repo.registry.all_ready() {
        for load in router.rankers.loads() {
            if !loads.iter().any(|l| l.0 == load.0) {
                loads.push(load);
            }
        }
    }
    let text = app.metrics.render(&loads, &app.front_stats());
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        text,
    )
        .into_response()
}

/// Compressed bodies (tritonclient's `request_compression_algorithm`) are refused by name
/// rather than failing as JSON that does not parse.
fn check_identity_encoding(headers: &HeaderMap) -> Result<(), RequestError> {
    match headers.get(header::CONTENT_ENCODING) {
        None => Ok(()),
        Some(v) if v.as_bytes().eq_ignore_ascii_case(b"identity") => Ok(()),
        Some(v) => Err(RequestError::invalid(format!(
            "header content-encoding is {v:?}: compressed request bodies are not supported; \
             send the body uncompressed"
        ))),
    }
}

/// The `cleave-budget-ms` header, when given: a positive number of milliseconds.
fn header_budget(headers: &HeaderMap) -> Result<Option<f64>, RequestError> {
    let Some(value) = headers.get(BUDGET_HEADER) else {
        return Ok(None);
    };
    let text = value.to_str().unwrap_or("").trim();
    match text.parse::<f64>() {
        Ok(ms) if ms > 0.0 && ms.is_finite() => Ok(Some(ms)),
        _ => Err(RequestError::invalid(format!(
            "header {BUDGET_HEADER} is {value:?}, expected a positive number of milliseconds"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn budget_header() {
        let mut h = HeaderMap::new();
        assert_eq!(header_budget(&h).unwrap(), None);
        h.insert(BUDGET_HEADER, HeaderValue::from_static(" 25.5"));
        assert_eq!(header_budget(&h).unwrap(), Some(25.5));
        for bad in ["0", "-3", "soon", "inf", "NaN"] {
            h.insert(BUDGET_HEADER, HeaderValue::from_static(bad));
            let e = header_budget(&h).unwrap_err();
            assert!(
                e.message
                    .contains("expected a positive number of milliseconds"),
                "{}",
                e.message
            );
            assert!(e.message.contains(bad), "{}", e.message);
        }
    }

    #[test]
    fn compressed_bodies_are_refused_by_name() {
        let mut h = HeaderMap::new();
        assert!(check_identity_encoding(&h).is_ok());
        h.insert(
            header::CONTENT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        assert!(check_identity_encoding(&h).is_ok());
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        let e = check_identity_encoding(&h).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidInput);
        assert!(
            e.message
                .contains("content-encoding is \"gzip\": compressed request bodies"),
            "{}",
            e.message
        );
    }
}
