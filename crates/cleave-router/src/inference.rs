//! The two inference endpoints (`infer`, `rank`) over HTTP: a request's budget starts at its
//! first byte; admission control may refuse it before its body is read; the body is read
//! under the size, rate and time bounds of body.rs; then it is parsed and run through the
//! router's pipeline. Every response carries the request's trace id as `x-request-id`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::{json, Map, Value};

use crate::admission::{RankerLoad, Shed, Stages};
use crate::binary_tensor::{header_length, HEADER_LENGTH};
use crate::body::read_body;
use crate::conn::Arrival;
use crate::error::{ErrorKind, RequestError, Stage};
use crate::http::{error_response, json_bytes, App};
use crate::kserve::{infer_response, parse_infer, InferReply};
use crate::metrics::{thread_cpu, Codec};
use crate::rank_form::{parse_rank, NestedOutputs};
use crate::router::{Budget, Inference};

/// The optional request header that gives a request's budget before its body is read, so
/// that admission control judges it by its own budget (docs/api.md, "Admission control").
pub const BUDGET_HEADER: &str = "cleave-budget-ms";

#[derive(Clone, Copy)]
enum Form {
    Infer,
    Rank,
}

enum Failure {
    Request(RequestError),
    Shed(Shed),
}

impl From<RequestError> for Failure {
    fn from(e: RequestError) -> Failure {
        Failure::Request(e)
    }
}

pub async fn infer(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    request: Request,
) -> Response {
    handle(&app, &name, request, Form::Infer).await
}

pub async fn rank(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    request: Request,
) -> Response {
    handle(&app, &name, request, Form::Rank).await
}

