//! The per-feature rank form (`/rank`), and what every REST reply shares: the JSON error body
//! every REST failure gets
//! (`{"error": ..., "stage": ...}` with the status of its kind, `Retry-After` when shed).

use axum::body::Bytes;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::codec::binary_tensor::HEADER_LENGTH;
use crate::codec::rank_form::{parse_rank, NestedOutputs};
use crate::codec::{timings, Codec, Parsed};
use crate::error::{Failure, RequestError};
use crate::metrics::Protocol;
use crate::model::Model;
use crate::pipeline::router::Inference;

/// The per-feature rank form; `binary_header` is the request's binary header, which this
/// form refuses.
pub struct RankForm {
    pub binary_header: Option<usize>,
}

/// What a rank reply repeats of its request.
pub struct RankContext {
    id: Option<String>,
    candidates: usize,
}

impl Codec for RankForm {
    type Message = Bytes;
    type Context = RankContext;
    type Response = Response;

    fn protocol(&self) -> Protocol {
        Protocol::Rank
    }

    fn parse(&self, model: &Model, body: Bytes) -> Result<Parsed<RankContext>, RequestError> {
        if self.binary_header.is_some() {
            return Err(RequestError::invalid(format!(
                "header {HEADER_LENGTH}: the rank form takes JSON only; send binary tensors to \
                 /v2/models/{}/infer",
                model.name
            )));
        }
        let req = parse_rank(model, &body)?;
        Ok(Parsed {
            inputs: req.inputs,
            budget_ms: req.budget_ms,
            version: None,
            context: RankContext {
                id: req.id,
                candidates: req.candidates,
            },
        })
    }

    fn encode(&self, model: &Model, context: RankContext, inf: Inference) -> (Response, Protocol) {
        let outputs = model
            .outputs
            .iter()
            .map(|s| s.name.as_str())
            .zip(inf.outputs.iter())
            .collect();
        let body = json!({
            "model_name": model.name,
            "model_version": model.version,
            "id": context.id,
            "candidates": context.candidates,
            "outputs": serde_json::to_value(NestedOutputs(outputs)).unwrap_or(Value::Null),
            "parameters": timings(&inf),
        });
        let body = body.to_string().into_bytes();
        (json_bytes(StatusCode::OK, body), Protocol::Rank)
    }

    fn error(&self, failure: &Failure) -> Response {
        error_response(failure)
    }

    fn finish(&self, response: &mut Response, trace_id: &str) {
        finish(response, trace_id)
    }
}

/// A JSON body with the right content type.
pub fn json_bytes(status: StatusCode, body: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// A REST failure: `{"error", "stage"}` with its kind's status, and `Retry-After` when shed.
pub fn error_response(failure: &Failure) -> Response {
    let e = &failure.error;
    let mut body = json!({"error": e.message});
    if let Some(stage) = e.stage {
        body["stage"] = stage.as_str().into();
    }
    let mut response = json_bytes(e.status(), body.to_string().into_bytes());
    if let Some(seconds) = failure.retry_after_s {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

/// The REST door's part of [`Codec::finish`].
pub fn finish(response: &mut Response, trace_id: &str) {
    if let Ok(id) = HeaderValue::from_str(trace_id) {
        response.headers_mut().insert("x-request-id", id);
    }
}
