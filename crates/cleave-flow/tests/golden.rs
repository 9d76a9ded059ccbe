//! Golden bytes of the incast control channel (docs/protocol.md, "Golden bytes"): the frames
//! this crate writes, which the Python ranker reads through `cleave._native.decode_control`
//! (tests/test_golden_bytes.py reads the same file).

#[path = "../../../tests/golden/golden.rs"]
mod golden;

use cleave_flow::control::{decode, ErrorCode};
use cleave_flow::ControlMessage;
use golden::u64_of;

/// A frame of the sidecar, in the dict form of docs/traffic.md.
fn message(v: &serde_json::Value) -> ControlMessage {
    match v["kind"].as_str().expect("kind") {
        "request-to-send" => ControlMessage::RequestToSend {
            id: u64_of(v, "id"),
            bytes: u64_of(v, "bytes"),
            slo_left_us: u64_of(v, "slo_left_us"),
            stamp_ns: u64_of(v, "stamp_ns"),
        },
        "grant" => ControlMessage::Grant {
            id: u64_of(v, "id"),
        },
        "done" => ControlMessage::Done {
            id: u64_of(v, "id"),
        },
        "expired" => ControlMessage::Expired {
            id: u64_of(v, "id"),
        },
        "credit" => ControlMessage::Credit {
            conn: u64_of(v, "conn") as u32,
            bytes: u64_of(v, "bytes"),
            stamp_ns: u64_of(v, "stamp_ns"),
        },
        "error" => ControlMessage::Error {
            code: match u64_of(v, "code") {
                1 => ErrorCode::Malformed,
                2 => ErrorCode::Oversized,
                3 => ErrorCode::Unexpected,
                _ => ErrorCode::Internal,
            },
            message: v["message"].as_str().expect("message").to_string(),
        },
        other => panic!("control_frames.json: unknown kind {other:?}"),
    }
}

#[test]
fn control_frames() {
    let spec = golden::content("control_frames");
    let want: Vec<ControlMessage> = spec["frames"]
        .as_array()
        .expect("frames")
        .iter()
        .map(message)
        .collect();
    let encoded: Vec<u8> = want.iter().flat_map(ControlMessage::encode).collect();
    golden::check_encoded("control_frames", &encoded);

    let bytes = golden::bytes("control_frames");
    let (mut at, mut got) = (0, Vec::new());
    while at < bytes.len() {
        let (m, used) = decode(&bytes[at..])
            .expect("a well-formed frame")
            .unwrap_or_else(|| {
                panic!("{} bytes left that are not a whole frame", bytes.len() - at)
            });
        got.push(m);
        at += used;
    }
    assert_eq!(got, want);
}
