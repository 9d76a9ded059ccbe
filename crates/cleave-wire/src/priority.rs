//! Control traffic marked for a higher-priority network class: every control connection
//! (probes, CANCEL, response CREDITs; the ranker's incast control port) sets DSCP EF on its
//! packets, so a network that honours DSCP — the testbed's priority htb class, a switch's
//! strict-priority queue, what RDMA QoS gives a control channel — never queues them behind
//! bulk data (docs/protocol.md, "Priority of control traffic").

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Expedited Forwarding (RFC 3246): low delay, the class for control messages.
pub const CONTROL_DSCP: u8 = 46;

/// Sets `dscp` on the packets a TCP socket sends (IP_TOS on IPv4, IPV6_TCLASS on IPv6; the
/// two ECN bits stay the kernel's). An error means the socket keeps its class: the traffic
/// still flows, only without priority.
pub fn mark(fd: BorrowedFd<'_>, dscp: u8) -> io::Result<()> {
    let value: libc::c_int = libc::c_int::from(dscp) << 2;
    let (level, name) = match family(fd)? {
        libc::AF_INET6 => (libc::IPPROTO_IPV6, libc::IPV6_TCLASS),
        _ => (libc::IPPROTO_IP, libc::IP_TOS),
    };
    // SAFETY: fd is a live socket for the call; value is a c_int of the size given.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The DSCP a socket's packets carry.
pub fn marked(fd: BorrowedFd<'_>) -> io::Result<u8> {
    let (level, name) = match family(fd)? {
        libc::AF_INET6 => (libc::IPPROTO_IPV6, libc::IPV6_TCLASS),
        _ => (libc::IPPROTO_IP, libc::IP_TOS),
    };
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: as in `mark`; the kernel writes at most `len` bytes into value.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&mut value as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        Ok((value >> 2) as u8)
    } else {
        Err(io::Error::last_os_error())
    }
}

fn family(fd: BorrowedFd<'_>) -> io::Result<libc::c_int> {
    // SAFETY: sockaddr_storage is plain old data, large enough for any address.
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: fd is a live socket; addr and len describe a valid buffer.
    let rc = unsafe {
        libc::getsockname(
            fd.as_raw_fd(),
            (&mut addr as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        Ok(libc::c_int::from(addr.ss_family))
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsFd;

    #[test]
    fn a_marked_socket_carries_the_class_on_v4_and_v6() {
        for host in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(listener) = TcpListener::bind(host) else {
                continue; // no IPv6 on this machine
            };
            let s = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            assert_eq!(marked(s.as_fd()).unwrap(), 0, "{host}: unmarked by default");
            mark(s.as_fd(), CONTROL_DSCP).unwrap();
            assert_eq!(marked(s.as_fd()).unwrap(), CONTROL_DSCP, "{host}");
        }
    }
}
