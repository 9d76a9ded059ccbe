//! Frames: a fixed 40-byte little-endian header followed by `payload_len` bytes. This file is
//! the one home of the codec: every header is read by [`Header::decode`].
//!
//! ```text
//! offset size field
//!  0     4    magic            b"CLVW"
//!  4     1    version          2
//!  5     1    flags            bit 0 RESPONSE, bit 1 ERROR, bit 2 CANCEL, bit 3 SHM; other bits 0
//!  6     2    kind             u16: 0x0000-0x00ff control, 0x0100- application
//!  8     8    request_id       u64, chosen by the requester, echoed in the response
//! 16     4    payload_len      u32, at most the receiver's frame limit
//! 20     4    reserved         0
//! 24     8    deadline_unix_us u64, the request's absolute deadline (Unix µs); 0 = none
//! 32     8    trace_id         u64, the id of the client request it serves; 0 = none
//! ```
//!
//! docs/protocol.md is the reference; this file and that page change together.

use std::fmt;

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"CLVW";
/// The protocol version this crate speaks.
pub const VERSION: u8 = 2;
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 40;
/// Leading header bytes that every version shares: magic, version, flags, kind, request id.
pub const PREFIX_LEN: usize = 16;
/// Default largest payload a peer accepts (64 MiB).
pub const DEFAULT_MAX_PAYLOAD: u32 = 64 << 20;

/// Header flag bits.
pub mod flags {
    /// The frame answers the request with the same id.
    pub const RESPONSE: u8 = 1 << 0;
    /// The frame is an error response; its payload is an [`ErrorBody`](super::ErrorBody).
    pub const ERROR: u8 = 1 << 1;
    /// The caller gave up on the earlier request with the same id on this connection. Only on
    /// a request frame, with an empty payload; nothing answers it.
    pub const CANCEL: u8 = 1 << 2;
    /// The payload is a 24-byte slot reference into the sender's shared-memory region
    /// (shm.rs); only on data connections that negotiated it in HELLO, never with CANCEL.
    pub const SHM: u8 = 1 << 3;
    /// Every bit version 2 defines.
    pub const KNOWN: u8 = RESPONSE | ERROR | CANCEL | SHM;
}

/// Frame kinds. Kinds below [`FIRST_APP`](kind::FIRST_APP) belong to this crate (connection
/// set-up and control); applications number theirs from it upwards.
pub mod kind {
    /// First frame of every connection: declares the connection's class.
    pub const HELLO: u16 = 0x0000;
    /// Liveness probe: answered by the I/O thread with an empty payload.
    pub const PING: u16 = 0x0001;
    /// Readiness probe: answered with one byte, 1 if the server's handler is ready.
    pub const READY: u16 = 0x0002;
    /// Response credits for one data connection, sent on a control connection (payload:
    /// data connection id u64, grant in bytes u64; answered with an empty response).
    pub const CREDIT: u16 = 0x0003;
    /// Kinds below this are control kinds, answered by the server itself.
    pub const FIRST_APP: u16 = 0x0100;

    /// Whether `kind` travels on a control connection.
    pub fn is_control(kind: u16) -> bool {
        kind < FIRST_APP
    }
}

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub flags: u8,
    pub kind: u16,
    pub request_id: u64,
    pub payload_len: u32,
    /// Absolute deadline of the request, Unix microseconds; 0 = none.
    pub deadline_unix_us: u64,
    /// The id of the client request this frame serves (set by the router); 0 = none.
    pub trace_id: u64,
}

impl Header {
    /// Writes the 40 header bytes.
    pub fn encode(&self, out: &mut impl BufMut) {
        out.put_slice(&MAGIC);
        out.put_u8(VERSION);
        out.put_u8(self.flags);
        out.put_u16_le(self.kind);
        out.put_u64_le(self.request_id);
        out.put_u32_le(self.payload_len);
        out.put_u32_le(0);
        out.put_u64_le(self.deadline_unix_us);
        out.put_u64_le(self.trace_id);
    }

