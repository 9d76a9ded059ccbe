//! The shard client: splits a batch of lookups by the range routing table, sends one LOOKUP
//! frame to every replica group involved (through one of its replicas, chosen by measured
//! latency and outstanding work), and merges the partial pools (hierarchical pooling, FlexEMR
//! §3.1.2): sums add, means add sums and divide by the total count, maxima take the max over
//! the shards that pooled at least one id. A group's frame that fails in a way another replica
//! may answer is sent once more to another replica; the replica that failed is ejected until a
//! probe finds it ready. The membership (routes, replicas) can change while lookups run: each
//! lookup works on the snapshot it started with.

use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_embed::lookup::finish;
use cleave_embed::{merge, Pooling};
use cleave_wire::{Address, Client, ClientConfig, IoThreads, WireError};

use crate::message::{decode_response, encode_request, Lookup, LookupView, Op, Pooled, LOOKUP};
use crate::replica::{candidates, failure, pick, Failure, Replica, ReplicaState};
use crate::routes::{Route, RoutingTable, TableRoutes};

/// Connections and timeouts of a shard client.
#[derive(Clone, Debug)]
pub struct ShardClientConfig {
    /// Longest wait for a whole batch (every shard's answer).
    pub timeout: Duration,
    pub connect_timeout: Duration,
    /// Data connections per shard.
    pub connections: usize,
    /// I/O threads (when the client makes its own).
    pub io_threads: usize,
    /// Largest response accepted from a shard.
    pub max_payload: u32,
}

impl Default for ShardClientConfig {
    fn default() -> ShardClientConfig {
        ShardClientConfig {
            timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
            connections: 2,
            io_threads: 1,
            max_payload: cleave_wire::frame::DEFAULT_MAX_PAYLOAD,
        }
    }
}

/// Why a batch failed.
#[derive(Debug)]
pub enum ClientError {
    /// The batch cannot be routed or is malformed; says which lookup and why.
    BadRequest(String),
    /// A shard failed, refused, or did not answer in time; the error names its address.
    Shard(WireError),
    /// The last replica tried for a group failed; `holds` names the group's ranges.
    Replica { source: WireError, holds: String },
    /// No replica of a group may take work (all ejected or draining): failed fast.
    Unavailable { holds: String, replicas: String },
    /// A shard answered something that does not fit the request.
    BadResponse { addr: Address, reason: String },
}

impl ClientError {
    /// The wire error behind a shard's failure, if one is.
    pub fn wire(&self) -> Option<&WireError> {
        match self {
            ClientError::Shard(e) | ClientError::Replica { source: e, .. } => Some(e),
            _ => None,
        }
    }
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::BadRequest(m) => f.write_str(m),
            ClientError::Shard(e) => write!(f, "shard {e}"),
            ClientError::Replica { source, holds } => write!(f, "shard {source} (holding {holds})"),
            ClientError::Unavailable { holds, replicas } => write!(
                f,
                "no shard replica can take the lookup of {holds}: replicas {replicas}"
            ),
            ClientError::BadResponse { addr, reason } => {
                write!(f, "shard {addr}: unexpected response: {reason}")
            }
        }
    }
}

impl std::error::Error for ClientError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.wire().map(|e| e as _)
    }
}

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

/// What a probe of every replica found: parts down while every range still has a replica
/// (`degraded`), and ranges no replica serves (`problems`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ProbeReport {
    pub degraded: Vec<String>,
    pub problems: Vec<String>,
}

/// A routing table and its replicas (indexed like `routes.shards()`): what one lookup uses.
struct Members {
    routes: RoutingTable,
    replicas: Vec<Arc<Replica>>,
}

impl Members {
    fn group(&self, g: usize) -> Vec<&Replica> {
        self.routes.groups()[g]
            .iter()
            .map(|&s| &*self.replicas[s])
            .collect()
    }

