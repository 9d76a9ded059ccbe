//! How large the cache may be, and what that leaves the rankers' batches (FlexEMR §3.1.1).
//!
//! One memory budget per host (`memory_budget_bytes`) holds both the cache and the rankers'
//! activations, `activation_bytes_per_sample` per row of a batch. The split is enforced both
//! ways: the cache never holds more than its limit (store.rs evicts when it falls), and the
//! rankers' largest batch is what the budget leaves after the cache's limit,
//! `(budget - limit) / activation`, capped by their `max_batch`. So a cache that does not
//! shrink costs batch size.
//!
//! * `off`: no cache; the largest batch is `min(max_batch, budget / activation)`.
//! * `fixed`: `cache_bytes` always.
//! * `adaptive`: a sliding window over the last `window` ranker replies (each says how many
//!   requests its batch joined and how many were queued behind it) gives the demand: the
//!   batch the ranker would run if it could take everything waiting, (joined + queued) × the
//!   request's rows, at the window's 90th percentile (one burst does not empty the cache,
//!   a sustained rise does). The policy reserves that many rows with headroom for the rankers
//!   and gives the cache the rest, up to `cache_bytes` (0: the whole budget). Idle rankers
//!   (small batches, no queue) leave the cache almost all of it; growing batches shrink it,
//!   down to nothing at overload, where the rankers keep their whole no-cache batch.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

pub use crate::config::CacheMode;

/// The reserve for batches is the demand times this: a batch a little larger than the
/// largest one seen lately must not find the memory taken.
pub const HEADROOM: f64 = 1.25;
/// The window's percentile taken as the demand.
pub const DEMAND_PERCENTILE: usize = 90;
/// The reserve never falls below this share of `max_batch`: the first burst after an idle
/// spell finds room for a batch while the window catches up.
pub const MIN_RESERVE_SHARE: usize = 8;

#[derive(Clone, Debug)]
pub struct PolicyConfig {
    pub mode: CacheMode,
    /// fixed: the cache's size; adaptive: its largest (0: the whole budget).
    pub cache_bytes: u64,
    /// The host memory (or GPU memory) the cache and the ranker batches share; 0: none given
    /// (then only `fixed` is possible, and the batch is not derived from it).
    pub budget_bytes: u64,
    pub activation_bytes_per_sample: u64,
    /// The rankers' configured `max_batch` (rows).
    pub ranker_max_batch: usize,
    /// Replies in the sliding window.
    pub window: usize,
}

