//! The server side: an acceptor and a control thread, data I/O threads that each own their
//! connections, and a [`Handler`] that answers application frames.

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, watch};

use crate::addr::{Address, Listener, StdListener, Stream};
use crate::auth::check_hello_with;
use crate::balance::{BalanceConfig, ThreadLoads};
use crate::conn::{read_header, read_payload, HeaderError};
use crate::credit::CreditTable;
use crate::frame::{hello_options, kind, ConnClass, ErrorCode, Frame, DEFAULT_MAX_PAYLOAD};
use crate::io::IoThreads;
use crate::queue::{QueuePolicy, RequestQueue};
use crate::serve_conn::{serve_connection, Waiting};
use crate::sockets::DataSockets;

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
    /// The order in which requests that arrived start (docs/serving.md, "Queue policies").
    pub queue: QueuePolicy,
    /// When data connections move between I/O threads (docs/serving.md, "I/O threads");
    /// `None`: they stay where they were accepted.
    pub balance: Option<BalanceConfig>,
    /// The region each shared-memory data connection sends its replies through.
    pub shm: crate::shm::ShmConfig,
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
            queue: QueuePolicy::default(),
            balance: Some(BalanceConfig::default()),
            shm: crate::shm::ShmConfig::default(),
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
    pub(crate) cancelled: Arc<AtomicBool>,
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
    /// The responder of a request that arrived with this header context.
    pub(crate) fn new(
        tx: mpsc::UnboundedSender<Frame>,
        kind: u16,
        request_id: u64,
        deadline_unix_us: u64,
        trace_id: u64,
    ) -> Responder {
        Responder {
            tx,
            kind,
            request_id,
            deadline_unix_us,
            trace_id,
            done: false,
        }
    }
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

    /// How long a request of `kind` is expected to take once started (µs), e.g. a moving
    /// average of past ones. A request with less time than this left before its deadline is
    /// answered `deadline` without reaching [`handle`](Self::handle). 0 (the default): only
    /// requests already late are dropped.
    fn expected_service_us(&self, _kind: u16) -> u64 {
        0
    }

    /// Called when a request of `kind` was dropped because only `left_us` were left, less
    /// than [`expected_service_us`](Self::expected_service_us). A handler whose estimate only
    /// served requests refresh should pull it below `left_us` here, or one slow spell would
    /// make it drop every later request.
    fn dropped_late(&self, _kind: u16, _left_us: u64) {}
}

/// Live counts of a server, for metrics.
#[derive(Debug, Default)]
pub struct ServerStats {
    pub(crate) connections: AtomicU64,
    pub(crate) frames_receiving: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) expired: AtomicU64,
    pub(crate) dropped_late: AtomicU64,
    pub(crate) queued: AtomicU64,
    pub(crate) responses_held: AtomicU64,
    pub(crate) credit_expired: AtomicU64,
    pub(crate) migrations: AtomicU64,
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

    /// Requests answered `deadline` without reaching the handler because, when their turn
    /// came, less time was left than the handler expects them to take.
    pub fn dropped_late(&self) -> u64 {
        self.dropped_late.load(Ordering::Relaxed)
    }

    /// Requests received and waiting in the queue to start.
    pub fn queued(&self) -> u64 {
        self.queued.load(Ordering::Relaxed)
    }

    /// Responses ready but held on credit-controlled connections until their caller grants
    /// credit for them.
    pub fn responses_held(&self) -> u64 {
        self.responses_held.load(Ordering::Relaxed)
    }

    /// Held responses whose deadline passed before credit came; each was answered `deadline`.
    pub fn credit_expired(&self) -> u64 {
        self.credit_expired.load(Ordering::Relaxed)
    }

    /// Data connections moved from a busy I/O thread to a less loaded one.
    pub fn migrations(&self) -> u64 {
        self.migrations.load(Ordering::Relaxed)
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
    sockets: Arc<DataSockets>,
}