    /// Parses and validates a header; `max_payload` is the receiver's frame limit.
    /// Checks magic and version from the first bytes of a header, as many as have arrived
    /// (up to [`PREFIX_LEN`]). Headers of other versions have other lengths (version 1: 24
    /// bytes), so they are refused from their prefix rather than waited for.
    pub fn check_prefix(bytes: &[u8]) -> Result<(), FrameError> {
        if bytes.len() >= 4 && bytes[..4] != MAGIC {
            let magic = bytes[..4].try_into().expect("4 bytes");
            return Err(FrameError::BadMagic(magic));
        }
        match bytes.get(4) {
            Some(&found) if found != VERSION => Err(FrameError::UnsupportedVersion {
                found,
                // Where versions 1 and 2 put it, when it has arrived.
                request_id: bytes
                    .get(8..16)
                    .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes"))),
            }),
            _ => Ok(()),
        }
    }

    pub fn decode(bytes: &[u8; HEADER_LEN], max_payload: u32) -> Result<Header, FrameError> {
        // Magic and version first: a peer of another version lays out the rest differently.
        Header::check_prefix(bytes)?;
        let mut b = &bytes[5..];
        let flags = b.get_u8();
        let kind = b.get_u16_le();
        let request_id = b.get_u64_le();
        let payload_len = b.get_u32_le();
        let reserved = b.get_u32_le();
        let deadline_unix_us = b.get_u64_le();
        let trace_id = b.get_u64_le();
        let response = flags & flags::RESPONSE != 0;
        if flags & !flags::KNOWN != 0
            || (flags & flags::ERROR != 0 && !response)
            || (flags & flags::CANCEL != 0 && response)
            || (flags & flags::SHM != 0 && flags & (flags::CANCEL | flags::ERROR) != 0)
        {
            return Err(FrameError::BadFlags { flags, request_id });
        }
        if flags & flags::CANCEL != 0 && payload_len != 0 {
            return Err(FrameError::CancelWithPayload {
                len: payload_len,
                request_id,
            });
        }
        if reserved != 0 {
            return Err(FrameError::BadReserved {
                value: reserved,
                request_id,
            });
        }
        if payload_len > max_payload {
            return Err(FrameError::TooLarge {
                len: payload_len,
                max: max_payload,
                request_id,
            });
        }
        Ok(Header {
            flags,
            kind,
            request_id,
            payload_len,
            deadline_unix_us,
            trace_id,
        })
    }
}

/// One frame: header fields and the payload (shared, never copied after decoding).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub flags: u8,
    pub kind: u16,
    pub request_id: u64,
    /// Unix µs; 0 = none. Requests carry their deadline; responses echo it.
    pub deadline_unix_us: u64,
    /// 0 = none. Responses echo their request's.
    pub trace_id: u64,
    pub payload: Bytes,
}

impl Frame {
    /// A request without deadline or trace id (see [`Frame::with_context`]).
    pub fn request(kind: u16, request_id: u64, payload: Bytes) -> Frame {
        Frame {
            flags: 0,
            kind,
            request_id,
            deadline_unix_us: 0,
            trace_id: 0,
            payload,
        }
    }

    /// Cancels the earlier request `request_id` of this connection.
    pub fn cancel(kind: u16, request_id: u64) -> Frame {
        Frame {
            flags: flags::CANCEL,
            ..Frame::request(kind, request_id, Bytes::new())
        }
    }

    pub fn response(kind: u16, request_id: u64, payload: Bytes) -> Frame {
        Frame {
            flags: flags::RESPONSE,
            ..Frame::request(kind, request_id, payload)
        }
    }

    /// The same frame with a deadline (Unix µs) and a trace id.
    pub fn with_context(mut self, deadline_unix_us: u64, trace_id: u64) -> Frame {
        self.deadline_unix_us = deadline_unix_us;
        self.trace_id = trace_id;
        self
    }

