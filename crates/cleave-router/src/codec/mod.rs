//! Codecs: each front-door protocol turns its request into the protocol-neutral inputs the
//! pipeline takes, and the pipeline's outputs (or an error) into its reply. One file per
//! protocol — `kserve_rest` (KServe v2 over REST: JSON tensors or the binary tensor
//! extension), `json` (the per-feature rank form, and the REST error body) and `grpc` (KServe
//! v2 gRPC) — over the format modules below them.
//! Everything the protocols share (budget, admission, metrics, trace id, error mapping) is
//! in envelope.rs, which drives a [`Codec`].

use std::time::Duration;

use serde_json::{Map, Value};

use crate::error::{Failure, RequestError};
use crate::metrics::Protocol;
use crate::model::Model;
use crate::pipeline::router::Inference;
use crate::tensor::Tensor;

pub mod binary_tensor;
pub mod grpc;
pub mod grpc_tensor;
pub mod grpc_timing;
pub mod json;
pub mod json_scan;
pub mod json_tensor;
pub mod kserve;
pub mod kserve_cut;
pub mod kserve_rest;
pub mod rank_form;

/// One front-door protocol's request and reply forms.
pub trait Codec {
    /// What the transport hands over once the request is whole: a body's bytes, or the
    /// decoded gRPC message.
    type Message;
    /// What the reply needs to know of its request (its id, the outputs asked for, their form).
    type Context;
    /// What goes back to the client, a reply or an error.
    type Response;

    /// The `protocol` label of the request's parse metrics.
    fn protocol(&self) -> Protocol;

    /// The request against the model: its inputs, the budget it asks for, the reply's context.
    fn parse(
        &self,
        model: &Model,
        message: Self::Message,
    ) -> Result<Parsed<Self::Context>, RequestError>;

    /// The reply, and the `protocol` label of its encoding (a JSON request may be answered
    /// with binary outputs).
    fn encode(
        &self,
        model: &Model,
        context: Self::Context,
        inference: Inference,
    ) -> (Self::Response, Protocol);

    /// The reply to a request that failed or was shed.
    fn error(&self, failure: &Failure) -> Self::Response;

    /// What every response carries: the trace id. (Whether an HTTP/1.1 connection stays
    /// open after a body left unread is the REST door's: front/rest.rs.)
    fn finish(&self, response: &mut Self::Response, trace_id: &str);

    /// CPU the transport spent decoding this protocol's messages outside `parse` (gRPC's
    /// protobuf codec), since the last call.
    fn decode_cpu(&self) -> Duration {
        Duration::ZERO
    }

    /// As `decode_cpu`, encoding replies outside `encode`.
    fn encode_cpu(&self) -> Duration {
        Duration::ZERO
    }
}

/// A request in the pipeline's terms.
pub struct Parsed<C> {
    /// Indexed like `model.inputs`; `None` where the request did not give the input.
    pub inputs: Vec<Option<Tensor>>,
    /// The budget the message asks for, when it does.
    pub budget_ms: Option<f64>,
    /// The version the message itself names (a KServe JSON body's `model_version`).
    pub version: Option<String>,
    pub context: C,
}

/// Where the request's time went, as every reply reports it in its parameters.
pub fn timings(inf: &Inference) -> Map<String, Value> {
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
