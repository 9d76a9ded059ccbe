//! The golden files of tests/golden/ (docs/protocol.md, "Golden bytes"), shared by every
//! crate's `tests/golden.rs` through `#[path = "../../../tests/golden/golden.rs"] mod golden;`.
//! NAME.bin holds the bytes its writer produced, NAME.json their logical content and, in
//! "writer", which side produced them. `CLEAVE_GOLDEN_REGEN=1` rewrites the Rust-written ones.
#![allow(dead_code)] // each crate's test uses the part it needs

use std::path::PathBuf;

pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden")
}

/// NAME.json: the logical content.
pub fn content(name: &str) -> serde_json::Value {
    let path = dir().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// NAME.bin: the bytes.
pub fn bytes(name: &str) -> Vec<u8> {
    let path = dir().join(format!("{name}.bin"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// (a): `encoded` must be NAME.bin; when regenerating, Rust's own files become it.
pub fn check_encoded(name: &str, encoded: &[u8]) {
    let path = dir().join(format!("{name}.bin"));
    let regen = std::env::var("CLEAVE_GOLDEN_REGEN").is_ok_and(|v| v == "1");
    if regen && content(name)["writer"] == "rust" {
        std::fs::write(&path, encoded).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        return;
    }
    let want = bytes(name);
    if encoded != want.as_slice() {
        let at = encoded
            .iter()
            .zip(&want)
            .position(|(x, y)| x != y)
            .unwrap_or(encoded.len().min(want.len()));
        let show = |b: &[u8]| {
            let end = b.len().min(at + 16);
            b[at..end]
                .iter()
                .map(|x| format!("{x:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        panic!(
            "{name}.bin: Rust encodes {} bytes, the golden file has {}; first difference at \
             byte {at}: {} here, {} in the file. After a deliberate format change regenerate \
             (docs/protocol.md, \"Golden bytes\").",
            encoded.len(),
            want.len(),
            show(encoded),
            show(&want)
        );
    }
}

/// A number in NAME.json derived from the bytes (a checksum, a header length) must be `value`;
/// when regenerating, Rust's own sidecars get it. The first `"key": N` of the text is meant.
pub fn check_derived(name: &str, key: &str, value: u64) {
    let path = dir().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let tag = format!("\"{key}\": ");
    let start = text
        .find(&tag)
        .unwrap_or_else(|| panic!("{name}.json has no {key}"))
        + tag.len();
    let end = start + text[start..].bytes().take_while(u8::is_ascii_digit).count();
    let regen = std::env::var("CLEAVE_GOLDEN_REGEN").is_ok_and(|v| v == "1");
    if regen && content(name)["writer"] == "rust" {
        let text = format!("{}{value}{}", &text[..start], &text[end..]);
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        return;
    }
    assert_eq!(
        text[start..end].parse::<u64>().ok(),
        Some(value),
        "{name}.json: {key}"
    );
}

/// A JSON number or integer field, panicking with its name when it is not one.
pub fn u64_of(v: &serde_json::Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key}: expected an unsigned integer, got {}", v[key]))
}
