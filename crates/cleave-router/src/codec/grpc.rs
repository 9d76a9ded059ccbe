//! The KServe v2 gRPC codec: a decoded `ModelInferRequest` into the pipeline's inputs, its
//! outputs into a `ModelInferResponse`, and a failure into a `Status` with the code of its
//! kind (error.rs), the stage in `cleave-stage` metadata, and for a shed request a
//! `google.rpc.RetryInfo` in `grpc-status-details-bin` plus `retry-after` metadata (seconds).

use std::collections::HashMap;
use std::time::Duration;

use tonic::metadata::MetadataValue;
use tonic::{Response, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::codec::grpc_tensor::{grpc_response, parse_grpc};
use crate::codec::grpc_timing::{take_decode_cpu, take_encode_cpu};
use crate::codec::{timings, Codec, Parsed};
use crate::error::{Failure, RequestError};
use crate::metrics::Protocol;
use crate::model::Model;
use crate::pipeline::router::Inference;

/// The code generated from proto/kserve_v2.proto by build.rs.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("inference");
}

use pb::infer_parameter::ParameterChoice;
use pb::{InferParameter, ModelInferRequest, ModelInferResponse};

/// KServe v2 gRPC (protobuf decoding and encoding included).
pub struct GrpcCodec;

/// What a gRPC reply takes from its request.
pub struct GrpcContext {
    id: Option<String>,
    outputs: Option<Vec<usize>>,
    /// The request sent raw contents: the reply does too.
    raw: bool,
}

impl Codec for GrpcCodec {
    type Message = ModelInferRequest;
    type Context = GrpcContext;
    type Response = Result<Response<ModelInferResponse>, Status>;

    fn protocol(&self) -> Protocol {
        Protocol::Grpc
    }

    fn parse(
        &self,
        model: &Model,
        message: ModelInferRequest,
    ) -> Result<Parsed<GrpcContext>, RequestError> {
        let req = parse_grpc(model, message)?;
        Ok(Parsed {
            inputs: req.request.inputs,
            budget_ms: req.request.budget_ms,
            version: None,
            context: GrpcContext {
                id: req.request.id,
                outputs: req.request.outputs,
                raw: req.raw,
            },
        })
    }

    fn encode(
        &self,
        model: &Model,
        context: GrpcContext,
        inf: Inference,
    ) -> (Self::Response, Protocol) {
        let parameters = timings(&inf)
            .into_iter()
            .filter_map(|(k, v)| {
                let choice = match v {
                    serde_json::Value::String(s) => ParameterChoice::StringParam(s),
                    v => ParameterChoice::Int64Param(v.as_i64()?),
                };
                Some((
                    k,
                    InferParameter {
                        parameter_choice: Some(choice),
                    },
                ))
            })
            .collect::<HashMap<_, _>>();
        let reply = grpc_response(
            model,
            context.id,
            inf.outputs,
            context.outputs.as_deref(),
            context.raw,
            parameters,
        );
        (Ok(Response::new(reply)), Protocol::Grpc)
    }

    fn error(&self, failure: &Failure) -> Self::Response {
        Err(status(failure))
    }

    fn finish(&self, response: &mut Self::Response, trace_id: &str) {
        if let Ok(id) = MetadataValue::try_from(trace_id) {
            match response {
                Ok(r) => r.metadata_mut().insert("x-request-id", id),
                Err(s) => s.metadata_mut().insert("x-request-id", id),
            };
        }
    }

    fn decode_cpu(&self) -> Duration {
        take_decode_cpu()
    }

    fn encode_cpu(&self) -> Duration {
        take_encode_cpu()
    }
}

/// The status of a failure: its kind's code and message, its stage, and when shed, when to
/// retry.
pub fn status(failure: &Failure) -> Status {
    let e = &failure.error;
    let code = e.kind.grpc_code();
    let mut s = match failure.retry_after_s {
        Some(seconds) => {
            let details = ErrorDetails::with_retry_info(Some(Duration::from_secs(seconds)));
            Status::with_error_details(code, e.message.clone(), details)
        }
        None => Status::new(code, e.message.clone()),
    };
    if let Some(stage) = e.stage {
        s.metadata_mut()
            .insert("cleave-stage", MetadataValue::from_static(stage.as_str()));
    }
    if let Some(seconds) = failure.retry_after_s {
        s.metadata_mut()
            .insert("retry-after", MetadataValue::from(seconds));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{ErrorKind, Stage};
    use tonic::Code;

    #[test]
    fn a_failure_keeps_its_code_message_and_stage() {
        let e = RequestError::deadline(Stage::Lookup, 5.0, 6.0);
        let s = status(&Failure::from(e.clone()));
        assert_eq!(s.code(), Code::DeadlineExceeded);
        assert_eq!(s.message(), e.message);
        assert_eq!(s.metadata().get("cleave-stage").unwrap(), "lookup");
        assert!(s.metadata().get("retry-after").is_none());
        assert!(s.get_details_retry_info().is_none());
    }

    #[test]
    fn a_shed_request_is_unavailable_with_a_retry_hint() {
        let failure = Failure {
            error: RequestError::new(ErrorKind::Overloaded, "overloaded: retry later")
                .at(Stage::Admission),
            retry_after_s: Some(3),
        };
        let s = status(&failure);
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(s.metadata().get("retry-after").unwrap(), "3");
        assert_eq!(s.metadata().get("cleave-stage").unwrap(), "admission");
        let retry = s.get_details_retry_info().expect("a RetryInfo detail");
        assert_eq!(retry.retry_delay, Some(Duration::from_secs(3)));
    }
}