    /// A frame from a decoded header and its payload.
    pub fn from_header(h: &Header, payload: Bytes) -> Frame {
        Frame {
            flags: h.flags,
            kind: h.kind,
            request_id: h.request_id,
            deadline_unix_us: h.deadline_unix_us,
            trace_id: h.trace_id,
            payload,
        }
    }

    pub fn error(kind: u16, request_id: u64, code: ErrorCode, message: &str) -> Frame {
        let body = ErrorBody {
            code,
            message: message.to_owned(),
        }
        .encode();
        Frame {
            flags: flags::RESPONSE | flags::ERROR,
            ..Frame::request(kind, request_id, body)
        }
    }

    pub fn is_response(&self) -> bool {
        self.flags & flags::RESPONSE != 0
    }

    pub fn is_error(&self) -> bool {
        self.flags & flags::ERROR != 0
    }

    pub fn is_cancel(&self) -> bool {
        self.flags & flags::CANCEL != 0
    }

    /// The header this frame is sent with. Payloads over 4 GiB cannot be framed; callers
    /// check sizes against the peer's limit (which is smaller) before building a frame.
    pub fn header(&self) -> Header {
        Header {
            flags: self.flags,
            kind: self.kind,
            request_id: self.request_id,
            payload_len: u32::try_from(self.payload.len()).unwrap_or(u32::MAX),
            deadline_unix_us: self.deadline_unix_us,
            trace_id: self.trace_id,
        }
    }

    /// Header and payload as one buffer (tests and small frames; the I/O loops write the
    /// payload without copying it).
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(HEADER_LEN + self.payload.len());
        self.header().encode(&mut out);
        out.put_slice(&self.payload);
        out.freeze()
    }
}

/// Incremental decoder: bytes in, whole frames out. Tolerates any split of the input.
#[derive(Debug)]
pub struct FrameDecoder {
    max_payload: u32,
    header: Option<Header>,
}

impl FrameDecoder {
    pub fn new(max_payload: u32) -> FrameDecoder {
        FrameDecoder {
            max_payload,
            header: None,
        }
    }

    /// Takes the next whole frame off the front of `buf`, or `None` if more bytes are needed.
    /// An error means the stream cannot be resynchronised: the connection must close.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        let header = match self.header {
            Some(h) => h,
            None => {
                if buf.len() < HEADER_LEN {
                    Header::check_prefix(&buf[..buf.len().min(PREFIX_LEN)])?;
                    return Ok(None);
                }
                let bytes: &[u8; HEADER_LEN] =
                    buf[..HEADER_LEN].try_into().expect("length checked");
                let h = Header::decode(bytes, self.max_payload)?;
                buf.advance(HEADER_LEN);
                // Make room for the whole payload at once rather than growing step by step.
                buf.reserve((h.payload_len as usize).saturating_sub(buf.len()));
                self.header = Some(h);
                h
            }
        };
        if buf.len() < header.payload_len as usize {
            return Ok(None);
        }
        self.header = None;
        let payload = buf.split_to(header.payload_len as usize).freeze();
        Ok(Some(Frame::from_header(&header, payload)))
    }

    /// Whether part of a frame has been read (a header, or bytes in `buf`).
    pub fn in_frame(&self, buf: &BytesMut) -> bool {
        self.header.is_some() || !buf.is_empty()
    }

    /// The request id of the frame being read, once its header has arrived.
    pub fn pending_request_id(&self) -> Option<u64> {
        self.header.map(|h| h.request_id)
    }
}

/// Why a byte stream is not a valid frame sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameError {
    BadMagic([u8; 4]),
    UnsupportedVersion {
        found: u8,
        request_id: u64,
    },
    BadFlags {
        flags: u8,
        request_id: u64,
    },
    BadReserved {
        value: u32,
        request_id: u64,
    },
    TooLarge {
        len: u32,
        max: u32,
        request_id: u64,
    },
    CancelWithPayload {
        len: u32,
        request_id: u64,
    },
    /// A shared-memory slot reference that does not name a payload the sender wrote (out of
    /// range, beyond its slot, stale generation); concerns that one frame, the stream is intact.
    BadSlotRef {
        kind: u16,
        request_id: u64,
        reason: String,
    },
}