/// Runs one request and renders its outcome, counted in the metrics.
async fn handle(app: &App, name: &str, request: Request, form: Form) -> Response {
    // Without the front door (tests calling the routes directly), the handler's start.
    let arrival = request
        .extensions()
        .get::<Arrival>()
        .map_or_else(Instant::now, |a| a.0);
    app.router.metrics.request();
    let mut budget = Budget::new(arrival, app.default_budget_ms);
    let mut body_read = false;
    let result = run(app, name, request, form, &mut budget, &mut body_read).await;
    let trace_id = cleave_wire::log::trace_id(budget.trace_id);
    let mut response = match result {
        Ok(reply) => {
            app.router.metrics.observe(Stage::Total, arrival.elapsed());
            tracing::debug!(%trace_id, model = name, elapsed_us = arrival.elapsed().as_micros() as u64, "answered");
            reply_response(reply)
        }
        Err(Failure::Request(e)) => {
            app.router.metrics.error(e.kind);
            tracing::warn!(%trace_id, model = name, kind = ?e.kind, stage = ?e.stage, error = %e.message, "request failed");
            error_response(&e)
        }
        Err(Failure::Shed(shed)) => {
            app.router.metrics.error(ErrorKind::Overloaded);
            tracing::warn!(%trace_id, model = name, reason = %shed.message, "request shed");
            shed_response(&shed)
        }
    };
    let headers = response.headers_mut();
    if let Ok(id) = HeaderValue::from_str(&trace_id) {
        headers.insert("x-request-id", id);
    }
    // A body left unread cannot be skipped to reach the next request: close after this one.
    if !body_read {
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// A 200: JSON, or a JSON header and binary outputs (the binary tensor data extension).
fn reply_response(reply: InferReply) -> Response {
    let Some(header) = reply.header else {
        return json_bytes(StatusCode::OK, reply.body);
    };
    let mut response = Response::new(axum::body::Body::from(reply.body));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    headers.insert(HEADER_LENGTH, HeaderValue::from(header));
    response
}

fn shed_response(shed: &Shed) -> Response {
    let body = json!({"error": shed.message, "stage": Stage::Admission.as_str()});
    let mut response = json_bytes(
        ErrorKind::Overloaded.status(),
        body.to_string().into_bytes(),
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(shed.retry_after_s));
    response
}

async fn run(
    app: &App,
    name: &str,
    request: Request,
    form: Form,
    budget: &mut Budget,
    body_read: &mut bool,
) -> Result<InferReply, Failure> {
    let model = app.model(name)?;
    let (parts, body) = request.into_parts();
    let asked = header_budget(&parts.headers)?;
    // Checked before the body is read: a bad header is the client's mistake however long
    // the body is.
    let binary_header =
        header_length(&parts.headers).map_err(|e| RequestError::invalid(e.to_string()))?;
    check_identity_encoding(&parts.headers)?;
    app.set_budget(budget, asked)?;
    let load = RankerLoad::of(&app.router.rankers);
    let _permit = app
        .admission
        .admit(budget.start.elapsed(), budget.budget, &load)
        .map_err(Failure::Shed)?;

    // The body's own budget_ms is not known until it is read: reading is bounded by the
    // header's budget, else by the largest budget a body may ask for (and by the rate).
    let read_ms = asked.unwrap_or(app.max_budget_ms);
    let until = budget.start + Duration::from_secs_f64(read_ms / 1e3);
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let bytes = read_body(body, declared, &app.body, (until, read_ms), budget.start).await?;
    *body_read = true;

    let metrics = &app.router.metrics;
    match form {
        Form::Infer => {
            let protocol = match binary_header {
                Some(_) => Codec::Binary,
                None => Codec::Json,
            };
            let cpu = thread_cpu();
            let req = parse_infer(model, &bytes, binary_header);
            metrics.codec_cpu("parse", protocol, cpu);
            let req = req?;
            app.set_budget(budget, req.budget_ms)?;
            let parsed = budget.start.elapsed();
            let inf = app.router.infer(req.inputs, budget).await?;
            app.admission.observe(stages(parsed, &inf));
            let cpu = thread_cpu();
            let reply = infer_response(
                model,
                req.id.as_deref(),
                &inf.outputs,
                req.outputs.as_deref(),
                &req.binary,
                &timings(&inf),
            );
            let protocol = match reply.header {
                Some(_) => Codec::Binary,
                None => Codec::Json,
            };
            metrics.codec_cpu("encode", protocol, cpu);
            Ok(reply)
        }
        Form::Rank => {
            if binary_header.is_some() {
                return Err(RequestError::invalid(format!(
                    "header {HEADER_LENGTH}: the rank form takes JSON only; send binary \
                     tensors to /v2/models/{name}/infer"
                ))
                .into());
            }
            let cpu = thread_cpu();
            let req = parse_rank(model, &bytes);
            metrics.codec_cpu("parse", Codec::Rank, cpu);
            let req = req?;
            app.set_budget(budget, req.budget_ms)?;
            let parsed = budget.start.elapsed();
            let inf = app.router.infer(req.inputs, budget).await?;
            app.admission.observe(stages(parsed, &inf));
            let cpu = thread_cpu();
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
            let body = body.to_string().into_bytes();
            metrics.codec_cpu("encode", Codec::Rank, cpu);
            Ok(InferReply { body, header: None })
        }
    }
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

pub(crate) fn stages(parse: Duration, inf: &Inference) -> Stages {
    Stages {
        parse,
        lookup: inf.lookup,
        transfer: inf.transfer,
        batch: inf.compute,
    }
}

pub(crate) fn timings(inf: &Inference) -> Map<String, Value> {
    let us = |d: Duration| Value::from(d.as_micros() as u64);
    let mut p = Map::new();
    p.insert("ranker".into(), inf.ranker.clone().into());
    p.insert("lookup_us".into(), us(inf.lookup));
    p.insert("transfer_us".into(), us(inf.transfer));
    p.insert("queue_us".into(), us(inf.queue));
    p.insert("compute_us".into(), us(inf.compute));
    p.insert("batch_requests".into(), inf.batch_requests.into());
    p
}

#[cfg(test)]
mod tests {
    use super::*;

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
