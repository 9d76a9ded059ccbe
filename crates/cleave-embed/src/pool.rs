//! A fixed pool of worker threads that splits lookups across bags and tables.
//!
//! A call cuts its jobs into chunks of whole bags of about equal numbers of ids, publishes
//! them as one batch, and works on the batch itself alongside the workers; each thread claims
//! the next chunk with an atomic counter until none is left, so a slow chunk never leaves the
//! others idle. The call returns when every chunk is done, which is what lets the chunks
//! borrow the caller's buffers. Several threads may share one engine: their batches queue.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::error::EmbedError;
use crate::kernels::Kernel;
use crate::lookup::{self, Bags, Pooling};
use crate::table::Table;

/// Below this many ids a call runs on the calling thread: waking workers costs more.
const INLINE_IDS: usize = 4096;
/// Chunks per thread: enough to even out uneven bags, few enough to keep claims cheap.
const CHUNKS_PER_THREAD: usize = 4;
/// The smallest chunk worth handing to another thread.
const MIN_CHUNK_IDS: usize = 1024;
/// How long an idle worker, or a caller waiting for the workers, spins before it sleeps: a
/// lookup of 50k ids takes about 50 µs on two cores, and a futex wake-up costs several µs of
/// it. Spinning only this long after each batch keeps idle engines off the CPU.
const SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// Spins until `ready()` or `SPIN` has passed; returns whether `ready()` became true.
fn spin_until(ready: impl Fn() -> bool) -> bool {
    let start = std::time::Instant::now();
    loop {
        for _ in 0..64 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= SPIN {
            return ready();
        }
    }
}

/// One table's bags to pool, with the buffers that receive the result (see [`lookup::pool`]).
pub struct PoolJob<'a> {
    pub table: &'a Table,
    pub bags: Bags<'a>,
    pub pooling: Pooling,
    /// bags × dim floats.
    pub out: &'a mut [f32],
    /// One count per bag.
    pub counts: &'a mut [u32],
}

/// The lookup engine: a fixed pool of worker threads plus the calling thread.
pub struct Engine {
    threads: usize,
    kernel: Kernel,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("threads", &self.threads)
            .field("kernel", &self.kernel)
            .finish()
    }
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Bumped on every batch pushed, so that spinning workers notice one without the lock.
    pushed: AtomicU64,
}

struct Queue {
    batches: VecDeque<Arc<Batch>>,
    shutdown: bool,
    /// Workers waiting on `wake`: pushing a batch only makes the wake-up call when there are.
    sleeping: usize,
}

/// One call's chunks. `task` borrows the caller's stack: it is only called for a claimed index
/// below `chunks`, and the caller does not return before `done == chunks`, after which every
/// claim fails.
struct Batch {
    task: *const (dyn Fn(usize) + Sync),
    chunks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
    finished: Mutex<bool>,
    finished_cv: Condvar,
}

// SAFETY: `task` points to a `Sync` closure that outlives every call made through it (see
// `Batch`); everything else is thread-safe.
unsafe impl Send for Batch {}
unsafe impl Sync for Batch {}

