//! Reading and writing frames on one stream; shared by the server and client loops.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::addr::Stream;
use crate::frame::{flags, Frame, FrameDecoder, FrameError, Header, HEADER_LEN, PREFIX_LEN};
use crate::shm::{ShmRx, ShmTx, SlotRef};

/// Payloads up to this size are copied next to their header so that a burst of small frames
/// goes out in one write; larger ones are written from their own buffer.
const COPY_LIMIT: usize = 16 << 10;
/// Most buffers handed to one vectored write.
const MAX_SLICES: usize = 64;
/// Read buffer grows in steps of at least this.
const READ_CHUNK: usize = 64 << 10;

/// Buffered, cancel-safe frame reader: `fill` may be dropped mid-way inside `select!` without
/// losing bytes, because bytes land in `buf` before `fill` returns.
pub(crate) struct FrameReader {
    buf: BytesMut,
    decoder: FrameDecoder,
    /// The peer's shared-memory region, on a connection that negotiated one.
    shm: Option<Arc<ShmRx>>,
}

impl FrameReader {
    pub(crate) fn new(max_payload: u32) -> FrameReader {
        FrameReader {
            buf: BytesMut::with_capacity(READ_CHUNK),
            decoder: FrameDecoder::new(max_payload),
            shm: None,
        }
    }

    /// Resolves slot references through the peer's region from now on.
    pub(crate) fn set_shm(&mut self, rx: Arc<ShmRx>) {
        self.shm = Some(rx);
    }

    /// Reads once from the stream; `Ok(0)` is end of stream.
    pub(crate) async fn fill<R: AsyncRead + Unpin>(&mut self, stream: &mut R) -> io::Result<usize> {
        if self.buf.capacity() - self.buf.len() < READ_CHUNK / 4 {
            self.buf.reserve(READ_CHUNK);
        }
        stream.read_buf(&mut self.buf).await
    }

    /// The next complete frame already read, if any.
    /// A frame carrying a slot reference comes back with its payload read in place from the
    /// peer's region (flag SHM cleared); a bad reference is `FrameError::BadSlotRef`, after
    /// which the stream may go on.
    pub(crate) fn next(&mut self) -> Result<Option<Frame>, FrameError> {
        let Some(mut f) = self.decoder.decode(&mut self.buf)? else {
            return Ok(None);
        };
        if f.flags & flags::SHM == 0 {
            return Ok(Some(f));
        }
        let bad = |reason: String| FrameError::BadSlotRef {
            kind: f.kind,
            request_id: f.request_id,
            reason,
        };
        let Some(rx) = &self.shm else {
            return Err(bad(
                "expected an inline payload: this connection did not negotiate shared memory \
                 (HELLO option SHM)"
                    .to_owned(),
            ));
        };
        let payload = SlotRef::decode(&f.payload)
            .and_then(|r| rx.resolve(&r))
            .map_err(bad)?;
        f.payload = payload;
        f.flags &= !flags::SHM;
        Ok(Some(f))
    }

    /// Whether a frame has started but not completed.
    pub(crate) fn in_frame(&self) -> bool {
        self.decoder.in_frame(&self.buf)
    }

    pub(crate) fn pending_request_id(&self) -> Option<u64> {
        self.decoder.pending_request_id()
    }

    pub(crate) fn buffered(&self) -> usize {
        self.buf.len()
    }
}

/// Queue of frames going out, written a piece at a time so that a connection's loop can keep
/// reading while the peer is slow to take what it writes. `write_some` is cancel-safe (one write
/// call; what it wrote is recorded before it returns), so it can be a `select!` branch.
pub(crate) struct FrameWriter {
    /// Bytes to write, in order; small frames are coalesced in `staging` first.
    chunks: VecDeque<Bytes>,
    staging: BytesMut,
    /// Per frame not yet fully written: its request id and where it ends in the byte count.
    ends: VecDeque<(u64, u64)>,
    queued: u64,
    written: u64,
    /// This side's shared-memory region, on a connection that negotiated one.
    shm: Option<Arc<ShmTx>>,
}

impl FrameWriter {
    pub(crate) fn new() -> FrameWriter {
        FrameWriter {
            chunks: VecDeque::new(),
            staging: BytesMut::new(),
            ends: VecDeque::new(),
            queued: 0,
            written: 0,
            shm: None,
        }
    }

