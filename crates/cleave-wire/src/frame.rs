//! Frames: a fixed 24-byte little-endian header followed by `payload_len` bytes.
//!
//! ```text
//! offset size field
//!  0     4    magic        b"CLVW"
//!  4     1    version      1
//!  5     1    flags        bit 0 RESPONSE, bit 1 ERROR; other bits 0
//!  6     2    kind         u16: 0x0000-0x00ff control, 0x0100- application
//!  8     8    request_id   u64, chosen by the requester, echoed in the response
//! 16     4    payload_len  u32, at most the receiver's frame limit
//! 20     4    reserved     0
//! ```
//!
//! docs/protocol.md is the reference; this file and that page change together.

use std::fmt;

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"CLVW";
/// The protocol version this crate speaks.
pub const VERSION: u8 = 1;
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 24;
/// Default largest payload a peer accepts (64 MiB).
pub const DEFAULT_MAX_PAYLOAD: u32 = 64 << 20;

/// Header flag bits.
pub mod flags {
    /// The frame answers the request with the same id.
    pub const RESPONSE: u8 = 1 << 0;
    /// The frame is an error response; its payload is an [`ErrorBody`](super::ErrorBody).
    pub const ERROR: u8 = 1 << 1;
    /// Every bit version 1 defines.
    pub const KNOWN: u8 = RESPONSE | ERROR;
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
}

impl Header {
    /// Writes the 24 header bytes.
    pub fn encode(&self, out: &mut impl BufMut) {
        out.put_slice(&MAGIC);
        out.put_u8(VERSION);
        out.put_u8(self.flags);
        out.put_u16_le(self.kind);
        out.put_u64_le(self.request_id);
        out.put_u32_le(self.payload_len);
        out.put_u32_le(0);
    }

    /// Parses and validates a header; `max_payload` is the receiver's frame limit.
    pub fn decode(bytes: &[u8; HEADER_LEN], max_payload: u32) -> Result<Header, FrameError> {
        let mut b = &bytes[..];
        let mut magic = [0u8; 4];
        b.copy_to_slice(&mut magic);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let version = b.get_u8();
        let flags = b.get_u8();
        let kind = b.get_u16_le();
        let request_id = b.get_u64_le();
        let payload_len = b.get_u32_le();
        let reserved = b.get_u32_le();
        // Version first: a newer peer may use flags and reserved bytes differently.
        if version != VERSION {
            return Err(FrameError::UnsupportedVersion {
                found: version,
                request_id,
            });
        }
        if flags & !flags::KNOWN != 0 || (flags & flags::ERROR != 0 && flags & flags::RESPONSE == 0)
        {
            return Err(FrameError::BadFlags { flags, request_id });
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
        })
    }
}

/// One frame: header fields and the payload (shared, never copied after decoding).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub flags: u8,
    pub kind: u16,
    pub request_id: u64,
    pub payload: Bytes,
}

impl Frame {
    pub fn request(kind: u16, request_id: u64, payload: Bytes) -> Frame {
        Frame {
            flags: 0,
            kind,
            request_id,
            payload,
        }
    }

    pub fn response(kind: u16, request_id: u64, payload: Bytes) -> Frame {
        Frame {
            flags: flags::RESPONSE,
            kind,
            request_id,
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
            kind,
            request_id,
            payload: body,
        }
    }

    pub fn is_response(&self) -> bool {
        self.flags & flags::RESPONSE != 0
    }

    pub fn is_error(&self) -> bool {
        self.flags & flags::ERROR != 0
    }