/// One reply's demand: the rows of the batch the ranker would have run with everything
/// waiting in it.
impl PolicyConfig {
    /// The policy's settings from the router's config (docs/cache.md, "Settings").
    pub fn of(c: &crate::config::RouterConfig) -> PolicyConfig {
        PolicyConfig {
            mode: c.cache,
            cache_bytes: c.cache_bytes,
            budget_bytes: c.memory_budget_bytes,
            activation_bytes_per_sample: c.activation_bytes_per_sample,
            ranker_max_batch: c.ranker_max_batch,
            window: c.cache_window,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    wanted_rows: u64,
}

pub struct Policy {
    cfg: PolicyConfig,
    window: Mutex<VecDeque<Sample>>,
    limit: AtomicUsize,
    max_batch: AtomicUsize,
}

impl Policy {
    pub fn new(cfg: PolicyConfig) -> Policy {
        let p = Policy {
            window: Mutex::new(VecDeque::with_capacity(cfg.window)),
            limit: AtomicUsize::new(0),
            max_batch: AtomicUsize::new(cfg.ranker_max_batch),
            cfg,
        };
        // Before any reply: as if idle.
        let limit = p.limit_for(0);
        p.set(limit);
        p
    }

    pub fn mode(&self) -> CacheMode {
        self.cfg.mode
    }

    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }

    /// The cache's current limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// The rankers' largest batch (rows) the budget allows beside the cache's limit.
    pub fn max_batch(&self) -> usize {
        self.max_batch.load(Ordering::Relaxed)
    }

    /// One ranker reply: its batch joined `batch_requests` requests of about `rows` rows, and
    /// `queue_depth` requests were waiting. Returns the new limit when it changed.
    pub fn observe(&self, batch_requests: u64, rows: u64, queue_depth: u64) -> Option<usize> {
        if self.cfg.mode != CacheMode::Adaptive {
            return None;
        }
        let demand = {
            let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
            if w.len() == self.cfg.window {
                w.pop_front();
            }
            w.push_back(Sample {
                wanted_rows: (batch_requests.max(1) + queue_depth).saturating_mul(rows.max(1)),
            });
            demand_rows(&w)
        };
        let limit = self.limit_for(demand);
        (limit != self.limit()).then(|| {
            self.set(limit);
            limit
        })
    }

    /// The cache's limit for a demand of `rows` per batch.
    fn limit_for(&self, demand_rows: u64) -> usize {
        let c = &self.cfg;
        match c.mode {
            CacheMode::Off => 0,
            CacheMode::Fixed => c.cache_bytes as usize,
            CacheMode::Adaptive => {
                let want = ((demand_rows as f64 * HEADROOM).ceil() as u64).clamp(
                    (c.ranker_max_batch / MIN_RESERVE_SHARE).max(1) as u64,
                    c.ranker_max_batch.max(1) as u64,
                );
                let reserve = want.saturating_mul(c.activation_bytes_per_sample);
                let cap = if c.cache_bytes == 0 {
                    c.budget_bytes
                } else {
                    c.cache_bytes.min(c.budget_bytes)
                };
                c.budget_bytes.saturating_sub(reserve).min(cap) as usize
            }
        }
    }

    fn set(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
        self.max_batch
            .store(self.batch_for(limit), Ordering::Relaxed);
    }

    /// What the budget leaves the rankers' batches beside a cache of `limit` bytes.
    fn batch_for(&self, limit: usize) -> usize {
        let c = &self.cfg;
        if c.budget_bytes == 0 || c.activation_bytes_per_sample == 0 {
            return c.ranker_max_batch;
        }
        let left = c.budget_bytes.saturating_sub(limit as u64);
        ((left / c.activation_bytes_per_sample) as usize).min(c.ranker_max_batch)
    }
}

/// The window's demand: its `DEMAND_PERCENTILE`th percentile of wanted rows.
fn demand_rows(w: &VecDeque<Sample>) -> u64 {
    let mut wanted: Vec<u64> = w.iter().map(|s| s.wanted_rows).collect();
    if wanted.is_empty() {
        return 0;
    }
    wanted.sort_unstable();
    // Nearest rank: the smallest value at or above the percentile's share of the window.
    wanted[(wanted.len() * DEMAND_PERCENTILE).div_ceil(100) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    const ACT: u64 = 1 << 20; // 1 MiB per row
    fn cfg(mode: CacheMode, cache_bytes: u64) -> PolicyConfig {
        PolicyConfig {
            mode,
            cache_bytes,
            budget_bytes: 512 * ACT,
            activation_bytes_per_sample: ACT,
            ranker_max_batch: 256,
            window: 4,
        }
    }

    #[test]
    fn off_and_fixed_split_the_budget_once() {
        let off = Policy::new(cfg(CacheMode::Off, 0));
        assert_eq!((off.limit(), off.max_batch()), (0, 256));
        // A fixed cache of 384 MiB leaves 128 rows of the budget: it costs batch size.
        let fixed = Policy::new(cfg(CacheMode::Fixed, 384 * ACT));
        assert_eq!((fixed.limit(), fixed.max_batch()), (384 << 20, 128));
        assert_eq!(fixed.observe(64, 4, 10), None, "fixed never moves");
        // No budget: the batch is the rankers' own.
        let mut c = cfg(CacheMode::Fixed, 1 << 30);
        c.budget_bytes = 0;
        assert_eq!(Policy::new(c).max_batch(), 256);
    }

    #[test]
    fn adaptive_grows_when_idle_and_shrinks_as_batches_grow() {
        let p = Policy::new(cfg(CacheMode::Adaptive, 0));
        // Idle: the floor of 256 / 8 = 32 rows reserved, the rest is the cache's.
        assert_eq!((p.limit(), p.max_batch()), ((512 - 32) << 20, 32));
        // Batches of 8 requests of 4 rows: 32 rows, 40 with headroom.
        assert_eq!(p.observe(8, 4, 0), Some((512 - 40) << 20));
        assert_eq!(p.max_batch(), 40);
        // A queue builds: 8 joined and 8 waiting want 64 rows, 80 reserved (the window's
        // 90th percentile of 4 replies is its largest).
        p.observe(8, 4, 8);
        assert_eq!(p.limit(), (512 - 80) << 20);
        // Overload: batches at the rankers' max; the cache shrinks to what 256 rows leave,
        // and the rankers keep the no-cache batch.
        p.observe(64, 4, 50);
        assert_eq!((p.limit(), p.max_batch()), (256 << 20, 256));
        // The window forgets: after 4 idle replies, the cache grows back.
        for _ in 0..4 {
            p.observe(1, 1, 0);
        }
        assert_eq!(p.limit(), (512 - 32) << 20);
    }

    #[test]
    fn one_burst_in_a_long_window_does_not_empty_the_cache() {
        let mut c = cfg(CacheMode::Adaptive, 0);
        c.window = 20;
        let p = Policy::new(c);
        for _ in 0..18 {
            p.observe(4, 4, 0);
        }
        p.observe(64, 4, 64);
        p.observe(64, 4, 64);
        // The 90th percentile of 18 replies of 16 rows and two of 512: 16 rows (the floor, 32).
        assert_eq!(p.limit(), (512 - 32) << 20);
        p.observe(64, 4, 64);
        assert_eq!(
            p.limit(),
            256 << 20,
            "three in 20 is more than 10%: sustained"
        );
    }

    #[test]
    fn adaptive_respects_its_cap_and_a_budget_smaller_than_a_full_batch() {
        let p = Policy::new(cfg(CacheMode::Adaptive, 100 * ACT));
        assert_eq!((p.limit(), p.max_batch()), (100 << 20, 256));
        let mut small = cfg(CacheMode::Adaptive, 0);
        small.budget_bytes = 128 * ACT;
        let p = Policy::new(small);
        p.observe(256, 1, 100);
        // Overload: the whole budget goes to the batch; it is the budget's, not max_batch.
        assert_eq!((p.limit(), p.max_batch()), (0, 128));
    }
}
