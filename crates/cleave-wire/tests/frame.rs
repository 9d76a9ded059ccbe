//! The frame codec (version 2): byte-exact header layout, each bad field refused, CANCEL
//! frames, incremental decoding, error bodies and codes, HELLO.

use bytes::{BufMut, Bytes, BytesMut};
use cleave_wire::frame::{decode_hello, encode_hello, flags, HEADER_LEN};
use cleave_wire::{ConnClass, ErrorBody, ErrorCode, Frame, FrameDecoder, FrameError, Header};

fn arr(b: &[u8]) -> [u8; HEADER_LEN] {
    b[..HEADER_LEN].try_into().unwrap()
}

#[test]
fn header_layout_is_byte_exact() {
    let h = Header {
        flags: 1,
        kind: 0x0102,
        request_id: 0x0807060504030201,
        payload_len: 9,
        deadline_unix_us: 0x1112131415161718,
        trace_id: 0x2122232425262728,
    };
    let mut out = BytesMut::new();
    h.encode(&mut out);
    let mut want = vec![b'C', b'L', b'V', b'W', 2, 1, 0x02, 0x01];
    want.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
    want.extend_from_slice(&[9, 0, 0, 0, 0, 0, 0, 0]);
    want.extend_from_slice(&[0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11]);
    want.extend_from_slice(&[0x28, 0x27, 0x26, 0x25, 0x24, 0x23, 0x22, 0x21]);
    assert_eq!(&out[..], &want[..]);
    assert_eq!(HEADER_LEN, 40);
    assert_eq!(Header::decode(&arr(&out), 100).unwrap(), h);
}

#[test]
fn header_rejects_each_bad_field() {
    let good = Frame::request(0x100, 7, Bytes::from_static(b"abc")).to_bytes();
    let mut b = good.to_vec();
    b[0] = b'X';
    assert!(matches!(
        Header::decode(&arr(&b), 100),
        Err(FrameError::BadMagic(_))
    ));
    // A version 1 peer (24-byte headers) is refused by version, whatever follows.
    for v in [1u8, 3] {
        let mut b = good.to_vec();
        b[4] = v;
        assert_eq!(
            Header::decode(&arr(&b), 100),
            Err(FrameError::UnsupportedVersion {
                found: v,
                request_id: 7
            })
        );
    }
    let bad_flags = [
        0x80,
        flags::ERROR,
        flags::CANCEL | flags::RESPONSE,
        flags::CANCEL | flags::RESPONSE | flags::ERROR,
    ];
    for f in bad_flags {
        let mut b = good.to_vec();
        b[5] = f;
        assert!(
            matches!(
                Header::decode(&arr(&b), 100),
                Err(FrameError::BadFlags { .. })
            ),
            "flags {f:#x}"
        );
    }
    let mut b = good.to_vec();
    b[5] = flags::CANCEL; // with a 3-byte payload
    let err = Header::decode(&arr(&b), 100).unwrap_err();
    assert_eq!(
        err,
        FrameError::CancelWithPayload {
            len: 3,
            request_id: 7
        }
    );
    assert_eq!(err.code(), ErrorCode::MalformedFrame);
    assert!(err
        .to_string()
        .contains("expected an empty payload, got 3 bytes"));
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
fn cancel_and_context_round_trip() {
    let c = Frame::cancel(0x110, 42);
    assert!(c.is_cancel() && !c.is_response() && c.payload.is_empty());
    let r = Frame::request(0x110, 43, Bytes::from_static(b"x")).with_context(1_700_000, 99);
    let mut d = FrameDecoder::new(100);
    let mut buf = BytesMut::new();
    buf.put_slice(&c.to_bytes());
    buf.put_slice(&r.to_bytes());
    assert_eq!(d.decode(&mut buf).unwrap(), Some(c));
    let back = d.decode(&mut buf).unwrap().unwrap();
    assert_eq!((back.deadline_unix_us, back.trace_id), (1_700_000, 99));
    assert_eq!(back, r);
}

#[test]
fn decoder_waits_for_whole_frames() {
    let f = Frame::response(0x100, 3, Bytes::from_static(b"hello")).with_context(5, 6);
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
fn error_codes_and_their_classes() {
    let numbered: Vec<(u16, &str)> = ErrorCode::all().map(|c| (c.to_u16(), c.name())).collect();
    assert_eq!(numbered.len(), 15);
    assert_eq!(
        numbered[12..],
        [(13, "deadline"), (14, "overloaded"), (15, "cancelled")]
    );
    assert!(numbered
        .iter()
        .enumerate()
        .all(|(i, &(n, _))| n == i as u16 + 1));
    let closing: Vec<u16> = ErrorCode::all()
        .filter(|c| c.closes_connection())
        .map(|c| c.to_u16())
        .collect();
    assert_eq!(closing, [1, 2, 3, 4, 5]);
    let retry: Vec<&str> = ErrorCode::all()
        .filter(|c| c.retry_elsewhere())
        .map(|c| c.name())
        .collect();
    assert_eq!(retry, ["not_ready", "shutting_down", "overloaded"]);
    let skipped: Vec<&str> = ErrorCode::all()
        .filter(|c| c.not_executed())
        .map(|c| c.name())
        .collect();
    assert_eq!(
        skipped,
        [
            "not_ready",
            "shutting_down",
            "deadline",
            "overloaded",
            "cancelled"
        ]
    );
    // Every code that may be retried elsewhere was not executed here.
    assert!(ErrorCode::all().all(|c| !c.retry_elsewhere() || c.not_executed()));
    assert!(!ErrorCode::Other(300).closes_connection());
    assert_eq!(ErrorCode::Other(300).to_string(), "300 (other)");
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
