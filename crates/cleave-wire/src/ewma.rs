//! A moving average that request handlers on any thread update and read without a lock
//! (shard replica choice, shard service time, the router's ranker choice and admission).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Weight of the newest sample.
const ALPHA: f64 = 0.2;

/// Samples an estimate takes before a request is refused on it ([`Ewma::settled`]): one slow
/// first request (a cold start, a starved core) is not yet a component's speed, and refusing
/// on it dropped the next request in a full test run (docs/protocol.md). The ranker's own
/// compute model waits as long (python/cleave/ranker/compute.py).
pub const SURE_AFTER: u32 = 3;

/// The f64 bits of an exponentially weighted moving average; 0 until the first sample.
#[derive(Debug, Default)]
pub struct Ewma {
    bits: AtomicU64,
    samples: AtomicU32,
}

impl Ewma {
    pub fn get(&self) -> f64 {
        f64::from_bits(self.bits.load(Ordering::Relaxed))
    }

    /// The average once [`SURE_AFTER`] samples made it, else 0: what a caller that refuses
    /// work on the estimate should read.
    pub fn settled(&self) -> f64 {
        if self.samples.load(Ordering::Relaxed) < SURE_AFTER {
            0.0
        } else {
            self.get()
        }
    }

    /// Racy read-modify-write is fine: a lost sample only slows the average down.
    pub fn update(&self, sample: f64) {
        let old = self.get();
        let new = if old == 0.0 {
            sample
        } else {
            old + ALPHA * (sample - old)
        };
        self.bits.store(new.to_bits(), Ordering::Relaxed);
        // Saturating: the count only has to reach SURE_AFTER.
        let _ = self
            .samples
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < SURE_AFTER).then_some(n + 1)
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settled_only_after_enough_samples() {
        let average = Ewma::default();
        average.update(1_000_000.0); // one slow first request
        assert_eq!(average.get(), 1_000_000.0);
        assert_eq!(average.settled(), 0.0, "one sample is not a speed yet");
        for _ in 1..SURE_AFTER {
            average.update(1000.0);
        }
        assert_eq!(average.settled(), average.get());
        assert!(average.get() < 1_000_000.0 && average.get() > 1000.0);
    }
}
