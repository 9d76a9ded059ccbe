//! Golden bytes of the files Python writes and this crate reads (docs/protocol.md, "Golden
//! bytes"): `cleave update`'s delta and a bundle's table files in every storage type
//! (tests/test_golden_bytes.py writes and checks the same files).

#[path = "../../../tests/golden/golden.rs"]
mod golden;

use cleave_embed::update::Delta;
use cleave_embed::{gather, OpenOptions, Table, TableDtype, TableMeta};

fn meta(spec: &serde_json::Value) -> TableMeta {
    serde_json::from_value(spec["table"].clone()).expect("a manifest table entry")
}

fn f32s(rows: &serde_json::Value) -> Vec<f32> {
    rows.as_array()
        .expect("rows")
        .iter()
        .flat_map(|r| r.as_array().expect("a row").iter())
        .map(|v| v.as_f64().expect("a number") as f32)
        .collect()
}

#[test]
fn delta() {
    let spec = golden::content("delta");
    let meta = meta(&spec);
    assert_eq!(
        meta.dtype,
        TableDtype::Float32,
        "the sidecar's rows are float32 values"
    );
    let want = Delta {
        table: meta.name.clone(),
        dtype: meta.dtype.as_str().into(),
        dim: meta.dim as u32,
        row_bytes: meta.row_bytes as u32,
        ids: spec["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("an id"))
            .collect(),
        rows: f32s(&spec["rows"])
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    };
    golden::check_encoded("delta", &want.to_bytes());
    assert_eq!(Delta::parse(&golden::bytes("delta"), &meta).unwrap(), want);
}

#[test]
fn table_files_in_every_storage_type() {
    for dtype in ["float32", "float16", "int8_rowwise", "int4_rowwise"] {
        let spec = golden::content(&format!("table_{dtype}"));
        let meta = meta(&spec);
        assert_eq!(meta.dtype.as_str(), dtype);
        let options = OpenOptions {
            verify_checksums: true, // the CRC-32 Python put in the manifest entry
            ..OpenOptions::default()
        };
        let table = Table::open_with(&golden::dir(), &meta, 0..meta.rows, &options)
            .unwrap_or_else(|e| panic!("table_{dtype}.bin: {e}"));
        let ids: Vec<i64> = (0..meta.rows as i64).collect();
        let mut got = vec![0.0f32; ids.len() * meta.dim];
        gather(&table, &ids, &mut got).unwrap();
        // The values are exact in every storage type, so the kernels must give them exactly.
        assert_eq!(got, f32s(&spec["values"]), "table_{dtype}.bin");
    }
}

/// The storage types are python/cleave/settings/choices.py's TABLE_DTYPES (through the
/// generated settings.json: `python -m cleave.settings --write`).
#[test]
fn table_dtype_names_are_the_settings_schemas() {
    let text = include_str!("../../../deploy/helm/cleave/files/settings.json");
    let settings: serde_json::Value = serde_json::from_str(text).unwrap();
    let names = settings["choices"]["table_dtype"]["names"]
        .as_array()
        .unwrap();
    assert!(!names.is_empty());
    for name in names {
        let dtype: TableDtype = serde_json::from_value(name.clone()).unwrap();
        assert_eq!(dtype.as_str(), name.as_str().unwrap());
    }
}
