//! The shard client: splits a batch of lookups by the range routing table, sends one LOOKUP
//! frame to every shard involved, and merges the partial pools (hierarchical pooling, FlexEMR
//! §3.1.2): sums add, means add sums and divide by the total count, maxima take the max over
//! the shards that pooled at least one id.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use cleave_embed::lookup::finish;
use cleave_embed::{merge, Pooling};
use cleave_wire::{Address, Client, ClientConfig, IoThreads, WireError};

use crate::message::{decode_response, encode_request, Lookup, LookupView, Op, Pooled, LOOKUP};
use crate::routes::{RoutingTable, TableRoutes};

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
    /// A shard answered something that does not fit the request.
    BadResponse { addr: Address, reason: String },
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::BadRequest(m) => f.write_str(m),
            ClientError::Shard(e) => write!(f, "shard {e}"),
            ClientError::BadResponse { addr, reason } => {
                write!(f, "shard {addr}: unexpected response: {reason}")
            }
        }
    }
}

impl std::error::Error for ClientError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ClientError::Shard(e) => Some(e),
            _ => None,
        }
    }
}

/// A client of every shard in a routing table.
pub struct ShardClient {
    routes: RoutingTable,
    clients: Vec<Client>,
    timeout: Duration,
}

/// One lookup of a shard's frame: a request of the batch sent whole, or one shard's part.
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

    /// A client whose connections live on `io` (shared with other clients).
    pub fn with_io(routes: RoutingTable, io: IoThreads, config: &ShardClientConfig) -> ShardClient {
        let wire = ClientConfig {
            connections: config.connections,
            connect_timeout: config.connect_timeout,
            max_payload: config.max_payload,
            ..ClientConfig::default()
        };
        let clients = routes
            .shards()
            .iter()
            .map(|a| Client::new(a.clone(), io.clone(), wire.clone()))
            .collect();
        ShardClient {
            routes,
            clients,
            timeout: config.timeout,
        }
    }

    pub fn routes(&self) -> &RoutingTable {
        &self.routes
    }

    /// Asks every shard whether it is ready; the error names the first shard that is not.
    pub async fn ready(&self) -> Result<(), ClientError> {
        let probes = self.clients.iter().map(|c| c.ready(self.timeout));
        for (c, r) in self.clients.iter().zip(join_all(probes.collect()).await) {
            if !r.map_err(ClientError::Shard)? {
                return Err(ClientError::Shard(WireError::Remote {
                    addr: c.addr().clone(),
                    code: cleave_wire::ErrorCode::NotReady,
                    message: "not ready".to_owned(),
                }));
            }
        }
        Ok(())
    }

    /// Looks up a batch: one result per lookup, in order. Pooled results have one row per bag
    /// (`counts` the number of ids pooled); gathers one row per id. Within the configured
    /// timeout, without a trace id.
    pub async fn lookup(&self, batch: &[Lookup]) -> Result<Vec<Pooled>, ClientError> {
        self.lookup_traced(batch, self.timeout, 0).await
    }

    /// [`lookup`](Self::lookup) within `timeout` (each shard's frame carries now + `timeout`
    /// as its deadline, so a shard drops it once nobody waits) and with the client request's
    /// trace id on every frame.
    pub async fn lookup_traced(
        &self,
        batch: &[Lookup],
        timeout: Duration,
        trace_id: u64,
    ) -> Result<Vec<Pooled>, ClientError> {
        let plan = self.plan(batch)?;
        let calls: Vec<_> = plan
            .iter()
            .enumerate()
            .filter(|(_, subs)| !subs.is_empty())
            .map(|(s, subs)| {
                let views = subs.iter().map(|sub| sub_view(sub, batch));
                let payload = encode_request(views);
                let client = &self.clients[s];
                async move {
                    let reply = client.call_traced(LOOKUP, payload, timeout, trace_id);
                    (s, reply.await)
                }
            })
            .collect();
        let mut merged: Vec<Merged> = (0..batch.len()).map(|_| Merged::None).collect();
        for (s, reply) in join_all(calls).await {
            let addr = self.clients[s].addr();
            let payload = reply.map_err(ClientError::Shard)?;
            let subs = &plan[s];
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

    /// Splits every lookup by shard: per shard, the lookups to send.
    fn plan(&self, batch: &[Lookup]) -> Result<Vec<Vec<Sub>>, ClientError> {
        let mut plan: Vec<Vec<Sub>> = (0..self.clients.len()).map(|_| Vec::new()).collect();
        for (i, l) in batch.iter().enumerate() {
            let bad = |m: String| {
                ClientError::BadRequest(format!("lookup {i} (table {:?}): {m}", l.table))
            };
            l.view().check().map_err(bad)?;
            let routes = self.routes.table(&l.table).ok_or_else(|| {
                bad(format!(
                    "no shard holds this table; routed tables are {:?}",
                    self.routes.table_names()
                ))
            })?;
            let shard_of = locate_all(l, routes, self.routes.shards()).map_err(bad)?;
            let Some(shard_of) = shard_of else {
                // One shard holds every id (or there are none): send the lookup as it is.
                let s = routes.single().map_or_else(
                    || {
                        l.ids
                            .first()
                            .and_then(|&id| routes.locate(id))
                            .unwrap_or(routes.first_shard())
                    },
                    |(s, _)| s,
                );
                plan[s].push(Sub::Whole(i));
                continue;
            };
            for (s, lookup, positions) in split(l, &shard_of, self.clients.len()) {
                plan[s].push(Sub::Part {
                    req: i,
                    lookup,
                    positions,
                });
            }
        }
        Ok(plan)
    }
}

/// The shard of every id, or None when one shard holds them all. Errors name the first id
/// that no route covers.
fn locate_all(
    l: &Lookup,
    routes: &TableRoutes,
    shards: &[Address],
) -> Result<Option<Vec<usize>>, String> {
    let outside = |p: usize, id: i64| {
        format!(
            "id {id} at position {p} is outside every route ({})",
            routes.describe(shards)
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
    let mut shard_of = Vec::with_capacity(l.ids.len());
    for (p, &id) in l.ids.iter().enumerate() {
        shard_of.push(routes.locate(id).ok_or_else(|| outside(p, id))?);
    }
    let first = shard_of.first().copied();
    if shard_of.iter().all(|&s| Some(s) == first) {
        return Ok(None);
    }
    Ok(Some(shard_of))
}

/// Cuts a lookup into one lookup per shard. Every part keeps all bags (empty where the shard
/// holds none of a bag's ids) and pools partially (a mean becomes a sum); a gather part
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