    /// The header this frame is sent with. Payloads over 4 GiB cannot be framed; callers
    /// check sizes against the peer's limit (which is smaller) before building a frame.
    pub fn header(&self) -> Header {
        Header {
            flags: self.flags,
            kind: self.kind,
            request_id: self.request_id,
            payload_len: u32::try_from(self.payload.len()).unwrap_or(u32::MAX),
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
        Ok(Some(Frame {
            flags: header.flags,
            kind: header.kind,
            request_id: header.request_id,
            payload,
        }))
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
    UnsupportedVersion { found: u8, request_id: u64 },
    BadFlags { flags: u8, request_id: u64 },
    BadReserved { value: u32, request_id: u64 },
    TooLarge { len: u32, max: u32, request_id: u64 },
}

impl FrameError {
    /// The error code an error frame reports this with.
    pub fn code(&self) -> ErrorCode {
        match self {
            FrameError::UnsupportedVersion { .. } => ErrorCode::UnsupportedVersion,
            FrameError::TooLarge { .. } => ErrorCode::FrameTooLarge,
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
            | FrameError::TooLarge { request_id, .. } => request_id,
        }
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
                "bad frame flags {flags:#04x}: expected only RESPONSE (0x01) and ERROR (0x02), \
                 ERROR only with RESPONSE"
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

/// Error codes carried by error frames. Codes below 0x100 are the transport's; the rest are
/// shared by applications (the shard uses `NotFound` for unknown tables, for example).
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
    /// A code this version does not know (from a newer peer).
    Other(u16),
}

impl ErrorCode {
    pub fn to_u16(self) -> u16 {
        match self {
            ErrorCode::MalformedFrame => 1,
            ErrorCode::UnsupportedVersion => 2,
            ErrorCode::FrameTooLarge => 3,
            ErrorCode::Timeout => 4,
            ErrorCode::Handshake => 5,
            ErrorCode::UnknownKind => 6,
            ErrorCode::BadRequest => 7,
            ErrorCode::NotFound => 8,
            ErrorCode::OutOfRange => 9,
            ErrorCode::NotReady => 10,
            ErrorCode::ShuttingDown => 11,
            ErrorCode::Internal => 12,
            ErrorCode::Other(c) => c,
        }
    }

    pub fn from_u16(code: u16) -> ErrorCode {
        match code {
            1 => ErrorCode::MalformedFrame,
            2 => ErrorCode::UnsupportedVersion,
            3 => ErrorCode::FrameTooLarge,
            4 => ErrorCode::Timeout,
            5 => ErrorCode::Handshake,
            6 => ErrorCode::UnknownKind,
            7 => ErrorCode::BadRequest,
            8 => ErrorCode::NotFound,
            9 => ErrorCode::OutOfRange,
            10 => ErrorCode::NotReady,
            11 => ErrorCode::ShuttingDown,
            12 => ErrorCode::Internal,
            c => ErrorCode::Other(c),
        }
    }

    /// Lower-case name used in messages and docs.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::MalformedFrame => "malformed_frame",
            ErrorCode::UnsupportedVersion => "unsupported_version",
            ErrorCode::FrameTooLarge => "frame_too_large",
            ErrorCode::Timeout => "timeout",
            ErrorCode::Handshake => "handshake",
            ErrorCode::UnknownKind => "unknown_kind",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::NotFound => "not_found",
            ErrorCode::OutOfRange => "out_of_range",
            ErrorCode::NotReady => "not_ready",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::Internal => "internal",
            ErrorCode::Other(_) => "other",
        }
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

/// HELLO payload: 4 bytes, class (0 data, 1 control) then three zero bytes.
pub fn encode_hello(class: ConnClass) -> Bytes {
    let c = match class {
        ConnClass::Data => 0,
        ConnClass::Control => 1,
    };
    Bytes::from(vec![c, 0, 0, 0])
}

pub fn decode_hello(payload: &[u8]) -> Result<ConnClass, String> {
    match payload {
        [0, 0, 0, 0] => Ok(ConnClass::Data),
        [1, 0, 0, 0] => Ok(ConnClass::Control),
        [c, 0, 0, 0] => Err(format!(
            "HELLO class {c} unknown: expected 0 (data) or 1 (control)"
        )),
        _ => Err(format!(
            "HELLO payload must be 4 bytes (class, 0, 0, 0), got {} bytes {:?}",
            payload.len(),
            &payload[..payload.len().min(8)]
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_layout_is_byte_exact() {
        let h = Header {
            flags: 1,
            kind: 0x0102,
            request_id: 0x0807060504030201,
            payload_len: 9,
        };
        let mut out = BytesMut::new();
        h.encode(&mut out);
        assert_eq!(
            &out[..],
            &[
                b'C', b'L', b'V', b'W', 1, 1, 0x02, 0x01, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0, 0, 0,
                0, 0
            ]
        );
        let arr: [u8; HEADER_LEN] = out[..].try_into().unwrap();
        assert_eq!(Header::decode(&arr, 100).unwrap(), h);
    }

    #[test]
    fn header_rejects_each_bad_field() {
        let good = Frame::request(0x100, 7, Bytes::from_static(b"abc")).to_bytes();
        let arr = |b: &[u8]| -> [u8; HEADER_LEN] { b[..HEADER_LEN].try_into().unwrap() };
        let mut b = good.to_vec();
        b[0] = b'X';
        assert!(matches!(
            Header::decode(&arr(&b), 100),
            Err(FrameError::BadMagic(_))
        ));
        let mut b = good.to_vec();
        b[4] = 2;
        assert_eq!(
            Header::decode(&arr(&b), 100),
            Err(FrameError::UnsupportedVersion {
                found: 2,
                request_id: 7
            })
        );
        let mut b = good.to_vec();
        b[5] = 0x80;
        assert!(matches!(
            Header::decode(&arr(&b), 100),
            Err(FrameError::BadFlags { .. })
        ));
        let mut b = good.to_vec();
        b[5] = flags::ERROR;
        assert!(matches!(
            Header::decode(&arr(&b), 100),
            Err(FrameError::BadFlags { .. })
        ));
        let mut b = good.to_vec();
        b[22] = 1;
        assert!(matches!(
            Header::decode(&arr(&b), 100),
            Err(FrameError::BadReserved { .. })
        ));
        assert_eq!(
            Header::decode(&arr(&good), 2),
            Err(FrameError::TooLarge {
                len: 3,
                max: 2,
                request_id: 7
            })
        );
        let err = Header::decode(&arr(&good), 2).unwrap_err();
        assert_eq!(err.code(), ErrorCode::FrameTooLarge);
        assert!(err.to_string().contains("3 bytes exceeds the limit of 2"));
    }

    #[test]
    fn decoder_waits_for_whole_frames() {
        let f = Frame::response(0x100, 3, Bytes::from_static(b"hello"));
        let bytes = f.to_bytes();
        let mut d = FrameDecoder::new(1 << 20);
        let mut buf = BytesMut::new();
        for (i, byte) in bytes.iter().enumerate() {
            assert_eq!(
                d.decode(&mut buf).unwrap(),
                None,
                "frame complete after {i} bytes"
            );
            buf.put_u8(*byte);
        }
        assert_eq!(d.decode(&mut buf).unwrap(), Some(f));
        assert!(!d.in_frame(&buf));
    }

    #[test]
    fn error_body_round_trips_and_tolerates_junk() {
        let e = ErrorBody {
            code: ErrorCode::OutOfRange,
            message: "id 9 outside [0, 4)".into(),
        };
        assert_eq!(ErrorBody::decode(&e.encode()), e);
        assert_eq!(ErrorBody::decode(&[1]).code, ErrorCode::MalformedFrame);
        assert_eq!(
            ErrorBody::decode(&[0xff, 0x7f, 0xff]).code,
            ErrorCode::Other(0x7fff)
        );
        for c in 0..20u16 {
            assert_eq!(ErrorCode::from_u16(c).to_u16(), c);
        }
    }

    #[test]
    fn hello_round_trips() {
        assert_eq!(
            decode_hello(&encode_hello(ConnClass::Data)),
            Ok(ConnClass::Data)
        );
        assert_eq!(
            decode_hello(&encode_hello(ConnClass::Control)),
            Ok(ConnClass::Control)
        );
        assert!(decode_hello(&[2, 0, 0, 0])
            .unwrap_err()
            .contains("class 2 unknown"));
        assert!(decode_hello(b"").unwrap_err().contains("0 bytes"));
    }
}
