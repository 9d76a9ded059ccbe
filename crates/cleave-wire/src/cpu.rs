//! CPU time of the calling thread, and a counter of it across a future's polls: how a caller
//! measures what one path costs in a process whose threads do many things at once.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The CPU time this thread has used. Code that runs without an await runs on one thread, so
/// the difference of two readings is its CPU time, whatever else the process does meanwhile.
pub fn thread_cpu() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the struct we own.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Adds the CPU time since `start` (a `thread_cpu()` reading) to `total`, in ns.
pub fn add_since(total: &AtomicU64, start: Duration) {
    let spent = thread_cpu().saturating_sub(start).as_nanos() as u64;
    total.fetch_add(spent, Ordering::Relaxed);
}

/// Runs `f`, adding the CPU time of each of its polls (and only those: not what other tasks of
/// the thread do while it waits) to `total` when there is one.
pub(crate) async fn counted<F: Future>(f: F, total: Option<&AtomicU64>) -> F::Output {
    let Some(total) = total else {
        return f.await;
    };
    let mut f = pin!(f);
    std::future::poll_fn(|cx| {
        let start = thread_cpu();
        let polled = f.as_mut().poll(cx);
        add_since(total, start);
        polled
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin(n: u64) -> u64 {
        (0..n).fold(0u64, |a, i| {
            a.wrapping_mul(31).wrapping_add(std::hint::black_box(i))
        })
    }

    #[tokio::test(flavor = "current_thread")]
    async fn counts_the_polls_and_not_the_waits_between_them() {
        let total = AtomicU64::new(0);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        // What another task burns while the counted one waits is not counted.
        let other = async move {
            let start = thread_cpu();
            spin(20_000_000);
            let burnt = thread_cpu() - start;
            tx.send(()).unwrap();
            burnt
        };
        let counted_work = counted(
            async {
                let start = thread_cpu();
                spin(2_000_000);
                let before_wait = thread_cpu() - start;
                rx.await.unwrap();
                before_wait
            },
            Some(&total),
        );
        let (mine, burnt) = tokio::join!(counted_work, other);
        let total = Duration::from_nanos(total.load(Ordering::Relaxed));
        assert!(total >= mine, "{total:?} < {mine:?}");
        assert!(total < burnt, "{total:?} counts the other task's {burnt:?}");
    }
}
