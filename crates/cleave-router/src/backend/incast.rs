//! Incast control on the router → ranker path (docs/traffic.md, "Wiring it into the router →
//! ranker path"): before a fused payload of at least `threshold` bytes goes to a ranker, the
//! router asks the ranker's control port (request-to-send {trace id, bytes, budget left}) and
//! waits for the grant within the request's budget. One control connection per ranker, kept
//! by a task that reconnects; grants and expiries reach the waiting request through a map of
//! one-shot channels. A grant that does not come in time ends the request with 504 in stage
//! `ranker incast queue`. Without a control connection (down, lost) payloads go uncontrolled,
//! logged once per outage: incast control shapes bursts, it must not take serving down.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use cleave_flow::control::{read_message, ControlMessage};
use cleave_wire::priority::CONTROL_DSCP;
use thiserror::Error;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use crate::error::{ErrorKind, RequestError, Stage};

/// Payloads smaller than this skip the exchange by default: 64 KiB is 0.5 ms at 1 Gbit/s,
/// less than a control round trip is worth (Prism controls only large transfers).
pub const DEFAULT_THRESHOLD: u64 = 64 << 10;
/// Between attempts to (re)connect a control connection.
const RECONNECT: Duration = Duration::from_millis(500);

#[derive(Debug, Error, PartialEq)]
pub enum IncastError {
    #[error("no grant from ranker {ranker}'s incast queue within the {left_ms:.1} ms left")]
    NoGrant { ranker: String, left_ms: f64 },
    #[error(
        "ranker {ranker}'s incast queue dropped the request: it could no longer start in time"
    )]
    Expired { ranker: String },
}

impl From<IncastError> for RequestError {
    fn from(e: IncastError) -> RequestError {
        RequestError {
            kind: ErrorKind::Deadline,
            message: e.to_string(),
            stage: Some(Stage::IncastQueue),
        }
    }
}

enum Answer {
    Grant,
    Expired,
    /// The control connection went while the request waited.
    Lost,
}

#[derive(Default)]
struct Shared {
    waiting: Mutex<HashMap<u64, oneshot::Sender<Answer>>>,
    writer: tokio::sync::Mutex<Option<OwnedWriteHalf>>,
    connected: AtomicBool,
    /// Whether this outage was logged already.
    warned: AtomicBool,
}

impl Shared {
    fn take(&self, id: u64) -> Option<oneshot::Sender<Answer>> {
        self.waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id)
    }

    async fn send(&self, m: &ControlMessage) -> bool {
        let mut guard = self.writer.lock().await;
        let Some(w) = guard.as_mut() else {
            return false;
        };
        if w.write_all(&m.encode()).await.is_err() {
            *guard = None;
            self.connected.store(false, Ordering::Relaxed);
            return false;
        }
        true
    }
}

/// A request's entry in `waiting` while it waits for its answer. Dropped before it is
/// settled (the request's future dropped: its client went, a gRPC deadline), it takes the
/// entry out and gives back a grant that had come, so neither the map nor the ranker's window
/// keeps what nobody waits for.
struct Claim {
    shared: Arc<Shared>,
    id: u64,
    rx: oneshot::Receiver<Answer>,
    settled: bool,
}

impl Claim {
    fn new(shared: &Arc<Shared>, id: u64) -> Claim {
        let (tx, rx) = oneshot::channel();
        shared
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, tx);
        Claim {
            shared: shared.clone(),
            id,
            rx,
            settled: false,
        }
    }

    /// Out of the map; whether the ranker holds something of this request to give back
    /// (it still queues it, or its grant came unread).
    fn settle(&mut self) -> bool {
        self.settled = true;
        let queued = self.shared.take(self.id).is_some();
        queued || matches!(self.rx.try_recv(), Ok(Answer::Grant))
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.settled && self.settle() {
            give_back(&self.shared, self.id);
        }
    }
}

