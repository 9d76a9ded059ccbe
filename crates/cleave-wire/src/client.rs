//! The client side: per peer, a few data connections and one control connection, each owned
//! by one I/O thread that writes requests and matches responses by request id.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};

use crate::addr::{Address, Stream};
use crate::auth::hello_payload_with;
use crate::conn::{read_header, read_payload, FrameReader, FrameWriter, HeaderError};
use crate::cpu::{add_since, counted, thread_cpu};
use crate::error::WireError;
use crate::frame::{
    flags, hello_options, kind, ConnClass, Credit, ErrorBody, Frame, DEFAULT_MAX_PAYLOAD,
};
use crate::io::IoThreads;
use crate::server::unix_now_us;
use crate::shm::{self, ShmConfig, ShmLink, ShmTx};

/// Connections and limits of a client.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Data connections to the peer; calls are spread over them round-robin.
    pub connections: usize,
    /// Longest wait for connect plus HELLO.
    pub connect_timeout: Duration,
    /// Largest response payload accepted.
    pub max_payload: u32,
    /// A connection with nothing in flight for this long closes itself. Shorter than the
    /// server's idle timeout, so that the client, not the server, ends idle connections: calls
    /// queued on a connection the client closes are retried on a new one, whereas a request
    /// racing a server-side close would fail.
    pub idle_close: Duration,
    /// Response credits (docs/protocol.md, "Response credits"): the initial window in bytes
    /// each data connection grants the server, returned on the control connection as
    /// responses arrive. `None`: no credits, the server sends as it pleases.
    pub response_credits: Option<u64>,
    /// The region this client's data connections to an `shm:` address send through.
    pub shm: ShmConfig,
    /// Where the client adds the CPU time its send path takes, in ns: writing a payload where
    /// its connection wants it (`call_written`) and the socket writes of every frame. `None`:
    /// not measured (two clock readings a write).
    pub send_cpu: Option<Arc<AtomicU64>>,
}

impl Default for ClientConfig {
    fn default() -> ClientConfig {
        ClientConfig {
            connections: 2,
            connect_timeout: Duration::from_secs(1),
            max_payload: DEFAULT_MAX_PAYLOAD,
            idle_close: Duration::from_secs(60),
            response_credits: None,
            shm: ShmConfig::default(),
            send_cpu: None,
        }
    }
}

/// A client of one peer. Cheap to clone; connections open on first use and reopen after a
/// failure. Calls may be made from any tokio runtime.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    addr: Address,
    config: ClientConfig,
    io: IoThreads,
    data: Vec<Mutex<Option<ConnHandle>>>,
    control: Mutex<Option<ConnHandle>>,
    next: AtomicUsize,
    counters: Arc<Counters>,
    /// Grants for the server, sent as CREDIT frames on the control connection.
    grants: Option<mpsc::UnboundedSender<Credit>>,
}

/// What a client has seen that its callers have not: counts since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Responses and request-level error frames for a request id nobody waits for (its
    /// caller timed out or went away); logged and dropped.
    pub orphan_responses: u64,
    /// CANCEL frames sent for requests whose callers gave up after they were sent.
    pub cancels_sent: u64,
}

#[derive(Debug, Default)]
struct Counters {
    orphan_responses: AtomicU64,
    cancels_sent: AtomicU64,
}

#[derive(Clone)]
struct ConnHandle {
    msgs: mpsc::UnboundedSender<Msg>,
    /// Request ids of this connection, allocated by callers so they can cancel by id.
    next_id: Arc<AtomicU64>,
    peer_max: u32,
    /// The connection's own region, where a payload written by its caller goes
    /// (`Client::call_written`).
    shm: Option<Arc<ShmTx>>,
}

/// A request payload its caller writes itself, wherever the connection wants it: straight
/// into a shared-memory slot on `shm:` (written once, docs/protocol.md "Shared-memory
/// transport"), else into a buffer sent on the socket. Written again for a retry.
pub trait Payload: Sync {
    /// Bytes the payload takes.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Writes every one of its `len()` bytes into `out` (`out` may hold old bytes).
    fn write_to(&self, out: &mut [u8]);
    /// The payload in a buffer of its own: what travels on a socket.
    fn to_bytes(&self) -> Bytes {
        let mut out = vec![0u8; self.len()];
        self.write_to(&mut out);
        Bytes::from(out)
    }
}

