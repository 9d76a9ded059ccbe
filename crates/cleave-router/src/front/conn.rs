//! One client connection as the front door sees it: which phase it is in (idle, reading a
//! request head, busy with a request), when the current request's first byte arrived, and
//! the deadline that phase allows. The socket wrapper notes first bytes; the service marks
//! the start and end of each request; the connection's driver (door.rs) closes the
//! connection when the deadline passes.

use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, Interest, ReadBuf};
use tokio::net::TcpStream;

use crate::front::rx_stamp;

/// When a request's first byte arrived: put in the request's extensions by the REST door
/// (door.rs) and by the gRPC layer (grpc_layer.rs, when a call's HEADERS frame arrives); the
/// envelope starts the request's budget there.
#[derive(Clone, Copy, Debug)]
pub struct Arrival(pub Instant);

/// How long a closing connection is drained so the client reads our last response before
/// the close (an unread request body would otherwise turn the close into a reset).
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 4 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// No request in progress since `since` (accept, or the end of the last response).
    Idle { since: Instant },
    /// A request head began at `first_byte` and is not whole yet.
    Head { first_byte: Instant },
    /// A request is being served; its own budget bounds it.
    Busy,
}

/// Which timeout closed a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    Idle,
    Header,
}

#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub header: Duration,
    pub idle: Duration,
}

/// What the socket wrapper, the service and the driver of one connection share.
pub struct ConnState {
    phase: Mutex<Phase>,
    accepted: Instant,
    timeouts: Timeouts,
}

impl ConnState {
    pub fn new(accepted: Instant, timeouts: Timeouts) -> ConnState {
        ConnState {
            phase: Mutex::new(Phase::Idle { since: accepted }),
            accepted,
            timeouts,
        }
    }

    fn phase(&self) -> std::sync::MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes arrived at `at`: while idle, they begin a request head.
    fn on_bytes(&self, at: Instant) {
        let mut phase = self.phase();
        if let Phase::Idle { .. } = *phase {
            *phase = Phase::Head { first_byte: at };
        }
    }

    /// A whole head was parsed: the request is busy from now on. Returns when its first byte
    /// arrived (now, when the bytes came in while the previous request was busy: pipelining).
    pub fn begin_request(&self) -> Instant {
        let mut phase = self.phase();
        let arrival = match *phase {
            Phase::Head { first_byte } => first_byte,
            _ => Instant::now(),
        };
        *phase = Phase::Busy;
        arrival
    }

    /// The response is ready: the connection is idle (writing the response counts as idle
    /// time, so a client that stops reading is closed by the idle timeout too).
    pub fn end_request(&self) {
        *self.phase() = Phase::Idle {
            since: Instant::now(),
        };
    }

    /// When the current phase must end, and which timeout that is; `None` while busy.
    pub fn deadline(&self) -> Option<(Instant, Expiry)> {
        match *self.phase() {
            Phase::Idle { since } => Some((since + self.timeouts.idle, Expiry::Idle)),
            Phase::Head { first_byte } => Some((first_byte + self.timeouts.header, Expiry::Header)),
            Phase::Busy => None,
        }
    }

    pub fn current(&self) -> Phase {
        *self.phase()
    }
}

/// One open connection counted against the cap; released when dropped.
pub struct Slot(Arc<AtomicUsize>);

