//! The rankers this router sends payloads to, and the choice among them: the ranker with the
//! lowest expected latency, from a moving average of the queue + compute times it reports,
//! scaled by the requests already outstanding on it (Prism §4.1: load balancing by real-time
//! processing latency). A ranker that cannot take a request (unreachable, died, overloaded,
//! not ready) hands it to the next one, each at most once, within the request's budget.
//! Rankers join, drain and leave while the router serves (the admin API): each request works
//! on the snapshot of the pool it started with.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_shard::MembershipError;
use cleave_wire::cpu::{add_since, thread_cpu};
use cleave_wire::{Address, Client, ClientConfig, ErrorCode, IoThreads, Payload, WireError};

use crate::backend::incast::IncastLink;
use crate::backend::payload::{decode_response, RankResponse};
use crate::error::{ErrorKind, RequestError, Stage};
use cleave_wire::Ewma;

/// The latency assumed for a ranker not measured yet (µs); small, so new rankers get tried.
const UNMEASURED_US: f64 = 1.0;

/// One ranker and what the router knows about it.
pub struct Ranker {
    client: Client,
    addr: String,
    /// f64 bits of the moving average of queue_us + compute_us; 0 until the first reply.
    ewma_us: Ewma,
    /// f64 bits of the moving average of compute_us / batch_requests: the ranker's time per
    /// request when busy, for admission control (`RankerPool::expected_wait`).
    service_us: Ewma,
    /// f64 bits of the moving average of a request's share of its batch's compute
    /// (compute_us / batch_requests, as `service_us`, but pulled down by skips): at most what a
    /// request sent now takes alone once the ranker starts it (a batch's fixed cost is shared;
    /// the whole batch's compute turned away requests that had time to run alone once batches
    /// held several). A request with less time left is not sent (`RankerPool::rank`); the
    /// ranker, which knows its batches, drops the rest that cannot make it.
    compute_us: Ewma,
    outstanding: AtomicU64,
    healthy: AtomicBool,
    /// Asked to leave (admin API): no new requests, those in flight finish.
    draining: AtomicBool,
    last_error: Mutex<String>,
}

impl Ranker {
    fn new(addr: &str, io: &IoThreads, config: &ClientConfig) -> Result<Ranker, String> {
        let parsed: Address = addr.parse().map_err(|e| format!("ranker {e}"))?;
        Ok(Ranker {
            client: Client::new(parsed, io.clone(), config.clone()),
            addr: addr.to_owned(),
            ewma_us: Ewma::default(),
            service_us: Ewma::default(),
            compute_us: Ewma::default(),
            outstanding: AtomicU64::new(0),
            healthy: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            last_error: Mutex::new("not probed yet".into()),
        })
    }

    /// "active", "draining" or "ejected" (down until a probe finds it ready).
    pub fn state(&self) -> &'static str {
        if self.is_draining() {
            "draining"
        } else if self.is_healthy() {
            "active"
        } else {
            "ejected"
        }
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn ewma_us(&self) -> f64 {
        self.ewma_us.get()
    }

    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Relaxed)
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    pub fn service_us(&self) -> f64 {
        self.service_us.get()
    }

    pub fn compute_us(&self) -> f64 {
        self.compute_us.get()
    }

    fn record(&self, response: &RankResponse) {
        let latency_us = response.queue_us as f64 + response.compute_us as f64;
        let service_us = response.compute_us as f64 / response.batch_requests.max(1) as f64;
        self.ewma_us.update(latency_us);
        self.service_us.update(service_us);
        self.compute_us.update(service_us);
    }

    fn mark(&self, healthy: bool, error: Option<String>) {
        self.healthy.store(healthy, Ordering::Relaxed);
        if let Some(e) = error {
            *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = e;
        }
    }

    fn score(&self) -> f64 {
        let ewma = self.ewma_us();
        let latency = if ewma == 0.0 { UNMEASURED_US } else { ewma };
        latency * (self.outstanding() + 1) as f64
    }
}

