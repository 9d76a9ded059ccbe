//! A group of bursty senders on one host. Every sender takes part in each incast event (all
//! senders of the run send one message at about the same instant); events follow a schedule
//! every process derives from the same seed, so groups on different hosts burst together.
//! Each message asks for a grant on the control connection and then goes on the data one.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cleave_flow::control::{read_message, ControlMessage};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify};

use crate::clock::{instant_at, mono_ns};
use crate::data;

#[derive(clap::Args, Clone)]
pub struct Args {
    #[arg(long)]
    ranker: String,
    #[arg(long)]
    control_port: u16,
    #[arg(long)]
    data_port: u16,
    /// Global index of this group's first sender (message ids are index << 32 | sequence).
    #[arg(long, default_value_t = 0)]
    first: u32,
    #[arg(long)]
    count: u32,
    #[arg(long)]
    message_bytes: u64,
    #[arg(long, default_value_t = 1.0)]
    link_gbit: f64,
    #[arg(long)]
    events: u32,
    /// Mean time between incast events; each gap is drawn in [0.8, 1.2] of it.
    #[arg(long)]
    period_ms: f64,
    /// CLOCK_MONOTONIC ns of the first event (shared by every group of a run).
    #[arg(long)]
    start_ns: u64,
    /// SLO = k·M/B with k drawn from "k:weight,k:weight".
    #[arg(long, default_value = "50:0.4,150:0.6")]
    mix: String,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Keep two messages outstanding per sender instead of bursts (load for the credit probe).
    #[arg(long)]
    continuous: bool,
    /// The first sender of this group sends a credit every this many ms on both channels.
    #[arg(long, default_value_t = 0)]
    credit_probe_ms: u64,
    /// How long to wait for outstanding messages after the last event.
    #[arg(long, default_value_t = 30.0)]
    drain_s: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum SenderError {
    #[error("--mix: expected k:weight pairs like 50:0.4,150:0.6, got {0:?}")]
    Mix(String),
    #[error("sender {index}: cannot connect to {addr}: {err}")]
    Connect {
        index: u32,
        addr: String,
        err: std::io::Error,
    },
}

/// splitmix64: a fixed, seedable stream, so every process derives the same schedule.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn unit(seed: u64, a: u64, b: u64) -> f64 {
    (mix64(seed ^ mix64(a ^ mix64(b))) >> 11) as f64 / (1u64 << 53) as f64
}

fn parse_mix(s: &str) -> Result<Vec<(f64, f64)>, SenderError> {
    let bad = || SenderError::Mix(s.to_string());
    let pairs: Vec<(f64, f64)> = s
        .split(',')
        .map(|p| {
            let (k, w) = p.split_once(':').ok_or_else(bad)?;
            Ok((
                k.trim().parse().map_err(|_| bad())?,
                w.trim().parse().map_err(|_| bad())?,
            ))
        })
        .collect::<Result<_, SenderError>>()?;
    if pairs.is_empty() || pairs.iter().any(|(k, w)| !(*k > 0.0 && *w > 0.0)) {
        return Err(bad());
    }
    Ok(pairs)
}

pub async fn run(args: Args) -> Result<(), SenderError> {
    let mix = parse_mix(&args.mix)?;
    // Event times: the same draw in every process.
    let mut events = Vec::with_capacity(args.events as usize);
    let mut t = args.start_ns;
    for j in 0..args.events {
        events.push(t);
        t += (args.period_ms * 1e6 * (0.8 + 0.4 * unit(args.seed, 0xE7, j as u64))) as u64;
    }
    let mut tasks = Vec::new();
    for i in 0..args.count {
        let index = args.first + i;
        let a = args.clone();
        let (m, ev) = (mix.clone(), events.clone());
        let probe = i == 0 && args.credit_probe_ms > 0;
        tasks.push(tokio::spawn(async move {
            one_sender(a, index, m, ev, probe).await
        }));
    }
    let mut first_err = None;
    for t in tasks {
        match t.await {
            Ok(Err(e)) if first_err.is_none() => first_err = Some(e),
            Err(e) => tracing::warn!(%e, "a sender task failed"),
            _ => {}
        }
    }
    first_err.map_or(Ok(()), Err)
}