impl Slot {
    /// Takes a slot if fewer than `max` are taken.
    pub fn take(open: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        let before = open.fetch_add(1, Ordering::Relaxed);
        let slot = Slot(open.clone());
        (before < max).then_some(slot)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The client socket, noting when each request's first byte arrived: as the kernel stamped
/// it (rx_stamp.rs), else when it was read. When dropped before the client closed its side,
/// it drains the socket briefly in the background (holding the connection's slot) so that the
/// client can read our last response.
pub struct Conn {
    stream: Option<TcpStream>,
    state: Arc<ConnState>,
    slot: Option<Slot>,
    /// The kernel stamps what the socket receives.
    stamped: bool,
    /// No read has waited yet: the first request's bytes were there when the connection
    /// was first polled, so they may have arrived as early as the accept.
    unwaited: bool,
    eof: bool,
}

impl Conn {
    pub fn new(stream: TcpStream, state: Arc<ConnState>, slot: Slot) -> Conn {
        Conn {
            stamped: rx_stamp::enable(stream.as_raw_fd()),
            stream: Some(stream),
            state,
            slot: Some(slot),
            unwaited: true,
            eof: false,
        }
    }

    /// One read, with the kernel's stamp of when its last byte arrived.
    fn poll_recv(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<Option<SystemTime>>> {
        let stream = self.stream()?;
        loop {
            ready!(stream.poll_read_ready(cx))?;
            // SAFETY: recvmsg only writes into the unfilled part; `assume_init` covers exactly
            // the bytes it wrote.
            let unfilled = unsafe { buf.unfilled_mut() };
            let fd = stream.as_raw_fd();
            match stream.try_io(Interest::READABLE, || rx_stamp::recv(fd, unfilled)) {
                Ok((n, stamp)) => {
                    unsafe { buf.assume_init(n) };
                    buf.advance(n);
                    return Poll::Ready(Ok(stamp));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    fn stream(&mut self) -> io::Result<&mut TcpStream> {
        self.stream
            .as_mut()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "connection closed"))
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = if self.stamped {
            self.poll_recv(cx, buf)
        } else {
            Pin::new(self.stream()?)
                .poll_read(cx, buf)
                .map_ok(|()| None)
        };
        match polled {
            Poll::Ready(Ok(stamp)) => {
                if buf.filled().len() > before {
                    let at = match stamp {
                        Some(stamp) => rx_stamp::instant_of(stamp),
                        None if self.unwaited => self.state.accepted,
                        None => Instant::now(),
                    };
                    self.state.on_bytes(at);
                } else {
                    self.eof = true;
                }
                self.unwaited = false;
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                self.unwaited = false;
                Poll::Pending
            }
            Poll::Ready(Err(e)) => {
                self.eof = true;
                Poll::Ready(Err(e))
            }
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(self.stream()?).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(self.stream()?).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.stream()?).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.stream()?).poll_shutdown(cx)
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        let (Some(stream), slot) = (self.stream.take(), self.slot.take()) else {
            return;
        };
        if self.eof {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(linger(stream, slot));
        }
    }
}

/// Half-closes the socket, then reads and discards what the client still sends, for at
/// most `LINGER` and `LINGER_BYTES`, before closing it.
pub async fn linger(mut stream: TcpStream, slot: Option<Slot>) {
    let _slot = slot;
    let _ = stream.shutdown().await;
    let deadline = tokio::time::Instant::now() + LINGER;
    let mut buf = vec![0u8; 16 << 10];
    let mut drained = 0;
    while drained < LINGER_BYTES {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => drained += n,
            _ => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn phases_and_deadlines() {
        let t0 = Instant::now();
        let timeouts = Timeouts {
            header: 10 * S,
            idle: 60 * S,
        };
        let c = ConnState::new(t0, timeouts);
        assert_eq!(c.deadline(), Some((t0 + 60 * S, Expiry::Idle)));
        c.on_bytes(t0 + S);
        assert_eq!(c.deadline(), Some((t0 + 11 * S, Expiry::Header)));
        c.on_bytes(t0 + 2 * S); // more of the same head: the clock does not restart
        assert_eq!(c.current(), Phase::Head { first_byte: t0 + S });
        assert_eq!(c.begin_request(), t0 + S);
        assert_eq!(c.deadline(), None);
        c.on_bytes(t0 + 3 * S); // body bytes, or the next request pipelined: still busy
        assert_eq!(c.current(), Phase::Busy);
        c.end_request();
        assert!(matches!(c.deadline(), Some((_, Expiry::Idle))));
        // A head parsed from bytes already buffered arrives "now".
        let before = Instant::now();
        assert!(c.begin_request() >= before);
    }

    #[tokio::test]
    async fn a_request_arrives_when_the_kernel_got_it_not_when_it_was_read() {
        let _stamping = rx_stamp::stamping_pair();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        let timeouts = Timeouts {
            header: 10 * S,
            idle: 60 * S,
        };
        let state = Arc::new(ConnState::new(Instant::now(), timeouts));
        let open = Arc::new(AtomicUsize::new(0));
        let mut conn = Conn::new(stream, state.clone(), Slot::take(&open, 1).unwrap());
        // The first poll has waited: without the kernel's stamp the read would be "now".
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_millis(10), conn.read(&mut buf)).await;
        assert!(read.is_err(), "nothing sent yet");
        client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        // Not a wait for a signal: the time the bytes must be seen to spend in the kernel.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(conn.read(&mut buf).await.unwrap(), 16);
        let Phase::Head { first_byte } = state.current() else {
            panic!("a head began: {:?}", state.current());
        };
        assert!(first_byte.elapsed() >= Duration::from_millis(50));
    }

    #[test]
    fn slots_are_capped_and_released() {
        let open = Arc::new(AtomicUsize::new(0));
        let a = Slot::take(&open, 2).unwrap();
        let b = Slot::take(&open, 2).unwrap();
        assert!(Slot::take(&open, 2).is_none());
        assert_eq!(
            open.load(Ordering::Relaxed),
            2,
            "a refused slot is released"
        );
        drop(a);
        let _c = Slot::take(&open, 2).unwrap();
        drop(b);
        assert_eq!(open.load(Ordering::Relaxed), 1);
    }
}
