//! `cleave-router`: the client-facing server of Cleave (Prism's CN frontend).
//!
//! It speaks the Open Inference Protocol (KServe v2) over HTTP and gRPC, checks each request
//! against the bundle manifest, fans its lookups out to the embedding shards by the range
//! routing table, packs the boundary tensors into one payload and sends it to the ranker with
//! the lowest measured latency. docs/api.md describes the API; docs/architecture.md how the
//! router fits with shards and rankers.
//!
//! The modules import one way (tests/layers.rs checks it): `serve` wires everything;
//! `front` (the doors) → `admin`, `envelope` → `codec`, `admission`, `app` → `repository`
//! (the versions served) → `pipeline` → `backend`; `shed_log` → `app`; below them all
//! `config`, `budget`, `model`, `tensor`, `metrics` (→ `heap`), `error`.

pub mod admin;
pub mod admission;
pub mod app;
pub mod backend;
pub mod budget;
pub mod codec;
pub mod config;
pub mod envelope;
pub mod error;
pub mod front;
pub mod heap;
pub mod metrics;
pub mod model;
pub mod pipeline;
pub mod repository;
pub mod serve;
pub mod shed_log;
pub mod tensor;

pub use config::{RouterConfig, ShardRoute};
pub use error::{ErrorKind, RequestError, Stage};
pub use model::{Mode, Model};
pub use serve::{run, serve};
pub use tensor::{DType, Tensor};
