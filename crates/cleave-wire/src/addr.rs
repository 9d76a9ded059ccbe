//! Addresses (`host:port`, `mptcp:host:port`, `unix:/path` or `shm:/path`) and the
//! stream/listener types over them. An MPTCP connection is a TCP stream to everything above
//! this file: the frames, HELLO and credits are unchanged; only the socket's protocol differs
//! (sockets.rs). A `shm:` connection is a Unix stream whose large payloads travel through
//! shared memory (shm/mod.rs).

use std::fmt;
use std::io;
use std::net::ToSocketAddrs;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{tcp, unix, TcpListener, TcpStream, UnixListener, UnixStream};

/// Where a peer listens.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Address {
    /// `host:port`; host may be a name, an IPv4 address or a bracketed IPv6 address.
    Tcp(String),
    /// `unix:/path/to/socket`.
    Unix(PathBuf),
    /// `mptcp:host:port`: as `Tcp`, over a Multipath TCP socket (`transport: mptcp`,
    /// docs/protocol.md "Multipath TCP"); plain TCP where the kernel refuses MPTCP.
    Mptcp(String),
    /// `shm:/path/to/socket`: a Unix socket whose data connections pass large payloads
    /// through shared memory (shm/mod.rs). A server listening here also serves plain Unix
    /// clients.
    Shm(PathBuf),
}

impl Address {
    /// The socket path of a Unix or shared-memory address.
    pub fn unix_path(&self) -> Option<&PathBuf> {
        match self {
            Address::Tcp(_) | Address::Mptcp(_) => None,
            Address::Unix(p) | Address::Shm(p) => Some(p),
        }
    }
}

impl FromStr for Address {
    type Err = String;

    fn from_str(s: &str) -> Result<Address, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(format!(
                    "address {s:?}: expected unix:/path/to/socket, path is empty"
                ));
            }
            return Ok(Address::Unix(PathBuf::from(path)));
        }
        if let Some(path) = s.strip_prefix("shm:") {
            if path.is_empty() {
                return Err(format!(
                    "address {s:?}: expected shm:/path/to/socket, path is empty"
                ));
            }
            return Ok(Address::Shm(PathBuf::from(path)));
        }
        let (rest, mptcp) = match s.strip_prefix("mptcp:") {
            Some(rest) => (rest, true),
            None => (s, false),
        };
        match rest.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(if mptcp {
                Address::Mptcp(rest.to_owned())
            } else {
                Address::Tcp(rest.to_owned())
            }),
            _ => Err(format!(
                "address {s:?}: expected host:port, mptcp:host:port, unix:/path or shm:/path"
            )),
        }
    }
}

impl Address {
    /// Opens one connection to this address as a Client's would and says whether it runs
    /// Multipath TCP end to end (tests and `cleave` diagnostics; false for TCP and Unix).
    pub async fn connects_mptcp(&self) -> io::Result<bool> {
        Ok(Stream::connect(self).await?.is_mptcp())
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Tcp(a) => f.write_str(a),
            Address::Unix(p) => write!(f, "unix:{}", p.display()),
            Address::Mptcp(a) => write!(f, "mptcp:{a}"),
            Address::Shm(p) => write!(f, "shm:{}", p.display()),
        }
    }
}

/// A connected byte stream, TCP or Unix.
#[derive(Debug)]
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Connects (needs a tokio runtime). Disables Nagle on TCP: frames are written whole.
    pub async fn connect(addr: &Address) -> io::Result<Stream> {
        match addr {
            Address::Tcp(a) => {
                let s = TcpStream::connect(a.as_str()).await?;
                s.set_nodelay(true)?;
                Ok(Stream::Tcp(s))
            }
            Address::Unix(p) | Address::Shm(p) => Ok(Stream::Unix(UnixStream::connect(p).await?)),
            Address::Mptcp(a) => {
                let s = crate::sockets::mptcp_connect(a).await?;
                s.set_nodelay(true)?;
                Ok(Stream::Tcp(s))
            }
        }
    }

    /// Whether this connection runs Multipath TCP end to end (false for plain TCP, for an
    /// MPTCP socket that fell back to TCP, and for Unix sockets).
    pub fn is_mptcp(&self) -> bool {
        match self {
            Stream::Tcp(s) => crate::sockets::is_mptcp(s.as_fd()),
            Stream::Unix(_) => false,
        }
    }

    /// Marks a TCP stream's packets as control traffic (DSCP EF, priority.rs); Unix sockets
    /// cross no network. A failure is logged: the stream still works, without priority.
    pub fn mark_control(&self) {
        if let Stream::Tcp(s) = self {
            if let Err(err) = crate::priority::mark(s.as_fd(), crate::priority::CONTROL_DSCP) {
                tracing::debug!(%err, "cannot mark a control connection's packets");
            }
        }
    }

    /// Detaches from the current runtime so another I/O thread can adopt it.
    pub fn into_std(self) -> io::Result<StdStream> {
        Ok(match self {
            Stream::Tcp(s) => StdStream::Tcp(s.into_std()?),
            Stream::Unix(s) => StdStream::Unix(s.into_std()?),
        })
    }

    /// Adopts a stream into the current runtime.
    pub fn from_std(s: StdStream) -> io::Result<Stream> {
        Ok(match s {
            StdStream::Tcp(s) => Stream::Tcp(TcpStream::from_std(s)?),
            StdStream::Unix(s) => Stream::Unix(UnixStream::from_std(s)?),
        })
    }

    /// Borrows the reading and writing sides separately, so one task can wait on both at once
    /// (no lock: both halves stay with the task that owns the stream).
    pub fn split(&mut self) -> (ReadHalf<'_>, WriteHalf<'_>) {
        match self {
            Stream::Tcp(s) => {
                let (r, w) = s.split();
                (ReadHalf::Tcp(r), WriteHalf::Tcp(w))
            }
            Stream::Unix(s) => {
                let (r, w) = s.split();
                (ReadHalf::Unix(r), WriteHalf::Unix(w))
            }
        }
    }
}

