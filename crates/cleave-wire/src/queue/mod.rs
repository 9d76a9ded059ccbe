//! The order in which requests waiting for a core are started: one policy per file behind
//! [`RequestQueue`]. Adding a policy is adding a file and a [`QueuePolicy`] variant, and its
//! name to python/cleave/settings/choices.py (a test compares the two lists).
//!
//! * [`Fifo`]: arrival order (Cleave's behaviour before policies existed, and the default).
//! * [`Edf`]: earliest absolute deadline first; requests without a deadline go last, in
//!   arrival order.
//! * [`Lifo`]: newest first (under overload: keep the newest requests in time).

mod edf;
mod fifo;
mod lifo;

use std::fmt;
use std::str::FromStr;

pub use edf::Edf;
pub use fifo::Fifo;
pub use lifo::Lifo;

/// What a queue needs to know about an item.
pub trait Queued {
    /// When the caller stops waiting, Unix µs; 0 = no deadline.
    fn deadline_unix_us(&self) -> u64;
}

/// Requests waiting to start. `pop` returns the one the policy starts next.
pub trait RequestQueue<T>: Send {
    fn push(&mut self, item: T);
    fn pop(&mut self) -> Option<T>;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which queue a server (shard, ranker) orders its waiting requests with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueuePolicy {
    /// Arrival order.
    #[default]
    Fifo,
    /// Earliest deadline first.
    Edf,
    /// Newest first.
    Lifo,
}

impl QueuePolicy {
    pub const ALL: [QueuePolicy; 3] = [QueuePolicy::Fifo, QueuePolicy::Edf, QueuePolicy::Lifo];
    /// Older names that still parse, with the name they stand for.
    pub const ALIASES: [(&'static str, &'static str); 1] = [("fcfs", "fifo")];

    pub fn as_str(self) -> &'static str {
        match self {
            QueuePolicy::Fifo => "fifo",
            QueuePolicy::Edf => "edf",
            QueuePolicy::Lifo => "lifo",
        }
    }

    /// Every policy's name, in declaration order.
    pub fn names() -> Vec<&'static str> {
        Self::ALL.iter().map(|p| p.as_str()).collect()
    }

    /// The policy named `name`, or `alias` (an older name for it: callers warn that it is
    /// deprecated).
    pub fn parse_name(name: &str) -> Result<(QueuePolicy, Option<&'static str>), UnknownPolicy> {
        let (canonical, alias) = match Self::ALIASES.iter().find(|(a, _)| *a == name) {
            Some((alias, canonical)) => (*canonical, Some(*alias)),
            None => (name, None),
        };
        match Self::ALL.into_iter().find(|p| p.as_str() == canonical) {
            Some(policy) => Ok((policy, alias)),
            None => Err(UnknownPolicy {
                got: name.to_owned(),
            }),
        }
    }

    /// An empty queue of this policy.
    pub fn queue<T: Queued + Send + 'static>(self) -> Box<dyn RequestQueue<T>> {
        match self {
            QueuePolicy::Fifo => Box::new(Fifo::default()),
            QueuePolicy::Edf => Box::new(Edf::default()),
            QueuePolicy::Lifo => Box::new(Lifo::default()),
        }
    }
}

