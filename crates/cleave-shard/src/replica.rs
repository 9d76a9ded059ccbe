//! Shard replicas as the client sees them: each one's state (active, draining, ejected), its
//! measured latency and outstanding calls, which replica of a group a call goes to, and which
//! failures may be retried on another replica.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

use cleave_wire::{Address, Client, ErrorCode, WireError};

use cleave_wire::Ewma;

/// The latency assumed for a replica not measured yet (µs); small, so new replicas get tried.
const UNMEASURED_US: f64 = 1.0;

/// Whether a replica gets new work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplicaState {
    /// Gets new work.
    Active,
    /// Asked to leave: no new work, calls in flight finish. Only an admin call ends it.
    Draining,
    /// Failed on its connection or a probe: no new work until a probe finds it ready.
    Ejected,
}

impl ReplicaState {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaState::Active => "active",
            ReplicaState::Draining => "draining",
            ReplicaState::Ejected => "ejected",
        }
    }

    fn from_u8(v: u8) -> ReplicaState {
        match v {
            0 => ReplicaState::Active,
            1 => ReplicaState::Draining,
            _ => ReplicaState::Ejected,
        }
    }

    fn to_u8(self) -> u8 {
        self as u8
    }
}

/// One shard replica: its connections and what the client measured of it.
pub struct Replica {
    pub(crate) client: Client,
    state: AtomicU8,
    ewma_us: Ewma,
    outstanding: AtomicU64,
    /// Why it was last ejected.
    reason: Mutex<String>,
}

impl Replica {
    pub(crate) fn new(client: Client, state: ReplicaState, reason: &str) -> Replica {
        Replica {
            client,
            state: AtomicU8::new(state.to_u8()),
            ewma_us: Ewma::default(),
            outstanding: AtomicU64::new(0),
            reason: Mutex::new(reason.to_owned()),
        }
    }

    pub fn addr(&self) -> &Address {
        self.client.addr()
    }

    pub fn state(&self) -> ReplicaState {
        ReplicaState::from_u8(self.state.load(Ordering::Relaxed))
    }

    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Moving average of a call's round trip, in µs (0 until the first reply).
    pub fn ewma_us(&self) -> f64 {
        self.ewma_us.get()
    }

    /// The round trip a lookup is refused on (too little time left): the average once it
    /// settled, 0 before (`Ewma::settled`).
    pub fn expected_us(&self) -> f64 {
        self.ewma_us.settled()
    }

