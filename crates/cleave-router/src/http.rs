//! The HTTP API (docs/api.md): KServe v2 endpoints, the per-feature `rank` form, health,
//! metrics, and the membership admin API (admin.rs). Every failure becomes a JSON `{"error": ...}` with the status of its kind; nothing
//! a client sends can take the process down. The inference endpoints themselves are in
//! inference.rs.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use cleave_wire::health::Health;
use serde_json::json;

use crate::admin::{self, AdminConfig};
use crate::admission::{Admission, ShedReason};
use crate::body::BodyLimits;
use crate::error::{ErrorKind, RequestError};
use crate::front_door::DoorStats;
use crate::inference::{infer, rank};
use crate::kserve::model_metadata;
use crate::metrics::FrontStats;
use crate::router::{Budget, Router};

/// What the handlers share.
pub struct App {
    pub router: Router,
    pub default_budget_ms: f64,
    pub max_budget_ms: f64,
    pub body: BodyLimits,
    pub admission: Admission,
    pub door: Arc<DoorStats>,
    /// The last probe's findings (docs/api.md, "Health").
    pub health: Mutex<Health>,
    pub admin: AdminConfig,
}

impl App {
    pub fn model(&self, name: &str) -> Result<&crate::model::Model, RequestError> {
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

    /// Sets the budget a request asked for, within the router's largest.
    pub fn set_budget(&self, budget: &mut Budget, asked: Option<f64>) -> Result<(), RequestError> {
        let Some(ms) = asked else { return Ok(()) };
        if ms > self.max_budget_ms {
            return Err(RequestError::invalid(format!(
                "budget_ms is {ms}, more than this router allows ({})",
                self.max_budget_ms
            )));
        }
        budget.budget = Duration::from_secs_f64(ms / 1e3);
        Ok(())
    }

    pub fn health(&self) -> Health {
        self.health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn front_stats(&self) -> FrontStats {
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        let refused = load(&self.door.refused);
        FrontStats {
            in_flight: self.admission.in_flight(),
            connections: self.door.open.load(std::sync::atomic::Ordering::Relaxed),
            shed: ShedReason::ALL
                .iter()
                .map(|&r| match r {
                    ShedReason::Connections => (r.as_str(), refused),
                    _ => (r.as_str(), self.admission.shed_total(r)),
                })
                .collect(),
            closed: vec![
                ("header_timeout", load(&self.door.header_timeouts)),
                ("idle_timeout", load(&self.door.idle_timeouts)),
            ],
        }
    }
}

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
        .route("/metrics", get(metrics))
        .merge(admin::routes())
        .fallback(|| async {
            error_response(&RequestError::new(
                ErrorKind::UnknownModel,
                "no such endpoint; see docs/api.md for the routes this router serves",
            ))
        })
        .with_state(app)
}

/// A JSON body with the right content type.
pub fn json_bytes(status: StatusCode, body: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

pub fn error_response(e: &RequestError) -> Response {
    let mut body = json!({"error": e.message});
    if let Some(stage) = e.stage {
        body["stage"] = stage.as_str().into();
    }
    json_bytes(e.status(), body.to_string().into_bytes())
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
    match app.model(&name) {
        Ok(_) => readiness(&app),
        Err(e) => error_response(&e),
    }
}

async fn metadata(State(app): State<Arc<App>>, Path(name): Path<String>) -> Response {
    match app.model(&name) {
        Ok(model) => json_bytes(
            StatusCode::OK,
            model_metadata(model).to_string().into_bytes(),
        ),
        Err(e) => error_response(&e),
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let text = app
        .router
        .metrics
        .render(&app.router.rankers.loads(), &app.front_stats());
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        text,
    )
        .into_response()
}
