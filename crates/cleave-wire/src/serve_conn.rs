//! One server connection on its I/O thread: reads frames, dispatches requests (control kinds
//! answered here, late ones with `deadline`, the rest into the server's queue), starts queued
//! requests (of any connection) in the queue policy's order, applies CANCEL frames, and writes
//! the replies, reads and writes progressing side by side. On a connection with response
//! credits, replies the credit does not cover wait in `HeldReplies` (credit.rs). A data
//! connection whose thread is far busier than another moves there between two turns of its
//! loop, its state with it (balance.rs).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::addr::Stream;
use crate::balance::migration_target;
use crate::conn::{FrameReader, FrameWriter};
use crate::credit::{HeldReplies, Registration};
use crate::frame::{kind, ConnClass, ErrorCode, Frame, FrameError, VERSION};
use crate::queue::Queued;
use crate::server::{unix_now_us, wait_shutdown, Request, Responder, ServerStats, Shared, Token};
use crate::sockets::Listed;

enum Event {
    Reply(Frame),
    Wrote(io::Result<usize>),
    Shutdown,
    Read(io::Result<usize>),
    Start,
    Woken,
    Deadline,
    Credit,
    HeldDeadline,
}

/// An application request received and not started yet, with what answering it needs.
pub(crate) struct Waiting {
    frame: Frame,
    conn_id: u64,
    tx: mpsc::UnboundedSender<Frame>,
    cancelled: Arc<AtomicBool>,
}

impl Queued for Waiting {
    fn deadline_unix_us(&self) -> u64 {
        self.frame.deadline_unix_us
    }
}

/// Serves one connection until the peer closes it, a framing error or timeout, idleness, or
/// shutdown; always after writing every reply it owes. Writes progress alongside reads: while
/// the peer is slow to take replies, the loop still reads (unless back-pressure pauses it) and
/// still notices timeouts and shutdown.
/// `thread`: the data I/O thread it runs on (`None` on the control thread); `shm`: the
/// regions of a shared-memory data connection.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn serve_connection(
    stream: Stream,
    shared: Arc<Shared>,
    conn_id: u64,
    class: ConnClass,
    credit: Option<Registration>,
    thread: Option<usize>,
    token: Token,
    shm: Option<crate::shm::ShmLink>,
) {
    let cfg = &shared.config;
    let (tx, rx) = mpsc::unbounded_channel::<Frame>();
    shared.stats.connections.fetch_add(1, Ordering::Relaxed);
    let listed = match class {
        ConnClass::Data => shared.sockets.list(conn_id, &stream),
        ConnClass::Control => None,
    };
    let mut reader = FrameReader::new(cfg.max_payload);
    let mut writer = FrameWriter::new();
    if let Some(l) = shm {
        reader.set_shm(l.rx);
        writer.set_shm(l.tx);
    }
    let state = ConnState {
        conn_id,
        class,
        held: credit.as_ref().map(|r| HeldReplies::new(r.credit.clone())),
        credit,
        tx,
        rx,
        reader,
        writer,
        shutdown: shared.shutdown.clone(),
        owed: 0,
        reading: true,
        draining: false,
        frame_deadline: None,
        last_activity: Instant::now(),
        in_flight: HashMap::new(),
        gauges: Gauges {
            shared: shared.clone(),
            receiving: false,
            held: 0,
            thread,
            load: 0,
        },
        _token: token,
        _listed: listed,
    };
    drive(stream, shared, state).await
}

/// What a connection carries from one I/O thread to another: everything but its socket's
/// registration with the old thread's reactor.
struct ConnState {
    conn_id: u64,
    class: ConnClass,
    credit: Option<Registration>,
    held: Option<HeldReplies>,
    tx: mpsc::UnboundedSender<Frame>,
    rx: mpsc::UnboundedReceiver<Frame>,
    reader: FrameReader,
    writer: FrameWriter,
    shutdown: tokio::sync::watch::Receiver<bool>,
    owed: usize,
    reading: bool,
    draining: bool,
    frame_deadline: Option<Instant>,
    last_activity: Instant,
    in_flight: HashMap<u64, Arc<AtomicBool>>,
    gauges: Gauges,
    _token: Token,
    /// In the server's list of data sockets while the connection lives, wherever it moves.
    _listed: Option<Listed>,
}