/// Decrements a ranker's outstanding count when the call ends, however it ends.
struct Outstanding<'a>(&'a Ranker);

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A ranker's reply with the times the router measured around it.
#[derive(Debug)]
pub struct Ranked {
    pub response: RankResponse,
    pub ranker: String,
    /// Round trip as the router saw it (packing the payload in the router's memory excluded;
    /// on shm its one write, straight into the slot, included: `RankerPool::rank`).
    pub round_trip: Duration,
}

impl Ranked {
    /// Round trip less the ranker's own queue and compute time: network and copies.
    pub fn transfer(&self) -> Duration {
        let inside =
            Duration::from_micros(self.response.queue_us as u64 + self.response.compute_us as u64);
        self.round_trip.saturating_sub(inside)
    }
}

/// Indices ordered by preference: healthy first, then by score; ties broken by `start`
/// rotating so that equal rankers share the load.
pub fn preference(scores: &[(bool, f64)], start: usize) -> Vec<usize> {
    let n = scores.len();
    let mut order: Vec<usize> = (0..n).map(|i| (start + i) % n.max(1)).collect();
    // A stable sort keeps the rotation among equals.
    order.sort_by(|&a, &b| {
        let (ha, sa) = scores[a];
        let (hb, sb) = scores[b];
        hb.cmp(&ha).then(sa.total_cmp(&sb))
    });
    order
}

pub struct RankerPool {
    rankers: RwLock<Arc<Vec<Arc<Ranker>>>>,
    next: AtomicUsize,
    io: IoThreads,
    config: ClientConfig,
    /// Incast control links by ranker data address (docs/traffic.md); empty: off.
    incast: RwLock<HashMap<String, Arc<IncastLink>>>,
    /// Set when incast control is on: the payload size from which senders ask.
    incast_threshold: std::sync::OnceLock<u64>,
}

impl RankerPool {
    pub fn new(
        addrs: &[String],
        io: &IoThreads,
        config: ClientConfig,
    ) -> Result<RankerPool, String> {
        let rankers = addrs
            .iter()
            .map(|a| Ranker::new(a, io, &config).map(Arc::new))
            .collect::<Result<Vec<_>, String>>()?;
        Ok(RankerPool::with_rankers(rankers, io.clone(), config))
    }

    fn with_rankers(rankers: Vec<Arc<Ranker>>, io: IoThreads, config: ClientConfig) -> RankerPool {
        RankerPool {
            rankers: RwLock::new(Arc::new(rankers)),
            next: AtomicUsize::new(0),
            io,
            config,
            incast: RwLock::new(HashMap::new()),
            incast_threshold: std::sync::OnceLock::new(),
        }
    }

    /// Turns incast control on: one control connection per ranker, to `control[data addr]`
    /// (the config checked that every ranker has one). Call on the router's runtime.
    pub fn start_incast(&self, control: &HashMap<String, String>, threshold: u64) {
        let _ = self.incast_threshold.set(threshold);
        let links = self
            .rankers()
            .iter()
            .filter_map(|r| {
                let at = control.get(&r.addr)?;
                Some((
                    r.addr.clone(),
                    Arc::new(IncastLink::start(&r.addr, at, threshold)),
                ))
            })
            .collect();
        *self.incast.write().unwrap_or_else(|p| p.into_inner()) = links;
    }

    fn incast_link(&self, addr: &str) -> Option<Arc<IncastLink>> {
        self.incast
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(addr)
            .cloned()
    }

