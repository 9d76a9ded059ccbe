//! The server's TCP data connections, listed for readers of their kernel counters (TCP_INFO:
//! the ranker's adaptive incast window, docs/traffic.md). Each entry holds a duplicate of its
//! connection's descriptor, so a listed descriptor is always that connection's socket, never
//! a number the kernel has since given to another file. Also the making of MPTCP sockets.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::addr::Stream;

#[derive(Default)]
pub(crate) struct DataSockets(Mutex<HashMap<u64, OwnedFd>>);

/// A connection's place in the list, removed when dropped (the connection ended).
pub(crate) struct Listed {
    sockets: Arc<DataSockets>,
    conn_id: u64,
}

impl DataSockets {
    /// Lists a TCP connection; Unix sockets have no TCP counters, and a failed `dup` (out of
    /// descriptors) only leaves this connection out of the counts.
    pub(crate) fn list(self: &Arc<Self>, conn_id: u64, stream: &Stream) -> Option<Listed> {
        let Stream::Tcp(tcp) = stream else {
            return None;
        };
        let fd = tcp.as_fd().try_clone_to_owned().ok()?;
        self.lock().insert(conn_id, fd);
        Some(Listed {
            sockets: self.clone(),
            conn_id,
        })
    }

    /// Calls `f` with each listed connection's id and socket.
    pub(crate) fn for_each(&self, mut f: impl FnMut(u64, BorrowedFd<'_>)) {
        for (id, fd) in self.lock().iter() {
            f(*id, fd.as_fd());
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, OwnedFd>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Listed {
    fn drop(&mut self) {
        self.sockets.lock().remove(&self.conn_id);
    }
}

// -- Multipath TCP sockets (`mptcp:host:port`, docs/protocol.md "Multipath TCP") ------------
//
// The kernel does the multipath work: an MPTCP socket is a SOCK_STREAM socket of protocol
// IPPROTO_MPTCP whose subflows the path manager opens over the endpoints `ip mptcp endpoint`
// lists (docs/testbed.md, "Racks"). To the process it reads and writes like TCP, so tokio's
// TcpStream/TcpListener carry it unchanged. A peer without MPTCP is met over plain TCP by the
// kernel itself; only a kernel that refuses the protocol is handled here.

const IPPROTO_MPTCP: libc::c_int = 262;
const TCP_IS_MPTCP: libc::c_int = 43;

static FALLBACK_LOGGED: AtomicBool = AtomicBool::new(false);

/// Whether this process has met a kernel that refuses MPTCP (and logged so): its `mptcp:`
/// sockets are plain TCP.
pub fn mptcp_refused_by_kernel() -> bool {
    FALLBACK_LOGGED.load(Ordering::Relaxed)
}

/// Errors with which a kernel says "no MPTCP here": built without it (EPROTONOSUPPORT),
/// `net.mptcp.enabled = 0` (ENOPROTOOPT), or an old kernel that rejects the number (EINVAL).
fn mptcp_refused(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::ENOPROTOOPT | libc::EPROTONOSUPPORT | libc::EINVAL)
    )
}

/// A non-blocking stream socket for `sa`'s family: MPTCP, or TCP where the kernel refuses
/// MPTCP (logged once per process: every later socket falls back the same way).
fn stream_socket(sa: &SocketAddr) -> io::Result<RawFd> {
    let family = if sa.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let kind = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: socket(2) takes no pointers; the descriptor is owned by the caller.
    let fd = unsafe { libc::socket(family, kind, IPPROTO_MPTCP) };
    if fd >= 0 {
        return Ok(fd);
    }
    let err = io::Error::last_os_error();
    if !mptcp_refused(&err) {
        return Err(err);
    }
    if !FALLBACK_LOGGED.swap(true, Ordering::Relaxed) {
        tracing::warn!(%err, "the kernel refuses MPTCP sockets; transport mptcp falls back to TCP");
    }
    // SAFETY: as above.
    let fd = unsafe { libc::socket(family, kind, libc::IPPROTO_TCP) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Connects to `addr` (`host:port`, resolved, each address tried in turn) over MPTCP.
pub(crate) async fn mptcp_connect(addr: &str) -> io::Result<tokio::net::TcpStream> {
    let mut last = None;
    for sa in tokio::net::lookup_host(addr).await? {
        let fd = stream_socket(&sa)?;
        // SAFETY: `fd` is a fresh, open stream socket that nothing else owns.
        let socket = unsafe { tokio::net::TcpSocket::from_raw_fd(fd) };
        match socket.connect(sa).await {
            Ok(s) => return Ok(s),
            Err(err) => last = Some(err),
        }
    }
    Err(last.unwrap_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{addr} resolves to nothing"),
        )
    }))
}

/// A non-blocking MPTCP listener bound to `sa` (SO_REUSEADDR, as std's TCP listener). Made
/// without a runtime, as StdListener::bind is.
pub(crate) fn mptcp_listener(sa: SocketAddr) -> io::Result<std::net::TcpListener> {
    let fd = stream_socket(&sa)?;
    // SAFETY: `fd` is a fresh, open stream socket; from here `listener` owns and closes it.
    let listener = unsafe { std::net::TcpListener::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    // SAFETY: `one` outlives the call and is an int, as SO_REUSEADDR takes.
    check(unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })?;
    let (storage, len) = sockaddr(&sa);
    // SAFETY: `storage` holds a sockaddr of `len` bytes for `sa`'s family.
    check(unsafe { libc::bind(fd, (&storage as *const libc::sockaddr_storage).cast(), len) })?;
    // SAFETY: listen(2) takes no pointers.
    check(unsafe { libc::listen(fd, 1024) })?;
    Ok(listener)
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `sa` as the kernel's sockaddr_in or sockaddr_in6, and its length.
fn sockaddr(sa: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all zeroes is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match sa {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            let sin = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: as above.
            let sin6 = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_flowinfo = a.flowinfo();
            sin6.sin6_scope_id = a.scope_id();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// Whether `fd`'s connection runs MPTCP end to end (TCP_IS_MPTCP: false after a fallback).
pub(crate) fn is_mptcp(fd: BorrowedFd<'_>) -> bool {
    let mut on: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `on` and `len` outlive the call and describe an int.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            TCP_IS_MPTCP,
            (&mut on as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    rc == 0 && on == 1
}