impl FrameError {
    /// The error code an error frame reports this with.
    pub fn code(&self) -> ErrorCode {
        match self {
            FrameError::UnsupportedVersion { .. } => ErrorCode::UnsupportedVersion,
            FrameError::TooLarge { .. } => ErrorCode::FrameTooLarge,
            FrameError::BadSlotRef { .. } => ErrorCode::BadRequest,
            _ => ErrorCode::MalformedFrame,
        }
    }

    /// The request id of the offending frame, when its header could be read.
    pub fn request_id(&self) -> u64 {
        match *self {
            FrameError::BadMagic(_) => 0,
            FrameError::UnsupportedVersion { request_id, .. }
            | FrameError::BadFlags { request_id, .. }
            | FrameError::BadReserved { request_id, .. }
            | FrameError::TooLarge { request_id, .. }
            | FrameError::CancelWithPayload { request_id, .. }
            | FrameError::BadSlotRef { request_id, .. } => request_id,
        }
    }

    /// Whether the stream can go on after this error (only one frame was bad).
    pub fn is_per_frame(&self) -> bool {
        matches!(self, FrameError::BadSlotRef { .. })
    }
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::BadMagic(m) => {
                write!(
                    f,
                    "bad frame magic: expected {:?} (\"CLVW\"), got {m:?}",
                    MAGIC
                )
            }
            FrameError::UnsupportedVersion { found, .. } => {
                write!(
                    f,
                    "unsupported protocol version {found}; this peer speaks {VERSION}"
                )
            }
            FrameError::BadFlags { flags, .. } => write!(
                f,
                "bad frame flags {flags:#04x}: expected only RESPONSE (0x01), ERROR (0x02), \
                 CANCEL (0x04) and SHM (0x08), ERROR only with RESPONSE, CANCEL only without \
                 it, SHM without CANCEL or ERROR"
            ),
            FrameError::BadSlotRef { reason, .. } => write!(f, "bad slot reference: {reason}"),
            FrameError::CancelWithPayload { len, .. } => write!(
                f,
                "bad CANCEL frame: expected an empty payload, got {len} bytes"
            ),
            FrameError::BadReserved { value, .. } => {
                write!(
                    f,
                    "bad frame header: reserved bytes 20..24 must be 0, got {value:#x}"
                )
            }
            FrameError::TooLarge { len, max, .. } => {
                write!(
                    f,
                    "frame payload of {len} bytes exceeds the limit of {max} bytes"
                )
            }
        }
    }
}

impl std::error::Error for FrameError {}

/// Error codes carried by error frames (docs/protocol.md, "Error frames"). Codes 1–5 concern
/// the connection (it closes); the others concern one request. The shard uses `NotFound` for
/// unknown tables, a ranker `Deadline` for a request that expired in its queue, and so on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// Header invalid (magic, flags, reserved bytes); the connection is closed.
    MalformedFrame,
    /// Header version not spoken here; the connection is closed.
    UnsupportedVersion,
    /// Payload longer than the frame limit; the connection is closed.
    FrameTooLarge,
    /// A frame started but did not complete within the frame timeout; the connection is closed.
    Timeout,
    /// The first frame was not HELLO, or HELLO was malformed; the connection is closed.
    Handshake,
    /// No handler for this kind.
    UnknownKind,
    /// The payload does not follow the kind's message layout.
    BadRequest,
    /// The request names something the server does not have (e.g. a table).
    NotFound,
    /// An index lies outside what the server holds.
    OutOfRange,
    /// The server is not ready yet.
    NotReady,
    /// The server is stopping and takes no new requests.
    ShuttingDown,
    /// A bug or resource failure on the server.
    Internal,
    /// The request's deadline passed before the server started it; not executed.
    Deadline,
    /// The server's queue is full; not executed, safe to retry elsewhere.
    Overloaded,
    /// The caller cancelled the request; not executed.
    Cancelled,
    /// A code this version does not know (from a newer peer).
    Other(u16),
}