    /// The rankers now (a snapshot: membership may change after).
    pub fn rankers(&self) -> Arc<Vec<Arc<Ranker>>> {
        self.rankers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Rankers in the order a request should try them; draining ones are left out.
    fn order(&self) -> Vec<Arc<Ranker>> {
        let rankers = self.rankers();
        let open: Vec<&Arc<Ranker>> = rankers.iter().filter(|r| !r.is_draining()).collect();
        let scores: Vec<(bool, f64)> = open.iter().map(|r| (r.is_healthy(), r.score())).collect();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        preference(&scores, start)
            .into_iter()
            .map(|i| open[i].clone())
            .collect()
    }

    /// Adds a ranker; it takes requests once a probe finds it ready (until then it is tried
    /// only after every healthy ranker).
    /// With incast control on, `control` (its control port's `HOST:PORT`) is required, as the
    /// config requires one for every ranker; with it off, refused. Call on the router's
    /// runtime (the control link's task starts on it).
    pub fn add(&self, addr: &str, control: Option<&str>) -> Result<(), MembershipError> {
        let mut guard = self.rankers.write().unwrap_or_else(|p| p.into_inner());
        if guard.iter().any(|r| r.addr == addr) {
            return Err(MembershipError::Conflict(format!(
                "ranker {addr} is already a member"
            )));
        }
        let link = match (self.incast_threshold.get(), control) {
            (Some(&threshold), Some(at)) => {
                if at.rsplit_once(':').is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err()) {
                    return Err(MembershipError::Invalid(format!(
                        "control: expected HOST:PORT, got {at:?}"
                    )));
                }
                Some(Arc::new(IncastLink::start(addr, at, threshold)))
            }
            (Some(_), None) => {
                return Err(MembershipError::Invalid(
                    "incast control is on: a ranker needs \"control\": \"HOST:PORT\" (its control port)"
                        .to_owned(),
                ))
            }
            (None, Some(_)) => {
                return Err(MembershipError::Invalid(
                    "control: incast control is off on this router; leave \"control\" out".to_owned(),
                ))
            }
            (None, None) => None,
        };
        let ranker = Ranker::new(addr, &self.io, &self.config)
            .map_err(|e| MembershipError::Invalid(format!("addr: {e}")))?;
        if let Some(link) = link {
            let mut links = self.incast.write().unwrap_or_else(|p| p.into_inner());
            links.insert(addr.to_owned(), link);
        }
        let mut next: Vec<Arc<Ranker>> = guard.to_vec();
        next.push(Arc::new(ranker));
        *guard = Arc::new(next);
        Ok(())
    }