/// What every connection of a server shares.
pub(crate) struct Shared {
    pub(crate) handler: Arc<dyn Handler>,
    pub(crate) config: ServerConfig,
    next_conn: AtomicU64,
    pub(crate) shutdown: watch::Receiver<bool>,
    live: Tracker,
    pub(crate) data_io: IoThreads,
    /// The work each data I/O thread's connections owe.
    pub(crate) loads: ThreadLoads,
    pub(crate) stats: Arc<ServerStats>,
    /// Requests of every connection waiting to start, in the configured policy's order: the
    /// first I/O thread free starts the next one, whichever connection it came on.
    pub(crate) queue: Mutex<Box<dyn RequestQueue<Waiting>>>,
    /// Wakes one idle connection task when a request is queued, so that an I/O thread with
    /// nothing to do starts work that a busy thread's connections received.
    pub(crate) queue_ready: tokio::sync::Notify,
    /// Response credit of the data connections that asked for credits.
    pub(crate) credits: Arc<CreditTable>,
    pub(crate) sockets: Arc<DataSockets>,
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
        let queue = Mutex::new(config.queue.queue());
        let loads = ThreadLoads::new(data_io.len());
        let sockets = Arc::new(DataSockets::default());
        let shared = Arc::new(Shared {
            handler,
            config,
            next_conn: AtomicU64::new(1),
            shutdown: shutdown_rx,
            live: live.clone(),
            data_io: data_io.clone(),
            loads,
            stats: stats.clone(),
            queue,
            queue_ready: tokio::sync::Notify::new(),
            credits: Arc::default(),
            sockets: sockets.clone(),
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
            sockets,
        })
    }

    /// Calls `f` with the id and socket of each live TCP data connection, e.g. to read its
    /// TCP_INFO. The list's lock is held meanwhile: keep `f` short.
    pub fn for_each_data_socket(&self, f: impl FnMut(u64, BorrowedFd<'_>)) {
        self.sockets.for_each(f);
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

pub(crate) struct Token(Tracker);

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

pub(crate) async fn wait_shutdown(rx: &mut watch::Receiver<bool>) {
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
    /// The class and option bits.
    Class(ConnClass, u8),
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
        Ok(f) => match check_hello_with(&f.payload) {
            Ok((class, options)) => Hello::Class(class, options),
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
    let (class, options) = match hello {
        Hello::Class(c, o) => (c, o),
        Hello::Refuse(code, id, msg) => {
            let f = Frame::error(kind::HELLO, id, code, &msg);
            let _ = stream.write_all(&f.to_bytes()).await;
            let _ = stream.shutdown().await;
            return;
        }
        Hello::Gone => return,
    };
    // Shared memory needs a Unix socket to pass the regions over.
    let wants_shm = options & hello_options::SHM != 0;
    if wants_shm && !matches!(stream, Stream::Unix(_)) {
        let msg = "HELLO option SHM needs a Unix socket (address shm:/path), got a TCP connection";
        let f = Frame::error(kind::HELLO, 0, ErrorCode::Handshake, msg);
        let _ = stream.write_all(&f.to_bytes()).await;
        let _ = stream.shutdown().await;
        return;
    }
    let conn_id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    // With credits, the reply also names the connection, for the client's CREDIT frames; it
    // is registered first, so that a CREDIT sent as soon as the reply arrives finds it.
    let mut reply = cfg.max_payload.to_le_bytes().to_vec();
    let credit = (options & hello_options::CREDITS != 0).then(|| {
        reply.extend_from_slice(&conn_id.to_le_bytes());
        shared.credits.register(conn_id)
    });
    let reply = Frame::response(kind::HELLO, 0, Bytes::from(reply));
    if stream.write_all(&reply.to_bytes()).await.is_err() {
        return;
    }
    // The client passes its region once the reply authenticated nothing more is needed (its
    // HELLO proved the secret), then this side answers with its own.
    let link = match (&stream, wants_shm) {
        (Stream::Unix(u), true) => {
            let exchange = crate::shm::exchange(u, cfg.shm, false);
            match tokio::time::timeout(cfg.frame_timeout, exchange).await {
                Ok(Ok(link)) => Some(link),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "shared-memory set-up failed; closing");
                    return;
                }
                Err(_) => {
                    tracing::warn!("no shared-memory region from the client in time; closing");
                    return;
                }
            }
        }
        _ => None,
    };
    match class {
        // Control connections stay on this (control) thread, away from bulk data, and their
        // replies go in the network's priority class.
        ConnClass::Control => {
            stream.mark_control();
            serve_connection(stream, shared, conn_id, class, credit, None, token, None).await
        }
        ConnClass::Data => {
            let Ok(std_stream) = stream.into_std() else {
                return;
            };
            let io = shared.data_io.clone();
            let thread = io.pick();
            io.spawn_on(thread, async move {
                if let Ok(stream) = Stream::from_std(std_stream) {
                    let t = Some(thread);
                    serve_connection(stream, shared, conn_id, class, credit, t, token, link).await;
                }
            });
        }
    }
}
