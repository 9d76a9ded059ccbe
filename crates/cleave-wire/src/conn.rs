//! Reading and writing frames on one stream; shared by the server and client loops.

use std::io;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::addr::Stream;
use crate::frame::{Frame, FrameDecoder, FrameError, Header, HEADER_LEN};

/// Payloads up to this size are copied next to their header so that a burst of small frames
/// goes out in one write; larger ones are written from their own buffer.
const COPY_LIMIT: usize = 16 << 10;
/// Read buffer grows in steps of at least this.
const READ_CHUNK: usize = 64 << 10;

/// Buffered, cancel-safe frame reader: `fill` may be dropped mid-way inside `select!` without
/// losing bytes, because bytes land in `buf` before `fill` returns.
pub(crate) struct FrameReader {
    buf: BytesMut,
    decoder: FrameDecoder,
}

impl FrameReader {
    pub(crate) fn new(max_payload: u32) -> FrameReader {
        FrameReader {
            buf: BytesMut::with_capacity(READ_CHUNK),
            decoder: FrameDecoder::new(max_payload),
        }
    }

    /// Reads once from the stream; `Ok(0)` is end of stream.
    pub(crate) async fn fill(&mut self, stream: &mut Stream) -> io::Result<usize> {
        if self.buf.capacity() - self.buf.len() < READ_CHUNK / 4 {
            self.buf.reserve(READ_CHUNK);
        }
        stream.read_buf(&mut self.buf).await
    }

    /// The next complete frame already read, if any.
    pub(crate) fn next(&mut self) -> Result<Option<Frame>, FrameError> {
        self.decoder.decode(&mut self.buf)
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

/// Writes `frames` in order, batching small ones into few writes.
pub(crate) async fn write_frames(
    stream: &mut Stream,
    staging: &mut BytesMut,
    frames: impl IntoIterator<Item = Frame>,
) -> io::Result<()> {
    for f in frames {
        f.header().encode(staging);
        if f.payload.len() <= COPY_LIMIT {
            staging.extend_from_slice(&f.payload);
        } else {
            stream.write_all(staging).await?;
            staging.clear();
            stream.write_all(&f.payload).await?;
        }
    }
    if !staging.is_empty() {
        stream.write_all(staging).await?;
        staging.clear();
    }
    Ok(())
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
    stream
        .read_exact(&mut head)
        .await
        .map_err(HeaderError::Io)?;
    Header::decode(&head, max_payload).map_err(HeaderError::Frame)
}

/// Reads exactly the payload `h` announces.
pub(crate) async fn read_payload(stream: &mut Stream, h: &Header) -> io::Result<Frame> {
    let mut payload = vec![0u8; h.payload_len as usize];
    stream.read_exact(&mut payload).await?;
    Ok(Frame {
        flags: h.flags,
        kind: h.kind,
        request_id: h.request_id,
        payload: payload.into(),
    })
}