    /// Sends no new requests to `addr`; those in flight finish.
    pub fn drain(&self, addr: &str) -> Result<(), MembershipError> {
        let guard = self.rankers.write().unwrap_or_else(|p| p.into_inner());
        let r = find(&guard, addr)?;
        last_open(&guard, addr, "drain")?;
        r.draining.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Removes `addr`; requests already sent to it finish.
    pub fn remove(&self, addr: &str) -> Result<(), MembershipError> {
        let mut guard = self.rankers.write().unwrap_or_else(|p| p.into_inner());
        find(&guard, addr)?;
        last_open(&guard, addr, "remove")?;
        let next: Vec<Arc<Ranker>> = guard.iter().filter(|r| r.addr != addr).cloned().collect();
        *guard = Arc::new(next);
        // Its control link's task ends once requests in flight let go of the link.
        let mut links = self.incast.write().unwrap_or_else(|p| p.into_inner());
        links.remove(addr);
        Ok(())
    }

    /// Sends one payload to the best ranker, within `timeout` (what is left of the request's
    /// budget; it is also the deadline on the wire), with the request's trace id. A ranker
    /// that could not take the request ([`retry_elsewhere`]) passes it to the next in order of
    /// preference, each ranker at most once: requests are pure, so running one twice is
    /// harmless. When every ranker failed that way the request is `Unavailable` (503). A
    /// ranker whose compute (moving average) takes longer than what is left is not sent the
    /// payload; when no ranker could make it the request fails `deadline` in stage `ranker`
    /// (504) without using the link or a ranker's core.
    pub async fn rank(
        &self,
        kind: u16,
        payload: &dyn Payload,
        timeout: Duration,
        trace_id: u64,
    ) -> Result<Ranked, RequestError> {
        let started = Instant::now();
        let mut failures: Vec<String> = Vec::new();
        let mut late: Vec<String> = Vec::new();
        // Packed once for every ranker reached by socket; a ranker on `shm:` has its
        // connection write it straight into a slot instead, on each attempt.
        let mut packed: Option<Bytes> = None;
        for ranker in self.order() {
            let left = timeout.saturating_sub(started.elapsed());
            let needs_us = ranker.compute_us.settled();
            if !left.is_zero() && (left.as_secs_f64() * 1e6) < needs_us {
                // Only replies refresh the estimate: each skip pulls it below what was left
                // (half of it as a sample), so a ranker once slow is tried again after a few.
                ranker.compute_us.update(left.as_secs_f64() * 1e6 / 2.0);
                late.push(format!(
                    "ranker {} computes in {needs_us:.0} us, {} us were left",
                    ranker.addr,
                    left.as_micros()
                ));
                continue;
            }
            if left.is_zero() {
                return Err(RequestError {
                    kind: ErrorKind::Deadline,
                    message: format!(
                        "latency budget ran out before a ranker could take the request: {}",
                        failures.join("; ")
                    ),
                    stage: Some(Stage::Ranker),
                });
            }
            let ranker = &*ranker;
            ranker.outstanding.fetch_add(1, Ordering::Relaxed);
            let guard = Outstanding(ranker);
            // Incast control: a large payload waits for the ranker's grant, within the budget.
            let link = self.incast_link(&ranker.addr);
            let mut granted = None; // dropped undelivered, its window space goes back
            if let Some(link) = &link {
                granted = link.permit(trace_id, payload.len() as u64, left).await?;
            }
            let in_slot = matches!(ranker.client.addr(), Address::Shm(_));
            if !in_slot && packed.is_none() {
                let cpu = thread_cpu();
                packed = Some(payload.to_bytes());
                if let Some(total) = &self.config.send_cpu {
                    add_since(total, cpu);
                }
            }
            let left = timeout.saturating_sub(started.elapsed());
            // The round trip starts once the payload is made: packing it in the router's
            // memory is not the transport's, as before; on shm making it is writing it into
            // the slot, which replaced the copy into the slot the round trip always counted.
            let sent = Instant::now();
            let result = if left.is_zero() {
                Err(WireError::Timeout {
                    addr: ranker.client.addr().clone(),
                    after: Duration::ZERO,
                })
            } else if let (false, Some(bytes)) = (in_slot, &packed) {
                let call = ranker
                    .client
                    .call_traced(kind, bytes.clone(), left, trace_id);
                call.await
            } else {
                let call = ranker.client.call_written(kind, payload, left, trace_id);
                call.await
            };
            let round_trip = sent.elapsed();
            drop(guard);
            if let (Some(granted), Ok(_)) = (granted, &result) {
                granted.delivered();
            }
            match result {
                Ok(reply) => {
                    let response = decode_response(&reply).map_err(|e| {
                        RequestError::new(ErrorKind::Ranker, format!("ranker {}: {e}", ranker.addr))
                    })?;
                    ranker.record(&response);
                    ranker.mark(true, None);
                    return Ok(Ranked {
                        response,
                        ranker: ranker.addr.clone(),
                        round_trip,
                    });
                }
                Err(e) => match retry_elsewhere(&e) {
                    Some(retry) => {
                        if retry == Retry::Down {
                            ranker.mark(false, Some(e.to_string()));
                        }
                        failures.push(e.to_string());
                    }
                    None => return Err(call_error(ranker, e)),
                },
            }
        }
        if failures.is_empty() && !late.is_empty() {
            return Err(RequestError {
                kind: ErrorKind::Deadline,
                message: format!(
                    "deadline cannot be met, not sent to a ranker: {}",
                    late.join("; ")
                ),
                stage: Some(Stage::Ranker),
            });
        }
        failures.extend(late);
        let what = if failures.is_empty() {
            "this router has no rankers".to_owned()
        } else {
            failures.join("; ")
        };
        Err(RequestError::new(
            ErrorKind::Unavailable,
            format!("no ranker could take the request: {what}"),
        ))
    }

    /// How long a request sent now would wait for a ranker to finish it: over the healthy
    /// rankers, the least (outstanding + 1) × time per request. `None` when no ranker is
    /// healthy. Unmeasured rankers count as free.
    pub fn expected_wait(&self) -> Option<Duration> {
        self.rankers()
            .iter()
            .filter(|r| r.is_healthy() && !r.is_draining())
            .map(|r| (r.outstanding() + 1) as f64 * r.service_us())
            .min_by(f64::total_cmp)
            .map(|us| Duration::from_secs_f64(us / 1e6))
    }

    /// Probes every ranker's readiness once; returns the problems (empty: all ready).
    pub async fn probe(&self, timeout: Duration) -> Vec<String> {
        let probes: Vec<_> = self
            .rankers()
            .iter()
            .map(|r| {
                let r = r.clone();
                tokio::spawn(async move {
                    let problem = match r.client.ready(timeout).await {
                        Ok(true) => None,
                        Ok(false) => Some(format!("ranker {}: not ready yet", r.addr)),
                        Err(e) => Some(format!("ranker {e}")),
                    };
                    r.mark(problem.is_none(), problem.clone());
                    problem
                })
            })
            .collect();
        let mut problems = Vec::new();
        for p in probes {
            match p.await {
                Ok(Some(problem)) => problems.push(problem),
                Ok(None) => {}
                Err(e) => problems.push(format!("ranker probe failed: {e}")),
            }
        }
        problems
    }

    /// (address, outstanding, EWMA latency in seconds) per ranker, for /metrics.
    pub fn loads(&self) -> Vec<(String, u64, f64)> {
        self.rankers()
            .iter()
            .map(|r| (r.addr.clone(), r.outstanding(), r.ewma_us() / 1e6))
            .collect()
    }
}

fn find<'a>(rankers: &'a [Arc<Ranker>], addr: &str) -> Result<&'a Arc<Ranker>, MembershipError> {
    rankers.iter().find(|r| r.addr == addr).ok_or_else(|| {
        let known: Vec<&str> = rankers.iter().map(|r| r.addr()).collect();
        MembershipError::Unknown(format!(
            "addr: ranker {addr} is not a member; members are {known:?}"
        ))
    })
}

