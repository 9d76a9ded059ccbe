//! gRPC over HTTP/2, the little a unary client needs: the 5-byte message prefix and the call's
//! status, which arrives in the trailers (or in the headers of a trailers-only response).

use bytes::{BufMut, Bytes, BytesMut};
use hyper::HeaderMap;

/// `message` behind its prefix: not compressed (0), then its length (u32, big-endian).
pub fn frame(message: &Bytes) -> Result<Bytes, String> {
    let len = u32::try_from(message.len()).map_err(|_| {
        format!(
            "a gRPC message holds at most 4 GiB, got {} bytes",
            message.len()
        )
    })?;
    let mut out = BytesMut::with_capacity(5 + message.len());
    out.put_u8(0);
    out.put_u32(len);
    out.put_slice(message);
    Ok(out.freeze())
}

/// The response message of a unary call: the body without its prefix (empty when the body is
/// shorter than the prefix says; the status tells why).
pub fn message(body: Bytes) -> Bytes {
    if body.len() < 5 {
        return Bytes::new();
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    body.slice(5..body.len().min(5 + len))
}

/// "" for an OK call, else `grpc_` and the status's lower-case name.
pub fn failure(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> String {
    let status = trailers
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| headers.get("grpc-status"));
    let Some(code) = status.and_then(|v| v.to_str().ok()?.parse::<usize>().ok()) else {
        return "grpc_no_status".into();
    };
    match code {
        0 => String::new(),
        _ => format!("grpc_{}", CODES.get(code).copied().unwrap_or("unknown")),
    }
}

/// The status codes' names, by number (gRPC's status code specification).
const CODES: [&str; 17] = [
    "ok",
    "cancelled",
    "unknown",
    "invalid_argument",
    "deadline_exceeded",
    "not_found",
    "already_exists",
    "permission_denied",
    "resource_exhausted",
    "failed_precondition",
    "aborted",
    "out_of_range",
    "unimplemented",
    "internal",
    "unavailable",
    "data_loss",
    "unauthenticated",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_and_message_round_trip() {
        let framed = frame(&Bytes::from_static(b"abc")).unwrap();
        assert_eq!(&framed[..], b"\0\0\0\0\x03abc");
        assert_eq!(&message(framed)[..], b"abc");
        assert!(message(Bytes::from_static(b"\0\0")).is_empty());
    }

    #[test]
    fn status_from_trailers_or_headers() {
        let mut ok = HeaderMap::new();
        ok.insert("grpc-status", "0".parse().unwrap());
        let mut busy = HeaderMap::new();
        busy.insert("grpc-status", "8".parse().unwrap());
        assert_eq!(failure(&HeaderMap::new(), Some(&ok)), "");
        assert_eq!(failure(&busy, None), "grpc_resource_exhausted");
        assert_eq!(failure(&HeaderMap::new(), None), "grpc_no_status");
    }
}
