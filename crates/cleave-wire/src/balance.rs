//! Load-aware I/O threads (FlexEMR §3.2, live migration): each data I/O thread's load is the
//! work its connections owe (requests read and not yet answered, replies not yet written).
//! When one thread's load is far above the least-loaded one's, a connection of the busy
//! thread moves there between two turns of its loop, taking its buffers, its reply channel and
//! its request table along: nothing is lost or reordered (docs/serving.md, "I/O threads").

use std::sync::atomic::{AtomicU64, Ordering};

/// When a connection moves. Hysteresis: a thread sheds a connection only above `min_load`
/// and `ratio` times the least-loaded thread's load, and only when the move leaves the target
/// no busier than the source, so a connection never bounces straight back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BalanceConfig {
    /// Work owed on a thread below which it never sheds a connection.
    pub min_load: u64,
    /// How many times the least-loaded thread's load (plus one) the busy one must carry.
    pub ratio: f64,
}

impl Default for BalanceConfig {
    fn default() -> BalanceConfig {
        BalanceConfig {
            min_load: 64,
            ratio: 4.0,
        }
    }
}

/// The thread a connection owing `conn_load` on thread `from` should move to, or `None`.
pub fn migration_target(
    loads: &[u64],
    from: usize,
    conn_load: u64,
    cfg: &BalanceConfig,
) -> Option<usize> {
    let hot = *loads.get(from)?;
    let (to, &cold) = loads.iter().enumerate().min_by_key(|&(_, l)| *l)?;
    if to == from || conn_load == 0 || hot < cfg.min_load {
        return None;
    }
    if (hot as f64) < cfg.ratio * (cold as f64 + 1.0) {
        return None;
    }
    // The target must end no busier than the source: moving the hot spot is no balance.
    let left = hot.saturating_sub(conn_load);
    (cold.saturating_add(conn_load) <= left).then_some(to)
}

/// The live load of each data I/O thread.
#[derive(Debug)]
pub(crate) struct ThreadLoads {
    loads: Vec<AtomicU64>,
}

impl ThreadLoads {
    pub(crate) fn new(n: usize) -> ThreadLoads {
        ThreadLoads {
            loads: (0..n.max(1)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub(crate) fn snapshot(&self) -> Vec<u64> {
        self.loads
            .iter()
            .map(|l| l.load(Ordering::Relaxed))
            .collect()
    }

    /// Moves a connection's share from `old` (on `from`) to `new` (on `to`).
    pub(crate) fn update(&self, from: usize, old: u64, to: usize, new: u64) {
        if let Some(l) = self.loads.get(from) {
            l.fetch_sub(old, Ordering::Relaxed);
        }
        if let Some(l) = self.loads.get(to) {
            l.fetch_add(new, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn moves_from_a_busy_thread_to_an_idle_one_only_past_the_thresholds() {
        let cfg = BalanceConfig {
            min_load: 10,
            ratio: 4.0,
        };
        assert_eq!(migration_target(&[100, 0], 0, 50, &cfg), Some(1));
        assert_eq!(migration_target(&[100, 0], 0, 100, &cfg), None); // the only connection
        assert_eq!(migration_target(&[9, 0], 0, 3, &cfg), None); // under min_load
        assert_eq!(migration_target(&[100, 30], 0, 20, &cfg), None); // under the ratio
        assert_eq!(migration_target(&[0, 100], 0, 0, &cfg), None); // already the idle one
    }

    proptest! {
        /// A move never makes the busiest thread busier, never targets the source, and the
        /// moved connection is never sent straight back.
        #[test]
        fn moves_balance_and_never_bounce(
            loads in proptest::collection::vec(0u64..1_000, 1..6),
            from_i in 0usize..6,
            share in 0.0f64..=1.0,
            min_load in 0u64..100,
            ratio in 1.0f64..8.0,
        ) {
            let cfg = BalanceConfig { min_load, ratio };
            let from = from_i % loads.len();
            let conn_load = (loads[from] as f64 * share) as u64;
            if let Some(to) = migration_target(&loads, from, conn_load, &cfg) {
                prop_assert_ne!(to, from);
                let mut after = loads.clone();
                after[from] -= conn_load;
                after[to] += conn_load;
                prop_assert!(after.iter().max() <= loads.iter().max());
                prop_assert!(after[to] <= after[from]);
                prop_assert_eq!(migration_target(&after, to, conn_load, &cfg), None);
            }
        }
    }
}