/// Every known code with its number and name, in order.
const CODES: [(ErrorCode, u16, &str); 15] = [
    (ErrorCode::MalformedFrame, 1, "malformed_frame"),
    (ErrorCode::UnsupportedVersion, 2, "unsupported_version"),
    (ErrorCode::FrameTooLarge, 3, "frame_too_large"),
    (ErrorCode::Timeout, 4, "timeout"),
    (ErrorCode::Handshake, 5, "handshake"),
    (ErrorCode::UnknownKind, 6, "unknown_kind"),
    (ErrorCode::BadRequest, 7, "bad_request"),
    (ErrorCode::NotFound, 8, "not_found"),
    (ErrorCode::OutOfRange, 9, "out_of_range"),
    (ErrorCode::NotReady, 10, "not_ready"),
    (ErrorCode::ShuttingDown, 11, "shutting_down"),
    (ErrorCode::Internal, 12, "internal"),
    (ErrorCode::Deadline, 13, "deadline"),
    (ErrorCode::Overloaded, 14, "overloaded"),
    (ErrorCode::Cancelled, 15, "cancelled"),
];

impl ErrorCode {
    /// Every code this version knows, in numeric order (for tables and bindings).
    pub fn all() -> impl Iterator<Item = ErrorCode> {
        CODES.iter().map(|&(c, _, _)| c)
    }

    pub fn to_u16(self) -> u16 {
        match self {
            ErrorCode::Other(c) => c,
            known => CODES
                .iter()
                .find(|(c, _, _)| *c == known)
                .map_or(0, |&(_, n, _)| n),
        }
    }

    pub fn from_u16(code: u16) -> ErrorCode {
        CODES
            .iter()
            .find(|&&(_, n, _)| n == code)
            .map_or(ErrorCode::Other(code), |&(c, _, _)| c)
    }

    /// Lower-case name used in messages and docs ("other" for an unknown code).
    pub fn name(self) -> &'static str {
        CODES
            .iter()
            .find(|(c, _, _)| *c == self)
            .map_or("other", |&(_, _, name)| name)
    }

    /// Connection-level codes (1–5): the stream cannot be trusted any more and the sender
    /// closes the connection after this frame. Every other code concerns one request only.
    pub fn closes_connection(self) -> bool {
        matches!(self.to_u16(), 1..=5)
    }

    /// The server refused the request before doing any of its work, because of its own
    /// state or the request's deadline, not because of what the request asks.
    pub fn not_executed(self) -> bool {
        matches!(
            self,
            ErrorCode::NotReady
                | ErrorCode::ShuttingDown
                | ErrorCode::Overloaded
                | ErrorCode::Deadline
                | ErrorCode::Cancelled
        )
    }

    /// Another replica may well serve the same request (within what is left of its budget):
    /// this server could not take it now. Requests are pure (lookups, scoring), so retrying
    /// one is always safe; retrying a `bad_request` or a `deadline` is merely pointless.
    pub fn retry_elsewhere(self) -> bool {
        matches!(
            self,
            ErrorCode::NotReady | ErrorCode::ShuttingDown | ErrorCode::Overloaded
        )
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.to_u16(), self.name())
    }
}

/// Payload of an error frame: u16 code, then a UTF-8 message to the end of the payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
}

impl ErrorBody {
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(2 + self.message.len());
        out.put_u16_le(self.code.to_u16());
        out.put_slice(self.message.as_bytes());
        out.freeze()
    }

    /// Never fails: a short payload or invalid UTF-8 is reported inside the message.
    pub fn decode(payload: &[u8]) -> ErrorBody {
        if payload.len() < 2 {
            return ErrorBody {
                code: ErrorCode::MalformedFrame,
                message: format!(
                    "error frame with {} payload bytes, expected >= 2",
                    payload.len()
                ),
            };
        }
        let code = ErrorCode::from_u16(u16::from_le_bytes([payload[0], payload[1]]));
        let message = String::from_utf8_lossy(&payload[2..]).into_owned();
        ErrorBody { code, message }
    }
}

