//! The receiving end: a control listener (requests-to-send, grants, credits) and a data
//! listener (message payloads, piggybacked credits). Grants come from the incast scheduler;
//! with `--adaptive` a timer moves its window from the data sockets' TCP_INFO.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cleave_flow::adaptive::Sample;
use cleave_flow::control::{error_reply, read_message, ControlMessage, ErrorCode};
use cleave_flow::tcp_info::receiver_stats;
use cleave_flow::{AdaptiveWindow, Grant, IncastScheduler, Order, Thresholds};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify};

use crate::clock::mono_ns;
use crate::data;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    listen: String,
    #[arg(long)]
    control_port: u16,
    #[arg(long)]
    data_port: u16,
    /// Control connections to expect; the ranker reports once they have all closed.
    #[arg(long)]
    senders: usize,
    /// Incast window in bytes; 0 is no control (every request granted at once).
    #[arg(long, default_value_t = 0)]
    window: u64,
    /// Adapt the window (starting at and never below --message-bytes).
    #[arg(long)]
    adaptive: bool,
    #[arg(long, default_value = "fcfs")]
    order: Order,
    #[arg(long, default_value_t = 1.0)]
    link_gbit: f64,
    #[arg(long)]
    message_bytes: u64,
    #[arg(long, default_value_t = 50)]
    interval_ms: u64,
    #[arg(long, default_value_t = 2.0)]
    high: f64,
    #[arg(long, default_value_t = 0.25)]
    low: f64,
    /// Report and exit after this long even if senders remain.
    #[arg(long, default_value_t = 600.0)]
    max_s: f64,
    /// Drop a waiting request once it can no longer meet its SLO (it is answered "expired").
    #[arg(long)]
    drop_expired: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum RankerError {
    #[error("cannot listen on {addr}: {err}")]
    Listen { addr: String, err: std::io::Error },
    #[error("cannot write the report: {0}")]
    Report(std::io::Error),
}

struct Message {
    sender: u32,
    bytes: u64,
    slo_us: u64,
    stamp_ns: u64,
    received: u64,
    latency_us: Option<u64>,
}

#[derive(Default)]
struct State {
    scheduler: Option<IncastScheduler>,
    control: HashMap<u32, mpsc::UnboundedSender<ControlMessage>>,
    messages: HashMap<u64, Message>,
    data_fds: HashMap<RawFd, u32>,
    bytes_received: u64,
    credits_priority_ns: Vec<u64>,
    credits_piggyback_ns: Vec<u64>,
    closed: usize,
    window_trace: Vec<(u64, u64)>,
    queue_peak: usize,
    expired: usize,
}

type Shared = Arc<Mutex<State>>;

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, State> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

fn dispatch(state: &mut State, grants: Vec<Grant>) {
    for g in grants {
        if let Some(tx) = state.control.get(&g.sender) {
            let _ = tx.send(ControlMessage::Grant { id: g.id });
        }
    }
    let expired = state
        .scheduler
        .as_mut()
        .map(|q| q.take_expired())
        .unwrap_or_default();
    for p in expired {
        state.expired += 1;
        if let Some(tx) = state.control.get(&p.sender) {
            let _ = tx.send(ControlMessage::Expired { id: p.id });
        }
    }
}

#[derive(Serialize)]
struct Report {
    /// [bytes, slo_us, latency_us or null] per message asked for.
    messages: Vec<(u64, u64, Option<u64>)>,
    credits_priority_us: Vec<f64>,
    credits_piggyback_us: Vec<f64>,
    window_trace: Vec<(u64, u64)>,
    queue_peak: usize,
    expired: usize,
}