impl fmt::Display for QueuePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A queue policy name that is not one of [`QueuePolicy::names`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown queue policy {got:?}: expected one of {}", expected())]
pub struct UnknownPolicy {
    pub got: String,
}

fn expected() -> String {
    let quoted: Vec<String> = QueuePolicy::names()
        .iter()
        .map(|n| format!("{n:?}"))
        .collect();
    quoted.join(", ")
}

/// A name or an alias (silently: see [`QueuePolicy::parse_name`] to warn).
impl FromStr for QueuePolicy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<QueuePolicy, UnknownPolicy> {
        QueuePolicy::parse_name(s).map(|(policy, _)| policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug)]
    struct Item {
        id: usize,
        deadline: u64,
        pushed_at: u64,
    }

    impl Queued for Item {
        fn deadline_unix_us(&self) -> u64 {
            self.deadline
        }
    }

    fn item(id: usize, deadline: u64) -> Item {
        Item {
            id,
            deadline,
            pushed_at: 0,
        }
    }

    fn drain(q: &mut dyn RequestQueue<Item>) -> Vec<usize> {
        std::iter::from_fn(|| q.pop()).map(|i| i.id).collect()
    }

    #[test]
    fn policies_parse_by_name_and_alias_and_refuse_others() {
        for name in QueuePolicy::names() {
            assert_eq!(name.parse::<QueuePolicy>().unwrap().as_str(), name);
        }
        assert_eq!(
            QueuePolicy::parse_name("fcfs").unwrap(),
            (QueuePolicy::Fifo, Some("fcfs"))
        );
        assert_eq!(
            QueuePolicy::parse_name("fifo").unwrap(),
            (QueuePolicy::Fifo, None)
        );
        let err = "random".parse::<QueuePolicy>().unwrap_err().to_string();
        assert!(
            err.contains("\"random\"") && err.contains("\"edf\""),
            "{err}"
        );
    }

    /// The names and aliases are python/cleave/settings/choices.py's (through the generated
    /// settings.json: `python -m cleave.settings --write`).
    #[test]
    fn names_are_the_settings_schemas() {
        let text = include_str!("../../../../deploy/helm/cleave/files/settings.json");
        let settings: serde_json::Value = serde_json::from_str(text).unwrap();
        let listed = &settings["choices"]["queue_policy"];
        let names: Vec<&str> = listed["names"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap())
            .collect();
        assert_eq!(names, QueuePolicy::names());
        let aliases: Vec<(&str, &str)> = listed["aliases"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(a, n)| (a.as_str(), n.as_str().unwrap()))
            .collect();
        assert_eq!(aliases, QueuePolicy::ALIASES);
    }

    #[test]
    fn fifo_keeps_arrival_order_and_edf_serves_the_earlier_deadline_first() {
        let items = [(0, 30), (1, 10), (2, 0), (3, 20), (4, 10)];
        let mut fifo = QueuePolicy::Fifo.queue();
        let mut edf = QueuePolicy::Edf.queue();
        for (id, d) in items {
            fifo.push(item(id, d));
            edf.push(item(id, d));
        }
        assert_eq!(fifo.len(), 5);
        assert_eq!(drain(&mut *fifo), [0, 1, 2, 3, 4]);
        // Equal deadlines keep arrival order; no deadline (0) goes last.
        assert_eq!(drain(&mut *edf), [1, 4, 3, 0, 2]);
        assert!(edf.is_empty());
    }

    /// One step of a simulated server: push a burst, then start one request.
    fn simulate(policy: QueuePolicy, bursts: &[(u8, Vec<u64>)]) -> Vec<(u64, u64, u64)> {
        let mut q = policy.queue::<Item>();
        let mut started = Vec::new(); // (pushed_at, started_at, slack)
        let mut t = 0u64;
        let mut id = 0;
        for (gap, slacks) in bursts {
            for &s in slacks {
                q.push(Item {
                    id,
                    deadline: 1 + t + s,
                    pushed_at: t,
                });
                id += 1;
            }
            // `gap` steps until the next burst, one start per step.
            for _ in 0..*gap {
                if let Some(i) = q.pop() {
                    started.push((i.pushed_at, t, i.deadline - 1 - i.pushed_at));
                }
                t += 1;
            }
        }
        while let Some(i) = q.pop() {
            started.push((i.pushed_at, t, i.deadline - 1 - i.pushed_at));
            t += 1;
        }
        assert_eq!(started.len(), id, "every request starts exactly once");
        started
    }

    const MAX_SLACK: u64 = 40;

    proptest! {
        /// When the load allows (each burst of b requests is followed by at least b steps,
        /// one start per step), EDF starves nobody: a request waits at most the longest slack
        /// plus two bursts, however loose its own deadline.
        #[test]
        fn edf_starves_no_request_when_load_allows(
            raw in prop::collection::vec(
                (0u8..8, prop::collection::vec(0..=MAX_SLACK, 0..8)), 1..60)
        ) {
            let bursts: Vec<(u8, Vec<u64>)> = raw
                .into_iter()
                .map(|(extra, s)| ((s.len() as u8).saturating_add(extra), s))
                .collect();
            let max_burst = bursts.iter().map(|(_, s)| s.len() as u64).max().unwrap_or(0);
            for (pushed, started, _) in simulate(QueuePolicy::Edf, &bursts) {
                prop_assert!(
                    started - pushed <= MAX_SLACK + 2 * max_burst + 1,
                    "waited {} steps (slack at most {MAX_SLACK}, bursts at most {max_burst})",
                    started - pushed
                );
            }
        }

        /// EDF never starts a request while one with an earlier deadline waits.
        #[test]
        fn edf_pops_in_deadline_order(deadlines in prop::collection::vec(0u64..100, 0..50)) {
            let mut q = QueuePolicy::Edf.queue();
            for (i, &d) in deadlines.iter().enumerate() {
                q.push(item(i, d));
            }
            let popped: Vec<u64> = std::iter::from_fn(|| q.pop()).map(|i| i.deadline).collect();
            prop_assert_eq!(popped.len(), deadlines.len());
            let key = |d: u64| if d == 0 { u64::MAX } else { d };
            prop_assert!(popped.windows(2).all(|w| key(w[0]) <= key(w[1])));
        }
    }
}
