//! The HTTP API (docs/api.md): KServe v2 endpoints, the per-feature `rank` form, metrics.
//! Every failure becomes a JSON `{"error": ...}` with the status of its kind; nothing a client
//! sends can take the process down.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{json, Map, Value};

use crate::error::{ErrorKind, RequestError, Stage};
use crate::kserve::{infer_response, model_metadata, parse_infer};
use crate::rank_form::{parse_rank, NestedOutputs};
use crate::router::{Budget, Inference, Router};

/// What the handlers share.
pub struct App {
    pub router: Router,
    pub default_budget_ms: f64,
    pub max_budget_ms: f64,
    pub body_limit: usize,
    /// Why the router is not ready (empty: every shard and ranker answered the last probe).
    pub problems: Mutex<Vec<String>>,
}

impl App {
    fn model(&self, name: &str) -> Result<&crate::model::Model, RequestError> {
        let model = &self.router.model;
        if model.name == name {
            Ok(model)
        } else {
            Err(RequestError::new(
                ErrorKind::UnknownModel,
                format!(
                    "unknown model {name:?}; this router serves {:?}",
                    model.name
                ),
            ))
        }
    }

    fn budget(&self, start: Instant, asked: Option<f64>) -> Result<Budget, RequestError> {
        let ms = asked.unwrap_or(self.default_budget_ms);
        if ms > self.max_budget_ms {
            return Err(RequestError::invalid(format!(
                "budget_ms is {ms}, more than this router allows ({})",
                self.max_budget_ms
            )));
        }
        Ok(Budget::new(start, ms))
    }

    fn body(&self, body: Result<Bytes, BytesRejection>) -> Result<Bytes, RequestError> {
        body.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                RequestError::new(
                    ErrorKind::TooLarge,
                    format!(
                        "request body is larger than the limit of {} bytes",
                        self.body_limit
                    ),
                )
            } else {
                RequestError::json(rejection.body_text())
            }
        })
    }

    pub fn problems(&self) -> Vec<String> {
        self.problems
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

pub fn routes(app: Arc<App>) -> axum::Router {
    let limit = app.body_limit;
    axum::Router::new()
        .route("/v2", get(server_metadata))
        .route(
            "/v2/health/live",
            get(|| async { Json(json!({"live": true})) }),
        )
        .route("/v2/health/ready", get(ready))
        .route("/v2/models/{name}", get(metadata))
        .route("/v2/models/{name}/ready", get(model_ready))
        .route("/v2/models/{name}/infer", post(infer))
        .route("/v2/models/{name}/rank", post(rank))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            error_response(&RequestError::new(
                ErrorKind::UnknownModel,
                "no such endpoint; see docs/api.md for the routes this router serves",
            ))
        })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(app)
}

/// A JSON body with the right content type.
struct Json(Value);

impl IntoResponse for Json {
    fn into_response(self) -> Response {
        json_bytes(StatusCode::OK, self.0.to_string().into_bytes())
    }
}

fn json_bytes(status: StatusCode, body: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn error_response(e: &RequestError) -> Response {
    let mut body = json!({"error": e.message});
    if let Some(stage) = e.stage {
        body["stage"] = stage.as_str().into();
    }
    json_bytes(e.status(), body.to_string().into_bytes())
}

/// Counts the outcome and renders it.
fn finish(app: &App, start: Instant, result: Result<Vec<u8>, RequestError>) -> Response {
    match result {
        Ok(body) => {
            app.router.metrics.observe(Stage::Total, start.elapsed());
            json_bytes(StatusCode::OK, body)
        }
        Err(e) => {
            app.router.metrics.error(e.kind);
            error_response(&e)
        }
    }
}

fn timings(inf: &Inference) -> Map<String, Value> {
    let us = |d: std::time::Duration| Value::from(d.as_micros() as u64);
    let mut p = Map::new();
    p.insert("ranker".into(), inf.ranker.clone().into());
    p.insert("lookup_us".into(), us(inf.lookup));
    p.insert("transfer_us".into(), us(inf.transfer));
    p.insert("queue_us".into(), us(inf.queue));
    p.insert("compute_us".into(), us(inf.compute));
    p.insert("batch_requests".into(), inf.batch_requests.into());
    p
}

async fn infer(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let start = Instant::now();
    app.router.metrics.request();
    let result = async {
        let model = app.model(&name)?;
        let body = app.body(body)?;
        let req = parse_infer(model, &body)?;
        let budget = app.budget(start, req.budget_ms)?;
        let inf = app.router.infer(req.inputs, &budget).await?;
        let params = timings(&inf);
        Ok(infer_response(
            model,
            req.id.as_deref(),
            &inf.outputs,
            req.outputs.as_deref(),
            &params,
        ))
    }
    .await;
    finish(&app, start, result)
}

async fn rank(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let start = Instant::now();
    app.router.metrics.request();
    let result = async {
        let model = app.model(&name)?;
        let body = app.body(body)?;
        let req = parse_rank(model, &body)?;
        let budget = app.budget(start, req.budget_ms)?;
        let inf = app.router.infer(req.inputs, &budget).await?;
        let outputs = model
            .outputs
            .iter()
            .map(|s| s.name.as_str())
            .zip(inf.outputs.iter())
            .collect();
        let body = json!({
            "model_name": model.name,
            "id": req.id,
            "candidates": req.candidates,
            "outputs": serde_json::to_value(NestedOutputs(outputs)).unwrap_or(Value::Null),
            "parameters": timings(&inf),
        });
        Ok(body.to_string().into_bytes())
    }
    .await;
    finish(&app, start, result)
}

async fn server_metadata() -> Json {
    Json(json!({"name": "cleave", "version": env!("CARGO_PKG_VERSION"), "extensions": []}))
}

fn readiness(app: &App) -> Response {
    let problems = app.problems();
    let status = if problems.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({"ready": problems.is_empty(), "problems": problems});
    json_bytes(status, body.to_string().into_bytes())
}

async fn ready(State(app): State<Arc<App>>) -> Response {
    readiness(&app)
}

async fn model_ready(State(app): State<Arc<App>>, Path(name): Path<String>) -> Response {
    match app.model(&name) {
        Ok(_) => readiness(&app),
        Err(e) => error_response(&e),
    }
}

async fn metadata(State(app): State<Arc<App>>, Path(name): Path<String>) -> Response {
    match app.model(&name) {
        Ok(model) => Json(model_metadata(model)).into_response(),
        Err(e) => error_response(&e),
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let text = app.router.metrics.render(&app.router.rankers.loads());
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        text,
    )
        .into_response()
}
