//! Load generators for `cleave bench shard` over the shard's wire protocol, lean on purpose: blocking sockets, one receiver
//! thread per connection, and latency measured from the moment a request was *due* (open loop),
//! so a generator or server that falls behind shows up as latency instead of hiding it
//! (no coordinated omission).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use cleave_shard::message::LOOKUP;
use cleave_wire::frame::{encode_hello, kind, Header, HEADER_LEN};
use cleave_wire::{Address, ConnClass, Frame, FrameDecoder};

/// What one load run measured.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    /// Requests per second offered (open loop) or 0 (closed loop).
    pub offered_rps: f64,
    pub sent: u64,
    pub completed: u64,
    /// Error responses (the shard refused a request).
    pub errors: u64,
    /// Requests without a response by the end of the run plus the timeout.
    pub lost: u64,
    /// Seconds from the first request due to the last response.
    pub elapsed_s: f64,
    /// Latencies of completed requests in nanoseconds, sorted: open loop, from when each
    /// request was due; closed loop, from when it was sent.
    pub latencies_ns: Vec<u64>,
    /// Open loop: latencies from when each request was actually written, sorted. The gap to
    /// `latencies_ns` is time the generator itself fell behind (e.g. descheduled).
    pub sent_latencies_ns: Vec<u64>,
}

impl LoadReport {
    /// Completed requests per second.
    pub fn achieved_rps(&self) -> f64 {
        if self.elapsed_s > 0.0 {
            self.completed as f64 / self.elapsed_s
        } else {
            0.0
        }
    }

    /// The `q`-quantile latency (0 <= q <= 1) in microseconds; 0 without samples.
    pub fn quantile_us(&self, q: f64) -> f64 {
        quantile_us(&self.latencies_ns, q)
    }

    /// The `q`-quantile of `sent_latencies_ns` in microseconds.
    pub fn sent_quantile_us(&self, q: f64) -> f64 {
        quantile_us(&self.sent_latencies_ns, q)
    }
}

fn quantile_us(sorted_ns: &[u64], q: f64) -> f64 {
    let n = sorted_ns.len();
    if n == 0 {
        return 0.0;
    }
    let i = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
    sorted_ns[i] as f64 / 1e3
}

/// A blocking connection that has done its HELLO.
enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    fn open(addr: &Address) -> io::Result<Conn> {
        let mut c = match addr {
            // An MPTCP listener takes plain TCP too: the load generator's own connections
            // need no second path.
            Address::Tcp(a) | Address::Mptcp(a) => {
                let s = TcpStream::connect(a.as_str())?;
                s.set_nodelay(true)?;
                Conn::Tcp(s)
            }
            // Plain frames only: an shm: server also serves clients that did not ask for it.
            Address::Unix(p) | Address::Shm(p) => Conn::Unix(UnixStream::connect(p)?),
        };
        c.write_all(&Frame::request(kind::HELLO, 0, encode_hello(ConnClass::Data)).to_bytes())?;
        let hello = read_frame(&mut c)?;
        if hello.is_error() || hello.kind != kind::HELLO {
            return Err(io::Error::other(format!("{addr}: HELLO refused")));
        }
        Ok(c)
    }

    fn try_clone(&self) -> io::Result<Conn> {
        Ok(match self {
            Conn::Tcp(s) => Conn::Tcp(s.try_clone()?),
            Conn::Unix(s) => Conn::Unix(s.try_clone()?),
        })
    }

    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_read_timeout(t),
            Conn::Unix(s) => s.set_read_timeout(t),
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.write(buf),
            Conn::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn read_frame(c: &mut impl Read) -> io::Result<Frame> {
    let mut head = [0u8; HEADER_LEN];
    c.read_exact(&mut head)?;
    let h = Header::decode(&head, u32::MAX).map_err(io::Error::other)?;
    let mut payload = vec![0u8; h.payload_len as usize];
    c.read_exact(&mut payload)?;
    Ok(Frame::from_header(&h, payload.into()))
}

fn request_bytes(id: u64, payload: &Bytes) -> Vec<u8> {
    Frame::request(LOOKUP, id, payload.clone())
        .to_bytes()
        .to_vec()
}

/// Small, fast, seeded generator for Poisson gaps (no dependency for one distribution).
struct XorShift(u64);