/// Refuses to `what` the ranker at `addr` when no other ranker would take requests.
fn last_open(rankers: &[Arc<Ranker>], addr: &str, what: &str) -> Result<(), MembershipError> {
    if rankers.iter().any(|r| r.addr != addr && !r.is_draining()) {
        Ok(())
    } else {
        Err(MembershipError::Conflict(format!(
            "cannot {what} ranker {addr}: it is the last ranker taking requests"
        )))
    }
}

/// Why a ranker could not take a request that another ranker may serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// Unreachable, gone, not ready or stopping: marked down until a probe finds it back.
    Down,
    /// Alive but its queue is full (`overloaded`): it stays in the pool.
    Busy,
}

/// Whether a failed call may be retried on another ranker: the ranker could not be reached
/// (connect, handshake), its connection closed before the reply (it died), or it refused
/// with a code that another ranker may not (`ErrorCode::retry_elsewhere`). `None`: the
/// failure is the request's own answer (a budget timeout, `deadline`, `bad_request`, ...).
pub fn retry_elsewhere(e: &WireError) -> Option<Retry> {
    match e {
        WireError::Connect { .. } | WireError::Handshake { .. } | WireError::Closed { .. } => {
            Some(Retry::Down)
        }
        WireError::Remote { code, .. } if code.retry_elsewhere() => match code {
            ErrorCode::Overloaded => Some(Retry::Busy),
            _ => Some(Retry::Down),
        },
        _ => None,
    }
}

