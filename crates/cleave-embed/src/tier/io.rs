//! Reading rows from SSD with O_DIRECT: io_uring when the kernel allows it, else positioned
//! reads on scoped threads. The backend is chosen once, when a tier is created, and logged.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::sync::Mutex;
use std::time::Duration;

use io_uring::{opcode, types, IoUring};

/// Which I/O backend a tier uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoMode {
    /// io_uring if this kernel allows it, else positioned reads.
    #[default]
    Auto,
    Uring,
    Pread,
}

impl std::str::FromStr for IoMode {
    type Err = String;

    fn from_str(s: &str) -> Result<IoMode, String> {
        match s {
            "auto" => Ok(IoMode::Auto),
            "uring" | "io_uring" => Ok(IoMode::Uring),
            "pread" => Ok(IoMode::Pread),
            other => Err(format!(
                "io backend must be auto, uring or pread, found {other:?}"
            )),
        }
    }
}

/// One read: `len` bytes (block-aligned) at `offset` (block-aligned) into its slot of the
/// buffer; `need` is how many of them must arrive (the row's end; the span may pass EOF).
#[derive(Debug, Clone, Copy)]
pub struct Span {
    pub offset: u64,
    pub len: usize,
    pub need: usize,
}

/// Reads in flight on one ring; more are submitted in rounds of this many.
const QUEUE_DEPTH: u32 = 256;
/// A read that has not completed in this long is an error, not a hang.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) enum Io {
    /// Rings for the threads reading at the same time, each taken for one batch of reads.
    Uring(Mutex<Vec<IoUring>>),
    Pread {
        threads: usize,
    },
}

impl Io {
    /// The backend for `mode`; Auto falls back to positioned reads if io_uring cannot be set up
    /// (an old kernel, or a sandbox that forbids it), and says so in the log.
    pub fn new(mode: IoMode, threads: usize) -> std::io::Result<Io> {
        let pread = Io::Pread {
            threads: threads.max(1),
        };
        match mode {
            IoMode::Pread => Ok(pread),
            IoMode::Uring => Ok(Io::Uring(Mutex::new(vec![IoUring::new(QUEUE_DEPTH)?]))),
            IoMode::Auto => match IoUring::new(QUEUE_DEPTH) {
                Ok(ring) => Ok(Io::Uring(Mutex::new(vec![ring]))),
                Err(e) => {
                    tracing::warn!(error = %e, "io_uring unavailable; SSD tier uses positioned reads on threads");
                    Ok(pread)
                }
            },
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Io::Uring(_) => "io_uring",
            Io::Pread { .. } => "pread",
        }
    }

    /// Reads every span into `buf`, span `i` at `i * slot` (all submitted together).
    pub fn read(
        &self,
        file: &File,
        spans: &[Span],
        buf: &mut AlignedBuf,
        slot: usize,
    ) -> std::io::Result<()> {
        assert!(spans.iter().all(|s| s.len <= slot) && spans.len() * slot <= buf.len());
        match self {
            Io::Uring(rings) => {
                let taken = rings.lock().unwrap_or_else(|e| e.into_inner()).pop();
                let mut ring = match taken {
                    Some(r) => r,
                    None => IoUring::new(QUEUE_DEPTH)?,
                };
                let result = read_uring(&mut ring, file, spans, buf, slot);
                rings.lock().unwrap_or_else(|e| e.into_inner()).push(ring);
                result
            }
            Io::Pread { threads } => read_pread(*threads, file, spans, buf, slot),
        }
    }
}

