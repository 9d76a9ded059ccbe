//! The KServe v2 gRPC front door (`GRPCInferenceService`, proto/kserve_v2.proto) on the
//! router's `grpc_port`. It shares everything behind the REST handlers: the same `App`
//! (model, budgets, admission, metrics, health), the same checks and the same messages; an
//! error's kind becomes a gRPC status code (`code`). Messages larger than the body limit are
//! refused with RESOURCE_EXHAUSTED before they are read (`front::GrpcFront`).

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tonic::metadata::MetadataValue;
use tonic::{Code, Request, Response, Status};

use crate::admission::RankerLoad;
use crate::error::{ErrorKind, RequestError, Stage};
use crate::grpc_codec::take_codec_cpu;
use crate::grpc_front::GrpcFront;
use crate::grpc_tensor::{grpc_response, parse_grpc};
use crate::http::App;
use crate::inference::{stages, timings, BUDGET_HEADER};
use crate::metrics::{thread_cpu, Codec};
use crate::router::Budget;

/// The code generated from proto/kserve_v2.proto by build.rs.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("inference");
}

use pb::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use pb::infer_parameter::ParameterChoice;
use pb::*;

/// The gRPC status code for an error kind: the usual mapping of its HTTP status.
pub fn code(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::InvalidJson | ErrorKind::InvalidInput => Code::InvalidArgument,
        ErrorKind::TooLarge => Code::ResourceExhausted,
        ErrorKind::UnknownModel => Code::NotFound,
        ErrorKind::Deadline | ErrorKind::BodyTimeout => Code::DeadlineExceeded,
        ErrorKind::Shard | ErrorKind::Ranker | ErrorKind::Unavailable | ErrorKind::Overloaded => {
            Code::Unavailable
        }
    }
}

fn status(e: &RequestError) -> Status {
    let mut s = Status::new(code(e.kind), e.message.clone());
    if let Some(stage) = e.stage {
        s.metadata_mut()
            .insert("cleave-stage", MetadataValue::from_static(stage.as_str()));
    }
    s
}

/// Serves the gRPC API on `listener` until `stop` completes.
pub async fn serve(
    app: Arc<App>,
    listener: tokio::net::TcpListener,
    front: GrpcFront,
    tls: Option<tonic::transport::ServerTlsConfig>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let addr = listener.local_addr().ok();
    let limit = app.body.max_bytes;
    let service = GrpcInferenceServiceServer::new(Service { app })
        .max_decoding_message_size(limit)
        .max_encoding_message_size(usize::MAX);
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls)
            .map_err(|e| format!("gRPC TLS: {e}"))?;
    }
    builder
        .layer(front)
        .add_service(service)
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            stop,
        )
        .await
        .map_err(|e| format!("gRPC server on {addr:?} stopped: {e}"))
}