/// The class a connection declares in its HELLO frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnClass {
    /// Requests and responses of the application (bulk data).
    Data,
    /// Control messages; served by a thread of their own so bulk data never delays them.
    Control,
}

/// HELLO option bits (byte 1 of the HELLO payload).
pub mod hello_options {
    /// Data connections only: the client grants response credits (kind CREDIT); the server
    /// sends a response only within them, and its HELLO reply names the connection's id.
    pub const CREDITS: u8 = 1 << 0;
    /// Data connections over a Unix socket only: after the HELLO reply each side passes the
    /// other a shared-memory region (SCM_RIGHTS) and large payloads travel as slot references.
    pub const SHM: u8 = 1 << 1;
    /// Every bit this version defines.
    pub const KNOWN: u8 = CREDITS | SHM;
}

/// HELLO payload: 4 bytes, class (0 data, 1 control), options (0 without credits), then two
/// zero bytes.
pub fn encode_hello(class: ConnClass) -> Bytes {
    encode_hello_with(class, 0)
}

/// HELLO payload with option bits ([`hello_options`]).
pub fn encode_hello_with(class: ConnClass, options: u8) -> Bytes {
    let c = match class {
        ConnClass::Data => 0,
        ConnClass::Control => 1,
    };
    Bytes::from(vec![c, options, 0, 0])
}

pub fn decode_hello(payload: &[u8]) -> Result<ConnClass, String> {
    decode_hello_with(payload).map(|(class, _)| class)
}

/// The class and option bits of a HELLO payload.
pub fn decode_hello_with(payload: &[u8]) -> Result<(ConnClass, u8), String> {
    let (class, options) = match payload {
        [0, o, 0, 0] => (ConnClass::Data, *o),
        [1, o, 0, 0] => (ConnClass::Control, *o),
        [c, _, 0, 0] => {
            return Err(format!(
                "HELLO class {c} unknown: expected 0 (data) or 1 (control)"
            ))
        }
        _ => {
            return Err(format!(
                "HELLO payload must be 4 bytes (class, options, 0, 0), got {} bytes {:?}",
                payload.len(),
                &payload[..payload.len().min(8)]
            ))
        }
    };
    if options & !hello_options::KNOWN != 0 {
        return Err(format!(
            "HELLO options {options:#04x} unknown: expected only CREDITS (0x01) and SHM (0x02)"
        ));
    }
    if options & hello_options::SHM != 0 && class == ConnClass::Control {
        return Err(
            "HELLO option SHM applies to data connections only, got it on a control connection"
                .to_owned(),
        );
    }
    if options & hello_options::CREDITS != 0 && class == ConnClass::Control {
        return Err(
            "HELLO option CREDITS applies to data connections only, got it on a \
                    control connection"
                .to_owned(),
        );
    }
    Ok((class, options))
}

/// Bytes in a CREDIT payload.
pub const CREDIT_LEN: usize = 16;

/// A CREDIT request: `grant` more response bytes for data connection `conn_id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credit {
    pub conn_id: u64,
    pub grant: u64,
}

impl Credit {
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(CREDIT_LEN);
        out.put_u64_le(self.conn_id);
        out.put_u64_le(self.grant);
        out.freeze()
    }

    pub fn decode(payload: &[u8]) -> Result<Credit, String> {
        let Ok(bytes) = <&[u8; CREDIT_LEN]>::try_from(payload) else {
            return Err(format!(
                "CREDIT payload must be {CREDIT_LEN} bytes (connection id u64, grant u64), got \
                 {} bytes",
                payload.len()
            ));
        };
        let mut b = &bytes[..];
        Ok(Credit {
            conn_id: b.get_u64_le(),
            grant: b.get_u64_le(),
        })
    }
}