/// Continues a moved connection on its new thread. Boxed: `drive` spawns it, and it runs
/// `drive`.
fn resume(
    std_stream: crate::addr::StdStream,
    shared: Arc<Shared>,
    state: ConnState,
) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(async move {
        if let Ok(stream) = Stream::from_std(std_stream) {
            drive(stream, shared, state).await;
        }
    })
}

async fn drive(mut stream: Stream, shared: Arc<Shared>, state: ConnState) {
    let ConnState {
        conn_id,
        class,
        credit,
        mut held,
        tx,
        mut rx,
        mut reader,
        mut writer,
        mut shutdown,
        mut owed,
        mut reading,
        mut draining,
        mut frame_deadline,
        mut last_activity,
        mut in_flight,
        mut gauges,
        _token,
        _listed,
    } = state;
    // Data connections' tasks are woken to start others' queued work; the control thread
    // stays free for probes.
    let helps = class == ConnClass::Data;
    let cfg = &shared.config;
    let (mut rd, mut wr) = stream.split();
    let mut move_to: Option<usize> = None;

    loop {
        if !reading && owed == 0 {
            break;
        }
        let paused = owed >= cfg.max_in_flight; // back-pressure: not reading for now
        let queued = shared.stats.queued.load(Ordering::Relaxed) > 0;
        let deadline = if !reading || paused {
            None
        } else if reader.in_frame() {
            frame_deadline
        } else if owed == 0 {
            cfg.idle_timeout.map(|t| last_activity + t)
        } else {
            None
        };
        // Bytes that arrived before a shutdown are read first, so a frame already started
        // is finished rather than cut.
        let holding = held.as_ref().is_some_and(|h| h.len() > 0);
        let held_deadline = held
            .as_ref()
            .and_then(|h| h.next_deadline())
            .map(|d| Instant::now() + Duration::from_micros(d.saturating_sub(unix_now_us())));
        let event = tokio::select! {
            biased;
            Some(f) = rx.recv() => Event::Reply(f),
            w = writer.write_some(&mut wr), if writer.has_pending() => Event::Wrote(w),
            _ = granted(&credit), if holding => Event::Credit,
            _ = sleep_until(held_deadline), if held_deadline.is_some() => Event::HeldDeadline,
            r = reader.fill(&mut rd), if reading && !paused => Event::Read(r),
            // After reading: what has arrived competes in the queue before the next start.
            _ = std::future::ready(()), if queued => Event::Start,
            _ = shared.queue_ready.notified(), if helps && !queued => Event::Woken,
            _ = wait_shutdown(&mut shutdown), if !draining => Event::Shutdown,
            _ = sleep_until(deadline), if deadline.is_some() => Event::Deadline,
        };
        match event {
            Event::Reply(f) => {
                let mut next = Some(f);
                while let Some(f) = next {
                    let cancelled = !kind::is_control(f.kind)
                        && in_flight
                            .remove(&f.request_id)
                            .is_some_and(|c| c.load(Ordering::Relaxed));
                    if cancelled {
                        owed -= 1; // the caller forgot the id: nothing goes out
                    } else {
                        let out = match held.as_mut() {
                            Some(h) => h.offer(f),
                            None => Some(f),
                        };
                        writer.extend(out);
                    }
                    next = rx.try_recv().ok();
                }
            }
            Event::Credit => {
                if let Some(h) = held.as_mut() {
                    writer.extend(h.release());
                }
            }
            Event::HeldDeadline => {
                if let Some(h) = held.as_mut() {
                    for f in h.expire(unix_now_us()) {
                        if f.is_error() {
                            shared.stats.credit_expired.fetch_add(1, Ordering::Relaxed);
                        }
                        writer.push(f);
                    }
                }
            }
            Event::Start => {
                start_next(&shared);
                // Let this thread's other connections read and write between two starts.
                tokio::task::yield_now().await;
            }
            Event::Woken => {} // the next turn sees the queue
            Event::Wrote(Err(_)) => return,
            Event::Wrote(Ok(n)) => {
                owed -= n;
                last_activity = Instant::now();
            }
            Event::Shutdown => {
                draining = true;
                if !reader.in_frame() {
                    reading = false;
                }
            }
            // The peer closed its side (perhaps mid-frame): answer what it asked, then close.
            Event::Read(Ok(0)) => reading = false,
            Event::Read(Err(_)) => return,
            Event::Read(Ok(_)) => {
                let mut completed = false;
                loop {
                    match reader.next() {
                        Ok(Some(frame)) => {
                            completed = true;
                            if frame.is_cancel() {
                                cancel(&frame, &shared, conn_id, &in_flight);
                                // A reply held for credit: the caller forgot the id.
                                if held.as_mut().is_some_and(|h| h.remove(frame.request_id)) {
                                    shared.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                                    owed -= 1;
                                }
                            } else {
                                owed += 1;
                                dispatch(frame, &shared, conn_id, class, &tx, &mut in_flight);
                            }
                        }
                        Ok(None) => break,
                        Err(FrameError::BadSlotRef {
                            kind: k,
                            request_id,
                            reason,
                        }) => {
                            // One bad slot reference: answer that request, read on.
                            completed = true;
                            owed += 1;
                            let msg = format!("bad slot reference: {reason}");
                            let _ =
                                tx.send(Frame::error(k, request_id, ErrorCode::BadRequest, &msg));
                        }
                        Err(e) => {
                            // The stream cannot be resynchronised: say why and close.
                            owed += 1;
                            let _ = tx.send(Frame::error(
                                kind::HELLO,
                                e.request_id(),
                                e.code(),
                                &e.to_string(),
                            ));
                            reading = false;
                            break;
                        }
                    }
                }
                let now = Instant::now();
                last_activity = now;
                if reader.in_frame() {
                    if completed || frame_deadline.is_none() {
                        frame_deadline = Some(now + cfg.frame_timeout);
                    }
                } else {
                    frame_deadline = None;
                }
                if draining && !reader.in_frame() {
                    reading = false;
                }
                gauges.set_receiving(reading && reader.in_frame());
                gauges.set_load(owed);
                move_to = gauges.migration(owed);
            }
            Event::Deadline => {
                if reader.in_frame() {
                    owed += 1;
                    let msg = format!(
                        "frame incomplete after {:.3} s ({} bytes of it arrived); closing",
                        cfg.frame_timeout.as_secs_f64(),
                        reader.buffered()
                    );
                    let id = reader.pending_request_id().unwrap_or(0);
                    let _ = tx.send(Frame::error(kind::HELLO, id, ErrorCode::Timeout, &msg));
                    reading = false;
                    gauges.set_receiving(false);
                } else {
                    break; // idle
                }
            }
        }
        gauges.set_held(held.as_ref().map_or(0, |h| h.len()));
        gauges.set_load(owed);
        if let Some(to) = move_to.take() {
            let Ok(std_stream) = stream.into_std() else {
                return;
            };
            gauges.moved_to(to, owed);
            shared.stats.migrations.fetch_add(1, Ordering::Relaxed);
            let state = ConnState {
                conn_id,
                class,
                credit,
                held,
                tx,
                rx,
                reader,
                writer,
                shutdown,
                owed,
                reading,
                draining,
                frame_deadline,
                last_activity,
                in_flight,
                gauges,
                _token,
                _listed,
            };
            tracing::debug!(conn_id, to, "connection moved to a less loaded I/O thread");
            shared
                .data_io
                .spawn_on(to, resume(std_stream, shared.clone(), state));
            return;
        }
    }
    let _ = stream.shutdown().await;
}

