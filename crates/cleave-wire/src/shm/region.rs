//! One shared-memory region: a sealed memfd mapping holding a ring of bounded slots, each
//! with an atomic state word (docs/protocol.md, "Shared-memory transport").
//!
//! ```text
//! offset              size            field
//! 0                   4               magic b"CLVS"
//! 4                   4               layout version (1)
//! 8                   4               slots (u32 LE)
//! 12                  4               slot_bytes (u32 LE)
//! 16                  48              zero
//! 64                  8 * slots       state words: generation << 2 | state
//! data_offset         slots * slot_bytes   payloads; data_offset = 64 + 8 * slots rounded up to 4096
//! ```
//!
//! A region belongs to its sender: the sender moves a slot FREE -> WRITING (bumping the
//! generation) -> SENT; the receiver moves it SENT -> HELD when it resolves a reference, and
//! HELD -> FREE when the payload it handed out is dropped. Every move is a compare-and-swap,
//! so a stale or repeated reference can never take a slot the sender has reused.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

const MAGIC: [u8; 4] = *b"CLVS";
const LAYOUT_VERSION: u32 = 1;
const HEADER_BYTES: usize = 64;
const PAGE: usize = 4096;
/// Most slots a region may declare (a peer's header is not trusted beyond this).
pub const MAX_SLOTS: u32 = 4096;
/// Largest slot a region may declare (1 GiB).
pub const MAX_SLOT_BYTES: u32 = 1 << 30;

/// A slot's states (the low two bits of its state word).
pub(crate) const FREE: u64 = 0;
pub(crate) const WRITING: u64 = 1;
pub(crate) const SENT: u64 = 2;
pub(crate) const HELD: u64 = 3;

pub(crate) fn word(generation: u64, state: u64) -> u64 {
    (generation << 2) | state
}

pub(crate) fn state_name(w: u64) -> &'static str {
    match w & 3 {
        FREE => "free",
        WRITING => "being written",
        SENT => "sent",
        _ => "held by the receiver",
    }
}

fn data_offset(slots: u32) -> usize {
    (HEADER_BYTES + 8 * slots as usize).div_ceil(PAGE) * PAGE
}

fn region_len(slots: u32, slot_bytes: u32) -> usize {
    data_offset(slots) + slots as usize * slot_bytes as usize
}

/// A mapped region (its own or a peer's). Unmapped when dropped.
pub struct Region {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
    slots: u32,
    slot_bytes: u32,
}

// The mapping is plain shared memory; all concurrent access to it goes through the atomic
// state words, and a slot's bytes are touched only by the side the state word says owns it.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