/// A grant whose payload is on its way. Dropped without [`Granted::delivered`] (the call
/// failed, or the request's future was dropped during it), it gives the ranker the window
/// space back: a payload that will not arrive must not hold it.
pub struct Granted {
    shared: Arc<Shared>,
    id: u64,
    delivered: bool,
}

impl Granted {
    /// The payload reached the ranker: the ranker frees the space when it is done with it.
    pub fn delivered(mut self) {
        self.delivered = true;
    }
}

impl Drop for Granted {
    fn drop(&mut self) {
        if !self.delivered {
            give_back(&self.shared, self.id);
        }
    }
}

/// Tells the ranker (done {id}) that message `id` will not come, from a drop: sent by a task of
/// its own, since a drop cannot wait.
fn give_back(shared: &Arc<Shared>, id: u64) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        let shared = shared.clone();
        runtime.spawn(async move { shared.send(&ControlMessage::Done { id }).await });
    }
}

/// The control connection to one ranker.
pub struct IncastLink {
    ranker: String,
    pub(crate) control: String,
    threshold: u64,
    shared: Arc<Shared>,
}

impl IncastLink {
    /// Starts the connecting task (on the current tokio runtime); `control` is `host:port`.
    pub fn start(ranker: &str, control: &str, threshold: u64) -> IncastLink {
        let shared = Arc::new(Shared::default());
        tokio::spawn(keep_connected(control.to_owned(), Arc::downgrade(&shared)));
        IncastLink {
            ranker: ranker.to_owned(),
            control: control.to_owned(),
            threshold,
            shared,
        }
    }

    pub fn is_connected(&self) -> bool {
        self.shared.connected.load(Ordering::Relaxed)
    }

    /// Waits for permission to send `bytes` of message `id` (the request's trace id), at most
    /// `left`. `Ok(Some)`: granted, see [`Granted`]; `Ok(None)`: send without control (small
    /// payload, no connection).
    pub async fn permit(
        &self,
        id: u64,
        bytes: u64,
        left: Duration,
    ) -> Result<Option<Granted>, IncastError> {
        if bytes < self.threshold {
            return Ok(None);
        }
        if !self.is_connected() {
            self.warn_once("not connected");
            return Ok(None);
        }
        let mut claim = Claim::new(&self.shared, id);
        let ask = ControlMessage::RequestToSend {
            id,
            bytes,
            slo_left_us: left.as_micros() as u64,
            stamp_ns: 0,
        };
        if !self.shared.send(&ask).await {
            claim.settle(); // nothing to give back: the connection went
            self.warn_once("lost");
            return Ok(None);
        }
        let answer = tokio::time::timeout(left, &mut claim.rx).await;
        // Gave up waiting: out of the ranker's queue, or, if the grant came in the meantime,
        // its space back.
        if claim.settle() && answer.is_err() {
            self.shared.send(&ControlMessage::Done { id }).await;
        }
        match answer {
            Ok(Ok(Answer::Grant)) => Ok(Some(Granted {
                shared: self.shared.clone(),
                id,
                delivered: false,
            })),
            Ok(Ok(Answer::Expired)) => Err(IncastError::Expired {
                ranker: self.ranker.clone(),
            }),
            Ok(Ok(Answer::Lost)) | Ok(Err(_)) => {
                self.warn_once("lost");
                Ok(None)
            }
            Err(_) => Err(IncastError::NoGrant {
                ranker: self.ranker.clone(),
                left_ms: left.as_secs_f64() * 1e3,
            }),
        }
    }

    fn warn_once(&self, what: &str) {
        if !self.shared.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                ranker = %self.ranker,
                control = %self.control,
                "incast control connection {what}: sending payloads without control until it is back"
            );
        }
    }
}