/// Keeps a connection's share of the server's gauges (and of its I/O thread's load), and
/// returns it when dropped.
struct Gauges {
    shared: Arc<Shared>,
    receiving: bool,
    /// Replies this connection holds for credit.
    held: usize,
    /// The data I/O thread it runs on, and the load it counts there.
    thread: Option<usize>,
    load: u64,
}

impl Gauges {
    fn stats(&self) -> &ServerStats {
        &self.shared.stats
    }

    fn set_load(&mut self, owed: usize) {
        if let Some(t) = self.thread {
            if owed as u64 != self.load {
                self.shared.loads.update(t, self.load, t, owed as u64);
                self.load = owed as u64;
            }
        }
    }

    /// The thread this connection should move to, if balancing is on and it should.
    fn migration(&self, owed: usize) -> Option<usize> {
        let (thread, cfg) = (self.thread?, self.shared.config.balance.as_ref()?);
        migration_target(&self.shared.loads.snapshot(), thread, owed as u64, cfg)
    }

    /// Carries this connection's load to thread `to`.
    fn moved_to(&mut self, to: usize, owed: usize) {
        if let Some(t) = self.thread {
            self.shared.loads.update(t, self.load, to, owed as u64);
            self.thread = Some(to);
            self.load = owed as u64;
        }
    }

