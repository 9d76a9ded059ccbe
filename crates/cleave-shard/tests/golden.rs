//! Golden bytes of the UPDATE frames `cleave update` (Python) sends and a shard reads
//! (docs/protocol.md, "Golden bytes"; tests/test_golden_bytes.py writes the same files).

#[path = "../../../tests/golden/golden.rs"]
mod golden;

use cleave_shard::update::decode;

#[test]
fn update_frame_payloads() {
    for name in ["update_stage", "update_switch", "update_abort"] {
        let spec = golden::content(name);
        let want = &spec["header"];
        let bytes = golden::bytes(name);
        let (header, data) = decode(&bytes).unwrap_or_else(|e| panic!("{name}.bin: {e}"));
        let text = |key: &str| want[key].as_str().unwrap_or_default().to_string();
        let int = |key: &str| want[key].as_u64().unwrap_or_default();
        assert_eq!(header.op, text("op"), "{name}");
        assert_eq!(header.update, int("update"), "{name}");
        assert_eq!(header.table, text("table"), "{name}");
        assert_eq!(header.kind, text("kind"), "{name}");
        assert_eq!(header.offset, int("offset"), "{name}");
        assert_eq!(
            header.last,
            want["last"].as_bool().unwrap_or_default(),
            "{name}"
        );
        assert_eq!(header.switch_at_unix_us, int("switch_at_unix_us"), "{name}");
        let want_data: Vec<u8> = spec["data"]
            .as_array()
            .expect("data")
            .iter()
            .map(|v| v.as_u64().expect("a byte") as u8)
            .collect();
        assert_eq!(data, want_data.as_slice(), "{name}");
    }
}