fn call_error(ranker: &Ranker, e: WireError) -> RequestError {
    match &e {
        WireError::Timeout { .. } => RequestError {
            kind: ErrorKind::Deadline,
            message: format!(
                "latency budget ran out waiting for ranker {} (transfer, queue or compute)",
                ranker.addr
            ),
            stage: Some(Stage::Ranker),
        },
        // The ranker dropped the request: its deadline passed while it was queued.
        WireError::Remote {
            code: ErrorCode::Deadline,
            message,
            ..
        } => RequestError {
            kind: ErrorKind::Deadline,
            message: format!("ranker {} dropped the request: {message}", ranker.addr),
            stage: Some(Stage::Queue),
        },
        WireError::Remote { .. } => {
            RequestError::new(ErrorKind::Ranker, format!("ranker {e}")).at(Stage::Compute)
        }
        _ => {
            if matches!(e, WireError::Protocol { .. }) {
                ranker.mark(false, Some(e.to_string()));
            }
            RequestError::new(ErrorKind::Ranker, format!("ranker {e}")).at(Stage::Transfer)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_wire::SURE_AFTER;

    #[test]
    fn which_failures_go_to_the_next_ranker() {
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
                Some(Retry::Down),
            ),
            (
                WireError::Handshake {
                    addr: addr.clone(),
                    reason: "r".into(),
                },
                Some(Retry::Down),
            ),
            (
                WireError::Closed {
                    addr: addr.clone(),
                    reason: "the peer closed the connection".into(),
                },
                Some(Retry::Down),
            ),
            (remote(ErrorCode::Overloaded), Some(Retry::Busy)),
            (remote(ErrorCode::NotReady), Some(Retry::Down)),
            (remote(ErrorCode::ShuttingDown), Some(Retry::Down)),
            (remote(ErrorCode::Deadline), None),
            (remote(ErrorCode::BadRequest), None),
            (remote(ErrorCode::Internal), None),
            (remote(ErrorCode::Other(300)), None),
            (
                WireError::Timeout {
                    addr: addr.clone(),
                    after: Duration::from_millis(5),
                },
                None,
            ),
            (
                WireError::TooLarge {
                    addr: addr.clone(),
                    len: 9,
                    max: 8,
                },
                None,
            ),
        ];
        for (e, want) in cases {
            assert_eq!(retry_elsewhere(&e), want, "{e}");
        }
        let r = ranker(0.0, 0);
        let deadline = call_error(&r, remote(ErrorCode::Deadline));
        assert_eq!(
            (deadline.kind, deadline.stage),
            (ErrorKind::Deadline, Some(Stage::Queue))
        );
        let internal = call_error(&r, remote(ErrorCode::Internal));
        assert_eq!(internal.kind, ErrorKind::Ranker);
        assert!(r.is_healthy(), "a ranker that answers is not down");
    }

    #[test]
    fn prefers_healthy_then_fast_then_rotates() {
        let s = [(true, 100.0), (true, 50.0), (false, 1.0), (true, 50.0)];
        assert_eq!(preference(&s, 0), vec![1, 3, 0, 2]);
        assert_eq!(preference(&s, 2), vec![3, 1, 0, 2]); // rotation among the equal two
        assert_eq!(preference(&[], 5), Vec::<usize>::new());
    }

    fn ranker(ewma: f64, outstanding: u64) -> Ranker {
        let io = IoThreads::new("test", 1).unwrap();
        Ranker {
            client: Client::new("127.0.0.1:1".parse().unwrap(), io, ClientConfig::default()),
            addr: "r".into(),
            ewma_us: {
                let average = Ewma::default();
                average.update(ewma);
                average
            },
            service_us: Ewma::default(),
            compute_us: Ewma::default(),
            outstanding: AtomicU64::new(outstanding),
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            last_error: Mutex::new(String::new()),
        }
    }

    #[test]
    fn outstanding_requests_count_against_a_ranker() {
        // 100 µs with 3 in flight is worse than 300 µs idle... equal here; 4 in flight is worse.
        assert!(ranker(100.0, 4).score() > ranker(300.0, 0).score());
        assert!(ranker(100.0, 1).score() < ranker(300.0, 0).score());
        // Unmeasured rankers are tried before measured ones.
        assert!(ranker(0.0, 0).score() < ranker(10.0, 0).score());
    }

    fn reply(queue_us: u32, compute_us: u32, batch_requests: u32) -> RankResponse {
        RankResponse {
            queue_us,
            compute_us,
            batch_requests,
            queue_depth: 0,
            outputs: vec![],
        }
    }

    #[test]
    fn moving_averages() {
        let r = ranker(0.0, 0);
        r.record(&reply(400, 600, 2));
        assert_eq!((r.ewma_us(), r.service_us()), (1000.0, 300.0));
        r.record(&reply(1000, 1000, 1));
        assert!((r.ewma_us() - 1200.0).abs() < 1e-9);
        assert!((r.service_us() - 440.0).abs() < 1e-9);
    }

    /// An empty RANK with `left` of its budget, sent to a pool of `ranker` alone (it listens
    /// on port 1: a request sent fails to connect); the pool, and the error.
    fn rank_alone(ranker: Ranker, left: Duration) -> (RankerPool, RequestError) {
        let pool = RankerPool::with_rankers(
            vec![Arc::new(ranker)],
            IoThreads::new("test", 1).unwrap(),
            ClientConfig::default(),
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let empty = crate::backend::payload::RankPayload::new([], 0);
        let rank = pool.rank(crate::backend::payload::RANK, &empty, left, 1);
        let err = rt.block_on(rank).unwrap_err();
        (pool, err)
    }

    #[test]
    fn one_slow_first_batch_does_not_keep_the_next_request_from_its_ranker() {
        let starved = ranker(0.0, 0);
        // Its first batch took 1 s on a starved core. The estimate is not settled yet, so the
        // request is sent: it fails to connect (port 1), not `deadline`.
        starved.record(&reply(0, 1_000_000, 1));
        let (_, err) = rank_alone(starved, Duration::from_millis(50));
        assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
    }

    #[test]
    fn a_payload_no_ranker_can_compute_in_time_is_not_sent() {
        let slow = ranker(0.0, 0);
        for _ in 0..SURE_AFTER {
            slow.record(&reply(0, 4_000_000, 4)); // a batch of 4 takes 4 s: 1 s each
        }
        assert_eq!(slow.compute_us(), 1_000_000.0);
        let (pool, err) = rank_alone(slow, Duration::from_millis(50));
        // Sent, it would have failed to connect (port 1) and been `unavailable`.
        assert_eq!(
            (err.kind, err.stage),
            (ErrorKind::Deadline, Some(Stage::Ranker)),
            "{err}"
        );
        assert!(
            err.message.contains("not sent") && err.message.contains("computes in 1000000 us"),
            "{err}"
        );
        // The skip pulled the estimate down (a sample of half the 50 ms left): a few more
        // skips and the ranker is tried again, so one slow batch does not shut it out.
        let after = pool.rankers()[0].compute_us();
        assert!(after < 1_000_000.0 && after > 25_000.0, "{after}");
    }

    #[test]
    fn a_request_with_time_to_run_alone_is_sent_though_a_full_batch_takes_longer() {
        let batching = ranker(0.0, 0);
        batching.record(&reply(0, 40_000, 4)); // a batch of 4 takes 40 ms: 10 ms each
                                               // Sent (25 ms left, 10 ms its share): it fails to connect (port 1), not `deadline`.
        let (_, err) = rank_alone(batching, Duration::from_millis(25));
        assert_eq!(err.kind, ErrorKind::Unavailable, "{err}");
    }

    #[test]
    fn expected_wait_is_the_least_loaded_healthy_ranker() {
        let (busy, idle, down) = (ranker(0.0, 9), ranker(0.0, 1), ranker(0.0, 0));
        busy.record(&reply(0, 1000, 1)); // 10 × 1 ms
        idle.record(&reply(0, 4000, 1)); // 2 × 4 ms
        down.record(&reply(0, 10, 1));
        down.mark(false, None);
        let pool = RankerPool::with_rankers(
            vec![Arc::new(busy), Arc::new(idle), Arc::new(down)],
            IoThreads::new("test", 1).unwrap(),
            ClientConfig::default(),
        );
        assert_eq!(pool.expected_wait(), Some(Duration::from_millis(8)));
        for r in pool.rankers().iter() {
            r.mark(false, None);
        }
        assert_eq!(pool.expected_wait(), None);
    }

    #[test]
    fn rankers_join_drain_and_leave() {
        let io = IoThreads::new("test", 1).unwrap();
        let pool = RankerPool::new(&["127.0.0.1:1".into()], &io, ClientConfig::default()).unwrap();
        let conflict = |e: MembershipError| matches!(e, MembershipError::Conflict(_));
        assert!(conflict(pool.add("127.0.0.1:1", None).unwrap_err()));
        assert!(matches!(
            pool.add("nonsense", None).unwrap_err(),
            MembershipError::Invalid(m) if m.starts_with("addr: ")
        ));
        assert!(conflict(pool.drain("127.0.0.1:1").unwrap_err()), "last one");
        assert!(matches!(
            pool.add("127.0.0.1:2", Some("127.0.0.1:3")).unwrap_err(),
            MembershipError::Invalid(m) if m.contains("incast control is off")
        ));
        pool.add("127.0.0.1:2", None).unwrap();
        assert_eq!(pool.rankers()[1].state(), "ejected", "not probed yet");
        pool.drain("127.0.0.1:1").unwrap();
        assert_eq!(pool.rankers()[0].state(), "draining");
        let order: Vec<String> = pool.order().iter().map(|r| r.addr.clone()).collect();
        assert_eq!(
            order,
            ["127.0.0.1:2"],
            "a draining ranker gets no new requests"
        );
        assert!(conflict(pool.remove("127.0.0.1:2").unwrap_err()));
        pool.remove("127.0.0.1:1").unwrap();
        assert!(matches!(
            pool.remove("127.0.0.1:1").unwrap_err(),
            MembershipError::Unknown(_)
        ));
        assert_eq!(pool.rankers().len(), 1);
    }

    #[test]
    fn a_ranker_added_with_incast_control_on_gets_its_control_link() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _entered = rt.enter(); // the control link's task starts on the router's runtime
        let io = IoThreads::new("test", 1).unwrap();
        let first = "127.0.0.1:1".to_owned();
        let pool =
            RankerPool::new(std::slice::from_ref(&first), &io, ClientConfig::default()).unwrap();
        pool.start_incast(&HashMap::from([(first, "127.0.0.1:2".to_owned())]), 4096);
        let invalid = |e: MembershipError, words: &str| matches!(e, MembershipError::Invalid(ref m) if m.contains(words));
        assert!(invalid(
            pool.add("127.0.0.1:3", None).unwrap_err(),
            "needs \"control\""
        ));
        assert!(invalid(
            pool.add("127.0.0.1:3", Some("nonsense")).unwrap_err(),
            "expected HOST:PORT, got \"nonsense\""
        ));
        assert_eq!(pool.rankers().len(), 1, "a refused ranker is not added");
        pool.add("127.0.0.1:3", Some("127.0.0.1:4")).unwrap();
        let link = pool
            .incast_link("127.0.0.1:3")
            .expect("a control link for the new ranker");
        assert_eq!(link.control, "127.0.0.1:4");
        pool.remove("127.0.0.1:3").unwrap();
        assert!(
            pool.incast_link("127.0.0.1:3").is_none(),
            "removed with its ranker"
        );
        assert!(pool.incast_link("127.0.0.1:1").is_some());
    }
}