    fn set_held(&mut self, now: usize) {
        if now != self.held {
            let held = &self.shared.stats.responses_held;
            held.fetch_add(now as u64, Ordering::Relaxed);
            held.fetch_sub(self.held as u64, Ordering::Relaxed);
            self.held = now;
        }
    }

    fn set_receiving(&mut self, now: bool) {
        if now != self.receiving {
            self.receiving = now;
            if now {
                self.stats()
                    .frames_receiving
                    .fetch_add(1, Ordering::Relaxed);
            } else {
                self.stats()
                    .frames_receiving
                    .fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for Gauges {
    fn drop(&mut self) {
        self.set_receiving(false);
        self.set_held(0);
        self.set_load(0);
        self.stats().connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Resolves when a grant arrives for this connection (never without credits).
async fn granted(credit: &Option<Registration>) {
    match credit {
        Some(r) => r.credit.granted.notified().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// A CANCEL frame: marks its request cancelled if it is still unanswered; never answered.
fn cancel(frame: &Frame, shared: &Shared, conn_id: u64, in_flight: &HashMap<u64, Arc<AtomicBool>>) {
    let Some(flag) = in_flight.get(&frame.request_id) else {
        return; // answered already, or never sent: nothing to do
    };
    if !flag.swap(true, Ordering::Relaxed) {
        shared.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        shared.handler.cancelled(conn_id, frame.request_id);
    }
}

/// Answers one request frame: control kinds here, late requests with `deadline`, the rest
/// through the handler. Exactly one reply frame follows on `tx`, now or later.
fn dispatch(
    frame: Frame,
    shared: &Shared,
    conn_id: u64,
    class: ConnClass,
    tx: &mpsc::UnboundedSender<Frame>,
    in_flight: &mut HashMap<u64, Arc<AtomicBool>>,
) {
    let (k, id) = (frame.kind, frame.request_id);
    let context = (frame.deadline_unix_us, frame.trace_id);
    let error = |code, msg: String| {
        let f = Frame::error(k, id, code, &msg).with_context(context.0, context.1);
        let _ = tx.send(f);
    };
    if frame.is_response() {
        return error(
            ErrorCode::BadRequest,
            format!(
                "expected a request frame, got a response (flags {:#04x})",
                frame.flags
            ),
        );
    }
    match k {
        kind::HELLO => error(
            ErrorCode::Handshake,
            "HELLO is only valid as the first frame of a connection".to_owned(),
        ),
        kind::PING => {
            let _ =
                tx.send(Frame::response(k, id, Bytes::new()).with_context(context.0, context.1));
        }
        kind::READY => {
            let ready = Bytes::copy_from_slice(&[shared.handler.ready() as u8]);
            let _ = tx.send(Frame::response(k, id, ready).with_context(context.0, context.1));
        }
        // On the control connection only, so that grants never queue behind bulk data.
        kind::CREDIT if class == ConnClass::Control => match shared.credits.apply(&frame.payload) {
            Ok(()) => {
                let f = Frame::response(k, id, Bytes::new()).with_context(context.0, context.1);
                let _ = tx.send(f);
            }
            Err((code, msg)) => error(code, msg),
        },
        kind::CREDIT => error(
            ErrorCode::BadRequest,
            "CREDIT is only valid on a control connection, got it on a data connection".to_owned(),
        ),
        k if kind::is_control(k) => error(
            ErrorCode::UnknownKind,
            format!("control kind {k:#06x} is not defined in protocol version {VERSION}"),
        ),
        _ => {
            let deadline = frame.deadline_unix_us;
            let now = if deadline == 0 { 0 } else { unix_now_us() };
            if now > deadline {
                shared.stats.expired.fetch_add(1, Ordering::Relaxed);
                return error(
                    ErrorCode::Deadline,
                    format!(
                        "deadline passed {} us before the server could start the request",
                        now - deadline
                    ),
                );
            }
            let cancelled = Arc::new(AtomicBool::new(false));
            in_flight.insert(id, cancelled.clone());
            let waiting = Waiting {
                frame,
                conn_id,
                tx: tx.clone(),
                cancelled,
            };
            let mut queue = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
            queue.push(waiting);
            shared.stats.queued.fetch_add(1, Ordering::Relaxed);
            shared.queue_ready.notify_one();
        }
    }
}

/// Starts the request the queue policy picks (if another thread has not emptied the queue):
/// skips it if its caller cancelled it or its connection is gone, answers `deadline` if less
/// time is left than the handler expects it to take, else hands it to the handler.
fn start_next(shared: &Shared) {
    let next = {
        let mut queue = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
        queue.pop()
    };
    let Some(w) = next else {
        return;
    };
    shared.stats.queued.fetch_sub(1, Ordering::Relaxed);
    let frame = w.frame;
    let (k, id) = (frame.kind, frame.request_id);
    let (deadline, trace_id) = (frame.deadline_unix_us, frame.trace_id);
    let error = |code, msg: &str| {
        let f = Frame::error(k, id, code, msg).with_context(deadline, trace_id);
        let _ = w.tx.send(f);
    };
    if w.tx.is_closed() {
        return; // nobody to answer
    }
    if w.cancelled.load(Ordering::Relaxed) {
        // Its connection discards this; sending it settles the connection's count of replies.
        return error(
            ErrorCode::Cancelled,
            "cancelled by the caller before it started",
        );
    }
    if deadline != 0 {
        let now = unix_now_us();
        let expected = shared.handler.expected_service_us(k);
        if now > deadline {
            shared.stats.expired.fetch_add(1, Ordering::Relaxed);
            let msg = format!(
                "deadline passed {} us before the server could start the request",
                now - deadline
            );
            return error(ErrorCode::Deadline, &msg);
        }
        if deadline - now < expected {
            shared.stats.dropped_late.fetch_add(1, Ordering::Relaxed);
            shared.handler.dropped_late(k, deadline - now);
            let msg = format!(
                "deadline cannot be met: {} us left when the request's turn came, the server \
                 expects {expected} us of service; dropped before starting",
                deadline - now
            );
            return error(ErrorCode::Deadline, &msg);
        }
    }
    let request = Request {
        conn_id: w.conn_id,
        request_id: id,
        kind: k,
        payload: frame.payload,
        deadline_unix_us: deadline,
        trace_id,
        cancelled: w.cancelled,
    };
    let responder = Responder::new(w.tx, k, id, deadline, trace_id);
    // A panicking handler must not take the connection (or thread) down; the dropped
    // responder answers `internal`.
    let handler = &shared.handler;
    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| handler.handle(request, responder)));
}