fn read_uring(
    ring: &mut IoUring,
    file: &File,
    spans: &[Span],
    buf: &mut AlignedBuf,
    slot: usize,
) -> std::io::Result<()> {
    let fd = types::Fd(file.as_raw_fd());
    let base = buf.as_mut_ptr();
    let timeout = types::Timespec::from(READ_TIMEOUT);
    for (round, chunk) in spans.chunks(QUEUE_DEPTH as usize).enumerate() {
        let first = round * QUEUE_DEPTH as usize;
        {
            let mut sq = ring.submission();
            for (k, span) in chunk.iter().enumerate() {
                let i = first + k;
                // SAFETY: slot i lies inside buf (asserted by the caller) and is written by
                // this read only; buf outlives the wait below.
                let dst = unsafe { base.add(i * slot) };
                let entry = opcode::Read::new(fd, dst, span.len as u32)
                    .offset(span.offset)
                    .build()
                    .user_data(i as u64);
                // SAFETY: the buffer stays valid until the completion is reaped below.
                unsafe { sq.push(&entry) }
                    .map_err(|_| std::io::Error::other("io_uring submission queue full"))?;
            }
        }
        let mut done = 0;
        // Each wait reaps at least one completion or times out: at most chunk.len() waits.
        for _ in 0..=chunk.len() {
            if done == chunk.len() {
                break;
            }
            let args = types::SubmitArgs::new().timespec(&timeout);
            match ring.submitter().submit_with_args(chunk.len() - done, &args) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ETIME) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("SSD reads did not complete within {READ_TIMEOUT:?}"),
                    ));
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
            for cqe in ring.completion() {
                done += 1;
                let span = &spans[cqe.user_data() as usize];
                let n = cqe.result();
                if n < 0 {
                    return Err(std::io::Error::from_raw_os_error(-n));
                }
                if (n as usize) < span.need {
                    return Err(short_read(span, n as usize));
                }
            }
        }
        if done < chunk.len() {
            return Err(std::io::Error::other("io_uring lost completions"));
        }
    }
    Ok(())
}

fn short_read(span: &Span, got: usize) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        format!(
            "read {got} bytes at offset {}, expected at least {} (file truncated?)",
            span.offset, span.need
        ),
    )
}

fn read_pread(
    threads: usize,
    file: &File,
    spans: &[Span],
    buf: &mut AlignedBuf,
    slot: usize,
) -> std::io::Result<()> {
    let slots: Vec<&mut [u8]> = buf
        .as_mut_slice()
        .chunks_mut(slot)
        .take(spans.len())
        .collect();
    let per = spans.len().div_ceil(threads.max(1)).max(1);
    let read_all = |spans: &[Span], slots: Vec<&mut [u8]>| -> std::io::Result<()> {
        for (span, dst) in spans.iter().zip(slots) {
            let n = file.read_at(&mut dst[..span.len], span.offset)?;
            if n < span.need {
                return Err(short_read(span, n));
            }
        }
        Ok(())
    };
    let mut groups: Vec<Vec<&mut [u8]>> = Vec::new();
    let mut slots = slots.into_iter();
    for _ in spans.chunks(per) {
        groups.push(slots.by_ref().take(per).collect());
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = spans
            .chunks(per)
            .zip(groups)
            .map(|(s, g)| scope.spawn(move || read_all(s, g)))
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("read thread panicked")))
        })
    })
}

/// A zeroed buffer aligned for O_DIRECT.
pub struct AlignedBuf {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: the buffer is owned memory like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

pub const ALIGN: usize = 4096;

impl AlignedBuf {
    pub fn new(len: usize) -> AlignedBuf {
        let layout = Layout::from_size_align(len.max(ALIGN), ALIGN).expect("buffer layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, layout }
    }

    pub fn len(&self) -> usize {
        self.layout.size()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr holds layout.size() initialised (zeroed) bytes we own.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// The smallest O_DIRECT read size `file` accepts: 512 if a 512-byte read at offset 0 works,
/// else 4096. Err if neither does.
pub fn probe_block(file: &File) -> std::io::Result<usize> {
    let mut buf = AlignedBuf::new(ALIGN);
    let mut last = None;
    for block in [512usize, 4096] {
        match file.read_at(&mut buf.as_mut_slice()[..block], 0) {
            Ok(_) => return Ok(block),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no block size works")))
}
