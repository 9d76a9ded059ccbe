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
    /// `left`. `Ok(true)`: granted, call [`IncastLink::withdraw`] if the payload then does not
    /// arrive whole; `Ok(false)`: send without control (small payload, no connection).
    pub async fn permit(&self, id: u64, bytes: u64, left: Duration) -> Result<bool, IncastError> {
        if bytes < self.threshold {
            return Ok(false);
        }
        if !self.is_connected() {
            self.warn_once("not connected");
            return Ok(false);
        }
        let (tx, rx) = oneshot::channel();
        self.shared
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, tx);
        let ask = ControlMessage::RequestToSend {
            id,
            bytes,
            slo_left_us: left.as_micros() as u64,
            stamp_ns: 0,
        };
        if !self.shared.send(&ask).await {
            self.shared.take(id);
            self.warn_once("lost");
            return Ok(false);
        }
        match tokio::time::timeout(left, rx).await {
            Ok(Ok(Answer::Grant)) => Ok(true),
            Ok(Ok(Answer::Expired)) => Err(IncastError::Expired {
                ranker: self.ranker.clone(),
            }),
            Ok(Ok(Answer::Lost)) | Ok(Err(_)) => {
                self.warn_once("lost");
                Ok(false)
            }
            Err(_) => {
                // Gave up waiting: out of the ranker's queue (or, if the grant crossed this
                // on the wire, its space back: the reader answers an unclaimed grant too).
                if self.shared.take(id).is_some() {
                    self.withdraw(id).await;
                }
                Err(IncastError::NoGrant {
                    ranker: self.ranker.clone(),
                    left_ms: left.as_secs_f64() * 1e3,
                })
            }
        }
    }

    /// A granted payload did not reach the ranker (the call failed): its window space back.
    pub async fn withdraw(&self, id: u64) {
        self.shared.send(&ControlMessage::Done { id }).await;
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
        assert_eq!(link.permit(1, 99, Duration::from_secs(5)).await, Ok(false));
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
        assert_eq!(link.permit(2, 100, Duration::from_secs(30)).await, Ok(true));
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
        assert_eq!(link.permit(5, 100, Duration::from_secs(5)).await, Ok(false));
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
