//! The shard's request handler: decodes LOOKUP frames, pools into the response buffer in place
//! with the embedding engine, and answers errors with a code and a message.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock, RwLock};
use std::time::Instant;

use bytes::Bytes;
use cleave_embed::{gather, Bags, EmbedError, Engine, PoolJob, Table};
use cleave_wire::{unix_now_us, ErrorCode, Handler, Request, Responder, ServerStats};

use crate::message::{decode_request_as_of, Lookup, Op, ResponseBuilder, LOOKUP, UPDATE};
use crate::metrics::{Gauges, Metrics};
use crate::update::{self, StepError, Updates};
use cleave_wire::Ewma;

/// Answers LOOKUP frames once its tables are loaded; `NotReady` before.
pub struct ShardService {
    loaded: OnceLock<Loaded>,
    stopping: AtomicBool,
    metrics: Metrics,
    max_response: usize,
    /// Moving average of a served lookup's time (µs): a lookup with less time left before
    /// its deadline is dropped before it starts (Handler::expected_service_us).
    service_us: Ewma,
    /// The server's counts (queue, dropped requests), once a server serves this.
    server: OnceLock<Arc<ServerStats>>,
    /// Model updates (docs/tiers.md, "Updates"); none accepted until set.
    updates: OnceLock<Updates>,
    /// Update steps that succeeded and failed, for /metrics.
    update_counts: [std::sync::atomic::AtomicU64; 2],
    /// The SSD tier and its caches, when the tables are served from it (its counters go to
    /// /metrics).
    tier: OnceLock<Arc<cleave_embed::Tier>>,
    /// Where lookups that read from the device are completed, once started.
    misses: OnceLock<MissWorkers>,
    /// Lookups handed to the miss workers.
    deferred: std::sync::atomic::AtomicU64,
    /// This service, for the threads it hands work to (set by `start_workers`).
    me: OnceLock<std::sync::Weak<ShardService>>,
}

/// How long a replaced version stays for requests as of before its successor's switch time:
/// longer than any request's budget, after which none of them can still arrive.
const RETAIN_PREVIOUS_US: u64 = 60_000_000;

/// A table at one version.
pub struct Held {
    pub table: Table,
    pub version: u64,
    /// When this version starts serving (Unix µs; 0: it always has): a request as of an
    /// earlier time reads `previous` (docs/tiers.md, "One version per request").
    pub switch_at_unix_us: u64,
    previous: Mutex<Option<Arc<Held>>>,
}

impl Held {
    pub fn new(table: Table, version: u64) -> Held {
        Held {
            table,
            version,
            switch_at_unix_us: 0,
            previous: Mutex::new(None),
        }
    }

    /// The version a request as of `at` (Unix µs) reads: this one, or the one it replaced
    /// when `at` is before its switch time. Lets go of the replaced one once no request
    /// that needs it can still arrive.
    fn as_of(self: &Arc<Self>, at: u64) -> Arc<Held> {
        let mut previous = self.previous.lock().unwrap_or_else(|e| e.into_inner());
        if at < self.switch_at_unix_us {
            if let Some(p) = previous.as_ref() {
                return p.clone();
            }
        } else if previous.is_some()
            && unix_now_us() > self.switch_at_unix_us.saturating_add(RETAIN_PREVIOUS_US)
        {
            *previous = None;
        }
        self.clone()
    }
}

/// The tables served, swapped whole by an update: a lookup works on the snapshot it took.
type Snapshot = Arc<HashMap<String, Arc<Held>>>;

struct Loaded {
    tables: RwLock<Snapshot>,
    /// (name, rows) in the order given, for listings and metrics.
    order: Vec<(String, Range<u64>)>,
    engine: Engine,
}

/// An error reply: code and message.
pub type Refusal = (ErrorCode, String);

/// What one served request did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    pub lookups: u64,
    pub rows: u64,
}

impl ShardService {
    /// A service without tables yet; responses are limited to `max_response` bytes.
    pub fn new(max_response: usize) -> ShardService {
        ShardService {
            loaded: OnceLock::new(),
            stopping: AtomicBool::new(false),
            metrics: Metrics::default(),
            max_response,
            service_us: Ewma::default(),
            server: OnceLock::new(),
            updates: OnceLock::new(),
            update_counts: Default::default(),
            tier: OnceLock::new(),
            misses: OnceLock::new(),
            deferred: Default::default(),
            me: OnceLock::new(),
        }
    }

