//! The KServe v2 gRPC door (`GRPCInferenceService`, proto/kserve_v2.proto) on the router's
//! `grpc_port`. `ModelInfer` goes through the same envelope as the REST requests
//! (envelope.rs, with codec/grpc.rs), its budget starting when its HEADERS frame arrived
//! (grpc_layer.rs stamps it); the other calls read the shared `App`. Messages larger than the
//! body limit are refused with RESOURCE_EXHAUSTED before they are read (grpc_layer.rs).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};

use crate::app::App;
use crate::codec::grpc::pb::grpc_inference_service_server::{
    GrpcInferenceService, GrpcInferenceServiceServer,
};
use crate::codec::grpc::pb::*;
use crate::codec::grpc::{status, GrpcCodec};
use crate::envelope::{self, Head, BUDGET_HEADER, KEY_HEADER};
use crate::error::RequestError;
use crate::front::conn::Arrival;
use crate::front::grpc_layer::GrpcFront;
use crate::front::repository::change;
use crate::repository::{Refusal, Why};
use cleave_wire::auth::constant_time_eq;
use tonic::Code;

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
    let listener = crate::front::door::listen(&where_)
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
        let r = request.get_ref();
        (self.app.repo.registry)
            .ready(&r.name, non_empty(&r.version))
            .map_err(|e| status(&e.into()))?;
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
        let r = request.get_ref();
        let version = non_empty(&r.version);
        let router = (self.app.repo.registry)
            .ready(&r.name, version)
            .map_err(|e| status(&e.into()))?;
        let model = &router.model;
        let versions = match version {
            Some(_) => vec![model.version.clone()],
            None => (self.app.repo.registry.ready_versions(&r.name).iter())
                .map(|v| v.to_string())
                .collect(),
        };
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
            versions,
            platform: "cleave".into(),
            inputs: tensors(&model.inputs),
            outputs: tensors(&model.outputs),
        }))
    }

    async fn model_infer(
        &self,
        request: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        // Stamped by the layer when the call's head arrived; the handler's start without it.
        let arrival = request
            .extensions()
            .get::<Arrival>()
            .map_or_else(Instant::now, |a| a.0);
        let asked = metadata_budget(request.metadata());
        let key = (request.metadata().get(KEY_HEADER))
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let message = request.into_inner();
        let head = Head {
            model: message.model_name.clone(),
            version: non_empty(&message.model_version).map(str::to_string),
            key,
            arrival,
            asked,
            message_read: true,
        };
        envelope::handle(&self.app, &GrpcCodec, head, |_| async { Ok(message) }).await
    }

    async fn repository_index(
        &self,
        request: Request<RepositoryIndexRequest>,
    ) -> Result<Response<RepositoryIndexResponse>, Status> {
        self.authorize(request.metadata())?;
        let entries = (self.app.repo)
            .index(request.get_ref().ready)
            .await
            .map_err(refused)?;
        let models = entries
            .into_iter()
            .map(|e| repository_index_response::ModelIndex {
                name: e.name,
                version: e.version,
                state: e.state,
                reason: e.reason,
            })
            .collect();
        Ok(Response::new(RepositoryIndexResponse { models }))
    }

    async fn repository_model_load(
        &self,
        request: Request<RepositoryModelLoadRequest>,
    ) -> Result<Response<RepositoryModelLoadResponse>, Status> {
        self.authorize(request.metadata())?;
        let r = request.into_inner();
        let c = change(&json_parameters(r.parameters), None).map_err(refused)?;
        (self.app)
            .change_repository(|app| async move {
                app.repo.load(&r.model_name, c.policy, c.version).await
            })
            .await
            .map_err(refused)?;
        Ok(Response::new(RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        request: Request<RepositoryModelUnloadRequest>,
    ) -> Result<Response<RepositoryModelUnloadResponse>, Status> {
        self.authorize(request.metadata())?;
        let r = request.into_inner();
        let c = change(&json_parameters(r.parameters), None).map_err(refused)?;
        (self.app)
            .change_repository(|app| async move { app.repo.unload(&r.model_name, c.version).await })
            .await
            .map_err(refused)?;
        Ok(Response::new(RepositoryModelUnloadResponse {}))
    }
}

impl Service {
    /// The admin token (`authorization: Bearer ...`) when the router has one.
    fn authorize(&self, md: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        let Some(token) = &self.app.admin.token else {
            return Ok(());
        };
        let given = (md.get("authorization"))
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes())) {
            Ok(())
        } else {
            Err(Status::unauthenticated(
                "repository calls need the metadata \"authorization: Bearer <token>\" with the \
                 token of the router's admin_token_env variable",
            ))
        }
    }
}

fn non_empty(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

fn refused(r: Refusal) -> Status {
    let code = match r.why {
        Why::Invalid => Code::InvalidArgument,
        Why::NotFound => Code::NotFound,
        Why::Conflict => Code::Aborted,
        Why::Precondition => Code::FailedPrecondition,
        Why::Unavailable => Code::Unavailable,
        Why::Internal => Code::Internal,
    };
    Status::new(code, r.message)
}

/// A repository call's parameters as the JSON a REST body would carry.
fn json_parameters(
    params: std::collections::HashMap<String, ModelRepositoryParameter>,
) -> serde_json::Map<String, serde_json::Value> {
    use model_repository_parameter::ParameterChoice as P;
    params
        .into_iter()
        .filter_map(|(k, p)| {
            let v = match p.parameter_choice? {
                P::BoolParam(b) => b.into(),
                P::Int64Param(i) => i.into(),
                P::StringParam(s) => s.into(),
                P::BytesParam(b) => String::from_utf8_lossy(&b).into_owned().into(),
            };
            Some((k, v))
        })
        .collect()
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
    use tonic::metadata::MetadataValue;

    #[test]
    fn repository_parameters_and_codes() {
        use model_repository_parameter::ParameterChoice as P;
        let param = |p| ModelRepositoryParameter {
            parameter_choice: Some(p),
        };
        let params = std::collections::HashMap::from([
            ("version".to_string(), param(P::StringParam("3".into()))),
            ("unload_dependents".to_string(), param(P::BoolParam(false))),
        ]);
        let json = json_parameters(params);
        assert_eq!(json["version"], "3");
        let c = change(&json, None).unwrap();
        assert_eq!(c.version, Some(crate::config::Version(3)));
        let code = |why| refused(Refusal::new(why, "m")).code();
        assert_eq!(code(Why::Conflict), Code::Aborted);
        assert_eq!(code(Why::Precondition), Code::FailedPrecondition);
        assert_eq!(code(Why::NotFound), Code::NotFound);
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