/// A call's payload: bytes already made, or written by the call.
#[derive(Clone, Copy)]
enum Body<'a> {
    Bytes(&'a Bytes),
    Written(&'a dyn Payload),
}

impl Body<'_> {
    fn len(&self) -> usize {
        match self {
            Body::Bytes(b) => b.len(),
            Body::Written(p) => p.len(),
        }
    }

    /// The payload for one attempt on `conn`, and whether it is a slot reference: a written
    /// payload goes straight into a free slot of the connection's region when it would
    /// travel by slot anyway; else (and with the ring full) into a buffer.
    fn for_conn(&self, conn: &ConnHandle) -> (Bytes, bool) {
        let p = match self {
            Body::Bytes(b) => return ((*b).clone(), false),
            Body::Written(p) => *p,
        };
        let len = p.len();
        let slot = (conn.shm.as_ref())
            .filter(|tx| tx.carries(len))
            .and_then(|tx| tx.write_with(len, |out| p.write_to(out)));
        match slot {
            Some(r) => (r.encode(), true),
            None => (p.to_bytes(), false),
        }
    }
}

enum Msg {
    Call(Call),
    /// The caller of this request gave up: forget it and tell the peer.
    Cancel(u64),
}

struct Call {
    id: u64,
    kind: u16,
    payload: Bytes,
    /// `payload` is a reference to a slot the caller wrote (flag SHM).
    in_slot: bool,
    deadline_unix_us: u64,
    trace_id: u64,
    reply: oneshot::Sender<Outcome>,
}

/// Sends `Msg::Cancel` for its request when dropped armed: the caller timed out, or its
/// future was dropped, before the outcome arrived.
struct CancelOnDrop<'a> {
    msgs: &'a mpsc::UnboundedSender<Msg>,
    id: u64,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.msgs.send(Msg::Cancel(self.id));
        }
    }
}

enum Outcome {
    Done(Result<Bytes, WireError>),
    /// The connection ended before the request was written; safe to retry elsewhere.
    NotSent,
}

impl Client {
    /// A client of `addr` whose connections live on `io`. Connects lazily.
    pub fn new(addr: Address, io: IoThreads, config: ClientConfig) -> Client {
        let n = config.connections.max(1);
        let (grants, grants_rx) = match config.response_credits {
            Some(_) => {
                let (tx, rx) = mpsc::unbounded_channel();
                (Some(tx), Some(rx))
            }
            None => (None, None),
        };
        let inner = Arc::new(Inner {
            addr,
            config,
            io,
            data: (0..n).map(|_| Mutex::new(None)).collect(),
            control: Mutex::new(None),
            next: AtomicUsize::new(0),
            counters: Arc::default(),
            grants,
        });
        if let Some(rx) = grants_rx {
            inner.io.spawn(grant_loop(Arc::downgrade(&inner), rx));
        }
        Client { inner }
    }

    pub fn addr(&self) -> &Address {
        &self.inner.addr
    }

    /// Counts of orphan responses and cancels so far.
    pub fn stats(&self) -> ClientStats {
        let c = &self.inner.counters;
        ClientStats {
            orphan_responses: c.orphan_responses.load(Ordering::Relaxed),
            cancels_sent: c.cancels_sent.load(Ordering::Relaxed),
        }
    }

