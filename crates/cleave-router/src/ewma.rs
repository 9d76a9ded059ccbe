//! The moving average lives in cleave-shard, whose replica choice needs it too (cleave-shard
//! may not depend on the router).

pub use cleave_shard::Ewma;
