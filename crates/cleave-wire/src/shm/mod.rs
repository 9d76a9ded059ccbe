//! The shared-memory transport (`shm:/path`): frame headers travel on a Unix socket, large
//! payloads in a memfd region per direction, exchanged with SCM_RIGHTS after the HELLO
//! (docs/protocol.md, "Shared-memory transport").
//!
//! Each side of a data connection creates a region for what it sends ([`ShmTx`]) and maps
//! the peer's for what it receives ([`ShmRx`]). A payload larger than [`INLINE_MAX`] is copied
//! once into a free slot and the frame on the socket carries a [`SlotRef`] (flag SHM) instead;
//! the receiver hands the payload on in place, as a `Bytes` that frees the slot when the last
//! clone drops. The socket itself is the wake-up: the header that names a slot arrives on it,
//! so no eventfd or futex is needed. Regions live as long as their connection: a peer that
//! dies or disconnects takes its slots with it.

mod region;

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::Interest;
use tokio::net::UnixStream;

use region::{state_name, word, FREE, HELD, SENT, WRITING};
pub use region::{Region, MAX_SLOTS, MAX_SLOT_BYTES};

/// Payloads up to this size travel inline on the socket: a slot and its release cost more
/// than copying a few kilobytes through the kernel.
pub const INLINE_MAX: usize = 16 << 10;
/// Bytes of an encoded [`SlotRef`].
pub const SLOT_REF_LEN: usize = 24;

/// The size of the region each side creates for what it sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmConfig {
    pub slots: u32,
    pub slot_bytes: u32,
}

impl Default for ShmConfig {
    /// 16 slots of 8 MiB: a 2,048-candidate RANK payload with binary tensors fits a slot, and
    /// 16 in flight per connection is more than a router keeps on one. Pages are touched only
    /// when written, so the idle cost is the page tables.
    fn default() -> ShmConfig {
        ShmConfig {
            slots: 16,
            slot_bytes: 8 << 20,
        }
    }
}

/// Where a payload lies in the sender's region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotRef {
    pub index: u32,
    /// Byte offset inside the slot.
    pub offset: u32,
    pub len: u32,
    /// The slot's generation when it was written (bumped at every reuse).
    pub generation: u64,
}

impl SlotRef {
    /// index u32, offset u32, length u32, 4 zero bytes, generation u64; little-endian.
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(SLOT_REF_LEN);
        out.put_u32_le(self.index);
        out.put_u32_le(self.offset);
        out.put_u32_le(self.len);
        out.put_u32_le(0);
        out.put_u64_le(self.generation);
        out.freeze()
    }

    pub fn decode(payload: &[u8]) -> Result<SlotRef, String> {
        let Ok(bytes) = <&[u8; SLOT_REF_LEN]>::try_from(payload) else {
            return Err(format!(
                "slot reference must be {SLOT_REF_LEN} bytes (index u32, offset u32, length \
                 u32, zero u32, generation u64), got {} bytes",
                payload.len()
            ));
        };
        let mut b = &bytes[..];
        let (index, offset, len, zero, generation) = (
            b.get_u32_le(),
            b.get_u32_le(),
            b.get_u32_le(),
            b.get_u32_le(),
            b.get_u64_le(),
        );
        if zero != 0 {
            return Err(format!(
                "slot reference bytes 12..16 must be 0, got {zero:#x}"
            ));
        }
        Ok(SlotRef {
            index,
            offset,
            len,
            generation,
        })
    }
}

/// The sending side: this process's own region.
pub struct ShmTx {
    region: Region,
}

impl ShmTx {
    pub fn new(config: ShmConfig) -> io::Result<ShmTx> {
        Ok(ShmTx {
            region: Region::create(config.slots, config.slot_bytes)?,
        })
    }

    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Whether a payload of `len` bytes goes through a slot rather than inline.
    pub fn carries(&self, len: usize) -> bool {
        len > INLINE_MAX && len <= self.region.slot_bytes() as usize
    }

    /// Whether some slot is free now.
    pub fn has_free(&self) -> bool {
        (0..self.region.slots()).any(|i| self.region.state(i).load(Ordering::Acquire) & 3 == FREE)
    }

