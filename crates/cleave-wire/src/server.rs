//! The server side: an acceptor and a control thread, data I/O threads that each own their
//! connections, and a [`Handler`] that answers application frames.

use std::collections::HashMap;
use std::io;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::addr::{Address, Listener, StdListener, Stream};
use crate::conn::{read_header, read_payload, FrameReader, FrameWriter, HeaderError};
use crate::frame::{decode_hello, kind, ConnClass, ErrorCode, Frame, DEFAULT_MAX_PAYLOAD, VERSION};
use crate::io::IoThreads;

/// Limits and timeouts of a server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Data I/O threads (control connections get one more thread of their own).
    pub io_threads: usize,
    /// Largest request payload accepted; larger frames get `frame_too_large` and a close.
    pub max_payload: u32,
    /// A frame (HELLO included) must arrive whole within this once it has started.
    pub frame_timeout: Duration,
    /// A connection with nothing in flight and nothing arriving for this long is closed.
    pub idle_timeout: Option<Duration>,
    /// Requests in flight per connection before the server stops reading from it.
    pub max_in_flight: usize,
    /// On shutdown, the longest wait for in-flight requests before connections are dropped.
    pub drain_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            io_threads: 1,
            max_payload: DEFAULT_MAX_PAYLOAD,
            frame_timeout: Duration::from_secs(10),
            idle_timeout: Some(Duration::from_secs(300)),
            max_in_flight: 1024,
            drain_timeout: Duration::from_secs(30),
        }
    }
}

/// One application request frame, as the handler sees it.
#[derive(Debug)]
pub struct Request {
    /// Server-wide id of the connection it arrived on.
    pub conn_id: u64,
    pub request_id: u64,
    pub kind: u16,
    pub payload: Bytes,
    /// When the caller stops waiting, Unix µs; 0 = none. A request already late when it
    /// arrives never reaches the handler (the server answers `deadline`).
    pub deadline_unix_us: u64,
    /// The id of the client request this serves, for logs; 0 = none.
    pub trace_id: u64,
    cancelled: Arc<AtomicBool>,
}

impl Request {
    /// Whether the caller has cancelled the request (a CANCEL frame arrived for it). Whatever
    /// the handler answers afterwards is not sent; a handler that has not started may skip it.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }
}

/// The time now as Unix microseconds, the unit of frame deadlines.
pub fn unix_now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Answers one request, once, from any thread. Dropping it unanswered sends an `internal`
/// error frame, so a client never waits for a reply that will not come.
#[derive(Debug)]
pub struct Responder {
    tx: mpsc::UnboundedSender<Frame>,
    kind: u16,
    request_id: u64,
    /// Echoed in the reply's header.
    deadline_unix_us: u64,
    trace_id: u64,
    done: bool,
}

impl Responder {
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// The request's kind, which the reply carries.
    pub fn kind(&self) -> u16 {
        self.kind
    }

    pub fn reply(mut self, payload: Bytes) {
        let f = Frame::response(self.kind, self.request_id, payload);
        self.send(f);
    }

    pub fn error(mut self, code: ErrorCode, message: &str) {
        let f = Frame::error(self.kind, self.request_id, code, message);
        self.send(f);
    }

    /// Whether the connection is gone, so a reply would be dropped.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    fn send(&mut self, f: Frame) {
        self.done = true;
        let _ = self
            .tx
            .send(f.with_context(self.deadline_unix_us, self.trace_id));
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        if !self.done {
            let f = Frame::error(
                self.kind,
                self.request_id,
                ErrorCode::Internal,
                "the server's handler dropped the request without replying",
            );
            self.send(f);
        }
    }
}

/// What a server does with application frames (kinds >= `kind::FIRST_APP`).
pub trait Handler: Send + Sync + 'static {
    /// Called on the connection's I/O thread for each request. Quick work may reply inline;
    /// anything slow should move `responder` to its own threads and reply from there.
    fn handle(&self, request: Request, responder: Responder);

    /// Whether READY probes answer 1.
    fn ready(&self) -> bool {
        true
    }

    /// Called on the I/O thread when a CANCEL frame arrives for a request of this connection
    /// that has not been answered yet (its `Request::is_cancelled` is already true). A handler
    /// that queues requests drops it here; its reply, if any, is discarded.
    fn cancelled(&self, _conn_id: u64, _request_id: u64) {}
}

/// Live counts of a server, for metrics.
#[derive(Debug, Default)]
pub struct ServerStats {
    connections: AtomicU64,
    frames_receiving: AtomicU64,
    cancelled: AtomicU64,
    expired: AtomicU64,
}

impl ServerStats {
    /// Connections past their HELLO and not yet closed.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// Connections in the middle of receiving a frame.
    pub fn frames_receiving(&self) -> u64 {
        self.frames_receiving.load(Ordering::Relaxed)
    }

