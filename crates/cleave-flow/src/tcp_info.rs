//! What TCP exposes about a receiving socket (`getsockopt(TCP_INFO)`): the congestion signals
//! the adaptive window reads, since TCP here has no congestion-notification packets.

use std::os::fd::RawFd;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    /// Segments that arrived out of order: on a path that does not reorder, each one means a
    /// segment before it was lost (dropped at a full queue) and will be retransmitted.
    pub rcv_ooopack: u32,
    /// The receiver's RTT estimate (µs), which grows with the queue in front of it.
    pub rcv_rtt_us: u32,
    pub bytes_received: u64,
}

/// TCP_INFO of a connected TCP socket.
pub fn receiver_stats(fd: RawFd) -> std::io::Result<ReceiverStats> {
    // SAFETY: tcp_info is plain old data; the kernel writes at most `len` bytes into it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: fd is a socket the caller owns, and info/len describe a valid buffer.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(ReceiverStats {
        rcv_ooopack: info.tcpi_rcv_ooopack,
        rcv_rtt_us: info.tcpi_rcv_rtt,
        bytes_received: info.tcpi_bytes_received,
    })
}
