//! The public port: an accept loop over hyper's HTTP/1.1 connections that serves the axum
//! routes and gives every connection bounds a client cannot stretch: a request head must
//! arrive whole within the header timeout once its first byte came, a connection without a
//! request in progress closes after the idle timeout, and at most `max_connections` are open
//! (one more is answered 503 and closed, the others are undisturbed). Body rates are held by
//! the handlers (body.rs), which know when a body is being read. Each request carries its
//! first byte's instant (`conn::Arrival`) so that its budget starts there.

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_rustls::TlsAcceptor;
use tower_service::Service;

use crate::front::conn::{linger, Arrival, Conn, ConnState, Expiry, Slot, Timeouts};
use crate::metrics::DoorStats;

/// Connections being refused at once, at most (each is held for about a second while the
/// refusal is written and drained); beyond that, extra connections are closed unanswered.
const MAX_REFUSING: usize = 1024;
/// How long accepting pauses after an error such as running out of file descriptors.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// A burst of new connections waits in the kernel's accept queue; at tokio's (and the
/// standard library's) 128 it overflowed under 10x bursts (`ListenOverflows`), and each
/// dropped handshake was retried a second later. The kernel caps it at `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 4096;

/// A listener on `address` (`host:port`, 0 for any free port) with [`LISTEN_BACKLOG`].
pub async fn listen(address: &str) -> std::io::Result<TcpListener> {
    let mut last = None;
    for addr in tokio::net::lookup_host(address).await? {
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        match socket
            .bind(addr)
            .and_then(|()| socket.listen(LISTEN_BACKLOG))
        {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("the address resolved to nothing")))
}

#[derive(Clone, Copy, Debug)]
pub struct DoorConfig {
    pub timeouts: Timeouts,
    pub max_connections: usize,
}

/// Serves `routes` on `listener` until `stop` turns true; then stops accepting, lets every
/// connection finish the request in progress (hyper's graceful shutdown) and returns once
/// all are closed.
pub async fn serve(
    listener: TcpListener,
    routes: axum::Router,
    config: DoorConfig,
    stats: Arc<DoorStats>,
    mut stop: watch::Receiver<bool>,
    tls: Option<TlsAcceptor>,
) {
    let mut builder = http1::Builder::new();
    // Our own clocks (conn.rs) replace hyper's header timeout, which also runs while idle.
    builder.keep_alive(true).header_read_timeout(None);
    let refusal = Arc::new(refusal(config.max_connections));
    let refusing = Arc::new(AtomicUsize::new(0));
    // Every connection task holds a sender; all are gone once `done.recv()` yields None.
    let (done_tx, mut done) = mpsc::channel::<()>(1);
    let mut last_complaint: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped(&mut stop) => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                if !is_connection_error(&e) {
                    // Out of descriptors or memory: wait rather than spin; say so now and then.
                    if last_complaint.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                        tracing::warn!(error = %e, "accepting a connection failed");
                        last_complaint = Some(Instant::now());
                    }
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
                continue;
            }
        };
        let accepted_at = Instant::now();
        // Small JSON responses: do not wait for Nagle's algorithm.
        let _ = stream.set_nodelay(true);
        let Some(slot) = Slot::take(&stats.open, config.max_connections) else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            refuse(stream, &refusing, refusal.clone());
            continue;
        };
        let state = Arc::new(ConnState::new(accepted_at, config.timeouts));
        let io = TokioIo::new(Conn::new(stream, state.clone(), slot));
        let service = {
            let (routes, state) = (routes.clone(), state.clone());
            // Marks the request busy, hands its arrival instant to the handlers, and marks
            // the connection idle again once the response is ready.
            hyper::service::service_fn(move |request: Request<Incoming>| {
                let arrival = state.begin_request();
                let mut request = request.map(Body::new);
                request.extensions_mut().insert(Arrival(arrival));
                // axum's router is always ready; `call` needs no `poll_ready` first.
                let response = routes.clone().call(request);
                let state = state.clone();
                async move {
                    let response = response.await;
                    state.end_request();
                    response
                }
            })
        };
        let (stats, stop, done_tx) = (stats.clone(), stop.clone(), done_tx.clone());
        let Some(tls) = &tls else {
            let connection = builder.serve_connection(io, service);
            tokio::spawn(drive(connection, state, stats, stop, done_tx));
            continue;
        };
        // The handshake is bounded by the header timeout: a client that opens a connection
        // and says nothing holds it no longer than one that sends half a request head.
        let (tls, builder) = (tls.clone(), builder.clone());
        let handshake_timeout = config.timeouts.header;
        tokio::spawn(async move {
            let accept = tls.accept(io.into_inner());
            match tokio::time::timeout(handshake_timeout, accept).await {
                Ok(Ok(stream)) => {
                    let connection = builder.serve_connection(TokioIo::new(stream), service);
                    drive(connection, state, stats, stop, done_tx).await;
                }
                Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!("TLS handshake timed out"),
            }
        });
    }
    drop(listener);
    drop(done_tx);
    let _ = done.recv().await;
}

