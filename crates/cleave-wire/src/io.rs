//! I/O threads: each runs its own single-threaded tokio runtime and owns the connections
//! spawned onto it, so a connection's reads, writes and request table never cross threads.

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, ThreadId};

use tokio::runtime::{Builder, Handle};
use tokio::sync::oneshot;

/// A fixed set of I/O threads. Cloning shares them; the threads stop when the last clone drops.
#[derive(Clone)]
pub struct IoThreads {
    inner: Arc<Inner>,
}

struct Inner {
    handles: Vec<Handle>,
    thread_ids: Vec<ThreadId>,
    stops: Mutex<Vec<oneshot::Sender<()>>>,
    joins: Mutex<Vec<JoinHandle<()>>>,
    next: AtomicUsize,
}

impl IoThreads {
    /// Starts `n` (at least 1) threads named `{name}-{i}`.
    pub fn new(name: &str, n: usize) -> io::Result<IoThreads> {
        let n = n.max(1);
        let mut handles = Vec::with_capacity(n);
        let mut thread_ids = Vec::with_capacity(n);
        let mut stops = Vec::with_capacity(n);
        let mut joins = Vec::with_capacity(n);
        for i in 0..n {
            let rt = Builder::new_current_thread().enable_all().build()?;
            let (stop_tx, stop_rx) = oneshot::channel::<()>();
            handles.push(rt.handle().clone());
            let join = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    // Runs every task spawned onto this handle until stopped; dropping the runtime
                    // then cancels what is left.
                    let _ = rt.block_on(stop_rx);
                })?;
            thread_ids.push(join.thread().id());
            stops.push(stop_tx);
            joins.push(join);
        }
        let inner = Inner {
            handles,
            thread_ids,
            stops: Mutex::new(stops),
            joins: Mutex::new(joins),
            next: AtomicUsize::new(0),
        };
        Ok(IoThreads {
            inner: Arc::new(inner),
        })
    }

    pub fn len(&self) -> usize {
        self.inner.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inner.handles.is_empty()
    }

    /// Spawns `fut` on the next thread in round-robin order.
    pub fn spawn<F>(&self, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.spawn_on(self.pick(), fut);
    }

    /// The next thread in round-robin order.
    pub fn pick(&self) -> usize {
        self.inner.next.fetch_add(1, Ordering::Relaxed) % self.len()
    }

    /// Spawns `fut` on thread `i` (modulo their number).
    pub fn spawn_on<F>(&self, i: usize, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.inner.handles[i % self.len()].spawn(fut);
    }

    /// Stops the threads (cancelling their tasks) and waits for them, unless called from one of
    /// them. Dropping the last clone does the same.
    pub fn stop(&self) {
        self.inner.stop();
    }
}

impl Inner {
    fn stop(&self) {
        for s in self
            .stops
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = s.send(());
        }
        // A thread cannot join itself; stopping from inside a task only signals.
        if self.thread_ids.contains(&std::thread::current().id()) {
            return;
        }
        for j in self
            .joins
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = j.join();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn spawns_round_robin_and_stops() {
        let io = IoThreads::new("t", 2).unwrap();
        let (tx, rx) = mpsc::channel();
        for _ in 0..4 {
            let tx = tx.clone();
            io.spawn(async move {
                tx.send(std::thread::current().name().unwrap().to_owned())
                    .unwrap();
            });
        }
        let mut names: Vec<String> = (0..4).map(|_| rx.recv().unwrap()).collect();
        names.sort();
        assert_eq!(names, ["t-0", "t-0", "t-1", "t-1"]);
        drop(io); // joins both threads
    }
}