fn os_err(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl Region {
    /// Creates a region of `slots` slots of `slot_bytes` each, sealed against resizing so a
    /// peer that maps it can never be made to fault by a shrink.
    pub fn create(slots: u32, slot_bytes: u32) -> io::Result<Region> {
        if slots == 0 || slots > MAX_SLOTS || slot_bytes == 0 || slot_bytes > MAX_SLOT_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "shared-memory region of {slots} slots of {slot_bytes} bytes: expected 1 to \
                     {MAX_SLOTS} slots of 1 to {MAX_SLOT_BYTES} bytes"
                ),
            ));
        }
        let len = region_len(slots, slot_bytes);
        // SAFETY: plain syscalls on a descriptor this function owns.
        let fd = unsafe {
            let raw = libc::memfd_create(
                c"cleave-shm".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            );
            if raw < 0 {
                return Err(os_err("memfd_create"));
            }
            let fd = OwnedFd::from_raw_fd(raw);
            if libc::ftruncate(raw, len as libc::off_t) != 0 {
                return Err(os_err("ftruncate of the shared-memory region"));
            }
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
            if libc::fcntl(raw, libc::F_ADD_SEALS, seals) != 0 {
                return Err(os_err("sealing the shared-memory region"));
            }
            fd
        };
        let region = Region::map(fd, len, slots, slot_bytes)?;
        // SAFETY: the header lies inside the fresh mapping, which nobody else sees yet.
        unsafe {
            let h = std::slice::from_raw_parts_mut(region.ptr, HEADER_BYTES);
            h[0..4].copy_from_slice(&MAGIC);
            h[4..8].copy_from_slice(&LAYOUT_VERSION.to_le_bytes());
            h[8..12].copy_from_slice(&slots.to_le_bytes());
            h[12..16].copy_from_slice(&slot_bytes.to_le_bytes());
        }
        Ok(region)
    }

    /// Maps a peer's region from its descriptor, checking the seals, the size and the header
    /// (read once: the peer could rewrite it later, so the values kept here are what count).
    pub fn open(fd: OwnedFd) -> Result<Region, String> {
        let raw = fd.as_raw_fd();
        // SAFETY: fcntl and fstat on a descriptor this function owns.
        let (seals, size) = unsafe {
            let seals = libc::fcntl(raw, libc::F_GET_SEALS);
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(raw, &mut st) != 0 {
                return Err(format!(
                    "fstat of the peer's region: {}",
                    io::Error::last_os_error()
                ));
            }
            (seals, st.st_size as usize)
        };
        let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals < 0 || seals & need != need {
            return Err(format!(
                "the peer's region must be a memfd sealed against shrinking and growing \
                 (seals {need:#x}), got seals {seals:#x}"
            ));
        }
        if size < PAGE {
            return Err(format!(
                "the peer's region is {size} bytes, expected at least {PAGE}"
            ));
        }
        let mut head = [0u8; 16];
        // SAFETY: pread into a local buffer.
        let n = unsafe { libc::pread(raw, head.as_mut_ptr().cast(), 16, 0) };
        if n != 16 {
            return Err("cannot read the peer's region header".to_owned());
        }
        let u32_at = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4 bytes"));
        let (version, slots, slot_bytes) = (u32_at(4), u32_at(8), u32_at(12));
        if head[0..4] != MAGIC || version != LAYOUT_VERSION {
            return Err(format!(
                "the peer's region header: expected magic \"CLVS\" version {LAYOUT_VERSION}, \
                 got {:?} version {version}",
                &head[0..4]
            ));
        }
        if slots == 0 || slots > MAX_SLOTS || slot_bytes == 0 || slot_bytes > MAX_SLOT_BYTES {
            return Err(format!(
                "the peer's region declares {slots} slots of {slot_bytes} bytes: expected 1 to \
                 {MAX_SLOTS} slots of 1 to {MAX_SLOT_BYTES} bytes"
            ));
        }
        let len = region_len(slots, slot_bytes);
        if size != len {
            return Err(format!(
                "the peer's region is {size} bytes, expected {len} for {slots} slots of \
                 {slot_bytes} bytes"
            ));
        }
        Region::map(fd, len, slots, slot_bytes).map_err(|e| e.to_string())
    }

    fn map(fd: OwnedFd, len: usize, slots: u32, slot_bytes: u32) -> io::Result<Region> {
        // SAFETY: a fresh shared mapping of the whole (sealed) file.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_err("mmap of the shared-memory region"));
        }
        Ok(Region {
            ptr: ptr.cast(),
            len,
            fd,
            slots,
            slot_bytes,
        })
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    pub fn slot_bytes(&self) -> u32 {
        self.slot_bytes
    }

    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Slot `i`'s state word (`i` < slots).
    pub(crate) fn state(&self, i: u32) -> &AtomicU64 {
        assert!(i < self.slots, "slot {i} of {}", self.slots);
        // SAFETY: inside the mapping, 8-aligned (the mapping is page-aligned), and only ever
        // accessed atomically by both processes.
        unsafe { &*(self.ptr.add(HEADER_BYTES + 8 * i as usize) as *const AtomicU64) }
    }

    /// Where slot `i`'s bytes start.
    pub(crate) fn slot_ptr(&self, i: u32) -> *mut u8 {
        assert!(i < self.slots, "slot {i} of {}", self.slots);
        // SAFETY: inside the mapping (region_len covers every slot).
        unsafe {
            self.ptr
                .add(data_offset(self.slots) + i as usize * self.slot_bytes as usize)
        }
    }

    /// Slots not free (being written, sent, or held by the receiver).
    pub fn in_use(&self) -> u32 {
        (0..self.slots)
            .filter(|&i| self.state(i).load(Ordering::Acquire) & 3 != FREE)
            .count() as u32
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`; nothing borrows it any more (payload views hold
        // an Arc of the region).
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_created_region_opens_from_its_descriptor() {
        let r = Region::create(4, 1000).unwrap();
        let fd = r.fd().try_clone().unwrap();
        let peer = Region::open(fd).unwrap();
        assert_eq!((peer.slots(), peer.slot_bytes()), (4, 1000));
        r.state(2).store(word(7, SENT), Ordering::Release);
        assert_eq!(peer.state(2).load(Ordering::Acquire), word(7, SENT));
        unsafe { *r.slot_ptr(3).add(999) = 42 };
        assert_eq!(unsafe { *peer.slot_ptr(3).add(999) }, 42);
        assert_eq!(peer.in_use(), 1);
    }

    #[test]
    fn bad_sizes_and_unsealed_files_are_refused() {
        assert!(Region::create(0, 10).is_err());
        assert!(Region::create(MAX_SLOTS + 1, 10).is_err());
        // A plain memfd, not sealed: a peer could shrink it under the mapping.
        let raw = unsafe { libc::memfd_create(c"plain".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        assert_eq!(unsafe { libc::ftruncate(raw, 8192) }, 0);
        let e = Region::open(fd).err().unwrap();
        assert!(e.contains("sealed"), "{e}");
    }
}