impl XorShift {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Waits until `t`: sleeps while far, spins the last stretch. Called with the thread's timer
/// slack at 1 ns (see [`TimerSlack`]), a sleep overshoots by a few microseconds, not the
/// default 50; spinning only the last 15 µs leaves the CPU to the shard on a small machine.
fn wait_until(t: Instant) {
    const SPIN: Duration = Duration::from_micros(15);
    loop {
        let now = Instant::now();
        if now >= t {
            return;
        }
        let left = t - now;
        if left > SPIN {
            std::thread::sleep(left - SPIN);
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Sets this thread's timer slack to 1 ns while alive, then restores it.
struct TimerSlack(libc::c_int);

impl TimerSlack {
    fn tight() -> TimerSlack {
        // SAFETY: prctl with PR_GET/SET_TIMERSLACK only reads or sets a per-thread value.
        unsafe {
            let old = libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0);
            libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
            TimerSlack(old)
        }
    }
}

impl Drop for TimerSlack {
    fn drop(&mut self) {
        if self.0 > 0 {
            // SAFETY: as in `tight`.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, self.0 as libc::c_ulong, 0, 0, 0) };
        }
    }
}

/// Open loop: requests arrive as a Poisson process of `rate` per second for `duration`,
/// round-robin over `connections`, each request one of `payloads` (cycled). Latency runs from
/// when a request was due to when its response was read.
pub fn run_open_loop(
    addr: &Address,
    payloads: &[Bytes],
    rate: f64,
    duration: Duration,
    connections: usize,
    timeout: Duration,
) -> io::Result<LoadReport> {
    if payloads.is_empty() || rate <= 0.0 {
        return Err(io::Error::other("need at least one payload and a rate > 0"));
    }
    let n = connections.max(1);
    // Due times, precomputed so the sender only waits and writes.
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let mut due_ns: Vec<u64> = Vec::new();
    let mut t = 0.0f64;
    loop {
        t += -(1.0 - rng.next_f64()).ln() / rate;
        if t >= duration.as_secs_f64() {
            break;
        }
        due_ns.push((t * 1e9) as u64);
    }
    let due = Arc::new(due_ns);
    let total = due.len();
    let frames: Vec<Vec<u8>> = (0..total)
        .map(|k| request_bytes(k as u64, &payloads[k % payloads.len()]))
        .collect();

    let mut writers = Vec::with_capacity(n);
    let mut readers = Vec::with_capacity(n);
    for _ in 0..n {
        let c = Conn::open(addr)?;
        readers.push(c.try_clone()?);
        writers.push(c);
    }
    let start = Instant::now() + Duration::from_millis(5);
    let done = Arc::new(AtomicBool::new(false));
    let sent: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
    let deadline_ns = Arc::new(AtomicU64::new(u64::MAX));
    let sent_at: Arc<Vec<AtomicU64>> = Arc::new((0..total).map(|_| AtomicU64::new(0)).collect());
    let receivers: Vec<_> = readers
        .into_iter()
        .enumerate()
        .map(|(i, mut r)| {
            let (due, sent_at) = (due.clone(), sent_at.clone());
            let (done, sent, deadline_ns) = (done.clone(), sent.clone(), deadline_ns.clone());
            std::thread::spawn(move || {
                let clock = Clock {
                    start,
                    due: &due,
                    sent_at: &sent_at,
                };
                receive(&mut r, i, &clock, &done, &sent, &deadline_ns)
            })
        })
        .collect();

    let mut send_error = None;
    let _slack = TimerSlack::tight();
    for (k, frame) in frames.iter().enumerate() {
        wait_until(start + Duration::from_nanos(due[k]));
        let c = k % n;
        sent_at[k].store(start.elapsed().as_nanos() as u64, Ordering::Release);
        if let Err(e) = writers[c].write_all(frame) {
            send_error = Some(e);
            break;
        }
        sent[c].fetch_add(1, Ordering::Release);
    }
    deadline_ns.store(
        (start.elapsed() + timeout).as_nanos() as u64,
        Ordering::Release,
    );
    done.store(true, Ordering::Release);
    let mut report = LoadReport {
        offered_rps: rate,
        ..LoadReport::default()
    };
    let mut last_ns = 0;
    for r in receivers {
        let part = r
            .join()
            .map_err(|_| io::Error::other("a receiver thread panicked"))?;
        report.completed += part.latencies_ns.len() as u64;
        report.errors += part.errors;
        last_ns = last_ns.max(part.last_ns);
        report.latencies_ns.extend(part.latencies_ns);
        report.sent_latencies_ns.extend(part.sent_latencies_ns);
    }
    if let Some(e) = send_error {
        return Err(io::Error::new(
            e.kind(),
            format!("{addr}: sending failed: {e}"),
        ));
    }
    report.sent = sent.iter().map(|s| s.load(Ordering::Acquire)).sum();
    report.lost = report.sent - report.completed - report.errors;
    report.elapsed_s = last_ns as f64 / 1e9;
    report.latencies_ns.sort_unstable();
    report.sent_latencies_ns.sort_unstable();
    Ok(report)
}

#[derive(Default)]
struct Received {
    latencies_ns: Vec<u64>,
    sent_latencies_ns: Vec<u64>,
    errors: u64,
    last_ns: u64,
}

/// When the run started, and when each request was due and written (ns after `start`).
struct Clock<'a> {
    start: Instant,
    due: &'a [u64],
    sent_at: &'a [AtomicU64],
}

fn receive(
    r: &mut Conn,
    conn: usize,
    clock: &Clock,
    done: &AtomicBool,
    sent: &[AtomicU64],
    deadline_ns: &AtomicU64,
) -> Received {
    let start = clock.start;
    let mut out = Received::default();
    let _ = r.set_read_timeout(Some(Duration::from_millis(50)));
    // Buffered decoding: a read timeout can then never cut a frame in half.
    let mut buf = BytesMut::with_capacity(1 << 16);
    let mut decoder = FrameDecoder::new(u32::MAX);
    let mut chunk = vec![0u8; 1 << 16];
    let mut got = 0u64;
    loop {
        while let Ok(Some(f)) = decoder.decode(&mut buf) {
            let now = start.elapsed().as_nanos() as u64;
            got += 1;
            out.last_ns = now;
            if f.is_error() {
                out.errors += 1;
            } else if let Some(&d) = clock.due.get(f.request_id as usize) {
                out.latencies_ns.push(now.saturating_sub(d));
                let sent_at = clock.sent_at[f.request_id as usize].load(Ordering::Acquire);
                out.sent_latencies_ns.push(now.saturating_sub(sent_at));
            }
        }
        if done.load(Ordering::Acquire) && got >= sent[conn].load(Ordering::Acquire) {
            break;
        }
        if start.elapsed().as_nanos() as u64 > deadline_ns.load(Ordering::Acquire) {
            break;
        }
        match r.read(&mut chunk) {
            Ok(0) => break,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    out
}

/// Closed loop: `window` requests outstanding per connection, a new one sent as each answer
/// arrives, for `duration`. Measures the most the shard can serve (and latency under it).
pub fn run_closed_loop(
    addr: &Address,
    payloads: &[Bytes],
    duration: Duration,
    connections: usize,
    window: usize,
) -> io::Result<LoadReport> {
    if payloads.is_empty() {
        return Err(io::Error::other("need at least one payload"));
    }
    let start = Instant::now();
    let threads: Vec<_> = (0..connections.max(1))
        .map(|i| {
            let mut c = Conn::open(addr)?;
            let payloads = payloads.to_vec();
            Ok(std::thread::spawn(move || -> io::Result<Received> {
                let mut w = c.try_clone()?;
                let mut sent_at: Vec<Instant> = Vec::new();
                let mut out = Received::default();
                let mut send = |id: u64, sent_at: &mut Vec<Instant>| -> io::Result<()> {
                    sent_at.push(Instant::now());
                    w.write_all(&request_bytes(
                        id,
                        &payloads[(id as usize + i) % payloads.len()],
                    ))
                };
                for _ in 0..window.max(1) {
                    let id = sent_at.len() as u64;
                    send(id, &mut sent_at)?;
                }
                let mut outstanding = window.max(1);
                while outstanding > 0 {
                    let f = read_frame(&mut c)?;
                    let now = Instant::now();
                    outstanding -= 1;
                    out.last_ns = (now - start).as_nanos() as u64;
                    if f.is_error() {
                        out.errors += 1;
                    } else {
                        out.latencies_ns
                            .push((now - sent_at[f.request_id as usize]).as_nanos() as u64);
                    }
                    if now - start < duration {
                        let id = sent_at.len() as u64;
                        send(id, &mut sent_at)?;
                        outstanding += 1;
                    }
                }
                Ok(out)
            }))
        })
        .collect::<io::Result<_>>()?;
    let mut report = LoadReport::default();
    let mut last_ns = 0;
    for t in threads {
        let part = t
            .join()
            .map_err(|_| io::Error::other("a load thread panicked"))??;
        report.completed += part.latencies_ns.len() as u64;
        report.errors += part.errors;
        last_ns = last_ns.max(part.last_ns);
        report.latencies_ns.extend(part.latencies_ns);
    }
    report.sent = report.completed + report.errors;
    report.elapsed_s = last_ns as f64 / 1e9;
    report.latencies_ns.sort_unstable();
    Ok(report)
}