    /// Copies `payload` into a free slot and marks it sent; `None` when every slot is taken
    /// (the caller sends inline) or the payload does not fit a slot.
    pub fn write(&self, payload: &[u8]) -> Option<SlotRef> {
        self.write_with(payload.len(), |slot| slot.copy_from_slice(payload))
    }

    /// Takes a free slot, lets `fill` write `len` bytes straight into it (every byte: the
    /// slot holds what its last payload left) and marks it sent: a payload assembled in place
    /// is written once. `None`, with `fill` not called, when every slot is taken or `len`
    /// does not fit a slot. Safe from any thread: slots are taken by compare-and-swap.
    pub fn write_with(&self, len: usize, fill: impl FnOnce(&mut [u8])) -> Option<SlotRef> {
        if len > self.region.slot_bytes() as usize {
            return None;
        }
        // The lowest free slot: the one freed last is most likely still in the caches (the
        // receiver just read it), so megabytes are written there faster than into a slot last
        // touched a ring ago (docs/benchmarks.md); and slots never needed stay untouched.
        for i in 0..self.region.slots() {
            let state = self.region.state(i);
            let w = state.load(Ordering::Acquire);
            if w & 3 != FREE {
                continue;
            }
            let generation = (w >> 2) + 1;
            if state
                .compare_exchange(
                    w,
                    word(generation, WRITING),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_err()
            {
                continue;
            }
            // SAFETY: WRITING gives this side the slot (no other writer, and the receiver
            // touches it only once it sees SENT, which the release store below publishes
            // after `fill`); `len` is within the slot (checked above).
            let slot = unsafe { std::slice::from_raw_parts_mut(self.region.slot_ptr(i), len) };
            // A panicking `fill` leaves the slot WRITING for good: one slot fewer, never a
            // half-written payload that looks sent.
            fill(slot);
            state.store(word(generation, SENT), Ordering::Release);
            return Some(SlotRef {
                index: i,
                offset: 0,
                len: len as u32,
                generation,
            });
        }
        None
    }
}

/// The receiving side: the peer's region, mapped.
pub struct ShmRx {
    region: Arc<Region>,
}

impl ShmRx {
    pub fn new(region: Region) -> ShmRx {
        ShmRx {
            region: Arc::new(region),
        }
    }

    pub fn region(&self) -> &Region {
        &self.region
    }