    /// Sends large payloads through this region from now on.
    pub(crate) fn set_shm(&mut self, tx: Arc<ShmTx>) {
        self.shm = Some(tx);
    }

    /// Queues `f` after the frames already queued.
    /// Queues every frame of `frames`, in order.
    pub(crate) fn extend(&mut self, frames: impl IntoIterator<Item = Frame>) {
        for f in frames {
            self.push(f);
        }
    }

    /// With a shared-memory region, a large payload is copied once into a free slot and the
    /// frame carries the slot's reference; with every slot taken it goes inline (never lost,
    /// never waiting for a slot). A frame already flagged SHM carries a reference its caller
    /// wrote in place (`Client::call_written`) and goes as it is.
    pub(crate) fn push(&mut self, mut f: Frame) {
        if let Some(tx) = &self.shm {
            let eligible = f.flags & (flags::CANCEL | flags::ERROR | flags::SHM) == 0;
            if eligible && tx.carries(f.payload.len()) {
                if let Some(r) = tx.write(&f.payload) {
                    f.payload = r.encode();
                    f.flags |= flags::SHM;
                }
            }
        }
        f.header().encode(&mut self.staging);
        self.queued += (HEADER_LEN + f.payload.len()) as u64;
        self.ends.push_back((f.request_id, self.queued));
        if f.payload.len() <= COPY_LIMIT {
            self.staging.extend_from_slice(&f.payload);
        } else {
            self.chunks.push_back(self.staging.split().freeze());
            self.chunks.push_back(f.payload);
        }
    }

    /// Whether any bytes wait to be written.
    pub(crate) fn has_pending(&self) -> bool {
        self.written < self.queued
    }

    /// Request ids of the frames not yet fully written (so the peer cannot have acted on them).
    pub(crate) fn unwritten(&self) -> impl Iterator<Item = u64> + '_ {
        self.ends.iter().map(|&(id, _)| id)
    }

    /// Writes once, as much as the stream takes; returns how many frames are now fully written.
    pub(crate) async fn write_some<W: AsyncWrite + Unpin>(
        &mut self,
        w: &mut W,
    ) -> io::Result<usize> {
        if !self.has_pending() {
            return Ok(0);
        }
        if !self.staging.is_empty() {
            self.chunks.push_back(self.staging.split().freeze());
        }
        let slices: Vec<IoSlice<'_>> = self
            .chunks
            .iter()
            .take(MAX_SLICES)
            .map(|c| IoSlice::new(c))
            .collect();
        let n = w.write_vectored(&slices).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        self.written += n as u64;
        let mut left = n;
        while left > 0 {
            let front = self
                .chunks
                .front_mut()
                .expect("wrote no more than was queued");
            if front.len() <= left {
                left -= front.len();
                self.chunks.pop_front();
            } else {
                front.advance(left);
                left = 0;
            }
        }
        let mut done = 0;
        while self
            .ends
            .front()
            .is_some_and(|&(_, end)| end <= self.written)
        {
            self.ends.pop_front();
            done += 1;
        }
        Ok(done)
    }
}

/// Why reading a header failed.
pub(crate) enum HeaderError {
    Io(io::Error),
    Frame(FrameError),
}

/// Reads exactly one header and not a byte more (used for HELLO, before a connection is
/// handed to its I/O thread, so no read-ahead may be left behind in a buffer).
pub(crate) async fn read_header(
    stream: &mut Stream,
    max_payload: u32,
) -> Result<Header, HeaderError> {
    let mut head = [0u8; HEADER_LEN];
    // The prefix first: a peer of another version (shorter header) is told so at once.
    let (prefix, rest) = head.split_at_mut(PREFIX_LEN);
    stream.read_exact(prefix).await.map_err(HeaderError::Io)?;
    Header::check_prefix(prefix).map_err(HeaderError::Frame)?;
    stream.read_exact(rest).await.map_err(HeaderError::Io)?;
    Header::decode(&head, max_payload).map_err(HeaderError::Frame)
}

/// Reads exactly the payload `h` announces.
pub(crate) async fn read_payload(stream: &mut Stream, h: &Header) -> io::Result<Frame> {
    let mut payload = vec![0u8; h.payload_len as usize];
    stream.read_exact(&mut payload).await?;
    Ok(Frame::from_header(h, payload.into()))
}