    /// Why it was ejected last (meaningful while ejected).
    pub fn reason(&self) -> String {
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(crate) fn set_state(&self, state: ReplicaState) {
        self.state.store(state.to_u8(), Ordering::Relaxed);
    }

    /// Ejects an active replica (a draining one stays draining: it is leaving anyway).
    /// True when this call ejected it.
    pub(crate) fn eject(&self, reason: String) -> bool {
        *self.reason.lock().unwrap_or_else(|p| p.into_inner()) = reason;
        self.state
            .compare_exchange(
                ReplicaState::Active.to_u8(),
                ReplicaState::Ejected.to_u8(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .is_ok()
    }

    /// Readmits an ejected replica; true when this call readmitted it.
    pub(crate) fn readmit(&self) -> bool {
        self.state
            .compare_exchange(
                ReplicaState::Ejected.to_u8(),
                ReplicaState::Active.to_u8(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .is_ok()
    }

    pub(crate) fn record(&self, round_trip_us: f64) {
        self.ewma_us.update(round_trip_us);
    }

    pub(crate) fn begin(&self) -> Outstanding<'_> {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        Outstanding(self)
    }

    fn score(&self) -> f64 {
        let ewma = self.ewma_us();
        let latency = if ewma == 0.0 { UNMEASURED_US } else { ewma };
        latency * (self.outstanding() + 1) as f64
    }
}

/// Decrements a replica's outstanding count when the call ends, however it ends.
pub(crate) struct Outstanding<'a>(&'a Replica);

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The replica a call goes to: among the candidates that may take work, the lowest EWMA ×
/// (outstanding + 1); ties go to the first at or after `start` (rotating `start` spreads
/// the load over equal replicas). `None` when no candidate may take work.
pub fn pick(candidates: &[(bool, f64)], start: usize) -> Option<usize> {
    let n = candidates.len();
    (0..n)
        .map(|i| (start + i) % n)
        .filter(|&i| candidates[i].0)
        .min_by(|&a, &b| candidates[a].1.total_cmp(&candidates[b].1))
}

/// The candidates of [`pick`] for these replicas, `skip` excluded.
pub(crate) fn candidates(replicas: &[&Replica], skip: Option<usize>) -> Vec<(bool, f64)> {
    replicas
        .iter()
        .enumerate()
        .map(|(i, r)| {
            (
                Some(i) != skip && r.state() == ReplicaState::Active,
                r.score(),
            )
        })
        .collect()
}

/// What a failed call means for its replica and its part of the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The connection failed or the replica is not serving: eject it, retry elsewhere.
    Eject,
    /// Alive but its queue is full (`overloaded`): retry elsewhere, keep it.
    Busy,
    /// The failure is the request's own answer (its budget, a bad request): no retry.
    Final,
}

/// How a failure is handled: connection-level failures (connect refused or reset, handshake,
/// closed before the reply) and refusals another replica may not give (`not_ready`,
/// `shutting_down`: `ErrorCode::retry_elsewhere`) eject; `overloaded` retries without
/// ejecting. A timeout is final here; the client retries one that left time before the
/// request's deadline (a per-attempt limit shorter than the budget), without ejecting.
pub fn failure(e: &WireError) -> Failure {
    match e {
        WireError::Connect { .. } | WireError::Handshake { .. } | WireError::Closed { .. } => {
            Failure::Eject
        }
        WireError::Remote { code, .. } if code.retry_elsewhere() => match code {
            ErrorCode::Overloaded => Failure::Busy,
            _ => Failure::Eject,
        },
        WireError::Remote { code, .. } if code.closes_connection() => Failure::Eject,
        _ => Failure::Final,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn picks_the_lowest_score_among_active_and_rotates_ties() {
        let c = [(true, 100.0), (true, 50.0), (false, 1.0), (true, 50.0)];
        assert_eq!(pick(&c, 0), Some(1));
        assert_eq!(pick(&c, 2), Some(3));
        assert_eq!(pick(&c, 3), Some(3));
        assert_eq!(pick(&[(false, 1.0), (false, 1.0)], 0), None);
        assert_eq!(pick(&[], 7), None);
        let even = [(true, 1.0); 3];
        let chosen: Vec<usize> = (0..6).map(|s| pick(&even, s).unwrap()).collect();
        assert_eq!(chosen, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn failures_that_eject_retry_or_end() {
        let addr: Address = "127.0.0.1:9".parse().unwrap();
        let remote = |code| WireError::Remote {
            addr: addr.clone(),
            code,
            message: "m".into(),
        };
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let cases = [
            (
                WireError::Connect {
                    addr: addr.clone(),
                    source: refused,
                },
                Failure::Eject,
            ),
            (
                WireError::Closed {
                    addr: addr.clone(),
                    reason: "reset".into(),
                },
                Failure::Eject,
            ),
            (remote(ErrorCode::NotReady), Failure::Eject),
            (remote(ErrorCode::ShuttingDown), Failure::Eject),
            (remote(ErrorCode::Overloaded), Failure::Busy),
            (remote(ErrorCode::BadRequest), Failure::Final),
            (remote(ErrorCode::Deadline), Failure::Final),
            (
                WireError::Timeout {
                    addr: addr.clone(),
                    after: Duration::from_millis(1),
                },
                Failure::Final,
            ),
        ];
        for (e, want) in cases {
            assert_eq!(failure(&e), want, "{e}");
        }
    }
}