    /// The payload a slot reference names, read in place: a `Bytes` that frees the slot when
    /// dropped. A reference out of range, beyond its slot, or to a slot not in the state and
    /// generation it names is an error saying what was expected and what arrived.
    pub fn resolve(&self, r: &SlotRef) -> Result<Bytes, String> {
        let (slots, slot_bytes) = (self.region.slots(), self.region.slot_bytes());
        if r.index >= slots {
            return Err(format!(
                "slot reference index {} out of range: expected < {slots}",
                r.index
            ));
        }
        let end = u64::from(r.offset) + u64::from(r.len);
        if end > u64::from(slot_bytes) {
            return Err(format!(
                "slot reference offset {} + length {} = {end} bytes: expected at most the slot \
                 size, {slot_bytes} bytes",
                r.offset, r.len
            ));
        }
        let state = self.region.state(r.index);
        let sent = word(r.generation, SENT);
        if let Err(found) = state.compare_exchange(
            sent,
            word(r.generation, HELD),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            return Err(format!(
                "stale slot reference: expected slot {} sent with generation {}, found it {} \
                 with generation {}",
                r.index,
                r.generation,
                state_name(found),
                found >> 2
            ));
        }
        // SAFETY: in bounds (checked above), and HELD keeps the sender off the slot until the
        // view drops.
        let ptr = unsafe { self.region.slot_ptr(r.index).add(r.offset as usize) };
        Ok(Bytes::from_owner(SlotView {
            region: self.region.clone(),
            index: r.index,
            generation: r.generation,
            ptr,
            len: r.len as usize,
        }))
    }
}

/// A received payload in place; frees its slot when dropped.
struct SlotView {
    region: Arc<Region>,
    index: u32,
    generation: u64,
    ptr: *const u8,
    len: usize,
}

// The pointer stays valid while `region` (an Arc) lives, and the slot is HELD for the view.
unsafe impl Send for SlotView {}
unsafe impl Sync for SlotView {}

impl AsRef<[u8]> for SlotView {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: see the Send impl.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for SlotView {
    fn drop(&mut self) {
        // Fails only if the sender broke the protocol; then the slot is not ours to free.
        let _ = self.region.state(self.index).compare_exchange(
            word(self.generation, HELD),
            word(self.generation, FREE),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}

/// Both directions of one data connection.
pub struct ShmLink {
    pub tx: Arc<ShmTx>,
    pub rx: Arc<ShmRx>,
}

/// The one byte that carries a region's descriptor.
const FD_MESSAGE: u8 = b'S';

/// Sends `fd` with one byte over the socket (SCM_RIGHTS).
pub async fn send_fd(stream: &UnixStream, fd: BorrowedFd<'_>) -> io::Result<()> {
    stream
        .async_io(Interest::WRITABLE, || {
            send_fd_now(stream.as_raw_fd(), fd.as_raw_fd())
        })
        .await
}

/// Receives exactly one byte and the descriptor that came with it.
pub async fn recv_fd(stream: &UnixStream) -> io::Result<OwnedFd> {
    stream
        .async_io(Interest::READABLE, || recv_fd_now(stream.as_raw_fd()))
        .await
}

const CMSG_BUF: usize = 64;

fn send_fd_now(sock: i32, fd: i32) -> io::Result<()> {
    let mut byte = [FD_MESSAGE];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut cbuf = [0u64; CMSG_BUF / 8];
    // SAFETY: msghdr and its control buffer are local, sized with CMSG_SPACE.
    unsafe {
        let space = libc::CMSG_SPACE(std::mem::size_of::<i32>() as u32) as usize;
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<i32>(), fd);
        match libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) {
            1 => Ok(()),
            n if n < 0 => Err(io::Error::last_os_error()),
            _ => Err(io::ErrorKind::WriteZero.into()),
        }
    }
}

fn recv_fd_now(sock: i32) -> io::Result<OwnedFd> {
    let mut byte = [0u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut cbuf = [0u64; CMSG_BUF / 8];
    // SAFETY: as in send_fd_now; descriptors received are owned at once so none leaks.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = CMSG_BUF as _;
        let n = libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut fds = Vec::new();
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let count = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                for k in 0..count {
                    let fd = std::ptr::read_unaligned(data.cast::<i32>().add(k));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer closed the connection before sending its shared-memory region",
            ));
        }
        if byte[0] != FD_MESSAGE || fds.len() != 1 || msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "expected one byte {FD_MESSAGE:#04x} carrying one region descriptor, got \
                     byte {:#04x} with {} descriptors",
                    byte[0],
                    fds.len()
                ),
            ));
        }
        Ok(fds.pop().expect("one"))
    }
}

