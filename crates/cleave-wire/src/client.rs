//! The client side: per peer, a few data connections and one control connection, each owned
//! by one I/O thread that writes requests and matches responses by request id.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};

use crate::addr::{Address, Stream};
use crate::conn::{read_header, read_payload, FrameReader, FrameWriter, HeaderError};
use crate::error::WireError;
use crate::frame::{encode_hello, kind, ConnClass, ErrorBody, Frame, DEFAULT_MAX_PAYLOAD};
use crate::io::IoThreads;

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
}

impl Default for ClientConfig {
    fn default() -> ClientConfig {
        ClientConfig {
            connections: 2,
            connect_timeout: Duration::from_secs(1),
            max_payload: DEFAULT_MAX_PAYLOAD,
            idle_close: Duration::from_secs(60),
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
}

#[derive(Clone)]
struct ConnHandle {
    calls: mpsc::UnboundedSender<Call>,
    peer_max: u32,
}

struct Call {
    kind: u16,
    payload: Bytes,
    reply: oneshot::Sender<Outcome>,
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
        let inner = Inner {
            addr,
            config,
            io,
            data: (0..n).map(|_| Mutex::new(None)).collect(),
            control: Mutex::new(None),
            next: AtomicUsize::new(0),
        };
        Client {
            inner: Arc::new(inner),
        }
    }

    pub fn addr(&self) -> &Address {
        &self.inner.addr
    }

    /// Sends one request and waits for its response payload. Control kinds go over the
    /// control connection. An error frame from the peer becomes `WireError::Remote`.
    pub async fn call(
        &self,
        kind: u16,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, WireError> {
        match tokio::time::timeout(timeout, self.call_inner(kind, payload)).await {
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

    async fn call_inner(&self, kind: u16, payload: Bytes) -> Result<Bytes, WireError> {
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
            if payload.len() > conn.peer_max as usize {
                return Err(WireError::TooLarge {
                    addr: inner.addr.clone(),
                    len: payload.len(),
                    max: conn.peer_max,
                });
            }
            let (tx, rx) = oneshot::channel();
            if conn
                .calls
                .send(Call {
                    kind,
                    payload: payload.clone(),
                    reply: tx,
                })
                .is_err()
            {
                continue;
            }
            match rx.await {
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
            if let Some(h) = guard.as_ref().filter(|h| !h.calls.is_closed()) {
                return Ok(h.clone());
            }
        }
        let inner = &*self.inner;
        let (tx, rx) = oneshot::channel();
        inner.io.spawn(run_connection(
            inner.addr.clone(),
            class,
            inner.config.clone(),
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

/// Connects and exchanges HELLO; returns the stream and the peer's frame limit.
async fn open(addr: &Address, class: ConnClass) -> Result<(Stream, u32), WireError> {
    let mut s = Stream::connect(addr)
        .await
        .map_err(|source| WireError::Connect {
            addr: addr.clone(),
            source,
        })?;
    let handshake = |reason: String| WireError::Handshake {
        addr: addr.clone(),
        reason,
    };
    let hello = Frame::request(kind::HELLO, 0, encode_hello(class));
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
    if !f.is_response() || f.kind != kind::HELLO || f.payload.len() != 4 {
        return Err(handshake(format!(
            "expected a HELLO response with a 4-byte payload, got kind {:#06x}, flags {:#04x}, \
             {} bytes",
            f.kind,
            f.flags,
            f.payload.len()
        )));
    }
    let peer_max = u32::from_le_bytes(f.payload[..4].try_into().expect("length checked"));
    Ok((s, peer_max))
}

enum Event {
    Call(Option<Call>),
    Read(io::Result<usize>),
    Wrote(io::Result<usize>),
    Sweep,
    Idle,
}

/// Owns one connection on an I/O thread: writes calls, matches responses to them by id.
/// Reading never waits for writing: a peer that stops reading requests until its responses are
/// taken (back-pressure) would otherwise deadlock with a client blocked on a full send buffer.
async fn run_connection(
    addr: Address,
    class: ConnClass,
    config: ClientConfig,
    ready: oneshot::Sender<Result<ConnHandle, WireError>>,
) {
    let (mut stream, peer_max) =
        match tokio::time::timeout(config.connect_timeout, open(&addr, class)).await {
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
    let (tx, mut calls) = mpsc::unbounded_channel::<Call>();
    if ready
        .send(Ok(ConnHandle {
            calls: tx,
            peer_max,
        }))
        .is_err()
    {
        return;
    }
    let mut pending: HashMap<u64, oneshot::Sender<Outcome>> = HashMap::new();
    let mut next_id: u64 = 1;
    let mut reader = FrameReader::new(config.max_payload);
    let mut writer = FrameWriter::new();
    let (mut rd, mut wr) = stream.split();
    let mut accepting = true;
    // Callers that timed out leave entries behind; sweep them now and then.
    let mut sweep = tokio::time::interval(Duration::from_secs(1));
    let mut last_activity = tokio::time::Instant::now();

    let failure: Option<String> = 'conn: loop {
        // Nothing left to wait for (requests of callers that gave up need not go out).
        let quiet = pending.is_empty();
        if !accepting && quiet {
            break None;
        }
        let event = tokio::select! {
            c = calls.recv(), if accepting => Event::Call(c),
            r = reader.fill(&mut rd) => Event::Read(r),
            w = writer.write_some(&mut wr), if writer.has_pending() => Event::Wrote(w),
            _ = sweep.tick() => Event::Sweep,
            _ = tokio::time::sleep_until(last_activity + config.idle_close),
                if quiet => Event::Idle,
        };
        if matches!(event, Event::Call(Some(_)) | Event::Read(Ok(1..))) {
            last_activity = tokio::time::Instant::now();
        }
        match event {
            Event::Call(None) => accepting = false,
            Event::Call(Some(first)) => {
                let mut next = Some(first);
                while let Some(c) = next {
                    let id = next_id;
                    next_id += 1;
                    writer.push(Frame::request(c.kind, id, c.payload));
                    pending.insert(id, c.reply);
                    next = calls.try_recv().ok();
                }
            }
            Event::Wrote(Err(e)) => break Some(format!("write failed: {e}")),
            Event::Wrote(Ok(_)) => {}
            Event::Read(Ok(0)) => break Some("the peer closed the connection".to_owned()),
            Event::Read(Err(e)) => break Some(format!("read failed: {e}")),
            Event::Read(Ok(_)) => loop {
                match reader.next() {
                    Ok(Some(f)) if f.is_response() => {
                        let result = if f.is_error() {
                            let body = ErrorBody::decode(&f.payload);
                            Err(WireError::Remote {
                                addr: addr.clone(),
                                code: body.code,
                                message: body.message,
                            })
                        } else {
                            Ok(f.payload)
                        };
                        match (pending.remove(&f.request_id), result) {
                            (Some(reply), result) => {
                                let _ = reply.send(Outcome::Done(result));
                            }
                            // An error about no call of ours concerns the connection itself.
                            (None, Err(WireError::Remote { code, message, .. })) => {
                                break 'conn Some(format!(
                                    "the peer closed the connection with error {code}: {message}"
                                ));
                            }
                            (None, _) => {} // the caller gave up waiting
                        }
                    }
                    Ok(Some(f)) => {
                        break 'conn Some(format!(
                            "protocol error: expected responses, got a request frame of kind \
                             {:#06x}",
                            f.kind
                        ))
                    }
                    Ok(None) => break,
                    Err(e) => break 'conn Some(format!("protocol error: {e}")),
                }
            },
            Event::Sweep => pending.retain(|_, reply| !reply.is_closed()),
            Event::Idle => break None,
        }
    };
    // Calls not yet (wholly) written may go elsewhere; those written failed with the connection.
    calls.close();
    while let Ok(c) = calls.try_recv() {
        let _ = c.reply.send(Outcome::NotSent);
    }
    for id in writer.unwritten() {
        if let Some(reply) = pending.remove(&id) {
            let _ = reply.send(Outcome::NotSent);
        }
    }
    if let Some(reason) = failure {
        for (_, reply) in pending.drain() {
            let err = WireError::Closed {
                addr: addr.clone(),
                reason: reason.clone(),
            };
            let _ = reply.send(Outcome::Done(Err(err)));
        }
    }
    let _ = stream.shutdown().await;
}