    /// Lookups completed by a miss worker so far (they read rows from the device).
    pub fn deferred_lookups(&self) -> u64 {
        self.deferred.load(Ordering::Relaxed)
    }

    /// Reports this tier's counters in /metrics (only the first call has an effect).
    pub fn attach_tier(&self, tier: Arc<cleave_embed::Tier>) {
        let _ = self.tier.set(tier);
    }

    /// Accepts UPDATE frames from now on (only the first call has an effect).
    pub fn enable_updates(&self, updates: Updates) {
        let _ = self.updates.set(updates);
    }

    /// The version of each table that serves now (0: the bundle's).
    pub fn versions(&self) -> Vec<(String, u64)> {
        let Some(loaded) = self.loaded.get() else {
            return Vec::new();
        };
        let snapshot = loaded.tables.read().unwrap().clone();
        let now = unix_now_us();
        loaded
            .order
            .iter()
            .filter_map(|(n, _)| snapshot.get(n).map(|h| (n.clone(), h.as_of(now).version)))
            .collect()
    }

    /// Runs one UPDATE step (stage a chunk, switch, abort) and returns the JSON reply.
    pub fn update(&self, payload: &[u8]) -> Result<Bytes, Refusal> {
        let result = self.update_step(payload);
        let i = usize::from(result.is_err());
        self.update_counts[i].fetch_add(1, Ordering::Relaxed);
        result.map_err(|e| {
            let code = match e {
                StepError::UnknownTable(_) | StepError::NotStaged(_) => ErrorCode::NotFound,
                StepError::Open { .. } => ErrorCode::Internal,
                _ => ErrorCode::BadRequest,
            };
            (code, e.to_string())
        })
    }

    fn update_step(&self, payload: &[u8]) -> Result<Bytes, StepError> {
        let (h, data) = update::decode(payload)?;
        let updates = self.updates.get().ok_or(StepError::NoStateDir)?;
        let loaded = self.loaded.get().ok_or_else(|| {
            StepError::BadMessage("the shard is still opening its tables".to_owned())
        })?;
        let current = || {
            let snapshot = loaded.tables.read().unwrap().clone();
            snapshot
                .get(&h.table)
                .cloned()
                .ok_or_else(|| StepError::UnknownTable(h.table.clone()))
        };
        let mut late_us: Option<u64> = None;
        let version = match h.op.as_str() {
            "stage" => {
                let held = current()?;
                updates.stage(&h, data, (&held.table, held.version))?
            }
            "switch" => {
                current()?;
                let staged = updates.switch(h.update, &h.table, h.source.clone())?;
                let version = staged.version;
                let mut tables = loaded.tables.write().unwrap();
                let replaced = tables.get(&h.table).cloned();
                // One version back is kept, not a chain: requests as of before the previous
                // switch are long past their budgets.
                if let Some(r) = &replaced {
                    r.previous.lock().unwrap_or_else(|e| e.into_inner()).take();
                }
                let mut next = HashMap::clone(&tables);
                next.insert(
                    h.table.clone(),
                    Arc::new(Held {
                        table: staged.opened,
                        version,
                        switch_at_unix_us: h.switch_at_unix_us,
                        previous: Mutex::new(replaced),
                    }),
                );
                *tables = Arc::new(next);
                let now = unix_now_us();
                late_us =
                    (h.switch_at_unix_us != 0).then(|| now.saturating_sub(h.switch_at_unix_us));
                if late_us.is_some_and(|l| l > 0) {
                    // Requests as of between the switch time and now read the old version
                    // here; a shard that switched in time gave them the new one.
                    tracing::warn!(table = %h.table, version, late_us, "switch arrived after its switch time");
                } else {
                    tracing::info!(table = %h.table, version, switch_at_unix_us = h.switch_at_unix_us, "update switched in");
                }
                Some(version)
            }
            "abort" => {
                updates.abort(h.update)?;
                None
            }
            "status" => {
                let held = current()?;
                let source = updates.source(&h.table)?;
                let reply = serde_json::json!({"table": h.table, "update": h.update,
                    "version": held.version, "source": source});
                return Ok(Bytes::from(reply.to_string()));
            }
            other => {
                return Err(StepError::BadMessage(format!(
                    "op {other:?}, expected \"stage\", \"switch\", \"abort\" or \"status\""
                )))
            }
        };
        let mut reply =
            serde_json::json!({"table": h.table, "update": h.update, "version": version});
        if let Some(late) = late_us {
            reply["late_us"] = late.into();
        }
        Ok(Bytes::from(reply.to_string()))
    }

