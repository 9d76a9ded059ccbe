//! A moving average that request handlers on any thread update and read without a lock
//! (shard replica choice, shard service time, the router's ranker choice and admission).

use std::sync::atomic::{AtomicU64, Ordering};

/// Weight of the newest sample.
const ALPHA: f64 = 0.2;

/// The f64 bits of an exponentially weighted moving average; 0 until the first sample.
#[derive(Debug, Default)]
pub struct Ewma(AtomicU64);

impl Ewma {
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }

    /// Racy read-modify-write is fine: a lost sample only slows the average down.
    pub fn update(&self, sample: f64) {
        let old = self.get();
        let new = if old == 0.0 {
            sample
        } else {
            old + ALPHA * (sample - old)
        };
        self.0.store(new.to_bits(), Ordering::Relaxed);
    }
}
