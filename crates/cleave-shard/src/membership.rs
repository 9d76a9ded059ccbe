//! Changing a shard client's membership while it serves: replicas join a replica group,
//! drain and leave. Each change builds a new snapshot (routing table and replicas) and swaps
//! it in under the client's lock; lookups already running keep the snapshot they started
//! with, so none sees a half-updated table and calls in flight finish.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use cleave_wire::{Address, Client};

use crate::client::ShardClient;
use crate::replica::{Replica, ReplicaState};
use crate::routes::{Route, RoutingTable};

/// Why a membership change was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MembershipError {
    /// The change is malformed (ranges that match no replica group, a bad address).
    Invalid(String),
    /// The change conflicts with the membership (address already present, last replica).
    Conflict(String),
    /// No such member.
    Unknown(String),
}

impl fmt::Display for MembershipError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MembershipError::Invalid(m)
            | MembershipError::Conflict(m)
            | MembershipError::Unknown(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for MembershipError {}

/// One shard replica as `members` reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    pub addr: Address,
    pub ranges: Vec<(String, Range<u64>)>,
    pub state: ReplicaState,
    pub outstanding: u64,
    pub ewma_ms: f64,
}

/// A routing table and its replicas (indexed like `routes.shards()`): what one lookup uses.
pub(crate) struct Members {
    pub(crate) routes: RoutingTable,
    pub(crate) replicas: Vec<Arc<Replica>>,
}

impl Members {
    pub(crate) fn group(&self, g: usize) -> Vec<&Replica> {
        self.routes.groups()[g]
            .iter()
            .map(|&s| &*self.replicas[s])
            .collect()
    }

    pub(crate) fn replica(&self, addr: &Address) -> Option<&Arc<Replica>> {
        self.replicas.iter().find(|r| r.addr() == addr)
    }

    /// "h:1 (ejected: why), h:2 (draining)": the replicas of group `g` and their states.
    pub(crate) fn describe_states(&self, g: usize) -> String {
        let parts: Vec<String> = self
            .group(g)
            .iter()
            .map(|r| match r.state() {
                ReplicaState::Ejected => format!("{} (ejected: {})", r.addr(), r.reason()),
                s => format!("{} ({})", r.addr(), s.as_str()),
            })
            .collect();
        parts.join(", ")
    }
}

impl ShardClient {
    /// Every replica with its ranges, state and load, in routing-table order.
    pub fn members(&self) -> Vec<Member> {
        let m = self.snapshot();
        m.replicas
            .iter()
            .map(|r| Member {
                addr: r.addr().clone(),
                ranges: m.routes.ranges_of(r.addr()),
                state: r.state(),
                outstanding: r.outstanding(),
                ewma_ms: r.ewma_us() / 1e3,
            })
            .collect()
    }

    /// Adds a replica holding exactly the ranges of an existing replica group. It starts
    /// ejected ("not probed yet"): the next probe admits it once it answers ready.
    pub fn add_replica(
        &self,
        addr: Address,
        ranges: Vec<(String, Range<u64>)>,
    ) -> Result<(), MembershipError> {
        let mut guard = self.members.write().unwrap_or_else(|p| p.into_inner());
        let m = guard.clone();
        if m.replica(&addr).is_some() {
            return Err(MembershipError::Conflict(format!(
                "shard {addr} is already a member"
            )));
        }
        let mut asked = ranges;
        asked.sort_by(|a, b| (&a.0, a.1.start, a.1.end).cmp(&(&b.0, b.1.start, b.1.end)));
        asked.dedup();
        let groups: Vec<Vec<(String, Range<u64>)>> = (0..m.routes.groups().len())
            .map(|g| m.routes.group_ranges(g))
            .collect();
        if !groups.contains(&asked) {
            let held: Vec<String> = (0..groups.len())
                .map(|g| format!("[{}]", m.routes.describe_group(g)))
                .collect();
            return Err(MembershipError::Invalid(format!(
                "ranges: a new replica must hold exactly the ranges of one replica group; \
                 the groups hold {}",
                held.join(", ")
            )));
        }
        let mut routes = m.routes.routes().to_vec();
        routes.extend(asked.into_iter().map(|(table, rows)| Route {
            table,
            rows,
            addr: addr.clone(),
        }));
        let client = Client::new(addr, self.io.clone(), self.wire.clone());
        let fresh = Arc::new(Replica::new(
            client,
            ReplicaState::Ejected,
            "added, not probed yet",
        ));
        *guard = Arc::new(rebuild(&m, routes, Some(fresh))?);
        Ok(())
    }

    /// Sends no new work to `addr`; calls in flight finish. Refused for the last active
    /// replica of a group.
    pub fn drain(&self, addr: &Address) -> Result<(), MembershipError> {
        let guard = self.members.write().unwrap_or_else(|p| p.into_inner());
        let r = guard.replica(addr).ok_or_else(|| unknown(addr, &guard))?;
        last_active(&guard, addr, "drain")?;
        r.set_state(ReplicaState::Draining);
        Ok(())
    }

    /// Removes `addr` and its routes; lookups already started finish on the old membership.
    /// Refused when a range it holds would be left with no active replica.
    pub fn remove(&self, addr: &Address) -> Result<(), MembershipError> {
        let mut guard = self.members.write().unwrap_or_else(|p| p.into_inner());
        let m = guard.clone();
        m.replica(addr).ok_or_else(|| unknown(addr, &m))?;
        last_active(&m, addr, "remove")?;
        let routes = m
            .routes
            .routes()
            .iter()
            .filter(|r| r.addr != *addr)
            .cloned()
            .collect();
        *guard = Arc::new(rebuild(&m, routes, None)?);
        Ok(())
    }
}

/// A membership with `routes`, keeping the replicas (state, load, connections) of addresses
/// that stay and taking `fresh` for the new one.
fn rebuild(
    m: &Members,
    routes: Vec<Route>,
    fresh: Option<Arc<Replica>>,
) -> Result<Members, MembershipError> {
    let routes = RoutingTable::new(routes).map_err(MembershipError::Invalid)?;
    let replicas = routes
        .shards()
        .iter()
        .map(|a| match m.replica(a) {
            Some(r) => Ok(r.clone()),
            None => fresh
                .clone()
                .filter(|f| f.addr() == a)
                .ok_or_else(|| MembershipError::Invalid(format!("shard {a}: no client"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Members { routes, replicas })
}

fn unknown(addr: &Address, m: &Members) -> MembershipError {
    let known: Vec<String> = m.replicas.iter().map(|r| r.addr().to_string()).collect();
    MembershipError::Unknown(format!(
        "addr: shard {addr} is not a member; members are [{}]",
        known.join(", ")
    ))
}

/// Refuses to `what` the replica at `addr` when a group it belongs to has no other active
/// replica (the group's ranges would have none).
fn last_active(m: &Members, addr: &Address, what: &str) -> Result<(), MembershipError> {
    for g in 0..m.routes.groups().len() {
        let group = m.group(g);
        if !group.iter().any(|r| r.addr() == addr) {
            continue;
        }
        let others = group
            .iter()
            .filter(|r| r.addr() != addr && r.state() == ReplicaState::Active)
            .count();
        if others == 0 {
            return Err(MembershipError::Conflict(format!(
                "cannot {what} shard {addr}: it is the last active replica of {} (replicas: {})",
                m.routes.describe_group(g),
                m.describe_states(g)
            )));
        }
    }
    Ok(())
}