impl Batch {
    /// Claims and runs chunks until none is left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.chunks {
                return;
            }
            // SAFETY: i < chunks, so the caller is still waiting in `Engine::run`.
            let task = unsafe { &*self.task };
            if catch_unwind(AssertUnwindSafe(|| task(i))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            if self.done.fetch_add(1, Ordering::AcqRel) + 1 == self.chunks {
                *lock(&self.finished) = true;
                self.finished_cv.notify_all();
            }
        }
    }

    fn exhausted(&self) -> bool {
        self.next.load(Ordering::Relaxed) >= self.chunks
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside a chunk is caught, so a poisoned lock only means a panic elsewhere; the
    // data (a flag, a queue) is still consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Engine {
    /// An engine of `threads` threads in all (the caller counts as one, so `threads - 1`
    /// workers are started; 0 is taken as 1). Uses the best kernel of this CPU.
    pub fn new(threads: usize) -> Engine {
        Engine::with_kernel(threads, Kernel::best())
    }

    /// An engine that runs `kernel` (which must be available: see [`Kernel::require`]).
    pub fn with_kernel(threads: usize, kernel: Kernel) -> Engine {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                batches: VecDeque::new(),
                shutdown: false,
                sleeping: 0,
            }),
            wake: Condvar::new(),
            pushed: AtomicU64::new(0),
        });
        let workers = (1..threads)
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("cleave-embed-{i}"))
                    .spawn(move || worker(&shared))
                    .expect("spawning an embedding worker thread")
            })
            .collect();
        Engine {
            threads,
            kernel,
            shared,
            workers,
        }
    }

    /// Threads that work on a call, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// Runs many (table, bags, pooling, out, counts) jobs, split across workers by bag ranges
    /// and tables; blocks until done. Small batches run inline on the calling thread. Every job
    /// is checked as by [`lookup::pool`]; on error the first failing job's error is returned
    /// and the outputs hold unspecified values.
    pub fn pool_many(&self, jobs: &mut [PoolJob<'_>]) -> Result<(), EmbedError> {
        self.kernel.require()?;
        for job in jobs.iter() {
            lookup::check_bags(
                job.table,
                &job.bags,
                job.pooling,
                job.out.len(),
                job.counts.len(),
            )?;
        }
        let total: usize = jobs.iter().map(|j| j.bags.ids.len()).sum();
        let inline = self.threads == 1 || total < INLINE_IDS;
        let target = if inline {
            usize::MAX
        } else {
            (total / (self.threads * CHUNKS_PER_THREAD)).max(MIN_CHUNK_IDS)
        };
        let chunks: Vec<Mutex<Option<Chunk>>> = split(jobs, target)
            .into_iter()
            .map(|c| Mutex::new(Some(c)))
            .collect();
        let results: Vec<Mutex<Result<(), EmbedError>>> =
            chunks.iter().map(|_| Mutex::new(Ok(()))).collect();
        self.run(chunks.len(), inline, &|i| {
            if let Some(c) = lock(&chunks[i]).take() {
                *lock(&results[i]) = lookup::pool_bag_range(
                    self.kernel,
                    c.table,
                    &c.bags,
                    c.pooling,
                    c.range,
                    c.out,
                    c.counts,
                );
            }
        });
        results
            .into_iter()
            .try_for_each(|r| r.into_inner().unwrap_or_else(|e| e.into_inner()))
    }

    /// [`lookup::pool`] of one job on this engine's threads.
    pub fn pool(
        &self,
        table: &Table,
        bags: &Bags,
        pooling: Pooling,
        out: &mut [f32],
        counts: &mut [u32],
    ) -> Result<(), EmbedError> {
        self.pool_many(&mut [PoolJob {
            table,
            bags: *bags,
            pooling,
            out,
            counts,
        }])
    }

    /// Wakes sleeping workers ahead of a call of about `ids` ids that they will share, so that
    /// their wake-up (tens of µs on a virtual machine) overlaps the caller's own preparation,
    /// such as allocating the output, instead of holding up the call; a worker woken for nothing
    /// spins `SPIN` and sleeps again. Calls that will run inline wake no one.
    pub fn expect(&self, ids: usize) {
        if self.threads == 1 || ids < INLINE_IDS {
            return;
        }
        if lock(&self.shared.queue).sleeping > 0 {
            self.shared.wake.notify_all();
        }
    }

    /// Runs `task(0..n)` on the workers and the calling thread (only the latter if `inline`);
    /// returns when all are done.
    fn run(&self, n: usize, inline: bool, task: &(dyn Fn(usize) + Sync)) {
        if inline || n <= 1 {
            (0..n).for_each(task);
            return;
        }
        // SAFETY: only the lifetime is erased; `Batch` explains why the borrow stays valid.
        let task: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(task) };
        let batch = Arc::new(Batch {
            task,
            chunks: n,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            finished: Mutex::new(false),
            finished_cv: Condvar::new(),
        });
        let sleeping = {
            let mut queue = lock(&self.shared.queue);
            queue.batches.push_back(Arc::clone(&batch));
            queue.sleeping
        };
        self.shared.pushed.fetch_add(1, Ordering::Release);
        if sleeping > 0 {
            self.shared.wake.notify_all();
        }
        batch.work();
        // Once `done` reaches `chunks` no thread calls `task` again (a worker may still touch
        // the batch itself, which it holds an Arc of), so the caller may return.
        if !spin_until(|| batch.done.load(Ordering::Acquire) == batch.chunks) {
            let mut finished = lock(&batch.finished);
            while !*finished {
                finished = batch
                    .finished_cv
                    .wait(finished)
                    .unwrap_or_else(|e| e.into_inner());
            }
        }
        lock(&self.shared.queue)
            .batches
            .retain(|b| !Arc::ptr_eq(b, &batch));
        if batch.panicked.load(Ordering::Relaxed) {
            panic!("an embedding lookup chunk panicked on a worker thread");
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        lock(&self.shared.queue).shutdown = true;
        self.shared.wake.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

fn worker(shared: &Shared) {
    let mut seen = shared.pushed.load(Ordering::Acquire);
    loop {
        // A busy engine's next batch usually comes within microseconds: wait for it awake.
        spin_until(|| shared.pushed.load(Ordering::Acquire) != seen);
        seen = shared.pushed.load(Ordering::Acquire);
        let batch = {
            let mut queue = lock(&shared.queue);
            let mut woken = false;
            loop {
                if queue.shutdown {
                    return;
                }
                match queue.batches.front() {
                    Some(b) if b.exhausted() => {
                        queue.batches.pop_front();
                    }
                    Some(b) => break Some(Arc::clone(b)),
                    // Woken ahead of a batch (`Engine::expect`): wait for it awake.
                    None if woken => break None,
                    None => {
                        queue.sleeping += 1;
                        queue = shared.wake.wait(queue).unwrap_or_else(|e| e.into_inner());
                        queue.sleeping -= 1;
                        woken = true;
                    }
                }
            }
        };
        if let Some(batch) = batch {
            batch.work();
        }
    }
}

/// A range of one job's bags with the slices of its buffers.
struct Chunk<'a> {
    table: &'a Table,
    bags: Bags<'a>,
    pooling: Pooling,
    range: std::ops::Range<usize>,
    out: &'a mut [f32],
    counts: &'a mut [u32],
}

/// Cuts jobs into chunks of whole bags holding about `target` ids each.
fn split<'a>(jobs: &'a mut [PoolJob<'_>], target: usize) -> Vec<Chunk<'a>> {
    let mut chunks = Vec::new();
    for job in jobs.iter_mut() {
        let dim = job.table.dim();
        let offsets = job.bags.offsets;
        let (mut out, mut counts) = (&mut job.out[..], &mut job.counts[..]);
        let mut start = 0;
        while start < job.bags.len() {
            // Whole bags until the chunk holds `target` ids (at least one bag): end is the
            // first bag boundary at or past offsets[start] + target.
            let limit = (offsets[start] as usize).saturating_add(target);
            let below = offsets[start + 1..].partition_point(|&o| (o as usize) < limit);
            let end = (start + 1 + below).min(job.bags.len());
            let (o, rest_out) = std::mem::take(&mut out).split_at_mut((end - start) * dim);
            let (c, rest_counts) = std::mem::take(&mut counts).split_at_mut(end - start);
            (out, counts) = (rest_out, rest_counts);
            chunks.push(Chunk {
                table: job.table,
                bags: job.bags,
                pooling: job.pooling,
                range: start..end,
                out: o,
                counts: c,
            });
            start = end;
        }
    }
    chunks
}
