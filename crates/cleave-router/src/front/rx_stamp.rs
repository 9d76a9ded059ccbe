//! The kernel's receive timestamps on client sockets (`SO_TIMESTAMPING` with
//! `SOF_TIMESTAMPING_RX_SOFTWARE`; for TCP since Linux 4.14): when the last byte a read returns
//! reached the machine. A request's budget then starts when it arrived, not when a router
//! stalled or starved of CPU got round to reading it (tests/test_front_door.py stops one while
//! a request waits in its socket).
//! The kernel stamps packets only while some socket asks, and turns that on a moment after
//! the first one does: a read of bytes that came before carries no stamp, and the caller's
//! clock stands in.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

// linux/net_tstamp.h and asm-generic/socket.h (SO_TIMESTAMPING_OLD, whose control message is
// the native `struct timespec[3]` on 64-bit targets); not exported by every libc version.
const SO_TIMESTAMPING: libc::c_int = 37;
const SOF_TIMESTAMPING_RX_SOFTWARE: libc::c_uint = 1 << 3;
const SOF_TIMESTAMPING_SOFTWARE: libc::c_uint = 1 << 4;

/// A stamp older than this is taken as this old: a wall-clock step between the kernel's stamp
/// and our reading must not make a request look ancient. Longer than any budget.
const MAX_AGE: Duration = Duration::from_secs(10);

/// Asks the kernel to stamp what `fd` receives; false where it refuses (reads then carry no
/// stamp and the caller's own clock is used).
pub fn enable(fd: RawFd) -> bool {
    let flags = SOF_TIMESTAMPING_RX_SOFTWARE | SOF_TIMESTAMPING_SOFTWARE;
    // SAFETY: setsockopt reads `flags` (a c_uint, as the option expects) for its length.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_TIMESTAMPING,
            (&flags as *const libc::c_uint).cast(),
            std::mem::size_of::<libc::c_uint>() as libc::socklen_t,
        )
    };
    rc == 0 && cfg!(target_pointer_width = "64")
}

/// One `recvmsg` into `buf`: the bytes read (0: the peer closed) and when the last of them
/// arrived, if the kernel stamped them. `WouldBlock` when nothing is there.
pub fn recv(fd: RawFd, buf: &mut [MaybeUninit<u8>]) -> io::Result<(usize, Option<SystemTime>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // Room for one SCM_TIMESTAMPING message (three timespecs), aligned for cmsghdr.
    let mut control = [0u64; 16];
    // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: `msg` describes `buf` and `control`, both writable for their lengths.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((n as usize, stamp_of(&msg)))
}

/// The software receive stamp among `msg`'s control messages (the first of the three).
fn stamp_of(msg: &libc::msghdr) -> Option<SystemTime> {
    // SAFETY: the CMSG_* macros walk the control buffer the kernel filled, within
    // `msg_controllen`; a timestamping message carries at least one timespec.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(msg);
        while !cmsg.is_null() {
            let c = &*cmsg;
            if c.cmsg_level == libc::SOL_SOCKET && c.cmsg_type == SO_TIMESTAMPING {
                let ts = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::timespec>());
                if ts.tv_sec > 0 {
                    return Some(UNIX_EPOCH + Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32));
                }
            }
            cmsg = libc::CMSG_NXTHDR(msg, cmsg);
        }
    }
    None
}

/// `stamp` on the monotonic clock the router measures budgets with.
pub fn instant_of(stamp: SystemTime) -> Instant {
    let age = SystemTime::now()
        .duration_since(stamp)
        .unwrap_or(Duration::ZERO)
        .min(MAX_AGE);
    let now = Instant::now();
    now.checked_sub(age).unwrap_or(now)
}

/// A loopback pair whose reads the kernel stamps, once it does: the kernel turns stamping on
/// for every socket a moment after the first one asks (a deferred static key), and off when
/// the last one that asked closes, so a test holds this pair open while it relies on stamps.
#[cfg(test)]
pub(crate) fn stamping_pair() -> (std::net::TcpStream, std::net::TcpStream) {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    assert!(enable(server.as_raw_fd()), "the kernel stamps TCP reads");
    server.set_nonblocking(true).unwrap();
    let mut buf = [MaybeUninit::<u8>::uninit(); 8];
    for _ in 0..1000 {
        client.write_all(b".").unwrap();
        loop {
            match recv(server.as_raw_fd(), &mut buf) {
                Ok((_, Some(_))) => return (client, server),
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("the kernel never stamped a read");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_read_says_when_its_bytes_arrived() {
        let (mut client, server) = stamping_pair();
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        // Not a wait for a signal: the time the bytes must be seen to spend in the kernel.
        std::thread::sleep(Duration::from_millis(50));
        let mut buf = [MaybeUninit::<u8>::uninit(); 64];
        let (n, stamp) = recv(server.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(n, 18);
        // Stamped when they arrived, not when they were read: at least the sleep ago.
        let arrived = instant_of(stamp.expect("a stamp"));
        assert!(Instant::now() - arrived >= Duration::from_millis(50));
        let err = recv(server.as_raw_fd(), &mut buf).unwrap_err();
        assert_eq!(
            err.kind(),
            io::ErrorKind::WouldBlock,
            "nothing more to read"
        );
    }

    #[test]
    fn an_ancient_stamp_counts_as_max_age() {
        let long_ago = SystemTime::now() - Duration::from_secs(3600);
        assert!(Instant::now() - instant_of(long_ago) <= MAX_AGE + Duration::from_secs(1));
    }
}