enum Step {
    Closed,
    Expired(Expiry),
    Stop,
}

/// Runs one connection until it closes, its phase's deadline passes (it is then dropped,
/// which closes it), or the server stops (then hyper finishes the request in progress).
async fn drive<C>(
    connection: C,
    state: Arc<ConnState>,
    stats: Arc<DoorStats>,
    mut stop: watch::Receiver<bool>,
    _done: mpsc::Sender<()>,
) where
    C: Future + GracefulShutdown,
{
    let mut connection = pin!(connection);
    let mut sleep = pin!(tokio::time::sleep(Duration::ZERO));
    let mut armed: Option<Instant> = None;
    let mut stopping = false;
    loop {
        // Every phase change happens inside the connection's poll (reads, the service), so
        // the deadline is read right after it.
        let step = poll_fn(|cx| {
            if connection.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Step::Closed);
            }
            let Some((at, expiry)) = state.deadline() else {
                return Poll::Pending;
            };
            if Instant::now() >= at {
                return Poll::Ready(Step::Expired(expiry));
            }
            if armed != Some(at) {
                sleep.as_mut().reset(tokio::time::Instant::from_std(at));
                armed = Some(at);
            }
            match sleep.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Step::Expired(expiry)),
                Poll::Pending => Poll::Pending,
            }
        });
        let step = tokio::select! {
            step = step => step,
            _ = stopped(&mut stop), if !stopping => Step::Stop,
        };
        match step {
            Step::Closed => return,
            Step::Expired(expiry) => {
                let counter = match expiry {
                    Expiry::Header => &stats.header_timeouts,
                    Expiry::Idle => &stats.idle_timeouts,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Step::Stop => {
                stopping = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// hyper's graceful shutdown, behind a trait so that `drive` can name the connection type.
pub trait GracefulShutdown {
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>);
}

impl<I, S, B> GracefulShutdown for http1::Connection<I, S>
where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>) {
        http1::Connection::graceful_shutdown(self);
    }
}

/// The answer to a connection over the cap: a whole HTTP response, written before the
/// request is read.
fn refusal(max_connections: usize) -> Vec<u8> {
    let body = serde_json::json!({
        "error": format!(
            "overloaded: the router has {max_connections} connections open, its cap \
             (max_connections); retry later, or reuse a connection"
        ),
        "stage": "admission",
    })
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn refuse(mut stream: TcpStream, refusing: &Arc<AtomicUsize>, refusal: Arc<Vec<u8>>) {
    // Too many refusals in progress: close at once (the kernel resets the connection).
    let Some(slot) = Slot::take(refusing, MAX_REFUSING) else {
        return;
    };
    tokio::spawn(async move {
        let write = stream.write_all(&refusal);
        if let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(1), write).await {
            linger(stream, Some(slot)).await;
        }
    });
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    // An error means the sender is gone: nobody can ask to stop any more, so stop now.
    let _ = stop.wait_for(|s| *s).await;
}

/// Errors of one connection that accepting the next one does not suffer from.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

/// Raises the soft limit on open files to the hard limit so that `max_connections` can be
/// reached; returns the soft limit now in force.
pub fn raise_open_files_limit() -> Result<libc::rlim_t, String> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(format!(
            "getrlimit(RLIMIT_NOFILE): {}",
            std::io::Error::last_os_error()
        ));
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads the struct we own.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(format!(
                "setrlimit(RLIMIT_NOFILE, {}): {}",
                limit.rlim_max,
                std::io::Error::last_os_error()
            ));
        }
        limit = raised;
    }
    Ok(limit.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A burst of new connections beyond 128 waits to be accepted instead of having its
    /// handshakes dropped (as many as the kernel's `somaxconn` allows).
    #[tokio::test]
    async fn a_burst_of_connections_waits_in_the_accept_queue() {
        let listener = listen("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let somaxconn = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(4096);
        // Past 128, and within a default limit of 1,024 open files beside the other tests.
        let burst = somaxconn.min(300);
        let mut held = Vec::with_capacity(burst);
        for i in 0..burst {
            // A dropped handshake is retried after a second: well past this bound.
            let connect = TcpStream::connect(addr);
            let stream = tokio::time::timeout(Duration::from_millis(500), connect).await;
            assert!(
                matches!(stream, Ok(Ok(_))),
                "connection {i} of {burst} not queued"
            );
            held.push(stream);
        }
    }

    #[test]
    fn refusal_is_a_whole_response() {
        let text = String::from_utf8(refusal(7)).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert!(head.contains("\r\nconnection: close"));
        assert!(head.contains("\r\nretry-after: 1"));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["stage"], "admission");
        assert!(v["error"].as_str().unwrap().contains("7 connections open"));
    }

    #[test]
    fn open_files_limit_is_raised_to_the_hard_limit() {
        let soft = raise_open_files_limit().unwrap();
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: as above.
        assert_eq!(
            unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
            0
        );
        assert_eq!((soft, limit.rlim_cur), (limit.rlim_max, soft));
    }
}