    fn replica(&self, addr: &Address) -> Option<&Arc<Replica>> {
        self.replicas.iter().find(|r| r.addr() == addr)
    }

    /// "h:1 (ejected: why), h:2 (draining)": the replicas of group `g` and their states.
    fn describe_states(&self, g: usize) -> String {
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

/// A client of every shard in a routing table.
pub struct ShardClient {
    members: RwLock<Arc<Members>>,
    io: IoThreads,
    wire: ClientConfig,
    timeout: Duration,
    /// Rotates the start of replica choice, so that equal replicas share the load.
    next: AtomicUsize,
}

/// One lookup of a shard's frame: a request of the batch sent whole, or one group's part.
enum Sub {
    Whole(usize),
    Part {
        req: usize,
        lookup: Lookup,
        positions: Vec<u32>,
    },
}

impl ShardClient {
    /// A client with its own I/O threads. Connects lazily, on the first lookup.
    pub fn new(routes: RoutingTable, config: &ShardClientConfig) -> std::io::Result<ShardClient> {
        let io = IoThreads::new("cleave-shard-client", config.io_threads)?;
        Ok(ShardClient::with_io(routes, io, config))
    }

    /// A client whose connections live on `io` (shared with other clients). Every replica
    /// starts active.
    pub fn with_io(routes: RoutingTable, io: IoThreads, config: &ShardClientConfig) -> ShardClient {
        let wire = ClientConfig {
            connections: config.connections,
            connect_timeout: config.connect_timeout,
            max_payload: config.max_payload,
            ..ClientConfig::default()
        };
        let replicas = routes
            .shards()
            .iter()
            .map(|a| {
                let client = Client::new(a.clone(), io.clone(), wire.clone());
                Arc::new(Replica::new(client, ReplicaState::Active, ""))
            })
            .collect();
        ShardClient {
            members: RwLock::new(Arc::new(Members { routes, replicas })),
            io,
            wire,
            timeout: config.timeout,
            next: AtomicUsize::new(0),
        }
    }

    fn snapshot(&self) -> Arc<Members> {
        self.members
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The routing table now (a copy: membership may change after).
    pub fn routes(&self) -> RoutingTable {
        self.snapshot().routes.clone()
    }

    /// Asks every shard whether it is ready; the error names the first shard that is not.
    pub async fn ready(&self) -> Result<(), ClientError> {
        let members = self.snapshot();
        let probes = members
            .replicas
            .iter()
            .map(|r| r.client.ready(self.timeout));
        for (r, ok) in members
            .replicas
            .iter()
            .zip(join_all(probes.collect()).await)
        {
            if !ok.map_err(ClientError::Shard)? {
                return Err(ClientError::Shard(WireError::Remote {
                    addr: r.addr().clone(),
                    code: cleave_wire::ErrorCode::NotReady,
                    message: "not ready".to_owned(),
                }));
            }
        }
        Ok(())
    }

    /// Probes every replica once within `timeout`: one that answers ready is readmitted if it
    /// was ejected; one that does not is ejected. Then reports, per replica group, replicas
    /// down (degraded) and groups with no active replica (problems).
    pub async fn probe(&self, timeout: Duration) -> ProbeReport {
        let members = self.snapshot();
        let probes = members.replicas.iter().map(|r| async move {
            match tokio::time::timeout(timeout, r.client.ready(timeout)).await {
                Ok(Ok(true)) => None,
                Ok(Ok(false)) => Some("not ready".to_owned()),
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!(
                    "no readiness answer within {} ms",
                    timeout.as_millis()
                )),
            }
        });
        for (r, problem) in members
            .replicas
            .iter()
            .zip(join_all(probes.collect()).await)
        {
            match problem {
                None if r.readmit() => eprintln!("cleave router: shard {} readmitted", r.addr()),
                Some(why) if r.eject(why.clone()) => {
                    eprintln!("cleave router: shard {} ejected: {why}", r.addr());
                }
                _ => {}
            }
        }
        let mut report = ProbeReport::default();
        for g in 0..members.routes.groups().len() {
            let group = members.group(g);
            let active = group
                .iter()
                .filter(|r| r.state() == ReplicaState::Active)
                .count();
            let holds = members.routes.describe_group(g);
            if active == 0 {
                report.problems.push(format!(
                    "no shard replica serves {holds}: {}",
                    members.describe_states(g)
                ));
            } else {
                for r in group.iter().filter(|r| r.state() == ReplicaState::Ejected) {
                    report.degraded.push(format!(
                        "shard {} (a replica of {holds}) is ejected: {}",
                        r.addr(),
                        r.reason()
                    ));
                }
            }
        }
        report
    }

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

    /// Looks up a batch: one result per lookup, in order. Pooled results have one row per bag
    /// (`counts` the number of ids pooled); gathers one row per id. Within the configured
    /// timeout, without a trace id.
    pub async fn lookup(&self, batch: &[Lookup]) -> Result<Vec<Pooled>, ClientError> {
        self.lookup_traced(batch, self.timeout, 0).await
    }

    /// [`lookup`](Self::lookup) within `timeout` (each shard's frame carries now + what is
    /// left of `timeout` as its deadline, so a shard drops it once nobody waits) and with the
    /// client request's trace id on every frame.
    pub async fn lookup_traced(
        &self,
        batch: &[Lookup],
        timeout: Duration,
        trace_id: u64,
    ) -> Result<Vec<Pooled>, ClientError> {
        let started = Instant::now();
        let members = self.snapshot();
        let plan = plan(&members.routes, batch)?;
        let calls: Vec<_> = plan
            .iter()
            .enumerate()
            .filter(|(_, subs)| !subs.is_empty())
            .map(|(g, subs)| {
                let views = subs.iter().map(|sub| sub_view(sub, batch));
                let payload = encode_request(views);
                let members = &members;
                async move {
                    let deadline = started + timeout;
                    (
                        g,
                        self.call_group(members, g, payload, deadline, trace_id)
                            .await,
                    )
                }
            })
            .collect();
        let mut merged: Vec<Merged> = (0..batch.len()).map(|_| Merged::None).collect();
        for (g, reply) in join_all(calls).await {
            let (addr, payload) = reply?;
            let subs = &plan[g];
            let bad = |reason: String| ClientError::BadResponse {
                addr: addr.clone(),
                reason,
            };
            let results = decode_response(&payload, subs.len()).map_err(|e| bad(e.0))?;
            for (sub, result) in subs.iter().zip(results) {
                let (req, expected_rows) = match sub {
                    Sub::Whole(r) => (*r, batch[*r].rows()),
                    Sub::Part { req, lookup, .. } => (*req, lookup.rows()),
                };
                if result.rows != expected_rows || result.values.len() != result.rows * result.dim {
                    return Err(bad(format!(
                        "lookup {req} (table {:?}): {} rows of dim {} with {} values, expected {} rows",
                        batch[req].table,
                        result.rows,
                        result.dim,
                        result.values.len(),
                        expected_rows
                    )));
                }
                merged[req]
                    .add(&batch[req], sub, result)
                    .map_err(|e| bad(format!("lookup {req}: {e}")))?;
            }
        }
        merged
            .into_iter()
            .zip(batch)
            .enumerate()
            .map(|(i, (m, l))| {
                m.finish(l).ok_or_else(|| {
                    ClientError::BadRequest(format!("lookup {i}: no shard answered"))
                })
            })
            .collect()
    }

    /// Sends group `g`'s frame to its best active replica; a failure another replica may
    /// answer is retried once on the next best, before `deadline`. Returns the replica that
    /// answered and its payload.
    async fn call_group(
        &self,
        m: &Members,
        g: usize,
        payload: Bytes,
        deadline: Instant,
        trace_id: u64,
    ) -> Result<(Address, Bytes), ClientError> {
        let replicas = m.group(g);
        let holds = || m.routes.describe_group(g);
        let mut skip = None;
        let mut failed: Option<WireError> = None;
        // The first try and at most one retry: a lookup is pure, so running it twice is
        // harmless, and one retry rides out one replica's death without piling on.
        for _ in 0..2 {
            let start = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(i) = pick(&candidates(&replicas, skip), start) else {
                break;
            };
            let r = replicas[i];
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let source = failed.unwrap_or_else(|| WireError::Timeout {
                    addr: r.addr().clone(),
                    after: Duration::ZERO,
                });
                return Err(ClientError::Replica {
                    source,
                    holds: holds(),
                });
            }
            let guard = r.begin();
            let sent = Instant::now();
            let reply = r
                .client
                .call_traced(LOOKUP, payload.clone(), left, trace_id)
                .await;
            drop(guard);
            match reply {
                Ok(p) => {
                    r.record(sent.elapsed().as_secs_f64() * 1e6);
                    return Ok((r.addr().clone(), p));
                }
                Err(e) => {
                    match failure(&e) {
                        Failure::Final => {
                            return Err(ClientError::Replica {
                                source: e,
                                holds: holds(),
                            })
                        }
                        Failure::Eject => {
                            if r.eject(e.to_string()) {
                                eprintln!("cleave router: shard {} ejected: {e}", r.addr());
                            }
                        }
                        Failure::Busy => {}
                    }
                    skip = Some(i);
                    failed = Some(e);
                }
            }
        }
        Err(match failed {
            Some(source) => ClientError::Replica {
                source,
                holds: holds(),
            },
            None => ClientError::Unavailable {
                holds: holds(),
                replicas: m.describe_states(g),
            },
        })
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

/// Splits every lookup by replica group: per group, the lookups to send.
fn plan(routes: &RoutingTable, batch: &[Lookup]) -> Result<Vec<Vec<Sub>>, ClientError> {
    let groups = routes.groups().len();
    let mut plan: Vec<Vec<Sub>> = (0..groups).map(|_| Vec::new()).collect();
    for (i, l) in batch.iter().enumerate() {
        let bad =
            |m: String| ClientError::BadRequest(format!("lookup {i} (table {:?}): {m}", l.table));
        l.view().check().map_err(bad)?;
        let table = routes.table(&l.table).ok_or_else(|| {
            bad(format!(
                "no shard holds this table; routed tables are {:?}",
                routes.table_names()
            ))
        })?;
        let group_of = locate_all(l, table, routes).map_err(bad)?;
        let Some(group_of) = group_of else {
            // One group holds every id (or there are none): send the lookup as it is.
            let g = table.single().map_or_else(
                || {
                    l.ids
                        .first()
                        .and_then(|&id| table.locate(id))
                        .unwrap_or(table.first_group())
                },
                |(g, _)| g,
            );
            plan[g].push(Sub::Whole(i));
            continue;
        };
        for (g, lookup, positions) in split(l, &group_of, groups) {
            plan[g].push(Sub::Part {
                req: i,
                lookup,
                positions,
            });
        }
    }
    Ok(plan)
}

/// The group of every id, or None when one group holds them all. Errors name the first id
/// that no route covers.
fn locate_all(
    l: &Lookup,
    routes: &TableRoutes,
    table: &RoutingTable,
) -> Result<Option<Vec<usize>>, String> {
    let outside = |p: usize, id: i64| {
        format!(
            "id {id} at position {p} is outside every route ({})",
            routes.describe(table)
        )
    };
    if let Some((_, range)) = routes.single() {
        return match l
            .ids
            .iter()
            .position(|&id| id < 0 || !range.contains(&(id as u64)))
        {
            Some(p) => Err(outside(p, l.ids[p])),
            None => Ok(None),
        };
    }
    let mut group_of = Vec::with_capacity(l.ids.len());
    for (p, &id) in l.ids.iter().enumerate() {
        group_of.push(routes.locate(id).ok_or_else(|| outside(p, id))?);
    }
    let first = group_of.first().copied();
    if group_of.iter().all(|&g| Some(g) == first) {
        return Ok(None);
    }
    Ok(Some(group_of))
}

/// Cuts a lookup into one lookup per replica group. Every part keeps all bags (empty where
/// the group holds none of a bag's ids) and pools partially (a mean becomes a sum); a gather part
/// remembers where its rows go.
fn split(l: &Lookup, shard_of: &[usize], shards: usize) -> Vec<(usize, Lookup, Vec<u32>)> {
    let mut slot = vec![usize::MAX; shards];
    let mut parts: Vec<(usize, Lookup, Vec<u32>)> = Vec::new();
    let op = match l.op {
        Op::Pool(p) => Op::Pool(p.partial()),
        Op::Gather => Op::Gather,
    };
    for &s in shard_of {
        if slot[s] == usize::MAX {
            slot[s] = parts.len();
            let offsets = if op == Op::Gather {
                Vec::new()
            } else {
                vec![0]
            };
            let weights = l.weights.as_ref().map(|_| Vec::new());
            let part = Lookup {
                table: l.table.clone(),
                op,
                ids: Vec::new(),
                offsets,
                weights,
            };
            parts.push((s, part, Vec::new()));
        }
    }
    let push = |parts: &mut Vec<(usize, Lookup, Vec<u32>)>, p: usize| {
        let (_, part, positions) = &mut parts[slot[shard_of[p]]];
        part.ids.push(l.ids[p]);
        if let (Some(w), Some(from)) = (part.weights.as_mut(), l.weights.as_ref()) {
            w.push(from[p]);
        }
        if op == Op::Gather {
            positions.push(p as u32);
        }
    };
    if op == Op::Gather {
        (0..l.ids.len()).for_each(|p| push(&mut parts, p));
    } else {
        for bag in l.offsets.windows(2) {
            (bag[0] as usize..bag[1] as usize).for_each(|p| push(&mut parts, p));
            for (_, part, _) in parts.iter_mut() {
                part.offsets.push(part.ids.len() as u32);
            }
        }
    }
    parts
}

fn sub_view<'a>(sub: &'a Sub, batch: &'a [Lookup]) -> LookupView<'a> {
    match sub {
        Sub::Whole(i) => batch[*i].view(),
        Sub::Part { lookup, .. } => lookup.view(),
    }
}

/// A lookup's result being assembled from shards' answers.
enum Merged {
    None,
    Done(Pooled),
    Pool(Pooled),
    Gather(Pooled),
}

impl Merged {
    fn add(&mut self, l: &Lookup, sub: &Sub, part: Pooled) -> Result<(), String> {
        let positions = match sub {
            Sub::Whole(_) => {
                *self = Merged::Done(part);
                return Ok(());
            }
            Sub::Part { positions, .. } => positions,
        };
        let dim = part.dim;
        let fresh = |rows| Pooled {
            rows,
            dim,
            values: vec![0.0; rows * dim],
            counts: Vec::new(),
        };
        if let Merged::None = self {
            *self = match l.op {
                Op::Gather => Merged::Gather(fresh(l.ids.len())),
                Op::Pool(_) => {
                    let mut acc = fresh(l.rows());
                    acc.counts = vec![0; l.rows()];
                    Merged::Pool(acc)
                }
            };
        }
        match (self, l.op) {
            (Merged::Pool(acc), Op::Pool(pooling)) => {
                if acc.dim != dim {
                    return Err(format!("shards disagree on the dim: {} and {dim}", acc.dim));
                }
                merge(
                    pooling,
                    dim,
                    &mut acc.values,
                    &mut acc.counts,
                    &part.values,
                    &part.counts,
                )
                .map_err(|e| e.to_string())
            }
            (Merged::Gather(acc), Op::Gather) => {
                if acc.dim != dim {
                    return Err(format!("shards disagree on the dim: {} and {dim}", acc.dim));
                }
                for (row, &p) in part.values.chunks_exact(dim.max(1)).zip(positions) {
                    let p = p as usize;
                    acc.values[p * dim..(p + 1) * dim].copy_from_slice(row);
                }
                Ok(())
            }
            _ => Err("a result arrived for a lookup already answered whole".to_owned()),
        }
    }

    fn finish(self, l: &Lookup) -> Option<Pooled> {
        match self {
            Merged::None => None,
            Merged::Done(p) | Merged::Gather(p) => Some(p),
            Merged::Pool(mut p) => {
                if let Op::Pool(pooling @ Pooling::Mean) = l.op {
                    finish(pooling, p.dim, &mut p.values, &p.counts);
                }
                Some(p)
            }
        }
    }
}

/// Polls every future until all are done (a handful of shards: polling all on each wake is
/// cheaper than spawning tasks).
async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, out) in futures.iter_mut().zip(outputs.iter_mut()) {
            if out.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *out = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outputs
        .into_iter()
        .map(|o| o.expect("every future finished"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_keeps_bags_and_positions() {
        let l = Lookup {
            table: "t".into(),
            op: Op::Pool(Pooling::Mean),
            ids: vec![1, 7, 2, 8, 9],
            offsets: vec![0, 2, 2, 5],
            weights: None,
        };
        // ids < 5 on shard 0, others on shard 2.
        let shard_of: Vec<usize> = l.ids.iter().map(|&i| if i < 5 { 0 } else { 2 }).collect();
        let parts = split(&l, &shard_of, 3);
        assert_eq!(parts.len(), 2);
        let (s0, p0, _) = &parts[0];
        let (s2, p2, _) = &parts[1];
        assert_eq!((*s0, *s2), (0, 2));
        assert_eq!(p0.op, Op::Pool(Pooling::Sum));
        assert_eq!(
            (p0.ids.clone(), p0.offsets.clone()),
            (vec![1, 2], vec![0, 1, 1, 2])
        );
        assert_eq!(
            (p2.ids.clone(), p2.offsets.clone()),
            (vec![7, 8, 9], vec![0, 1, 1, 3])
        );

        let g = Lookup {
            op: Op::Gather,
            offsets: vec![],
            ..l
        };
        let parts = split(&g, &shard_of, 3);
        assert_eq!(parts[0].2, vec![0, 2]);
        assert_eq!(parts[1].2, vec![1, 3, 4]);
    }

    #[test]
    fn merge_of_parts_matches_pooling_the_whole() {
        let l = Lookup {
            table: "t".into(),
            op: Op::Pool(Pooling::Max),
            ids: vec![0, 1, 2],
            offsets: vec![0, 2, 3, 3],
            weights: None,
        };
        let a = Pooled {
            rows: 3,
            dim: 1,
            values: vec![-5.0, 0.0, 0.0],
            counts: vec![1, 0, 0],
        };
        let b = Pooled {
            rows: 3,
            dim: 1,
            values: vec![-7.0, 4.0, 0.0],
            counts: vec![1, 1, 0],
        };
        let sub = Sub::Part {
            req: 0,
            lookup: l.clone(),
            positions: vec![],
        };
        let mut m = Merged::None;
        m.add(&l, &sub, a).unwrap();
        m.add(&l, &sub, b).unwrap();
        let out = m.finish(&l).unwrap();
        // -5 beats -7 and the empty shard's 0 does not win; an empty bag stays 0.
        assert_eq!(out.values, vec![-5.0, 4.0, 0.0]);
        assert_eq!(out.counts, vec![2, 1, 0]);
    }
}