    /// CANCEL frames that found their request unanswered.
    pub fn cancelled(&self) -> u64 {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// Requests answered `deadline` without reaching the handler.
    pub fn expired(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
    }
}

/// A running server. `shutdown` starts draining; `join` waits for it.
pub struct Server {
    addr: Address,
    stats: Arc<ServerStats>,
    shutdown: watch::Sender<bool>,
    live: Tracker,
    data_io: IoThreads,
    control_io: IoThreads,
    drain_timeout: Duration,
}

struct Shared {
    handler: Arc<dyn Handler>,
    config: ServerConfig,
    next_conn: AtomicU64,
    shutdown: watch::Receiver<bool>,
    live: Tracker,
    data_io: IoThreads,
    stats: Arc<ServerStats>,
}

impl Server {
    /// Binds `addr` (port 0 picks a free port) and starts serving on new threads.
    pub fn bind(
        addr: &Address,
        handler: Arc<dyn Handler>,
        config: ServerConfig,
    ) -> io::Result<Server> {
        let listener = StdListener::bind(addr)?;
        let local = listener.local_addr()?;
        let data_io = IoThreads::new("cleave-io", config.io_threads)?;
        let control_io = IoThreads::new("cleave-ctl", 1)?;
        let (shutdown, shutdown_rx) = watch::channel(false);
        let live = Tracker::default();
        let drain_timeout = config.drain_timeout;
        let stats = Arc::new(ServerStats::default());
        let shared = Arc::new(Shared {
            handler,
            config,
            next_conn: AtomicU64::new(1),
            shutdown: shutdown_rx,
            live: live.clone(),
            data_io: data_io.clone(),
            stats: stats.clone(),
        });
        let token = live.enter();
        control_io.spawn(async move {
            match Listener::from_std(listener) {
                Ok(l) => accept_loop(l, shared, token).await,
                Err(e) => eprintln!("cleave-wire: cannot adopt listener: {e}"),
            }
        });
        Ok(Server {
            addr: local,
            stats,
            shutdown,
            live,
            data_io,
            control_io,
            drain_timeout,
        })
    }

    /// Live counts (connections, frames being received).
    pub fn stats(&self) -> Arc<ServerStats> {
        self.stats.clone()
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> &Address {
        &self.addr
    }

    /// Stops accepting and lets every connection finish the requests it has started (a frame
    /// partly received included), then close. Returns at once; `join` waits.
    pub fn shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    /// Shuts down if not yet, waits up to the drain timeout for connections to finish, then
    /// stops the threads. Returns whether everything drained in time.
    pub fn join(self) -> bool {
        self.shutdown();
        let drained = self.live.wait_zero(self.drain_timeout);
        self.data_io.stop();
        self.control_io.stop();
        drained
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
        self.data_io.stop();
        self.control_io.stop();
    }
}

/// Counts live connections (and the acceptor) so `join` can wait for them.
#[derive(Clone, Default)]
struct Tracker(Arc<(Mutex<usize>, Condvar)>);

struct Token(Tracker);

impl Tracker {
    fn enter(&self) -> Token {
        *self.0 .0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        Token(self.clone())
    }

    fn wait_zero(&self, timeout: Duration) -> bool {
        let (lock, cv) = &*self.0;
        let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = cv
            .wait_timeout_while(guard, timeout, |n| *n > 0)
            .unwrap_or_else(|e| e.into_inner());
        *guard == 0
    }
}

impl Drop for Token {
    fn drop(&mut self) {
        let (lock, cv) = &*self.0 .0;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        cv.notify_all();
    }
}

async fn wait_shutdown(rx: &mut watch::Receiver<bool>) {
    // A dropped sender also means stop.
    let _ = rx.wait_for(|stop| *stop).await;
}

async fn accept_loop(listener: Listener, shared: Arc<Shared>, _token: Token) {
    let mut shutdown = shared.shutdown.clone();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok(stream) => {
                    let token = shared.live.enter();
                    tokio::spawn(handshake(stream, shared.clone(), token));
                }
                // Out of descriptors or a connection reset before accept: retry shortly.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
            _ = wait_shutdown(&mut shutdown) => break,
        }
    }
}

/// Result of reading a connection's first frame.
enum Hello {
    Class(ConnClass),
    /// Answer with this error frame, then close.
    Refuse(ErrorCode, u64, String),
    /// The peer went away.
    Gone,
}

async fn read_hello(stream: &mut Stream, max_payload: u32) -> Hello {
    let h = match read_header(stream, max_payload).await {
        Ok(h) => h,
        Err(HeaderError::Io(_)) => return Hello::Gone,
        Err(HeaderError::Frame(e)) => {
            return Hello::Refuse(e.code(), e.request_id(), e.to_string())
        }
    };
    if h.kind != kind::HELLO || h.flags != 0 || h.payload_len > 64 {
        return Hello::Refuse(
            ErrorCode::Handshake,
            h.request_id,
            format!(
                "expected a HELLO request (kind 0x0000, flags 0, 4-byte payload) as the first \
                 frame of a connection, got kind {:#06x}, flags {:#04x}, {} payload bytes",
                h.kind, h.flags, h.payload_len
            ),
        );
    }
    match read_payload(stream, &h).await {
        Ok(f) => match decode_hello(&f.payload) {
            Ok(class) => Hello::Class(class),
            Err(msg) => Hello::Refuse(ErrorCode::Handshake, h.request_id, msg),
        },
        Err(_) => Hello::Gone,
    }
}

