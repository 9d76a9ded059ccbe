//! The embedding shard of Cleave.
//!
//! * [`message`]: the LOOKUP request and response layouts (docs/protocol.md).
//! * [`ShardService`]: answers LOOKUP frames from memory-mapped tables with the
//!   `cleave_embed` engine, pooling straight into the response buffer.
//! * [`Shard`]: a shard process: tables and row ranges ([`ShardConfig`]), the wire server,
//!   `/metrics`, `/ready`, `/live`, and a drain on SIGTERM/SIGINT.
//! * [`ShardClient`]: routes a batch of lookups by row range ([`RoutingTable`]), fans it out
//!   to one replica of every group holding its rows ([`replica`]: choice, fail-over,
//!   ejection), and merges their partial pools; its membership can change while it serves.

mod client;
mod http;
mod membership;
pub mod message;
pub mod metrics;
pub mod replica;
mod routes;
mod service;
mod shard;
mod split;
pub mod update;

pub use cleave_wire::Ewma;
pub use client::{ClientError, ProbeReport, ShardClient, ShardClientConfig};
pub use membership::{Member, MembershipError};
pub use message::{Lookup, LookupView, Op, Pooled, LOOKUP, UPDATE};
pub use replica::ReplicaState;
pub use routes::{Route, RoutingTable};
pub use service::{Served, ShardService};
pub use shard::{RowSpec, Shard, ShardConfig, ShardInfo, StartError};