/// Binds the gRPC port; `host:port`, 0 for any free port.
pub async fn bind(host: &str, port: u16) -> Result<(tokio::net::TcpListener, SocketAddr), String> {
    let where_ = format!("{host}:{port}");
    let listener = tokio::net::TcpListener::bind(&where_)
        .await
        .map_err(|e| format!("cannot listen for gRPC on {where_}: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("{where_}: {e}"))?;
    Ok((listener, addr))
}

struct Service {
    app: Arc<App>,
}

#[tonic::async_trait]
impl GrpcInferenceService for Service {
    async fn server_live(
        &self,
        _: Request<ServerLiveRequest>,
    ) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<ServerReadyRequest>,
    ) -> Result<Response<ServerReadyResponse>, Status> {
        let ready = self.app.health().http_status() == 200;
        Ok(Response::new(ServerReadyResponse { ready }))
    }

    async fn model_ready(
        &self,
        request: Request<ModelReadyRequest>,
    ) -> Result<Response<ModelReadyResponse>, Status> {
        self.app
            .model(&request.get_ref().name)
            .map_err(|e| status(&e))?;
        let ready = self.app.health().http_status() == 200;
        Ok(Response::new(ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        Ok(Response::new(ServerMetadataResponse {
            name: "cleave".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: vec![],
        }))
    }

    async fn model_metadata(
        &self,
        request: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let model = self
            .app
            .model(&request.get_ref().name)
            .map_err(|e| status(&e))?;
        let tensors = |specs: &[crate::model::TensorSpec]| {
            specs
                .iter()
                .map(|s| model_metadata_response::TensorMetadata {
                    name: s.name.clone(),
                    datatype: s.dtype.kserve_name().into(),
                    shape: s.kserve_shape(),
                })
                .collect()
        };
        Ok(Response::new(ModelMetadataResponse {
            name: model.name.clone(),
            versions: vec!["1".into()],
            platform: "cleave".into(),
            inputs: tensors(&model.inputs),
            outputs: tensors(&model.outputs),
        }))
    }

    async fn model_infer(
        &self,
        request: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        // The message is whole by now: its budget starts here.
        let arrival = Instant::now();
        let app = &self.app;
        app.router.metrics.request();
        let mut budget = Budget::new(arrival, app.default_budget_ms);
        let name = request.get_ref().model_name.clone();
        let result = infer(app, request, &mut budget).await;
        let trace_id = cleave_wire::log::trace_id(budget.trace_id);
        let mut response = match result {
            Ok(reply) => {
                app.router.metrics.observe(Stage::Total, arrival.elapsed());
                tracing::debug!(%trace_id, model = %name, protocol = "grpc", elapsed_us = arrival.elapsed().as_micros() as u64, "answered");
                Ok(Response::new(reply))
            }
            Err(e) => {
                app.router.metrics.error(e.kind);
                tracing::warn!(%trace_id, model = %name, protocol = "grpc", kind = ?e.kind, stage = ?e.stage, error = %e.message, "request failed");
                Err(status(&e))
            }
        };
        if let Ok(id) = MetadataValue::try_from(trace_id.as_str()) {
            match &mut response {
                Ok(r) => r.metadata_mut().insert("x-request-id", id),
                Err(s) => s.metadata_mut().insert("x-request-id", id),
            };
        }
        response
    }
}

async fn infer(
    app: &App,
    request: Request<ModelInferRequest>,
    budget: &mut Budget,
) -> Result<ModelInferResponse, RequestError> {
    let asked = metadata_budget(request.metadata())?;
    let message = request.into_inner();
    let model = app.model(&message.model_name)?;
    app.set_budget(budget, asked)?;
    let load = RankerLoad::of(&app.router.rankers);
    let _permit = app
        .admission
        .admit(budget.start.elapsed(), budget.budget, &load)
        .map_err(|shed| {
            RequestError::new(ErrorKind::Overloaded, shed.message).at(Stage::Admission)
        })?;
    let metrics = &app.router.metrics;
    let cpu = thread_cpu();
    let parsed = parse_grpc(model, message);
    metrics.codec_cpu_plus("parse", Codec::Grpc, cpu, take_codec_cpu().0);
    let req = parsed?;
    app.set_budget(budget, req.request.budget_ms)?;
    let parsed_at = budget.start.elapsed();
    let inf = app.router.infer(req.request.inputs, budget).await?;
    app.admission.observe(stages(parsed_at, &inf));
    let cpu = thread_cpu();
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
        req.request.id,
        inf.outputs,
        req.request.outputs.as_deref(),
        req.raw,
        parameters,
    );
    metrics.codec_cpu_plus("encode", Codec::Grpc, cpu, take_codec_cpu().1);
    Ok(reply)
}

/// The `cleave-budget-ms` metadata, when given: as the REST header of that name.
fn metadata_budget(md: &tonic::metadata::MetadataMap) -> Result<Option<f64>, RequestError> {
    let Some(value) = md.get(BUDGET_HEADER) else {
        return Ok(None);
    };
    let text = value.to_str().unwrap_or("").trim();
    match text.parse::<f64>() {
        Ok(ms) if ms > 0.0 && ms.is_finite() => Ok(Some(ms)),
        _ => Err(RequestError::invalid(format!(
            "metadata {BUDGET_HEADER} is {text:?}, expected a positive number of milliseconds"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_http_statuses() {
        assert_eq!(code(ErrorKind::InvalidInput), Code::InvalidArgument);
        assert_eq!(code(ErrorKind::UnknownModel), Code::NotFound);
        assert_eq!(code(ErrorKind::TooLarge), Code::ResourceExhausted);
        assert_eq!(code(ErrorKind::Deadline), Code::DeadlineExceeded);
        assert_eq!(code(ErrorKind::Overloaded), Code::Unavailable);
        let e = RequestError::deadline(Stage::Lookup, 5.0, 6.0);
        let s = status(&e);
        assert_eq!(s.code(), Code::DeadlineExceeded);
        assert_eq!(s.message(), e.message);
        assert_eq!(s.metadata().get("cleave-stage").unwrap(), "lookup");
    }

    #[test]
    fn budget_metadata() {
        let mut md = tonic::metadata::MetadataMap::new();
        assert_eq!(metadata_budget(&md).unwrap(), None);
        md.insert(BUDGET_HEADER, MetadataValue::from_static("12.5"));
        assert_eq!(metadata_budget(&md).unwrap(), Some(12.5));
        md.insert(BUDGET_HEADER, MetadataValue::from_static("soon"));
        assert!(metadata_budget(&md)
            .unwrap_err()
            .message
            .contains("expected a positive number of milliseconds"));
    }
}