async fn connect(addr: &str, index: u32) -> Result<TcpStream, SenderError> {
    let mut last = None;
    for _ in 0..50 {
        match TcpStream::connect(addr).await {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let err = last.unwrap_or_else(|| std::io::Error::other("no attempt"));
    Err(SenderError::Connect {
        index,
        addr: addr.to_string(),
        err,
    })
}

/// Unsent bytes a data socket may hold: a sender that keeps its own queue short lets a
/// piggybacked credit wait behind at most this much of its data (plus what is in flight), so
/// the bench compares the priority channel with a well-behaved piggyback, not a 4 MiB buffer.
const NOTSENT_LOWAT: u32 = 128 * 1024;

fn limit_unsent(sock: &TcpStream, bytes: u32) {
    use std::os::fd::AsRawFd;
    let v = bytes as libc::c_int;
    // SAFETY: a valid socket and a c_int option value of the right size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_NOTSENT_LOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        tracing::warn!(err = %std::io::Error::last_os_error(), "TCP_NOTSENT_LOWAT not set");
    }
}

/// Small payloads sent once and reused: zeros cost nothing to make.
static ZEROS: [u8; data::CHUNK] = [0u8; data::CHUNK];

async fn one_sender(
    args: Args,
    index: u32,
    mix: Vec<(f64, f64)>,
    events: Vec<u64>,
    probe: bool,
) -> Result<(), SenderError> {
    let control = connect(&format!("{}:{}", args.ranker, args.control_port), index).await?;
    let data_sock = connect(&format!("{}:{}", args.ranker, args.data_port), index).await?;
    limit_unsent(&data_sock, NOTSENT_LOWAT);
    let (mut crd, mut cwr) = control.into_split();
    let (ctx, mut crx) = mpsc::unbounded_channel::<ControlMessage>();
    let control_writer = tokio::spawn(async move {
        while let Some(m) = crx.recv().await {
            if cwr.write_all(&m.encode()).await.is_err() {
                break;
            }
        }
        let _ = cwr.shutdown().await;
    });
    let (gtx, mut grx) = mpsc::unbounded_channel::<u64>();
    let outstanding = Arc::new(Mutex::new(0usize));
    let done_note = Arc::new(Notify::new());
    let (o2, n2) = (outstanding.clone(), done_note.clone());
    let reader = tokio::spawn(async move {
        loop {
            match read_message(&mut crd).await {
                Ok(Some(ControlMessage::Grant { id })) => {
                    let _ = gtx.send(id);
                }
                Ok(Some(ControlMessage::Done { .. } | ControlMessage::Expired { .. })) => {
                    let mut o = o2.lock().unwrap_or_else(|p| p.into_inner());
                    *o = o.saturating_sub(1);
                    n2.notify_one();
                }
                Ok(Some(ControlMessage::Error { message, .. })) => {
                    tracing::warn!(index, %message, "the ranker rejected a control frame");
                    break;
                }
                Ok(Some(_)) | Ok(None) => break,
                Err(err) => {
                    tracing::warn!(index, %err, "bad control frame from the ranker");
                    break;
                }
            }
        }
        n2.notify_one();
    });
    // Piggybacked credits wait here for the next chunk boundary of the data stream.
    let piggyback: Arc<Mutex<VecDeque<u64>>> = Arc::new(Mutex::new(VecDeque::new()));
    let pb = piggyback.clone();
    let bytes = args.message_bytes;
    let data_writer = tokio::spawn(async move {
        let mut sock = data_sock;
        while let Some(id) = grx.recv().await {
            let mut left = bytes;
            while left > 0 {
                let credits: Vec<u64> = pb
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .drain(..)
                    .collect();
                for stamp in credits {
                    if sock
                        .write_all(&data::header(data::KIND_CREDIT, stamp, 0))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                let n = left.min(data::CHUNK as u64);
                let ok = sock
                    .write_all(&data::header(data::KIND_CHUNK, id, n))
                    .await
                    .is_ok()
                    && sock.write_all(&ZEROS[..n as usize]).await.is_ok();
                if !ok {
                    return;
                }
                left -= n;
            }
        }
        let _ = sock.shutdown().await;
    });
    let transfer_ns = bytes as f64 / (args.link_gbit * 1e9 / 8.0) * 1e9;
    let slo_ns = |seq: u64| {
        let mut r = unit(args.seed, index as u64 + 1, seq) * mix.iter().map(|m| m.1).sum::<f64>();
        for (k, w) in &mix {
            if r < *w {
                return (k * transfer_ns) as u64;
            }
            r -= w;
        }
        (mix[mix.len() - 1].0 * transfer_ns) as u64
    };
    let ask = |seq: u64| {
        let stamp = mono_ns();
        let id = (index as u64) << 32 | seq;
        *outstanding.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        let m = ControlMessage::RequestToSend {
            id,
            bytes,
            slo_left_us: slo_ns(seq) / 1000,
            stamp_ns: stamp,
        };
        let _ = ctx.send(m);
    };
    let end_ns = *events.last().unwrap_or(&args.start_ns) + (args.period_ms * 1e6) as u64;
    let prober = probe.then(|| {
        let (ctx, pb) = (ctx.clone(), piggyback.clone());
        let every = Duration::from_millis(args.credit_probe_ms);
        tokio::spawn(async move {
            tokio::time::sleep_until(instant_at(args.start_ns)).await;
            while mono_ns() < end_ns {
                let stamp = mono_ns();
                let _ = ctx.send(ControlMessage::Credit {
                    conn: index,
                    bytes: 4096,
                    stamp_ns: stamp,
                });
                pb.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push_back(stamp);
                tokio::time::sleep(every).await;
            }
        })
    });
    let count = |o: &Arc<Mutex<usize>>| *o.lock().unwrap_or_else(|p| p.into_inner());
    if args.continuous {
        tokio::time::sleep_until(instant_at(args.start_ns)).await;
        let mut seq = 0u64;
        for _ in 0..1_000_000 {
            if mono_ns() >= end_ns || reader.is_finished() {
                break;
            }
            while count(&outstanding) < 2 {
                seq += 1;
                ask(seq);
            }
            let _ = tokio::time::timeout(Duration::from_millis(100), done_note.notified()).await;
        }
    } else {
        for (j, at) in events.iter().enumerate() {
            // Up to 1 ms apart within an event, as fan-out replies are.
            let jitter = (unit(args.seed, 0xA1 + index as u64, j as u64) * 1e6) as u64;
            tokio::time::sleep_until(instant_at(at + jitter)).await;
            ask(j as u64);
        }
    }
    let drain_until = mono_ns() + (args.drain_s * 1e9) as u64;
    while count(&outstanding) > 0 && mono_ns() < drain_until && !reader.is_finished() {
        let _ = tokio::time::timeout(Duration::from_millis(100), done_note.notified()).await;
    }
    if let Some(p) = prober {
        p.abort();
    }
    drop(ctx);
    reader.abort();
    data_writer.abort();
    let _ = control_writer.await;
    Ok(())
}