    /// Sends one request and waits for its response payload; `call_traced` with trace id 0.
    pub async fn call(
        &self,
        kind: u16,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, WireError> {
        self.call_traced(kind, payload, timeout, 0).await
    }

    /// Sends one request, whose deadline on the wire is now + `timeout` (Unix µs), and waits
    /// for its response payload. Control kinds go over the control connection. An error frame
    /// from the peer becomes `WireError::Remote`. A request that times out (or whose future is
    /// dropped) after it was queued for sending is cancelled on the wire (CANCEL).
    pub async fn call_traced(
        &self,
        kind: u16,
        payload: Bytes,
        timeout: Duration,
        trace_id: u64,
    ) -> Result<Bytes, WireError> {
        self.call_body(kind, Body::Bytes(&payload), timeout, trace_id)
            .await
    }

    /// `call_traced` with a payload the call writes itself (`Payload`): on `shm:` straight
    /// into a shared-memory slot, so a payload assembled there is written once, not built in
    /// a buffer and then copied into the slot. Written again if the call is retried on a new
    /// connection.
    pub async fn call_written(
        &self,
        kind: u16,
        payload: &dyn Payload,
        timeout: Duration,
        trace_id: u64,
    ) -> Result<Bytes, WireError> {
        self.call_body(kind, Body::Written(payload), timeout, trace_id)
            .await
    }

    async fn call_body(
        &self,
        kind: u16,
        body: Body<'_>,
        timeout: Duration,
        trace_id: u64,
    ) -> Result<Bytes, WireError> {
        let deadline_unix_us = unix_now_us().saturating_add(timeout.as_micros() as u64);
        let call = self.call_inner(kind, body, deadline_unix_us, trace_id);
        match tokio::time::timeout(timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(WireError::Timeout {
                addr: self.inner.addr.clone(),
                after: timeout,
            }),
        }
    }

    /// Liveness over the control connection.
    pub async fn ping(&self, timeout: Duration) -> Result<(), WireError> {
        self.call(kind::PING, Bytes::new(), timeout)
            .await
            .map(|_| ())
    }

    /// Readiness over the control connection.
    pub async fn ready(&self, timeout: Duration) -> Result<bool, WireError> {
        let p = self.call(kind::READY, Bytes::new(), timeout).await?;
        Ok(p.first() == Some(&1))
    }

    /// Opens every data connection now rather than on first use.
    pub async fn connect_all(&self, timeout: Duration) -> Result<(), WireError> {
        let all = async {
            for slot in &self.inner.data {
                self.conn(slot, ConnClass::Data).await?;
            }
            Ok(())
        };
        match tokio::time::timeout(timeout, all).await {
            Ok(r) => r,
            Err(_) => Err(WireError::Timeout {
                addr: self.inner.addr.clone(),
                after: timeout,
            }),
        }
    }

    async fn call_inner(
        &self,
        kind: u16,
        body: Body<'_>,
        deadline_unix_us: u64,
        trace_id: u64,
    ) -> Result<Bytes, WireError> {
        let inner = &*self.inner;
        let (slot, class) = if kind::is_control(kind) {
            (&inner.control, ConnClass::Control)
        } else {
            let i = inner.next.fetch_add(1, Ordering::Relaxed) % inner.data.len();
            (&inner.data[i], ConnClass::Data)
        };
        // A connection that ended (idle close, peer restart) is replaced once.
        for _ in 0..2 {
            let conn = self.conn(slot, class).await?;
            if body.len() > conn.peer_max as usize {
                return Err(WireError::TooLarge {
                    addr: inner.addr.clone(),
                    len: body.len(),
                    max: conn.peer_max,
                });
            }
            // A full ring does not hold the call back: the frame goes inline (conn.rs). The
            // peer holds slots while it keeps payloads in place (a Python ranker's queued
            // requests: cleave-py's FrameServer), so a full ring means a backlogged peer,
            // which the server's own back-pressure and queue limits already bound.
            let (tx, rx) = oneshot::channel();
            let id = conn.next_id.fetch_add(1, Ordering::Relaxed);
            // A slot written for a connection that then ends is never read: its region goes
            // with the connection, and the next attempt writes the payload again.
            let counting = inner
                .config
                .send_cpu
                .as_ref()
                .map(|total| (total, thread_cpu()));
            let (payload, in_slot) = body.for_conn(&conn);
            if let Some((total, start)) = counting {
                add_since(total, start);
            }
            let call = Call {
                id,
                kind,
                payload,
                in_slot,
                deadline_unix_us,
                trace_id,
                reply: tx,
            };
            if conn.msgs.send(Msg::Call(call)).is_err() {
                continue;
            }
            let mut guard = CancelOnDrop {
                msgs: &conn.msgs,
                id,
                armed: true,
            };
            let outcome = rx.await;
            guard.armed = false;
            match outcome {
                Ok(Outcome::Done(r)) => return r,
                Ok(Outcome::NotSent) | Err(_) => continue,
            }
        }
        Err(WireError::Closed {
            addr: inner.addr.clone(),
            reason: "the connection closed twice before the request could be sent".to_owned(),
        })
    }

    async fn conn(
        &self,
        slot: &Mutex<Option<ConnHandle>>,
        class: ConnClass,
    ) -> Result<ConnHandle, WireError> {
        {
            let guard = slot.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(h) = guard.as_ref().filter(|h| !h.msgs.is_closed()) {
                return Ok(h.clone());
            }
        }
        let inner = &*self.inner;
        let (tx, rx) = oneshot::channel();
        // Only data connections take credits; CREDIT itself travels on the control one.
        let grants = inner.grants.clone().filter(|_| class == ConnClass::Data);
        inner.io.spawn(run_connection(
            inner.addr.clone(),
            class,
            inner.config.clone(),
            inner.counters.clone(),
            grants,
            tx,
        ));
        let handle = rx.await.map_err(|_| WireError::Closed {
            addr: inner.addr.clone(),
            reason: "the client's I/O threads have stopped".to_owned(),
        })??;
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle.clone());
        Ok(handle)
    }
}