/// Connects, reads grants and expiries until the connection ends, reconnects; ends when the
/// link is dropped (the router stopped).
async fn keep_connected(control: String, shared: Weak<Shared>) {
    loop {
        match tokio::time::timeout(RECONNECT, TcpStream::connect(&control)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                // Requests-to-send must not queue behind the payloads they pace.
                let _ = cleave_wire::priority::mark(stream.as_fd(), CONTROL_DSCP);
                let (mut read, write) = stream.into_split();
                {
                    let Some(s) = shared.upgrade() else { return };
                    *s.writer.lock().await = Some(write);
                    s.connected.store(true, Ordering::Relaxed);
                    if s.warned.swap(false, Ordering::Relaxed) {
                        tracing::info!(%control, "incast control connection back");
                    }
                }
                let why = loop {
                    let m = match read_message(&mut read).await {
                        Ok(Some(m)) => m,
                        Ok(None) => break "closed by the ranker".to_owned(),
                        Err(e) => break e.to_string(),
                    };
                    let Some(s) = shared.upgrade() else { return };
                    let (id, answer) = match m {
                        ControlMessage::Grant { id } => (id, Answer::Grant),
                        ControlMessage::Expired { id } => (id, Answer::Expired),
                        ControlMessage::Error { message, .. } => break message,
                        _ => continue, // done and credit carry nothing for the router here
                    };
                    let grant = matches!(answer, Answer::Grant);
                    let claimed = match s.take(id) {
                        Some(tx) => tx.send(answer).is_ok(),
                        None => false,
                    };
                    // Nobody waits for it (it gave up): give a grant's space back.
                    if grant && !claimed {
                        s.send(&ControlMessage::Done { id }).await;
                    }
                };
                let Some(s) = shared.upgrade() else { return };
                s.connected.store(false, Ordering::Relaxed);
                *s.writer.lock().await = None;
                let waiting: Vec<_> = s
                    .waiting
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .drain()
                    .collect();
                for (_, tx) in waiting {
                    let _ = tx.send(Answer::Lost);
                }
                tracing::warn!(%control, "incast control connection ended: {why}");
            }
            Ok(Err(_)) | Err(_) => {
                if shared.strong_count() == 0 {
                    return;
                }
            }
        }
        tokio::time::sleep(RECONNECT).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// Waits (bounded) until the link's task has connected.
    async fn connected(link: &IncastLink) {
        for _ in 0..500 {
            if link.is_connected() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the control connection never came up");
    }

    #[tokio::test]
    async fn granted_expired_withdrawn_and_fallback_when_the_connection_goes() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap().to_string();
        let link = IncastLink::start("r:1", &at, 100);
        // Small payloads skip the exchange.
        assert!(matches!(
            link.permit(1, 99, Duration::from_secs(5)).await,
            Ok(None)
        ));
        let (stream, _) = listener.accept().await.unwrap();
        drop(listener); // no reconnection once this connection goes
        let (mut read, mut write) = stream.into_split();
        connected(&link).await;
        let ranker = tokio::spawn(async move {
            // Grant id 2, expire id 3, never answer id 4 and expect its withdrawal (done).
            let mut seen = Vec::new();
            while let Ok(Some(m)) = read_message(&mut read).await {
                let reply = match m {
                    ControlMessage::RequestToSend { id: 2, .. } => ControlMessage::Grant { id: 2 },
                    ControlMessage::RequestToSend { id: 3, .. } => {
                        ControlMessage::Expired { id: 3 }
                    }
                    ControlMessage::Done { id: 4 } => break,
                    _ => {
                        seen.push(m);
                        continue;
                    }
                };
                write.write_all(&reply.encode()).await.unwrap();
            }
            seen
        });
        let granted = link.permit(2, 100, Duration::from_secs(30)).await.unwrap();
        granted.expect("granted").delivered(); // else done {2} would follow
        assert!(matches!(
            link.permit(3, 100, Duration::from_secs(30)).await,
            Err(IncastError::Expired { .. })
        ));
        assert!(matches!(
            link.permit(4, 100, Duration::from_millis(50)).await,
            Err(IncastError::NoGrant { .. })
        ));
        let seen = ranker.await.unwrap(); // it saw id 4's withdrawal, then closed
        assert!(
            matches!(
                seen.as_slice(),
                [ControlMessage::RequestToSend { id: 4, .. }]
            ),
            "{seen:?}"
        );
        // The ranker side closed: requests go without control (logged once).
        for _ in 0..500 {
            if !link.is_connected() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(matches!(
            link.permit(5, 100, Duration::from_secs(5)).await,
            Ok(None)
        ));
    }

    #[tokio::test]
    async fn dropped_waits_and_undelivered_grants_leave_nothing_behind() {
        // A request whose future is dropped while it waits (its client went) leaves no entry
        // in the map and takes itself out of the ranker's queue; a grant whose payload does
        // not arrive gives its window space back; a delivered one does not.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap().to_string();
        let link = Arc::new(IncastLink::start("r:1", &at, 100));
        let (stream, _) = listener.accept().await.unwrap();
        let (mut read, mut write) = stream.into_split();
        connected(&link).await;
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            // Grants ids 30 and up; never answers the others.
            while let Ok(Some(m)) = read_message(&mut read).await {
                if let ControlMessage::RequestToSend { id, .. } = m {
                    if id >= 30 {
                        let grant = ControlMessage::Grant { id };
                        write.write_all(&grant.encode()).await.unwrap();
                    }
                }
                let _ = seen_tx.send(m);
            }
        });
        let waits: Vec<_> = (10..20)
            .map(|id| {
                let link = link.clone();
                tokio::spawn(async move { link.permit(id, 100, Duration::from_secs(60)).await })
            })
            .collect();
        for _ in 10..20 {
            let m = seen.recv().await.unwrap();
            assert!(matches!(m, ControlMessage::RequestToSend { .. }), "{m:?}");
        }
        for wait in waits {
            wait.abort();
            assert!(matches!(wait.await, Err(e) if e.is_cancelled()));
        }
        let waiting = link.shared.waiting.lock().unwrap().len();
        assert_eq!(waiting, 0, "dropped waits left entries behind");
        let mut done: Vec<u64> = Vec::new();
        for _ in 10..20 {
            match seen.recv().await.unwrap() {
                ControlMessage::Done { id } => done.push(id),
                m => panic!("expected done for a dropped wait, got {m:?}"),
            }
        }
        done.sort_unstable();
        assert_eq!(done, (10..20).collect::<Vec<u64>>());
        // Granted, then the call failed or was dropped: done {30}.
        let granted = link.permit(30, 100, Duration::from_secs(30)).await.unwrap();
        drop(granted.expect("granted"));
        let m = seen.recv().await.unwrap();
        assert!(
            matches!(m, ControlMessage::RequestToSend { id: 30, .. }),
            "{m:?}"
        );
        let m = seen.recv().await.unwrap();
        assert!(matches!(m, ControlMessage::Done { id: 30 }), "{m:?}");
        // Delivered: nothing for 31, so the next message after its request-to-send is 32's.
        let delivered = link.permit(31, 100, Duration::from_secs(30)).await.unwrap();
        delivered.expect("granted").delivered();
        let next = link.permit(32, 100, Duration::from_secs(30)).await.unwrap();
        let m = seen.recv().await.unwrap();
        assert!(
            matches!(m, ControlMessage::RequestToSend { id: 31, .. }),
            "{m:?}"
        );
        let m = seen.recv().await.unwrap();
        assert!(
            matches!(m, ControlMessage::RequestToSend { id: 32, .. }),
            "{m:?}"
        );
        next.expect("granted").delivered();
        assert_eq!(link.shared.waiting.lock().unwrap().len(), 0);
    }

    #[test]
    fn no_grant_is_a_504_in_the_incast_queue_stage() {
        let e: RequestError = IncastError::NoGrant {
            ranker: "r:1".into(),
            left_ms: 5.0,
        }
        .into();
        assert_eq!(e.status().as_u16(), 504);
        assert_eq!(e.stage.map(|s| s.as_str()), Some("ranker incast queue"));
        assert!(e.message.contains("no grant from ranker r:1"), "{e}");
    }
}
