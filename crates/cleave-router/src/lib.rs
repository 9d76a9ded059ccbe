//! `cleave-router`: the client-facing server of Cleave (Prism's CN frontend).
//!
//! It speaks the Open Inference Protocol (KServe v2) over HTTP, checks each request against
//! the bundle manifest, fans its lookups out to the embedding shards by the range routing
//! table, packs the boundary tensors into one payload and sends it to the ranker with the
//! lowest measured latency. docs/api.md describes the HTTP API; docs/architecture.md how the
//! router fits with shards and rankers.

pub mod admin;
pub mod admission;
pub mod auth;
pub mod binary_tensor;
pub mod body;
pub mod config;
pub mod conn;
pub mod error;
mod ewma;
pub mod front_door;
pub mod grpc;
pub mod grpc_codec;
pub mod grpc_front;
pub mod grpc_tensor;
pub mod held;
pub mod http;
pub mod incast;
pub mod inference;
pub mod json_tensor;
pub mod kserve;
pub mod metrics;
pub mod model;
pub mod payload;
pub mod rank_form;
pub mod ranker;
pub mod router;
pub mod serve;
pub mod sparse;
pub mod tensor;
pub mod tls;
pub mod validate;

pub use config::{RouterConfig, ShardRoute};
pub use error::{ErrorKind, RequestError, Stage};
pub use model::{Mode, Model};
pub use serve::{run, serve};
pub use tensor::{DType, Tensor};
