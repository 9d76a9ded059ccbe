//! CLOCK_MONOTONIC in ns: the clock Python's time.monotonic_ns() reads. Emulated hosts are
//! namespaces on one machine and share it, so a sender's stamp and the ranker's "now" compare.

pub fn mono_ns() -> u64 {
    // SAFETY: timespec is plain data; clock_gettime only writes it.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid clock id and a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The tokio instant at monotonic time `at_ns` (now if it has passed).
pub fn instant_at(at_ns: u64) -> tokio::time::Instant {
    let now = mono_ns();
    tokio::time::Instant::now() + std::time::Duration::from_nanos(at_ns.saturating_sub(now))
}