pub async fn run(args: Args) -> Result<(), RankerError> {
    let bind = |port: u16| {
        let addr = format!("{}:{port}", args.listen);
        async move {
            TcpListener::bind(&addr)
                .await
                .map_err(|err| RankerError::Listen { addr, err })
        }
    };
    let control = bind(args.control_port).await?;
    let data_listener = bind(args.data_port).await?;
    // Port 0 binds a free one: say which, before "ready" (which readers wait for).
    if let (Ok(c), Ok(d)) = (control.local_addr(), data_listener.local_addr()) {
        println!("listening control={c} data={d}");
    }
    let link_bps = args.link_gbit * 1e9 / 8.0;
    let window = if args.window == 0 && !args.adaptive {
        u64::MAX
    } else {
        args.window.max(1)
    };
    let mut adaptive = args.adaptive.then(|| {
        let th = Thresholds {
            high: args.high,
            low: args.low,
            ..Thresholds::default()
        };
        AdaptiveWindow::new(
            args.message_bytes,
            64 * args.message_bytes,
            args.message_bytes,
            th,
        )
    });
    let start = adaptive.as_ref().map_or(window, |a| a.limit());
    let state: Shared = Arc::new(Mutex::new(State {
        scheduler: Some(if args.drop_expired {
            IncastScheduler::new(start, args.order, link_bps).with_expiry(mono_ns)
        } else {
            IncastScheduler::new(start, args.order, link_bps)
        }),
        ..State::default()
    }));
    let all_closed = Arc::new(Notify::new());
    println!("ready");

    let st = state.clone();
    let expected = args.senders;
    let closed_note = all_closed.clone();
    tokio::spawn(async move {
        let mut next: u32 = 0;
        while let Ok((sock, _)) = control.accept().await {
            next += 1;
            tokio::spawn(serve_control(
                sock,
                next,
                st.clone(),
                expected,
                closed_note.clone(),
            ));
        }
    });
    let st = state.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = data_listener.accept().await {
            tokio::spawn(serve_data(sock, st.clone()));
        }
    });
    if let Some(adaptive) = adaptive.as_mut() {
        let st = state.clone();
        let interval = Duration::from_millis(args.interval_ms.max(1));
        let mut ticker = tokio::time::interval(interval);
        // Per socket: (out-of-order segments, bytes received) at the last sample, from the
        // kernel's counters, so the rate does not depend on when this process got the CPU.
        let mut last: HashMap<RawFd, (u32, u64)> = HashMap::new();
        let t0 = mono_ns();
        let stop = tokio::time::sleep(Duration::from_secs_f64(args.max_s));
        tokio::pin!(stop);
        let done = all_closed.notified();
        tokio::pin!(done);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                _ = &mut done => break,
                _ = ticker.tick() => {}
            }
            let mut s = lock(&st);
            let (mut ooo, mut bytes) = (0u64, 0u64);
            let fds: Vec<RawFd> = s.data_fds.keys().copied().collect();
            last.retain(|fd, _| s.data_fds.contains_key(fd));
            for fd in fds {
                if let Ok(info) = receiver_stats(fd) {
                    let now = (info.rcv_ooopack, info.bytes_received);
                    let prev = last.insert(fd, now).unwrap_or(now);
                    // Smaller counts are a new connection that reuses the fd number.
                    ooo += u64::from(now.0.checked_sub(prev.0).unwrap_or(now.0));
                    bytes += now.1.checked_sub(prev.1).unwrap_or(now.1);
                }
            }
            let mib = (bytes as f64 / (1 << 20) as f64).max(0.25);
            let backlog = s.scheduler.as_ref().is_some_and(|q| q.queued() > 0);
            let sample = Sample {
                congestion: ooo as f64 / mib,
                utilization: bytes as f64 / (link_bps * interval.as_secs_f64()),
                backlog,
            };
            let before = adaptive.limit();
            let limit = adaptive.observe(sample);
            if limit != before {
                s.window_trace.push(((mono_ns() - t0) / 1_000_000, limit));
                let grants = s
                    .scheduler
                    .as_mut()
                    .map(|q| q.set_limit(limit))
                    .unwrap_or_default();
                dispatch(&mut s, grants);
            }
        }
    } else {
        let _ =
            tokio::time::timeout(Duration::from_secs_f64(args.max_s), all_closed.notified()).await;
    }
    let s = lock(&state);
    let us = |v: &Vec<u64>| v.iter().map(|ns| *ns as f64 / 1e3).collect();
    let report = Report {
        messages: s
            .messages
            .values()
            .map(|m| (m.bytes, m.slo_us, m.latency_us))
            .collect(),
        credits_priority_us: us(&s.credits_priority_ns),
        credits_piggyback_us: us(&s.credits_piggyback_ns),
        window_trace: s.window_trace.clone(),
        queue_peak: s.queue_peak,
        expired: s.expired,
    };
    let line = serde_json::to_string(&report).map_err(|e| RankerError::Report(e.into()))?;
    let mut out = std::io::stdout().lock();
    use std::io::Write;
    writeln!(out, "{line}")
        .and_then(|_| out.flush())
        .map_err(RankerError::Report)
}

