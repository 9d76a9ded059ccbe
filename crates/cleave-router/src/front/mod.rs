//! The doors: how requests reach the router. The REST door (`door` accepts HTTP/1.1
//! connections with `conn`'s clocks, `rest` routes them, `body` reads bodies under their
//! bounds, `auth` and `tls` guard them) and the gRPC door (`grpc` serves the KServe v2
//! service behind `grpc_layer`). Each gathers a request's head and message and hands it to the
//! envelope (envelope.rs).

pub mod auth;
pub mod body;
pub mod conn;
pub mod door;
pub mod grpc;
pub mod grpc_layer;
pub mod repository;
pub mod rest;
pub mod rx_stamp;
pub mod tls;