async fn handshake(mut stream: Stream, shared: Arc<Shared>, token: Token) {
    let cfg = &shared.config;
    let hello =
        match tokio::time::timeout(cfg.frame_timeout, read_hello(&mut stream, cfg.max_payload))
            .await
        {
            Ok(h) => h,
            Err(_) => Hello::Refuse(
                ErrorCode::Timeout,
                0,
                format!(
                    "no complete HELLO frame within {:.3} s of connecting",
                    cfg.frame_timeout.as_secs_f64()
                ),
            ),
        };
    let class = match hello {
        Hello::Class(c) => c,
        Hello::Refuse(code, id, msg) => {
            let f = Frame::error(kind::HELLO, id, code, &msg);
            let _ = stream.write_all(&f.to_bytes()).await;
            let _ = stream.shutdown().await;
            return;
        }
        Hello::Gone => return,
    };
    let reply = Frame::response(
        kind::HELLO,
        0,
        Bytes::copy_from_slice(&cfg.max_payload.to_le_bytes()),
    );
    if stream.write_all(&reply.to_bytes()).await.is_err() {
        return;
    }
    let conn_id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    match class {
        // Control connections stay on this (control) thread, away from bulk data.
        ConnClass::Control => serve_connection(stream, shared, conn_id, token).await,
        ConnClass::Data => {
            let Ok(std_stream) = stream.into_std() else {
                return;
            };
            let io = shared.data_io.clone();
            io.spawn(async move {
                if let Ok(stream) = Stream::from_std(std_stream) {
                    serve_connection(stream, shared, conn_id, token).await;
                }
            });
        }
    }
}

enum Event {
    Reply(Frame),
    Wrote(io::Result<usize>),
    Shutdown,
    Read(io::Result<usize>),
    Deadline,
}

/// Serves one connection until the peer closes it, a framing error or timeout, idleness, or
/// shutdown; always after writing every reply it owes. Writes progress alongside reads: while
/// the peer is slow to take replies, the loop still reads (unless back-pressure pauses it) and
/// still notices timeouts and shutdown.
async fn serve_connection(mut stream: Stream, shared: Arc<Shared>, conn_id: u64, _token: Token) {
    let cfg = &shared.config;
    let (tx, mut rx) = mpsc::unbounded_channel::<Frame>();
    let mut reader = FrameReader::new(cfg.max_payload);
    let mut writer = FrameWriter::new();
    let (mut rd, mut wr) = stream.split();
    let mut shutdown = shared.shutdown.clone();
    let mut owed = 0usize; // frames this side has still to write in full
    let mut reading = true;
    let mut draining = false;
    let mut frame_deadline: Option<Instant> = None;
    let mut last_activity = Instant::now();
    // Application requests not answered yet, with their cancel flags.
    let mut in_flight: HashMap<u64, Arc<AtomicBool>> = HashMap::new();
    let mut gauges = Gauges {
        stats: &shared.stats,
        receiving: false,
    };
    gauges.stats.connections.fetch_add(1, Ordering::Relaxed);

    loop {
        if !reading && owed == 0 {
            break;
        }
        let paused = owed >= cfg.max_in_flight; // back-pressure: not reading for now
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
        let event = tokio::select! {
            biased;
            Some(f) = rx.recv() => Event::Reply(f),
            w = writer.write_some(&mut wr), if writer.has_pending() => Event::Wrote(w),
            r = reader.fill(&mut rd), if reading && !paused => Event::Read(r),
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
                        writer.push(f);
                    }
                    next = rx.try_recv().ok();
                }
            }
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
                            } else {
                                owed += 1;
                                dispatch(frame, &shared, conn_id, &tx, &mut in_flight);
                            }
                        }
                        Ok(None) => break,
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
    }
    let _ = stream.shutdown().await;
}

/// Keeps a connection's share of the server's gauges, and returns it when dropped.
struct Gauges<'a> {
    stats: &'a ServerStats,
    receiving: bool,
}

impl Gauges<'_> {
    fn set_receiving(&mut self, now: bool) {
        if now != self.receiving {
            self.receiving = now;
            if now {
                self.stats.frames_receiving.fetch_add(1, Ordering::Relaxed);
            } else {
                self.stats.frames_receiving.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for Gauges<'_> {
    fn drop(&mut self) {
        self.set_receiving(false);
        self.stats.connections.fetch_sub(1, Ordering::Relaxed);
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
            let request = Request {
                conn_id,
                request_id: id,
                kind: k,
                payload: frame.payload,
                deadline_unix_us: deadline,
                trace_id: frame.trace_id,
                cancelled,
            };
            let responder = Responder {
                tx: tx.clone(),
                kind: k,
                request_id: id,
                deadline_unix_us: deadline,
                trace_id: frame.trace_id,
                done: false,
            };
            // A panicking handler must not take the connection (or thread) down; the dropped
            // responder answers `internal`.
            let handler = &shared.handler;
            let _ =
                std::panic::catch_unwind(AssertUnwindSafe(|| handler.handle(request, responder)));
        }
    }
}
