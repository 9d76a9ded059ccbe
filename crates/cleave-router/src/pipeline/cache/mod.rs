//! The router's embedding cache (docs/cache.md): hot rows and pooled bags kept next to the
//! rankers, so that what every request asks for stops crossing the network. In
//! `Shards::lookup`, before the fan-out, [`EmbedCache::split`] answers what it holds and
//! leaves a smaller batch of the misses (each distinct row or bag once); the shards' answer to
//! it is put back in place and inserted by [`EmbedCache::finish`].
//!
//! * key.rs: what a result is keyed by (exact: ordered bags, weights' bits, pooling, version);
//! * store.rs: the byte-bounded CLOCK store;
//! * versions.rs: a table's version per request, from the switches `cleave update` announces;
//! * policy.rs: the cache's size and the rankers' largest batch, from one memory budget.

pub mod key;
pub mod policy;
pub mod store;
pub mod versions;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use cleave_shard::{Lookup as ShardLookup, Op, Pooled};

use crate::metrics::CacheHandle;
pub use crate::metrics::CacheStats;

use key::{Item, Key};
use policy::{CacheMode, Policy, PolicyConfig};
use store::Store;
use versions::Versions;

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    ids_avoided: AtomicU64,
    bytes_not_sent: AtomicU64,
}

pub struct EmbedCache {
    store: Store,
    versions: Versions,
    policy: Policy,
    /// Table ids (the index) to table names; each `Shards` registers its own ids.
    tables: Mutex<Vec<String>>,
    counters: Counters,
}