/// After HELLO, on either side: sends this side's new region and maps the peer's. The client
/// sends first, the server answers, so neither waits on the other.
pub(crate) async fn exchange(
    stream: &UnixStream,
    config: ShmConfig,
    send_first: bool,
) -> Result<ShmLink, String> {
    let tx = ShmTx::new(config).map_err(|e| e.to_string())?;
    let send = || async {
        send_fd(stream, tx.region().fd().as_fd())
            .await
            .map_err(|e| format!("cannot send the shared-memory region: {e}"))
    };
    if send_first {
        send().await?;
    }
    let fd = recv_fd(stream)
        .await
        .map_err(|e| format!("no shared-memory region from the peer: {e}"))?;
    let rx = Region::open(fd)?;
    if !send_first {
        send().await?;
    }
    Ok(ShmLink {
        tx: Arc::new(tx),
        rx: Arc::new(ShmRx::new(rx)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(slots: u32, slot_bytes: u32) -> (ShmTx, ShmRx) {
        let tx = ShmTx::new(ShmConfig { slots, slot_bytes }).unwrap();
        let fd = tx.region().fd().try_clone().unwrap();
        (tx, ShmRx::new(Region::open(fd).unwrap()))
    }

    #[test]
    fn a_payload_is_read_in_place_and_its_slot_freed_on_drop() {
        let (tx, rx) = pair(2, 64 << 10);
        let data: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();
        let r = tx.write(&data).unwrap();
        let got = rx.resolve(&r).unwrap();
        assert_eq!(&got[..], &data[..]);
        let clone = got.slice(10..20);
        drop(got);
        assert_eq!(tx.region().in_use(), 1, "a clone still holds the slot");
        drop(clone);
        assert_eq!(tx.region().in_use(), 0);
    }

    #[test]
    fn the_slot_just_freed_is_written_next_while_it_is_warm() {
        let (tx, rx) = pair(4, 1024);
        for round in 0..3 {
            let r = tx.write(&[round; 100]).unwrap();
            assert_eq!(r.index, 0, "round {round}: the lowest free slot");
            drop(rx.resolve(&r).unwrap());
        }
        let held = rx.resolve(&tx.write(&[7; 100]).unwrap()).unwrap();
        assert_eq!(tx.write(&[8; 100]).unwrap().index, 1, "slot 0 is held");
        drop(held);
    }

    #[test]
    fn a_full_ring_refuses_until_a_slot_is_released() {
        let (tx, rx) = pair(2, 1024);
        let a = tx.write(&[1; 100]).unwrap();
        let b = tx.write(&[2; 100]).unwrap();
        assert!(!tx.has_free());
        assert_eq!(tx.write(&[3; 100]), None);
        assert_eq!(tx.write(&[4; 2000]), None, "larger than a slot");
        let held = rx.resolve(&a).unwrap();
        drop(rx.resolve(&b).unwrap());
        assert!(tx.has_free());
        let c = tx.write(&[5; 100]).unwrap();
        assert_eq!(c.index, b.index);
        assert_eq!(c.generation, b.generation + 1);
        assert_eq!(held[0], 1);
    }

    #[test]
    fn a_payload_filled_in_place_is_read_as_written() {
        let (tx, rx) = pair(1, 64 << 10);
        let r = tx.write_with(30_000, |slot| {
            for (i, b) in slot.iter_mut().enumerate() {
                *b = (i % 251) as u8;
            }
        });
        let got = rx.resolve(&r.unwrap()).unwrap();
        assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        let mut called = false;
        assert_eq!(
            tx.write_with(10, |_| called = true),
            None,
            "the only slot is held"
        );
        assert!(!called, "fill runs only with a slot");
        drop(got);
        assert_eq!(
            tx.write_with(70_000, |_| called = true),
            None,
            "larger than a slot"
        );
        assert!(!called);
    }

    #[test]
    fn malformed_references_are_errors_naming_what_was_expected() {
        let (tx, rx) = pair(4, 1024);
        let r = tx.write(&[7; 100]).unwrap();
        let e = rx.resolve(&SlotRef { index: 9, ..r }).unwrap_err();
        assert!(e.contains("index 9 out of range: expected < 4"), "{e}");
        let e = rx.resolve(&SlotRef { len: 2000, ..r }).unwrap_err();
        assert!(e.contains("expected at most the slot size, 1024"), "{e}");
        let e = rx.resolve(&SlotRef { generation: 5, ..r }).unwrap_err();
        assert!(e.contains("stale slot reference: expected slot"), "{e}");
        let first = rx.resolve(&r).unwrap();
        let e = rx.resolve(&r).unwrap_err();
        assert!(
            e.contains("held by the receiver"),
            "a reference used twice: {e}"
        );
        drop(first);
        let e = SlotRef::decode(&[0; 10]).unwrap_err();
        assert!(e.contains("must be 24 bytes"), "{e}");
    }

    #[test]
    fn slot_reference_round_trips() {
        let r = SlotRef {
            index: 3,
            offset: 5,
            len: 99,
            generation: u64::MAX >> 2,
        };
        assert_eq!(SlotRef::decode(&r.encode()), Ok(r));
    }
}
