//! The router's side of its backends: the ranker pool (`ranker`: connections, latency
//! averages, the choice of ranker), incast control with the rankers (`incast`) and the RANK
//! payload sent to them (`payload`). Shard connections are cleave-shard's client.

pub mod incast;
pub mod payload;
pub mod ranker;