impl EmbedCache {
    pub fn new(cfg: PolicyConfig) -> EmbedCache {
        let policy = Policy::new(cfg);
        let store = Store::default();
        store.set_limit(policy.limit());
        EmbedCache {
            store,
            versions: Versions::default(),
            policy,
            tables: Mutex::new(Vec::new()),
            counters: Counters::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.policy.mode() != CacheMode::Off
    }

    /// Whether the cache may hold anything now: an adaptive cache shrunk to nothing at
    /// overload is passed by (its key work would only cost CPU), see [`EmbedCache::passed`].
    pub fn holds(&self) -> bool {
        self.policy.limit() > 0
    }

    /// Counts a batch sent past an empty cache as misses (each row or bag).
    pub fn passed(&self, batch: &[ShardLookup]) {
        let rows: usize = batch.iter().map(|l| l.rows()).sum();
        self.counters.misses.fetch_add(rows as u64, Relaxed);
    }

    /// A new id for `table` as one served version names it. Versions never share ids: a
    /// version's tables are whatever its own shards serve, so a new model version starts
    /// cold and cannot read another version's rows.
    pub fn table(&self, name: &str) -> u32 {
        let mut tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        tables.push(name.to_string());
        (tables.len() - 1) as u32
    }

    /// An update of `table` switches at `at_us` (0: now): see versions.rs. Entries no request
    /// can ask for any more are dropped.
    pub fn switch(&self, table: &str, at_us: u64) -> Result<u64, String> {
        let now = cleave_wire::unix_now_us();
        let epoch = self.versions.switch(table, at_us, now)?;
        let oldest = self.versions.oldest_live(table, now);
        let ids: Vec<bool> = {
            let tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
            tables.iter().map(|t| t == table).collect()
        };
        self.store
            .retain(|k| !ids.get(k.table as usize).copied().unwrap_or(false) || k.epoch >= oldest);
        Ok(epoch)
    }

    /// A ranker's reply (see policy.rs); a new limit applies to the store at once.
    pub fn observe(&self, batch_requests: u64, rows: u64, queue_depth: u64) {
        if let Some(limit) = self.policy.observe(batch_requests, rows, queue_depth) {
            self.store.set_limit(limit);
        }
    }

    /// The rankers' largest batch (rows) now.
    pub fn max_batch(&self) -> usize {
        self.policy.max_batch()
    }

    pub fn stats(&self) -> CacheStats {
        let (bytes, limit, entries) = self.store.size();
        let c = &self.counters;
        CacheStats {
            mode: self.policy.mode().as_str(),
            hits: c.hits.load(Relaxed),
            misses: c.misses.load(Relaxed),
            ids_avoided: c.ids_avoided.load(Relaxed),
            bytes_not_sent: c.bytes_not_sent.load(Relaxed),
            bytes: bytes as u64,
            limit: limit as u64,
            entries: entries as u64,
            ranker_max_batch: self.policy.max_batch() as u64,
            budget_bytes: self.policy.config().budget_bytes,
            activation_bytes_per_sample: self.policy.config().activation_bytes_per_sample,
        }
    }

    /// Answers what the cache holds of `batch` (`tables[i]`: lookup i's table id) for a
    /// request as of `as_of_us`, and leaves the misses to send.
    pub fn split(&self, batch: &[ShardLookup], tables: &[u32], as_of_us: u64) -> Split {
        let names = self
            .tables
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let keys: Vec<Vec<Key>> = batch
            .iter()
            .zip(tables)
            .map(|(l, &table)| {
                let epoch = self.versions.epoch(&names[table as usize], as_of_us);
                let key = |item| Key { table, epoch, item };
                match l.op {
                    Op::Gather => l.ids.iter().map(|&id| key(Item::Row(id))).collect(),
                    Op::Pool(p) => (l.offsets.windows(2))
                        .map(|w| {
                            let (a, b) = (w[0] as usize, w[1] as usize);
                            let weights = l.weights.as_ref().map(|w| &w[a..b]);
                            key(Item::bag(p, &l.ids[a..b], weights))
                        })
                        .collect(),
                }
            })
            .collect();
        let mut got = self.store.get_many(keys.iter().flatten()).into_iter();
        let got: Vec<Vec<Option<Arc<[f32]>>>> = keys
            .iter()
            .map(|k| got.by_ref().take(k.len()).collect())
            .collect();
        let mut misses = Vec::new();
        let mut sent = Vec::new();
        let (mut hits, mut ids_avoided, mut bytes_not_sent) = (0u64, 0u64, 0u64);
        for (i, (l, (keys, got))) in batch.iter().zip(keys.iter().zip(&got)).enumerate() {
            // Each distinct missing key once, with every position it fills.
            let mut first: HashMap<&Key, usize> = HashMap::new();
            let mut rows: Vec<Missing> = Vec::new();
            for (pos, (k, g)) in keys.iter().zip(got).enumerate() {
                if let Some(values) = g {
                    let ids = match &k.item {
                        Item::Row(_) => 1,
                        Item::Bag { ids, .. } => ids.len(),
                    };
                    hits += 1;
                    ids_avoided += ids as u64;
                    let weights = if l.weights.is_some() { 4 } else { 0 };
                    let offset = if matches!(k.item, Item::Bag { .. }) {
                        4
                    } else {
                        0
                    };
                    bytes_not_sent += (ids * (8 + weights) + offset + values.len() * 4) as u64;
                    continue;
                }
                match first.get(k) {
                    Some(&r) => rows[r].1.push(pos),
                    None => {
                        first.insert(k, rows.len());
                        rows.push((k.clone(), vec![pos]));
                    }
                }
            }
            if rows.is_empty() {
                continue;
            }
            misses.push(miss_lookup(l, &rows));
            sent.push((i, rows));
        }
        let c = &self.counters;
        c.hits.fetch_add(hits, Relaxed);
        c.misses
            .fetch_add(sent.iter().map(|(_, r)| r.len() as u64).sum(), Relaxed);
        c.ids_avoided.fetch_add(ids_avoided, Relaxed);
        c.bytes_not_sent.fetch_add(bytes_not_sent, Relaxed);
        Split { got, misses, sent }
    }

    /// Puts the shards' answers to `split.misses` in place, inserts them, and returns each
    /// lookup's values (rows × `dims[i]`, row-major), as the shards would have.
    pub fn finish(
        &self,
        split: Split,
        fetched: Vec<Pooled>,
        dims: &[usize],
    ) -> Result<Vec<Vec<f32>>, String> {
        let Split { mut got, sent, .. } = split;
        if fetched.len() != sent.len() {
            return Err(format!(
                "{} results for {} lookups of cache misses",
                fetched.len(),
                sent.len()
            ));
        }
        let mut inserts = Vec::new();
        for ((i, rows), p) in sent.into_iter().zip(fetched) {
            let dim = dims[i];
            if p.values.len() != rows.len() * dim {
                return Err(format!(
                    "lookup {i}: {} values for {} rows of dim {dim}",
                    p.values.len(),
                    rows.len()
                ));
            }
            for ((key, positions), values) in rows.into_iter().zip(p.values.chunks(dim.max(1))) {
                let values: Arc<[f32]> = values.into();
                for pos in positions {
                    got[i][pos] = Some(values.clone());
                }
                inserts.push((key, values));
            }
        }
        self.store.insert_many(inserts);
        got.into_iter()
            .zip(dims)
            .enumerate()
            .map(|(i, (rows, &dim))| {
                let mut out = Vec::with_capacity(rows.len() * dim);
                for r in rows {
                    let r = r.ok_or_else(|| format!("lookup {i}: a row was left unanswered"))?;
                    if r.len() != dim {
                        return Err(format!(
                            "lookup {i}: a cached row of {} values, dim {dim}",
                            r.len()
                        ));
                    }
                    out.extend_from_slice(&r);
                }
                Ok(out)
            })
            .collect()
    }
}

/// What the rest of the router sees of the cache, through the metrics it already holds.
impl CacheHandle for EmbedCache {
    fn stats(&self) -> CacheStats {
        EmbedCache::stats(self)
    }

