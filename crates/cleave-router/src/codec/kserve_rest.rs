//! KServe v2 over REST: JSON tensors, or the binary tensor data extension (a JSON header of
//! `Inference-Header-Content-Length` bytes followed by the raw tensors; binary_tensor.rs
//! frames it). One codec for both bodies, told apart by that header; a request in either
//! form may ask for binary outputs.

use axum::body::Bytes;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;

use crate::codec::binary_tensor::HEADER_LENGTH;
use crate::codec::json::{error_response, finish, json_bytes};
use crate::codec::kserve::{infer_response, parse_infer, InferRequest};
use crate::codec::{timings, Codec, Parsed};
use crate::error::{Failure, RequestError};
use crate::metrics::Protocol;
use crate::model::Model;
use crate::pipeline::router::Inference;

/// KServe v2 REST; `binary_header`: the JSON header's length when the body carries binary
/// tensors.
pub struct Kserve {
    pub binary_header: Option<usize>,
}

impl Codec for Kserve {
    type Message = Bytes;
    type Context = InferContext;
    type Response = Response;

    fn protocol(&self) -> Protocol {
        match self.binary_header {
            Some(_) => Protocol::Binary,
            None => Protocol::Json,
        }
    }

    fn parse(&self, model: &Model, body: Bytes) -> Result<Parsed<InferContext>, RequestError> {
        InferContext::split(parse_infer(model, &body, self.binary_header)?)
    }

    fn encode(&self, model: &Model, context: InferContext, inf: Inference) -> (Response, Protocol) {
        infer_reply(model, context, &inf)
    }

    fn error(&self, failure: &Failure) -> Response {
        error_response(failure)
    }

    fn finish(&self, response: &mut Response, trace_id: &str) {
        finish(response, trace_id)
    }
}

/// What a KServe infer reply takes from its request.
pub struct InferContext {
    id: Option<String>,
    outputs: Option<Vec<usize>>,
    binary: Vec<bool>,
}

impl InferContext {
    pub fn split(req: InferRequest) -> Result<Parsed<InferContext>, RequestError> {
        Ok(Parsed {
            inputs: req.inputs,
            budget_ms: req.budget_ms,
            version: req.version,
            context: InferContext {
                id: req.id,
                outputs: req.outputs,
                binary: req.binary,
            },
        })
    }
}

/// A 200: JSON, or a JSON header and binary outputs; labelled by what it became.
pub fn infer_reply(model: &Model, context: InferContext, inf: &Inference) -> (Response, Protocol) {
    let reply = infer_response(
        model,
        context.id.as_deref(),
        &inf.outputs,
        context.outputs.as_deref(),
        &context.binary,
        &timings(inf),
    );
    let Some(header) = reply.header else {
        return (json_bytes(StatusCode::OK, reply.body), Protocol::Json);
    };
    let mut response = Response::new(axum::body::Body::from(reply.body));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    headers.insert(HEADER_LENGTH, HeaderValue::from(header));
    (response, Protocol::Binary)
}