    /// Installs the tables (each a row range) and the engine; the service is ready after.
    /// Only the first call has an effect.
    pub fn load(&self, tables: Vec<Table>, engine: Engine) {
        self.load_versions(tables.into_iter().map(|t| (t, 0)).collect(), engine);
    }

    /// [`ShardService::load`] of tables at known versions (a shard replaying its updates).
    pub fn load_versions(&self, tables: Vec<(Table, u64)>, engine: Engine) {
        let order = tables
            .iter()
            .map(|(t, _)| (t.name().to_owned(), t.row_range()))
            .collect();
        let tables = tables
            .into_iter()
            .map(|(table, version)| (table.name().to_owned(), Arc::new(Held::new(table, version))))
            .collect();
        let _ = self.loaded.set(Loaded {
            tables: RwLock::new(Arc::new(tables)),
            order,
            engine,
        });
    }

    /// Marks the service as stopping: READY probes and /ready answer "not ready" from now on.
    pub fn set_stopping(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.problems().is_empty()
    }

    /// Why the shard cannot serve (empty when ready), for `/ready`.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.loaded.get().is_none() {
            problems.push("the shard is still opening its tables".to_owned());
        }
        if self.stopping.load(Ordering::Relaxed) {
            problems.push("the shard is stopping".to_owned());
        }
        problems
    }

    /// (table, row range) of every table held; empty before loading.
    pub fn tables(&self) -> Vec<(String, Range<u64>)> {
        self.loaded
            .get()
            .map(|l| l.order.clone())
            .unwrap_or_default()
    }

    /// Reports the counts of the server that serves this (its queue and dropped requests)
    /// in the metrics. Only the first call has an effect.
    pub fn attach_server(&self, stats: Arc<ServerStats>) {
        let _ = self.server.set(stats);
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Prometheus text of this shard's metrics; `connections` and `receiving` come from the
    /// server.
    pub fn render_metrics(&self, connections: u64, receiving: u64) -> String {
        let tables = self
            .tables()
            .into_iter()
            .map(|(n, r)| (n, r.start, r.end))
            .collect();
        let server = self.server.get();
        let count = |f: fn(&ServerStats) -> u64| server.map_or(0, |s| f(s));
        self.metrics.render(&Gauges {
            ready: self.is_ready(),
            connections,
            frames_receiving: receiving,
            tables,
            queued: count(ServerStats::queued),
            dropped_expired: count(ServerStats::expired),
            dropped_late: count(ServerStats::dropped_late),
            responses_held: count(ServerStats::responses_held),
            credit_expired: count(ServerStats::credit_expired),
            connection_migrations: count(ServerStats::migrations),
            lookups_deferred: self.deferred_lookups(),
            table_versions: self.versions(),
            tier: self.tier.get().map(|t| t.stats()),
            update_steps: self
                .update_counts
                .each_ref()
                .map(|n| n.load(Ordering::Relaxed)),
        })
    }

    /// Serves one LOOKUP payload and returns the response payload. Also the entry point for a
    /// caller that holds a shard in-process.
    pub fn lookup(&self, payload: &[u8]) -> Result<(Bytes, Served), Refusal> {
        let (lookups, at) = self.decode(payload)?;
        self.lookup_decoded(&lookups, at)
    }

    /// A LOOKUP payload's lookups and the time (Unix µs) whose table versions they read: its
    /// `as_of`, else now. Not ready before the tables are loaded.
    fn decode(&self, payload: &[u8]) -> Result<(Vec<Lookup>, u64), Refusal> {
        if self.loaded.get().is_none() {
            return Err(not_ready());
        }
        let (lookups, as_of) =
            decode_request_as_of(payload).map_err(|e| (ErrorCode::BadRequest, e.0))?;
        Ok((lookups, as_of.unwrap_or_else(unix_now_us)))
    }

    /// Serves decoded lookups as of `at`.
    fn lookup_decoded(&self, lookups: &[Lookup], at: u64) -> Result<(Bytes, Served), Refusal> {
        let loaded = self.loaded.get().ok_or_else(not_ready)?;
        // Sleeping lookup workers wake while the snapshot and the response are prepared, not
        // after the lookups are handed to them (docs/engine.md).
        loaded
            .engine
            .expect(lookups.iter().map(|l| l.ids.len()).sum());
        // One version of each table for the whole request, even if an update switches now:
        // the one its as_of reads, so every shard of a split table picks the same.
        let snapshot: Snapshot = loaded.tables.read().unwrap().clone();
        let mut held = Vec::with_capacity(lookups.len());
        for (i, l) in lookups.iter().enumerate() {
            let h = snapshot.get(&l.table).map(|h| h.as_of(at)).ok_or_else(|| {
                let names: Vec<&str> = loaded.order.iter().map(|(n, _)| n.as_str()).collect();
                let msg = format!(
                    "lookup {i}: table {:?} is not held here; this shard holds {names:?}",
                    l.table
                );
                (ErrorCode::NotFound, msg)
            })?;
            held.push(h);
        }
        let tables: Vec<&Table> = held.iter().map(|h| &h.table).collect();
        let shapes: Vec<(usize, usize, bool)> = lookups
            .iter()
            .zip(&tables)
            .map(|(l, t)| (l.rows(), t.dim(), l.op != Op::Gather))
            .collect();
        let mut response = ResponseBuilder::new(&shapes, self.max_response)
            .map_err(|e| (ErrorCode::BadRequest, e.0))?;
        {
            let mut jobs = Vec::with_capacity(lookups.len());
            let mut gathers = Vec::new();
            for ((l, &table), (out, counts)) in lookups.iter().zip(&tables).zip(response.slices()) {
                match l.op {
                    Op::Pool(pooling) => jobs.push(PoolJob {
                        table,
                        bags: Bags {
                            ids: &l.ids,
                            offsets: &l.offsets,
                            weights: l.weights.as_deref(),
                        },
                        pooling,
                        out,
                        counts,
                    }),
                    Op::Gather => gathers.push((table, &l.ids, out)),
                }
            }
            loaded.engine.pool_many(&mut jobs).map_err(refusal)?;
            for (table, ids, out) in gathers {
                gather(table, ids, out).map_err(refusal)?;
            }
        }
        let served = Served {
            lookups: lookups.len() as u64,
            rows: lookups.iter().map(|l| l.ids.len() as u64).sum(),
        };
        Ok((response.finish(), served))
    }
}

