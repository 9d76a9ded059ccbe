//! `cleave-embed`: the embedding engine of a Cleave shard.
//!
//! It opens the tables of a bundle (docs/bundle.md) — memory-mapped, whole or as a row range —
//! and runs pooled lookups (sum, mean, max, per-sample weights) and unpooled gathers on them with
//! SIMD kernels (AVX-512 or AVX2 picked at run time, a portable scalar fallback) that prefetch
//! rows a few ids ahead. docs/engine.md explains the design.
//!
//! ```no_run
//! use cleave_embed::{pool, Bags, Pooling, TableSet};
//! # fn main() -> Result<(), cleave_embed::EmbedError> {
//! let set = TableSet::open("bundle".as_ref(), None, None)?;
//! let table = set.get("t0").unwrap();
//! let ids = [3_i64, 7, 7, 1];
//! let offsets = [0_u32, 3, 4]; // two bags: [3, 7, 7] and [1]
//! let bags = Bags { ids: &ids, offsets: &offsets, weights: None };
//! let mut out = vec![0.0; 2 * table.dim()];
//! let mut counts = vec![0; 2];
//! pool(table, &bags, Pooling::Sum, &mut out, &mut counts)?;
//! # Ok(()) }
//! ```
//!
//! # Partial pooling
//! A shard holds a row range of a table, so a bag's ids may be spread over several shards.
//! Each shard pools the ids it holds with [`Pooling::partial`] of the feature's pooling and
//! returns the result with the bag's counts; the caller merges with [`merge`] and [`finish`]:
//! sums add up, a mean is the merged sum divided by the merged count, and a max takes the
//! maximum over the shards whose count is not zero.
//!
//! # Threads
//! [`pool()`] and [`gather`] run on the calling thread. An [`Engine`] owns a fixed pool of worker
//! threads and splits [`PoolJob`]s across them by bag ranges and tables.
//!
//! [`limit::gather_sum_prefetch`] is the memory-limit loop `cleave bench lookup` compares the
//! engine with.

pub mod bundle;
pub mod cache;
pub mod error;
pub mod kernels;
pub mod limit;
pub mod lookup;
pub mod pool;
pub mod pooling;
pub mod store;
pub mod table;
pub mod tier;
mod tiered;
pub mod update;

pub use bundle::{Manifest, TableDtype, TableMeta};
pub use cache::PolicyKind;
pub use error::EmbedError;
pub use kernels::Kernel;
pub use lookup::{finish, gather, gather_with, merge, pool, pool_with, Bags, Pooling};
pub use pool::{Engine, PoolJob};
pub use table::{OpenOptions, Residency, Table, TableSet};
pub use tier::io::IoMode;
pub use tier::{Tier, TierConfig, TierStats};