    fn observe(&self, batch_requests: u64, rows: u64, queue_depth: u64) {
        EmbedCache::observe(self, batch_requests, rows, queue_depth)
    }

    fn max_batch(&self) -> usize {
        EmbedCache::max_batch(self)
    }

    fn switch(&self, table: &str, at_us: u64) -> Result<u64, String> {
        EmbedCache::switch(self, table, at_us)
    }
}

/// A request's lookups, split into what the cache answered and what to send.
pub struct Split {
    got: Vec<Vec<Option<Arc<[f32]>>>>,
    /// The lookups to send (only the missing rows or bags, each once).
    pub misses: Vec<ShardLookup>,
    /// Per lookup sent: which lookup of the batch, and per row sent its key and positions.
    sent: Vec<(usize, Vec<Missing>)>,
}

/// A distinct missing row or bag of one lookup: its key and every position it fills.
type Missing = (Key, Vec<usize>);

/// The lookup of `l`'s missing `rows` (in their order).
fn miss_lookup(l: &ShardLookup, rows: &[Missing]) -> ShardLookup {
    let mut out = ShardLookup {
        table: l.table.clone(),
        op: l.op,
        ids: Vec::new(),
        offsets: Vec::new(),
        weights: l.weights.as_ref().map(|_| Vec::new()),
    };
    match l.op {
        Op::Gather => out.ids = rows.iter().map(|(_, p)| l.ids[p[0]]).collect(),
        Op::Pool(_) => {
            out.offsets.push(0);
            for (_, p) in rows {
                let (a, b) = (l.offsets[p[0]] as usize, l.offsets[p[0] + 1] as usize);
                out.ids.extend_from_slice(&l.ids[a..b]);
                if let (Some(w), Some(ow)) = (&l.weights, out.weights.as_mut()) {
                    ow.extend_from_slice(&w[a..b]);
                }
                out.offsets.push(out.ids.len() as u32);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