fn not_ready() -> Refusal {
    (
        ErrorCode::NotReady,
        "the shard is still opening its tables".to_owned(),
    )
}

fn refusal(e: EmbedError) -> Refusal {
    let code = match &e {
        EmbedError::IdOutOfRange { .. } => ErrorCode::OutOfRange,
        EmbedError::UnknownTable { .. } => ErrorCode::NotFound,
        EmbedError::BadBags { .. } => ErrorCode::BadRequest,
        _ => ErrorCode::Internal,
    };
    (code, e.to_string())
}

impl Handler for ShardService {
    fn handle(&self, request: Request, responder: Responder) {
        let started = Instant::now();
        self.metrics.start();
        let outcome = if request.kind == LOOKUP {
            match self.decode(&request.payload) {
                Ok((lookups, at)) => {
                    if let Some(workers) = self.misses.get() {
                        if self.needs_device(&lookups, at) {
                            // Its reads wait on a miss worker; this I/O thread serves the next.
                            self.deferred.fetch_add(1, Ordering::Relaxed);
                            workers.send(MissJob {
                                request,
                                lookups,
                                at,
                                responder,
                                started,
                            });
                            return;
                        }
                    }
                    self.lookup_decoded(&lookups, at)
                }
                Err(refused) => Err(refused),
            }
        } else if request.kind == UPDATE {
            // A stage's last chunk writes a whole table: on a thread of its own where it can,
            // so the lookups of this I/O thread do not wait for it.
            let me = self.me.get().cloned();
            let step = move |service: &ShardService| match service.update(&request.payload) {
                Ok(payload) => responder.reply(payload),
                Err((code, msg)) => {
                    tracing::warn!(code = ?code, error = %msg, "update step refused");
                    responder.error(code, &msg);
                }
            };
            match me {
                Some(me) => {
                    std::thread::spawn(move || {
                        if let Some(service) = me.upgrade() {
                            step(&service);
                        }
                    });
                }
                None => step(self),
            }
            return;
        } else {
            let msg = format!(
                "frame kind {:#06x} unknown; a shard serves LOOKUP ({LOOKUP:#06x})",
                request.kind
            );
            Err((ErrorCode::UnknownKind, msg))
        };
        self.answer(outcome, &request, responder, started);
    }

    fn ready(&self) -> bool {
        self.is_ready()
    }

    fn dropped_late(&self, kind: u16, left_us: u64) {
        if kind == LOOKUP {
            // Only served lookups refresh the estimate: each drop pulls it below what was
            // left (half of it as a sample), so after a slow spell lookups are served again.
            self.service_us.update(left_us as f64 / 2.0);
        }
    }