/// Sends the grants of every data connection of a client as CREDIT calls on its control
/// connection, summing those that queued while the last ones went out. Ends with the client.
async fn grant_loop(client: Weak<Inner>, mut rx: mpsc::UnboundedReceiver<Credit>) {
    while let Some(first) = rx.recv().await {
        let mut sums: HashMap<u64, u64> = HashMap::new();
        let mut next = Some(first);
        while let Some(c) = next {
            let sum = sums.entry(c.conn_id).or_default();
            *sum = sum.saturating_add(c.grant);
            next = rx.try_recv().ok();
        }
        let Some(inner) = client.upgrade() else {
            break;
        };
        let timeout = inner.config.connect_timeout;
        for (conn_id, grant) in sums {
            let client = Client {
                inner: inner.clone(),
            };
            // Concurrently: one slow grant must not delay the next connection's.
            tokio::spawn(async move {
                let payload = Credit { conn_id, grant }.encode();
                if let Err(e) = client.call(kind::CREDIT, payload, timeout).await {
                    tracing::warn!(
                        peer = %client.addr(), conn_id, grant, error = %e,
                        "response credit not granted; the connection's window shrinks by it"
                    );
                }
            });
        }
    }
}

/// Connects and exchanges HELLO; returns the stream, the peer's frame limit, and with
/// `credits` the connection's id at the peer.
async fn open(
    addr: &Address,
    class: ConnClass,
    credits: bool,
    shm_config: ShmConfig,
) -> Result<(Stream, u32, Option<u64>, Option<ShmLink>), WireError> {
    let mut s = Stream::connect(addr)
        .await
        .map_err(|source| WireError::Connect {
            addr: addr.clone(),
            source,
        })?;
    if class == ConnClass::Control {
        s.mark_control();
    }
    let handshake = |reason: String| WireError::Handshake {
        addr: addr.clone(),
        reason,
    };
    // Control connections carry small frames only: shared memory is for data connections.
    let use_shm = matches!(addr, Address::Shm(_)) && class == ConnClass::Data;
    let mut options = if credits { hello_options::CREDITS } else { 0 };
    if use_shm {
        options |= hello_options::SHM;
    }
    let hello = Frame::request(kind::HELLO, 0, hello_payload_with(class, options));
    s.write_all(&hello.to_bytes())
        .await
        .map_err(|e| handshake(e.to_string()))?;
    let h = read_header(&mut s, 1 << 16).await.map_err(|e| match e {
        HeaderError::Io(e) => handshake(format!("no HELLO response: {e}")),
        HeaderError::Frame(e) => handshake(format!("bad HELLO response: {e}")),
    })?;
    let f = read_payload(&mut s, &h)
        .await
        .map_err(|e| handshake(e.to_string()))?;
    if f.is_error() {
        let body = ErrorBody::decode(&f.payload);
        return Err(handshake(format!(
            "peer refused: error {}: {}",
            body.code, body.message
        )));
    }
    let want = if credits { 12 } else { 4 };
    if !f.is_response() || f.kind != kind::HELLO || f.payload.len() != want {
        return Err(handshake(format!(
            "expected a HELLO response with a {want}-byte payload, got kind {:#06x}, flags \
             {:#04x}, {} bytes",
            f.kind,
            f.flags,
            f.payload.len()
        )));
    }
    let peer_max = u32::from_le_bytes(f.payload[..4].try_into().expect("length checked"));
    let conn_id = credits.then(|| u64::from_le_bytes(f.payload[4..].try_into().expect("12")));
    let link = match (&s, use_shm) {
        (Stream::Unix(u), true) => Some(
            shm::exchange(u, shm_config, true)
                .await
                .map_err(|e| handshake(format!("shared memory: {e}")))?,
        ),
        _ => None,
    };
    Ok((s, peer_max, conn_id, link))
}