/// The reading side of a borrowed [`Stream`].
#[derive(Debug)]
pub enum ReadHalf<'a> {
    Tcp(tcp::ReadHalf<'a>),
    Unix(unix::ReadHalf<'a>),
}

/// The writing side of a borrowed [`Stream`].
#[derive(Debug)]
pub enum WriteHalf<'a> {
    Tcp(tcp::WriteHalf<'a>),
    Unix(unix::WriteHalf<'a>),
}

impl AsyncRead for ReadHalf<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ReadHalf::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            ReadHalf::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for WriteHalf<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            WriteHalf::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            WriteHalf::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Tcp(s) => Pin::new(s).poll_flush(cx),
            WriteHalf::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            WriteHalf::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// A stream between runtimes (non-blocking mode kept).
#[derive(Debug)]
pub enum StdStream {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// A bound listener, created without a runtime so bind errors and the chosen port are known
/// before any thread starts.
#[derive(Debug)]
pub enum StdListener {
    /// A TCP listener; `true` when its socket is MPTCP (it accepts plain TCP peers too).
    Tcp(std::net::TcpListener, bool),
    /// The listener, its path, and whether it was bound as `shm:`.
    Unix(std::os::unix::net::UnixListener, PathBuf, bool),
}

impl StdListener {
    /// Binds `addr`. A Unix socket file left by a dead server is replaced; one a live server
    /// answers on is an error.
    pub fn bind(addr: &Address) -> io::Result<StdListener> {
        let l = match addr {
            Address::Tcp(a) => {
                let sa = a.to_socket_addrs()?.next().ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{a} resolves to nothing"),
                    )
                })?;
                let l = std::net::TcpListener::bind(sa)?;
                l.set_nonblocking(true)?;
                StdListener::Tcp(l, false)
            }
            Address::Mptcp(a) => {
                let sa = a.to_socket_addrs()?.next().ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{a} resolves to nothing"),
                    )
                })?;
                StdListener::Tcp(crate::sockets::mptcp_listener(sa)?, true)
            }
            Address::Unix(p) | Address::Shm(p) => {
                if p.exists() {
                    if std::os::unix::net::UnixStream::connect(p).is_ok() {
                        return Err(io::Error::new(
                            io::ErrorKind::AddrInUse,
                            format!("a server already listens on unix:{}", p.display()),
                        ));
                    }
                    std::fs::remove_file(p)?;
                }
                let l = std::os::unix::net::UnixListener::bind(p)?;
                l.set_nonblocking(true)?;
                StdListener::Unix(l, p.clone(), matches!(addr, Address::Shm(_)))
            }
        };
        Ok(l)
    }

    /// The address peers connect to (the real port when bound to port 0).
    pub fn local_addr(&self) -> io::Result<Address> {
        Ok(match self {
            StdListener::Tcp(l, false) => Address::Tcp(l.local_addr()?.to_string()),
            StdListener::Tcp(l, true) => Address::Mptcp(l.local_addr()?.to_string()),
            StdListener::Unix(_, p, false) => Address::Unix(p.clone()),
            StdListener::Unix(_, p, true) => Address::Shm(p.clone()),
        })
    }
}

/// A listener adopted by a runtime.
#[derive(Debug)]
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    pub fn from_std(l: StdListener) -> io::Result<Listener> {
        Ok(match l {
            StdListener::Tcp(l, _) => Listener::Tcp(TcpListener::from_std(l)?),
            StdListener::Unix(l, p, _) => Listener::Unix(UnixListener::from_std(l)?, p),
        })
    }

    pub async fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept().await?;
                s.set_nodelay(true)?;
                Ok(Stream::Tcp(s))
            }
            Listener::Unix(l, _) => Ok(Stream::Unix(l.accept().await?.0)),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_forms() {
        assert_eq!(
            "127.0.0.1:80".parse(),
            Ok(Address::Tcp("127.0.0.1:80".into()))
        );
        assert_eq!("[::1]:80".parse(), Ok(Address::Tcp("[::1]:80".into())));
        assert_eq!("unix:/tmp/s".parse(), Ok(Address::Unix("/tmp/s".into())));
        assert_eq!("shm:/tmp/s".parse(), Ok(Address::Shm("/tmp/s".into())));
        assert_eq!(
            "shm:/tmp/s".parse::<Address>().unwrap().to_string(),
            "shm:/tmp/s"
        );
        assert_eq!(
            "mptcp:10.0.0.1:80".parse(),
            Ok(Address::Mptcp("10.0.0.1:80".into()))
        );
        assert_eq!(
            "mptcp:[::1]:80".parse::<Address>().unwrap().to_string(),
            "mptcp:[::1]:80"
        );
        assert_eq!(
            "unix:/tmp/s".parse::<Address>().unwrap().to_string(),
            "unix:/tmp/s"
        );
        for bad in [
            "",
            "host",
            "host:",
            ":80",
            "host:99999",
            "unix:",
            "shm:",
            "mptcp:",
            "mptcp:host",
            "mptcp::80",
        ] {
            let err = bad.parse::<Address>().unwrap_err();
            assert!(err.contains("expected"), "{bad}: {err}");
        }
    }
}