    fn expected_service_us(&self, kind: u16) -> u64 {
        if kind == LOOKUP {
            self.service_us.settled() as u64
        } else {
            0
        }
    }
}

impl ShardService {
    /// Replies with a lookup's outcome and counts it.
    fn answer(
        &self,
        outcome: Result<(Bytes, Served), Refusal>,
        request: &Request,
        responder: Responder,
        started: Instant,
    ) {
        let (result, sent) = match outcome {
            Ok((payload, served)) => {
                let n = payload.len();
                responder.reply(payload);
                self.service_us
                    .update(started.elapsed().as_secs_f64() * 1e6);
                tracing::debug!(
                    trace_id = %cleave_wire::log::trace_id(request.trace_id),
                    lookups = served.lookups,
                    rows = served.rows,
                    elapsed_us = started.elapsed().as_micros() as u64,
                    "lookup answered"
                );
                (Ok((served.lookups, served.rows)), n)
            }
            Err((code, msg)) => {
                // A refused lookup is the caller's bug or a plan mismatch: worth a line.
                tracing::warn!(
                    trace_id = %cleave_wire::log::trace_id(request.trace_id),
                    code = ?code,
                    error = %msg,
                    "lookup refused"
                );
                responder.error(code, &msg);
                (Err(code), msg.len() + 2)
            }
        };
        self.metrics
            .finish(result, request.payload.len(), sent, started.elapsed());
    }

    /// Whether lookups as of `at` read any row from the device (a row-cache miss of an SSD
    /// table).
    fn needs_device(&self, lookups: &[Lookup], at: u64) -> bool {
        let Some(loaded) = self.loaded.get() else {
            return false;
        };
        let snapshot: Snapshot = loaded.tables.read().unwrap().clone();
        lookups.iter().any(|l| {
            snapshot
                .get(&l.table)
                .is_some_and(|h| h.as_of(at).table.would_read(&l.ids))
        })
    }

    /// Runs update steps on threads of their own, and lookups that miss the row cache on
    /// `miss_threads` miss workers (docs/tiers.md, "Asynchronous completion"; 0: on the I/O
    /// thread): the I/O thread that received such work hands it over and goes on, so a slow
    /// device read or a table being written stalls no other request. Only the first call has
    /// an effect; the threads end when the service is dropped.
    pub fn start_workers(self: &Arc<Self>, miss_threads: usize) {
        if self.me.set(Arc::downgrade(self)).is_ok() && miss_threads > 0 {
            self.complete_misses_on(miss_threads);
        }
    }

    fn complete_misses_on(self: &Arc<Self>, threads: usize) {
        if self.misses.get().is_some() {
            return;
        }
        let (tx, rx) = mpsc::channel::<MissJob>();
        let rx = Arc::new(Mutex::new(rx));
        let mut started = 0;
        for i in 0..threads {
            let (service, rx) = (Arc::downgrade(self), rx.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("cleave-miss-{i}"))
                .spawn(move || loop {
                    // The sender goes with the service: then recv fails and the thread ends.
                    let Ok(job) = rx.lock().unwrap_or_else(|e| e.into_inner()).recv() else {
                        return;
                    };
                    let Some(service) = service.upgrade() else {
                        return;
                    };
                    let outcome = service.lookup_decoded(&job.lookups, job.at);
                    service.answer(outcome, &job.request, job.responder, job.started);
                });
            match spawned {
                Ok(_) => started += 1,
                Err(err) => tracing::warn!(%err, "cannot start a miss worker"),
            }
        }
        // Without any worker, misses go on being read on the I/O threads.
        if started > 0 {
            let _ = self.misses.set(MissWorkers(Mutex::new(tx)));
        }
    }
}

/// A lookup that reads from the device, on its way to a miss worker.
struct MissJob {
    request: Request,
    lookups: Vec<Lookup>,
    at: u64,
    responder: Responder,
    started: Instant,
}

struct MissWorkers(Mutex<mpsc::Sender<MissJob>>);

impl MissWorkers {
    fn send(&self, job: MissJob) {
        let tx = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(mpsc::SendError(job)) = tx.send(job) {
            // Every worker has ended (a panic in a lookup): answered, never left hanging.
            drop(tx);
            job.responder.error(
                ErrorCode::Internal,
                "no miss worker is left to complete this lookup",
            );
        }
    }
}
