//! The control channel's one codec. Every frame is an 8-byte header, magic "CF", version,
//! kind, little-endian body length, then a body whose size the kind fixes (an error carries up
//! to `MAX_TEXT` bytes of text). Control frames are tiny, so a length over `MAX_BODY` is
//! malformed rather than large: the peer answers with an error frame and closes.

use tokio::io::{AsyncRead, AsyncReadExt};

use crate::error::ControlError;

pub const MAGIC: u16 = 0x4346; // "CF" read as little-endian bytes 'F','C'
pub const VERSION: u8 = 1;
pub const HEADER: usize = 8;
pub const MAX_TEXT: usize = 240;
pub const MAX_BODY: u32 = 2 + MAX_TEXT as u32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    Malformed = 1,
    Oversized = 2,
    Unexpected = 3,
    Internal = 4,
}

impl ErrorCode {
    fn from_u16(code: u16) -> ErrorCode {
        match code {
            1 => ErrorCode::Malformed,
            2 => ErrorCode::Oversized,
            3 => ErrorCode::Unexpected,
            _ => ErrorCode::Internal,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlMessage {
    /// Sender → ranker: may I send `bytes` for message `id`? `slo_left_us` is what remains of
    /// its SLO when asked (relative, so host clocks need not agree); `stamp_ns` is opaque to
    /// the ranker and echoed into its measurements.
    RequestToSend {
        id: u64,
        bytes: u64,
        slo_left_us: u64,
        stamp_ns: u64,
    },
    /// Ranker → sender: send message `id` now.
    Grant { id: u64 },
    /// Ranker → sender: every byte of `id` has arrived; the window space is free again.
    Done { id: u64 },
    /// Either way: `bytes` of credit for connection `conn` (FlexEMR's response credits).
    Credit {
        conn: u32,
        bytes: u64,
        stamp_ns: u64,
    },
    /// Either way: the peer's last frame was rejected; the connection closes after this.
    Error { code: ErrorCode, message: String },
    /// Ranker → sender: message `id` waited past the latest time it could start and still
    /// meet its SLO; it will not be granted (the sender gives up on it).
    Expired { id: u64 },
}

const KIND_RTS: u8 = 1;
const KIND_GRANT: u8 = 2;
const KIND_DONE: u8 = 3;
const KIND_CREDIT: u8 = 4;
const KIND_ERROR: u8 = 5;
const KIND_EXPIRED: u8 = 6;

impl ControlMessage {
    fn kind(&self) -> u8 {
        match self {
            ControlMessage::RequestToSend { .. } => KIND_RTS,
            ControlMessage::Grant { .. } => KIND_GRANT,
            ControlMessage::Done { .. } => KIND_DONE,
            ControlMessage::Credit { .. } => KIND_CREDIT,
            ControlMessage::Error { .. } => KIND_ERROR,
            ControlMessage::Expired { .. } => KIND_EXPIRED,
        }
    }

    /// The frame, header included. Error text longer than `MAX_TEXT` is cut at a char boundary.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(32);
        match self {
            ControlMessage::RequestToSend {
                id,
                bytes,
                slo_left_us,
                stamp_ns,
            } => {
                for v in [id, bytes, slo_left_us, stamp_ns] {
                    body.extend_from_slice(&v.to_le_bytes());
                }
            }
            ControlMessage::Grant { id }
            | ControlMessage::Done { id }
            | ControlMessage::Expired { id } => body.extend_from_slice(&id.to_le_bytes()),
            ControlMessage::Credit {
                conn,
                bytes,
                stamp_ns,
            } => {
                body.extend_from_slice(&conn.to_le_bytes());
                body.extend_from_slice(&bytes.to_le_bytes());
                body.extend_from_slice(&stamp_ns.to_le_bytes());
            }
            ControlMessage::Error { code, message } => {
                body.extend_from_slice(&(*code as u16).to_le_bytes());
                let mut end = message.len().min(MAX_TEXT);
                while !message.is_char_boundary(end) {
                    end -= 1;
                }
                body.extend_from_slice(&message.as_bytes()[..end]);
            }
        }
        let mut frame = Vec::with_capacity(HEADER + body.len());
        frame.extend_from_slice(&MAGIC.to_le_bytes());
        frame.push(VERSION);
        frame.push(self.kind());
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(&body);
        frame
    }
}

/// Checks a header; gives the kind and body length.
pub fn decode_header(h: &[u8; HEADER]) -> Result<(u8, u32), ControlError> {
    let magic = u16::from_le_bytes([h[0], h[1]]);
    if magic != MAGIC {
        return Err(ControlError::BadMagic { got: magic });
    }
    if h[2] != VERSION {
        return Err(ControlError::BadVersion {
            expected: VERSION,
            got: h[2],
        });
    }
    let kind = h[3];
    if !(KIND_RTS..=KIND_EXPIRED).contains(&kind) {
        return Err(ControlError::UnknownKind { kind });
    }
    let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    if len > MAX_BODY {
        return Err(ControlError::Oversized {
            got: len,
            limit: MAX_BODY,
        });
    }
    Ok((kind, len))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

fn fixed(kind: &'static str, expected: usize, body: &[u8]) -> Result<(), ControlError> {
    if body.len() != expected {
        return Err(ControlError::BadLength {
            kind,
            expected: expected.to_string(),
            got: body.len() as u32,
        });
    }
    Ok(())
}

/// The message of a checked header's body.
pub fn decode_body(kind: u8, body: &[u8]) -> Result<ControlMessage, ControlError> {
    Ok(match kind {
        KIND_RTS => {
            fixed("request-to-send", 32, body)?;
            ControlMessage::RequestToSend {
                id: u64_at(body, 0),
                bytes: u64_at(body, 8),
                slo_left_us: u64_at(body, 16),
                stamp_ns: u64_at(body, 24),
            }
        }
        KIND_GRANT => {
            fixed("grant", 8, body)?;
            ControlMessage::Grant {
                id: u64_at(body, 0),
            }
        }
        KIND_DONE => {
            fixed("done", 8, body)?;
            ControlMessage::Done {
                id: u64_at(body, 0),
            }
        }
        KIND_CREDIT => {
            fixed("credit", 20, body)?;
            ControlMessage::Credit {
                conn: u32::from_le_bytes([body[0], body[1], body[2], body[3]]),
                bytes: u64_at(body, 4),
                stamp_ns: u64_at(body, 12),
            }
        }
        KIND_EXPIRED => {
            fixed("expired", 8, body)?;
            ControlMessage::Expired {
                id: u64_at(body, 0),
            }
        }
        KIND_ERROR => {
            if body.len() < 2 {
                return Err(ControlError::BadLength {
                    kind: "error",
                    expected: format!("2..={MAX_BODY}"),
                    got: body.len() as u32,
                });
            }
            let message = std::str::from_utf8(&body[2..]).map_err(|_| ControlError::BadText)?;
            ControlMessage::Error {
                code: ErrorCode::from_u16(u16::from_le_bytes([body[0], body[1]])),
                message: message.to_string(),
            }
        }
        other => return Err(ControlError::UnknownKind { kind: other }),
    })
}

/// One message from the front of `buf`: `Ok(None)` while it is incomplete, else the message
/// and the bytes it took. Never panics, whatever `buf` holds.
pub fn decode(buf: &[u8]) -> Result<Option<(ControlMessage, usize)>, ControlError> {
    if buf.len() < HEADER {
        return Ok(None);
    }
    let mut h = [0u8; HEADER];
    h.copy_from_slice(&buf[..HEADER]);
    let (kind, len) = decode_header(&h)?;
    let end = HEADER + len as usize;
    if buf.len() < end {
        return Ok(None);
    }
    Ok(Some((decode_body(kind, &buf[HEADER..end])?, end)))
}

/// The next message on a stream: `Ok(None)` at a clean end of stream (between frames).
pub async fn read_message<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<Option<ControlMessage>, ControlError> {
    let mut h = [0u8; HEADER];
    match r.read_exact(&mut h[..1]).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    r.read_exact(&mut h[1..]).await?;
    let (kind, len) = decode_header(&h)?;
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await?;
    decode_body(kind, &body).map(Some)
}

/// The error frame that answers a rejected frame.
pub fn error_reply(err: &ControlError) -> ControlMessage {
    let code = match err {
        ControlError::Oversized { .. } => ErrorCode::Oversized,
        ControlError::Io(_) => ErrorCode::Internal,
        _ => ErrorCode::Malformed,
    };
    ControlMessage::Error {
        code,
        message: err.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_each_kind() {
        let all = [
            ControlMessage::RequestToSend {
                id: 7,
                bytes: 8 << 20,
                slo_left_us: 5,
                stamp_ns: 9,
            },
            ControlMessage::Grant { id: u64::MAX },
            ControlMessage::Done { id: 0 },
            ControlMessage::Expired { id: 5 },
            ControlMessage::Credit {
                conn: 3,
                bytes: 4096,
                stamp_ns: 11,
            },
            ControlMessage::Error {
                code: ErrorCode::Oversized,
                message: "too big".into(),
            },
        ];
        for m in all {
            let frame = m.encode();
            assert_eq!(decode(&frame).unwrap(), Some((m.clone(), frame.len())));
            assert_eq!(decode(&frame[..frame.len() - 1]).unwrap(), None);
        }
    }

    #[test]
    fn rejects_what_is_malformed() {
        let mut f = ControlMessage::Grant { id: 1 }.encode();
        f[0] = b'X';
        assert!(matches!(decode(&f), Err(ControlError::BadMagic { .. })));
        let mut f = ControlMessage::Grant { id: 1 }.encode();
        f[3] = 9;
        assert_eq!(decode(&f), Err(ControlError::UnknownKind { kind: 9 }));
        let mut f = ControlMessage::Grant { id: 1 }.encode();
        f[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            decode(&f),
            Err(ControlError::Oversized {
                got: u32::MAX,
                limit: MAX_BODY
            })
        );
        let mut f = ControlMessage::Grant { id: 1 }.encode();
        f[4] = 4; // a grant needs 8 bytes
        let err = decode(&f).unwrap_err();
        assert_eq!(
            err.to_string(),
            "control frame: grant needs a body of 8 bytes, got 4"
        );
    }

    #[test]
    fn long_error_text_is_cut_on_a_char_boundary() {
        let m = ControlMessage::Error {
            code: ErrorCode::Malformed,
            message: "é".repeat(200),
        };
        let (back, _) = decode(&m.encode()).unwrap().unwrap();
        match back {
            ControlMessage::Error { message, .. } => assert_eq!(message.len(), MAX_TEXT),
            other => panic!("expected an error frame, got {other:?}"),
        }
    }
}
