//! The embedding shard of Cleave.
//!
//! * [`message`]: the LOOKUP request and response layouts (docs/protocol.md).
//! * [`ShardService`]: answers LOOKUP frames from memory-mapped tables with the
//!   `cleave_embed` engine, pooling straight into the response buffer.
//! * [`Shard`]: a shard process: tables and row ranges ([`ShardConfig`]), the wire server,
//!   `/metrics`, `/ready`, `/live`, and a drain on SIGTERM/SIGINT.
//! * [`ShardClient`]: routes a batch of lookups by row range ([`RoutingTable`]), fans it out
//!   to the shards holding its rows, and merges their partial pools.
//! * [`bench`]: an open-loop load generator for `cleave bench shard`.

pub mod bench;
mod client;
mod http;
pub mod message;
pub mod metrics;
mod routes;
mod service;
mod shard;

pub use client::{ClientError, ShardClient, ShardClientConfig};
pub use message::{Lookup, LookupView, Op, Pooled, LOOKUP};
pub use routes::{Route, RoutingTable};
pub use service::{Served, ShardService};
pub use shard::{RowSpec, Shard, ShardConfig, ShardInfo, StartError};