enum Event {
    Msg(Option<Msg>),
    Read(io::Result<usize>),
    Wrote(io::Result<usize>),
    Idle,
}

/// Owns one connection on an I/O thread: writes calls, matches responses to them by id.
/// Reading never waits for writing: a peer that stops reading requests until its responses are
/// taken (back-pressure) would otherwise deadlock with a client blocked on a full send buffer.
async fn run_connection(
    addr: Address,
    class: ConnClass,
    config: ClientConfig,
    counters: Arc<Counters>,
    grants: Option<mpsc::UnboundedSender<Credit>>,
    ready: oneshot::Sender<Result<ConnHandle, WireError>>,
) {
    let opening = open(&addr, class, grants.is_some(), config.shm);
    let (mut stream, peer_max, conn_id, link) =
        match tokio::time::timeout(config.connect_timeout, opening).await {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => {
                let _ = ready.send(Err(e));
                return;
            }
            Err(_) => {
                let source = io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "no connection and HELLO within {:.3} s",
                        config.connect_timeout.as_secs_f64()
                    ),
                );
                let _ = ready.send(Err(WireError::Connect { addr, source }));
                return;
            }
        };
    let (tx, mut msgs) = mpsc::unbounded_channel::<Msg>();
    let handle = ConnHandle {
        msgs: tx,
        next_id: Arc::new(AtomicU64::new(1)),
        peer_max,
        shm: link.as_ref().map(|l| l.tx.clone()),
    };
    if ready.send(Ok(handle)).is_err() {
        return;
    }
    // The initial window, then the bytes of each response as it is taken off the socket.
    let grant = |bytes: u64| {
        if let (Some(g), Some(conn_id), true) = (&grants, conn_id, bytes > 0) {
            let _ = g.send(Credit {
                conn_id,
                grant: bytes,
            });
        }
    };
    grant(config.response_credits.unwrap_or(0));
    // Calls written (or queued to be), by id, with their kinds for a CANCEL.
    let mut pending: HashMap<u64, (u16, oneshot::Sender<Outcome>)> = HashMap::new();
    let mut reader = FrameReader::new(config.max_payload);
    let mut writer = FrameWriter::new();
    if let Some(l) = link {
        reader.set_shm(l.rx);
        writer.set_shm(l.tx);
    }
    let (mut rd, mut wr) = stream.split();
    let mut accepting = true;
    let mut last_activity = tokio::time::Instant::now();
    let mut consumed = 0u64;

    let failure: Option<String> = 'conn: loop {
        // Nothing left to wait for (requests of callers that gave up need not go out).
        let quiet = pending.is_empty();
        if !accepting && quiet {
            break None;
        }
        let event = tokio::select! {
            m = msgs.recv(), if accepting => Event::Msg(m),
            r = reader.fill(&mut rd) => Event::Read(r),
            w = counted(writer.write_some(&mut wr), config.send_cpu.as_deref()),
                if writer.has_pending() => Event::Wrote(w),
            _ = tokio::time::sleep_until(last_activity + config.idle_close),
                if quiet => Event::Idle,
        };
        if matches!(event, Event::Msg(Some(_)) | Event::Read(Ok(1..))) {
            last_activity = tokio::time::Instant::now();
        }
        match event {
            Event::Msg(None) => accepting = false,
            Event::Msg(Some(first)) => {
                let mut next = Some(first);
                while let Some(m) = next {
                    match m {
                        Msg::Call(c) => {
                            let mut f = Frame::request(c.kind, c.id, c.payload)
                                .with_context(c.deadline_unix_us, c.trace_id);
                            if c.in_slot {
                                f.flags |= flags::SHM;
                            }
                            writer.push(f);
                            pending.insert(c.id, (c.kind, c.reply));
                        }
                        // Still pending: the request is (or will be) on the wire before this.
                        Msg::Cancel(id) => {
                            if let Some((k, _)) = pending.remove(&id) {
                                writer.push(Frame::cancel(k, id));
                                counters.cancels_sent.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    next = msgs.try_recv().ok();
                }
            }
            Event::Wrote(Err(e)) => break Some(format!("write failed: {e}")),
            Event::Wrote(Ok(_)) => {}
            Event::Read(Ok(0)) => break Some("the peer closed the connection".to_owned()),
            Event::Read(Err(e)) => break Some(format!("read failed: {e}")),
            Event::Read(Ok(_)) => loop {
                match reader.next() {
                    Ok(Some(f)) if f.is_response() => {
                        // Returned in one CREDIT per read; orphans used credit too.
                        consumed += crate::credit::cost(&f).unwrap_or(0);
                        if let Some(reason) = deliver(f, &mut pending, &addr, &counters) {
                            break 'conn Some(reason);
                        }
                    }
                    Ok(Some(f)) => {
                        break 'conn Some(format!(
                            "protocol error: expected responses, got a request frame of kind \
                             {:#06x}",
                            f.kind
                        ))
                    }
                    Ok(None) => {
                        grant(std::mem::take(&mut consumed));
                        break;
                    }
                    Err(e) => break 'conn Some(format!("protocol error: {e}")),
                }
            },
            Event::Idle => break None,
        }
    };
    // Calls not yet (wholly) written may go elsewhere; those written failed with the connection.
    msgs.close();
    while let Ok(m) = msgs.try_recv() {
        if let Msg::Call(c) = m {
            let _ = c.reply.send(Outcome::NotSent);
        }
    }
    for id in writer.unwritten() {
        if let Some((_, reply)) = pending.remove(&id) {
            let _ = reply.send(Outcome::NotSent);
        }
    }
    if let Some(reason) = failure {
        for (_, (_, reply)) in pending.drain() {
            let err = WireError::Closed {
                addr: addr.clone(),
                reason: reason.clone(),
            };
            let _ = reply.send(Outcome::Done(Err(err)));
        }
    }
    let _ = stream.shutdown().await;
}