async fn serve_control(
    sock: TcpStream,
    conn: u32,
    st: Shared,
    expected: usize,
    all_closed: Arc<Notify>,
) {
    let _ = sock.set_nodelay(true);
    let (mut rd, mut wr) = sock.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<ControlMessage>();
    lock(&st).control.insert(conn, tx.clone());
    let writer = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            let is_error = matches!(m, ControlMessage::Error { .. });
            if wr.write_all(&m.encode()).await.is_err() || is_error {
                break;
            }
        }
        let _ = wr.shutdown().await;
    });
    loop {
        let msg = match read_message(&mut rd).await {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(err) => {
                tracing::warn!(conn, %err, "control frame rejected; closing the connection");
                let _ = tx.send(error_reply(&err));
                break;
            }
        };
        let now = mono_ns();
        let mut s = lock(&st);
        match msg {
            ControlMessage::RequestToSend {
                id,
                bytes,
                slo_left_us,
                stamp_ns,
            } => {
                let slo_us = (now.saturating_sub(stamp_ns)) / 1000 + slo_left_us;
                s.messages.insert(
                    id,
                    Message {
                        sender: conn,
                        bytes,
                        slo_us,
                        stamp_ns,
                        received: 0,
                        latency_us: None,
                    },
                );
                let grants = s
                    .scheduler
                    .as_mut()
                    .map(|q| q.request(conn, id, bytes, slo_left_us * 1000, now))
                    .unwrap_or_default();
                let queued = s.scheduler.as_ref().map_or(0, |q| q.queued());
                s.queue_peak = s.queue_peak.max(queued);
                dispatch(&mut s, grants);
            }
            ControlMessage::Credit { stamp_ns, .. } => {
                s.credits_priority_ns.push(now.saturating_sub(stamp_ns))
            }
            other => {
                let message = format!("a ranker expects request-to-send or credit, got {other:?}");
                let _ = tx.send(ControlMessage::Error {
                    code: ErrorCode::Unexpected,
                    message,
                });
                break;
            }
        }
    }
    drop(tx);
    {
        let mut s = lock(&st);
        s.control.remove(&conn);
        let grants = s
            .scheduler
            .as_mut()
            .map(|q| q.sender_gone(conn))
            .unwrap_or_default();
        dispatch(&mut s, grants);
        s.closed += 1;
        if s.closed >= expected {
            all_closed.notify_one();
        }
    }
    let _ = writer.await;
}

async fn serve_data(mut sock: TcpStream, st: Shared) {
    let fd = sock.as_raw_fd();
    lock(&st).data_fds.insert(fd, 0);
    let mut buf = vec![0u8; data::CHUNK];
    let mut h = [0u8; data::HEADER];
    let outcome: Result<(), String> = async {
        loop {
            match sock.read_exact(&mut h).await {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e.to_string()),
            }
            let (kind, a, b) = data::parse(&h);
            match kind {
                data::KIND_CHUNK if b as usize <= data::CHUNK => {
                    sock.read_exact(&mut buf[..b as usize]).await.map_err(|e| e.to_string())?;
                    let now = mono_ns();
                    let mut s = lock(&st);
                    s.bytes_received += b;
                    let Some(m) = s.messages.get_mut(&a) else {
                        return Err(format!("data for message {a}, which no request-to-send announced"));
                    };
                    m.received += b;
                    if m.received >= m.bytes && m.latency_us.is_none() {
                        m.latency_us = Some(now.saturating_sub(m.stamp_ns) / 1000);
                        let sender = m.sender;
                        let grants = s.scheduler.as_mut().map(|q| q.complete(sender, a)).unwrap_or_default();
                        if let Some(tx) = s.control.get(&sender) {
                            let _ = tx.send(ControlMessage::Done { id: a });
                        }
                        dispatch(&mut s, grants);
                    }
                }
                data::KIND_CREDIT => {
                    let now = mono_ns();
                    lock(&st).credits_piggyback_ns.push(now.saturating_sub(a));
                }
                _ => return Err(format!("expected a chunk (kind 1, ≤ {} bytes) or credit (kind 2), got kind {kind} with length {b}", data::CHUNK)),
            }
        }
    }
    .await;
    if let Err(err) = outcome {
        tracing::warn!(%err, "data connection closed");
    }
    lock(&st).data_fds.remove(&fd);
}
