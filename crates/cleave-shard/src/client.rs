//! The shard client: splits a batch of lookups by the range routing table, sends one LOOKUP
//! frame to every replica group involved (through one of its replicas, chosen by measured
//! latency and outstanding work), and merges the partial pools (split.rs). A group's frame
//! that fails in a way another replica may answer is sent once more to another replica; the
//! replica that failed is ejected until a probe finds it ready. The membership (routes,
//! replicas) can change while lookups run (membership.rs): each lookup works on the snapshot
//! it started with.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_wire::{Address, Client, ClientConfig, IoThreads, WireError};

use crate::membership::Members;
use crate::message::{decode_response, encode_request_as_of, Lookup, Pooled, LOOKUP};
use crate::replica::{candidates, failure, pick, Failure, Replica, ReplicaState};
use crate::routes::RoutingTable;
use crate::split::{plan, sub_view, Merged, Sub};

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
    /// Response credits: each data connection's initial window in bytes (docs/protocol.md,
    /// "Response credits"); `None`: off.
    pub response_credits: Option<u64>,
}

impl Default for ShardClientConfig {
    fn default() -> ShardClientConfig {
        ShardClientConfig {
            timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
            connections: 2,
            io_threads: 1,
            max_payload: cleave_wire::frame::DEFAULT_MAX_PAYLOAD,
            response_credits: None,
        }
    }
}

/// Why a batch failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The batch cannot be routed or is malformed; says which lookup and why.
    #[error("{0}")]
    BadRequest(String),
    /// A shard failed, refused, or did not answer in time; the error names its address.
    #[error("shard {0}")]
    Shard(#[source] WireError),
    /// The last replica tried for a group failed; `holds` names the group's ranges.
    #[error("shard {source} (holding {holds})")]
    Replica { source: WireError, holds: String },
    /// No replica of a group may take work (all ejected or draining): failed fast.
    #[error("no shard replica can take the lookup of {holds}: replicas {replicas}")]
    Unavailable { holds: String, replicas: String },
    /// A shard answered something that does not fit the request.
    #[error("shard {addr}: unexpected response: {reason}")]
    BadResponse { addr: Address, reason: String },
    /// Less time was left before the deadline than the replica's lookups take (its moving
    /// average): not sent, so that it uses neither the link nor the shard's cores.
    #[error(
        "lookup of {holds} not sent to shard {addr}: {left_us} us left before the deadline, \
         its lookups take {expected_us} us"
    )]
    Late {
        addr: Address,
        holds: String,
        left_us: u64,
        expected_us: u64,
    },
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

/// What a probe of every replica found: parts down while every range still has a replica
/// (`degraded`), and ranges no replica serves (`problems`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ProbeReport {
    pub degraded: Vec<String>,
    pub problems: Vec<String>,
}

/// A client of every shard in a routing table.
pub struct ShardClient {
    pub(crate) members: RwLock<Arc<Members>>,
    pub(crate) io: IoThreads,
    pub(crate) wire: ClientConfig,
    timeout: Duration,
    /// Rotates the start of replica choice, so that equal replicas share the load.
    next: AtomicUsize,
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
            response_credits: config.response_credits,
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

    pub(crate) fn snapshot(&self) -> Arc<Members> {
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
                None if r.readmit() => {
                    tracing::info!(shard = %r.addr(), "shard replica readmitted")
                }
                Some(why) if r.eject(why.clone()) => {
                    tracing::warn!(shard = %r.addr(), reason = %why, "shard replica ejected");
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
        self.lookup_within(batch, timeout, timeout, trace_id, None)
            .await
    }

    /// [`lookup_traced`](Self::lookup_traced) where each call to a replica waits at most
    /// `attempt` while another replica of its group could take a retry: one that times out
    /// while `timeout` has time left is retried once there (a slow or cut-off replica costs
    /// `attempt`, not the whole budget). A group's last candidate may use all of `timeout`.
    /// `as_of_unix_us`: when the client request arrived, sent to every shard so that all of
    /// them read the same version of a table an update is switching (None: now, here).
    pub async fn lookup_within(
        &self,
        batch: &[Lookup],
        timeout: Duration,
        attempt: Duration,
        trace_id: u64,
        as_of_unix_us: Option<u64>,
    ) -> Result<Vec<Pooled>, ClientError> {
        let as_of = as_of_unix_us.unwrap_or_else(cleave_wire::unix_now_us);
        let started = Instant::now();
        let members = self.snapshot();
        let plan = plan(&members.routes, batch)?;
        let calls: Vec<_> = plan
            .iter()
            .enumerate()
            .filter(|(_, subs)| !subs.is_empty())
            .map(|(g, subs)| {
                let views = subs.iter().map(|sub| sub_view(sub, batch));
                let payload = encode_request_as_of(views, Some(as_of));
                let members = &members;
                async move {
                    let deadline = started + timeout;
                    let reply = self.call_group(members, g, payload, deadline, attempt, trace_id);
                    (g, reply.await)
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

    /// Sends group `g`'s frame to its best active replica, waiting at most `attempt`; a
    /// failure another replica may answer (a timeout with time left before `deadline`
    /// included) is retried once on the next best. Returns the replica that answered and its
    /// payload.
    async fn call_group(
        &self,
        m: &Members,
        g: usize,
        payload: Bytes,
        deadline: Instant,
        attempt: Duration,
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
            let expected = r.expected_us();
            if (left.as_secs_f64() * 1e6) < expected {
                // Only replies refresh the estimate: without this a replica once slow would
                // never be sent another lookup. Each drop pulls it below what was left (half
                // of it as a sample), so after a few drops a lookup goes out and measures.
                r.record(left.as_secs_f64() * 1e6 / 2.0);
                return Err(ClientError::Late {
                    addr: r.addr().clone(),
                    holds: holds(),
                    left_us: left.as_micros() as u64,
                    expected_us: expected as u64,
                });
            }
            // Cutting a call short only pays when another replica can take the retry.
            let alternative =
                skip.is_none() && pick(&candidates(&replicas, Some(i)), start).is_some();
            let wait = if alternative { left.min(attempt) } else { left };
            let guard = r.begin();
            let sent = Instant::now();
            let reply = r
                .client
                .call_traced(LOOKUP, payload.clone(), wait, trace_id)
                .await;
            drop(guard);
            match reply {
                Ok(p) => {
                    r.record(sent.elapsed().as_secs_f64() * 1e6);
                    return Ok((r.addr().clone(), p));
                }
                Err(e) => {
                    let timed_out = matches!(e, WireError::Timeout { .. });
                    if timed_out {
                        // It took at least that long: a slow replica loses the preference.
                        r.record(wait.as_secs_f64() * 1e6);
                    }
                    let retry = timed_out && Instant::now() < deadline;
                    match failure(&e) {
                        Failure::Final if retry => {}
                        Failure::Final => {
                            return Err(ClientError::Replica {
                                source: e,
                                holds: holds(),
                            })
                        }
                        Failure::Eject => {
                            if r.eject(e.to_string()) {
                                tracing::warn!(shard = %r.addr(), reason = %e, "shard replica ejected");
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