/// Hands a response (or error frame) to its caller. One for a request nobody waits for any
/// more is logged and counted, never fatal: its caller timed out, and the peer answered
/// anyway. Returns why the connection must close: a connection-level error frame that
/// concerns no call (the peer closes after sending it).
fn deliver(
    f: Frame,
    pending: &mut HashMap<u64, (u16, oneshot::Sender<Outcome>)>,
    addr: &Address,
    counters: &Counters,
) -> Option<String> {
    let body = f.is_error().then(|| ErrorBody::decode(&f.payload));
    let len = f.payload.len();
    let caller = pending.remove(&f.request_id);
    let result = match body.clone() {
        Some(ErrorBody { code, message }) => Err(WireError::Remote {
            addr: addr.clone(),
            code,
            message,
        }),
        None => Ok(f.payload),
    };
    let unsent = match caller {
        Some((_, reply)) => match reply.send(Outcome::Done(result)) {
            Ok(()) => return None,
            Err(_) => "its caller went away",
        },
        None => match &body {
            Some(b) if b.code.closes_connection() => {
                return Some(format!(
                    "the peer closed the connection with error {}: {}",
                    b.code, b.message
                ))
            }
            _ => "no call waits for that id (timed out, or never made)",
        },
    };
    counters.orphan_responses.fetch_add(1, Ordering::Relaxed);
    match body {
        Some(b) => tracing::warn!(
            peer = %addr, request_id = f.request_id, code = %b.code, message = %b.message,
            "error frame dropped: {unsent}"
        ),
        None => tracing::warn!(
            peer = %addr, request_id = f.request_id, bytes = len,
            "response dropped: {unsent}"
        ),
    }
    None
}
