//! Malformed bundles and malformed lookups give errors that name what was expected, what
//! arrived and where; never a panic.

mod common;

use std::path::Path;

use cleave_embed::{
    gather, limit, merge, pool, Bags, EmbedError, Engine, Kernel, Manifest, OpenOptions, PoolJob,
    Pooling, Residency, Table, TableDtype, TableSet,
};
use common::{table_data, write_bundle, TableData};
use proptest::strategy::{Strategy, ValueTree};

fn sample(name: &str, rows: u64, dim: usize, dtype: TableDtype) -> TableData {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    table_data(name, rows, dim, dtype)
        .new_tree(&mut runner)
        .unwrap()
        .current()
}

fn bundle(tables: &[TableData]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_bundle(dir.path(), tables);
    dir
}

fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("manifest.json");
    let mut value: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(path, serde_json::to_vec(&value).unwrap()).unwrap();
}

fn message(err: EmbedError) -> String {
    err.to_string()
}

#[test]
fn manifest_of_wrong_format_or_newer_version_is_refused_naming_the_file() {
    let dir = bundle(&[sample("t", 4, 8, TableDtype::Float32)]);
    edit_manifest(dir.path(), |m| m["version"] = 7.into());
    let err = Manifest::load(dir.path()).unwrap_err();
    assert!(matches!(
        err,
        EmbedError::UnsupportedVersion {
            found: 7,
            supported: 1,
            ..
        }
    ));
    let text = message(err);
    assert!(
        text.contains("manifest.json") && text.contains('7') && text.contains('1'),
        "{text}"
    );

    edit_manifest(dir.path(), |m| {
        m["version"] = 1.into();
        m["format"] = "something-else".into();
    });
    let text = message(Manifest::load(dir.path()).unwrap_err());
    assert!(
        text.contains("something-else") && text.contains("cleave-bundle"),
        "{text}"
    );

    std::fs::write(dir.path().join("manifest.json"), b"{not json").unwrap();
    let text = message(Manifest::load(dir.path()).unwrap_err());
    assert!(
        text.contains("manifest.json") && text.contains("not valid JSON"),
        "{text}"
    );

    let missing = tempfile::tempdir().unwrap();
    let text = message(TableSet::open(missing.path(), None, None).unwrap_err());
    assert!(text.contains("manifest.json"), "{text}");
}

#[test]
fn manifest_rules_are_checked() {
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "row_bytes is 33, expected 32",
            Box::new(|m| m["tables"][0]["row_bytes"] = 33.into()),
        ),
        (
            "dim must be at least 1",
            Box::new(|m| m["tables"][0]["dim"] = 0.into()),
        ),
        (
            "inside the bundle",
            Box::new(|m| m["tables"][0]["file"] = "../t.bin".into()),
        ),
        (
            "inside the bundle",
            Box::new(|m| m["tables"][0]["file"] = "/etc/passwd".into()),
        ),
        (
            "unknown variant `int4`",
            Box::new(|m| m["tables"][0]["dtype"] = "int4".into()),
        ),
        (
            "appears twice",
            Box::new(|m| {
                let t = m["tables"][0].clone();
                m["tables"].as_array_mut().unwrap().push(t);
            }),
        ),
        (
            "not in \"tables\"",
            Box::new(|m| {
                m["features"] = serde_json::json!([{"name": "f", "table": "nope", "ids": "i",
                "layout": "offsets", "offsets": "o", "pooling": "sum", "output": "p"}]);
            }),
        ),
        (
            "divisor must not be 0",
            Box::new(|m| {
                m["features"] = serde_json::json!([{"name": "f", "table": "t", "ids": "i",
                "transform": [{"op": "remainder", "divisor": 0}],
                "layout": "offsets", "offsets": "o", "pooling": "sum", "output": "p"}]);
            }),
        ),
        (
            "pooling \"none\" goes with layout \"gather\" or \"kjt\"",
            Box::new(|m| {
                m["features"] = serde_json::json!([{"name": "f", "table": "t", "ids": "i",
                "layout": "offsets", "offsets": "o", "pooling": "none", "output": "p"}]);
            }),
        ),
        (
            "lengths_by_key has 1 names, expected one per key (2)",
            Box::new(|m| {
                m["kjts"] = serde_json::json!([{"name": "p", "keys": ["a", "b"],
                "values": "v", "lengths": "l", "lengths_by_key": ["l.a"]}]);
            }),
        ),
        (
            "weights need pooling \"sum\"",
            Box::new(|m| {
                m["features"] = serde_json::json!([{"name": "f", "table": "t", "ids": "i",
                "layout": "offsets", "offsets": "o", "weights": "w", "pooling": "max",
                "output": "p"}]);
            }),
        ),
    ];
    for (expected, edit) in cases {
        let dir = bundle(&[sample("t", 4, 8, TableDtype::Float32)]);
        edit_manifest(dir.path(), edit);
        let text = message(Manifest::load(dir.path()).unwrap_err());
        assert!(
            text.contains(expected) && text.contains("manifest.json"),
            "{expected}: {text}"
        );
    }
}

#[test]
fn table_files_of_wrong_size_or_checksum_are_reported_with_their_path() {
    let t = sample("t", 10, 8, TableDtype::Int8Rowwise);
    let dir = bundle(std::slice::from_ref(&t));
    let file = dir.path().join("tables/t.bin");
    std::fs::write(&file, &t.bytes[..t.bytes.len() - 1]).unwrap();
    let err = TableSet::open(dir.path(), None, None).unwrap_err();
    assert!(
        matches!(
            err,
            EmbedError::SizeMismatch {
                expected: 160,
                found: 159,
                ..
            }
        ),
        "{err}"
    );
    assert!(message(err).contains("tables/t.bin"));

    let mut corrupt = t.bytes.clone();
    corrupt[3] ^= 1;
    std::fs::write(&file, &corrupt).unwrap();
    // Unverified opening trusts the manifest; verification catches the flipped bit.
    assert!(TableSet::open(dir.path(), None, None).is_ok());
    let options = OpenOptions {
        verify_checksums: true,
        ..OpenOptions::default()
    };
    let err = TableSet::open_with(dir.path(), None, None, &options).unwrap_err();
    assert!(matches!(err, EmbedError::Checksum { .. }), "{err}");
    assert!(message(err).contains("tables/t.bin"));

    std::fs::write(&file, &t.bytes).unwrap();
    assert!(TableSet::open_with(dir.path(), None, None, &options).is_ok());
    std::fs::remove_file(&file).unwrap();
    let text = message(TableSet::open(dir.path(), None, None).unwrap_err());
    assert!(text.contains("tables/t.bin"), "{text}");
}

#[test]
fn table_sets_open_named_tables_and_row_ranges() {
    let dir = bundle(&[
        sample("a", 10, 8, TableDtype::Float32),
        sample("b", 3, 4, TableDtype::Float16),
    ]);
    let err = TableSet::open(dir.path(), Some(&["a".into(), "zz".into()]), None).unwrap_err();
    assert!(
        matches!(&err, EmbedError::UnknownTable { name, .. } if name == "zz"),
        "{err}"
    );
    assert!(message(err).contains("\"a\""));

    let set = TableSet::open(dir.path(), Some(&["b".into()]), None).unwrap();
    assert_eq!(set.names().collect::<Vec<_>>(), ["b"]);
    assert!(set.get("a").is_none());
    assert!(set.require("a").is_err());

    // Row ranges are clipped to each table's size.
    let set = TableSet::open(dir.path(), None, Some(2..6)).unwrap();
    assert_eq!(set.get("a").unwrap().row_range(), 2..6);
    assert_eq!(set.get("b").unwrap().row_range(), 2..3);
    let set = TableSet::open(dir.path(), None, Some(8..100)).unwrap();
    assert_eq!(set.get("b").unwrap().row_range(), 3..3);
    assert_eq!(set.get("b").unwrap().bytes().unwrap().len(), 0);
}

#[test]
fn resident_tables_hold_the_same_rows_as_mapped_ones() {
    let t = sample("t", 50, 24, TableDtype::Float32);
    let dir = bundle(std::slice::from_ref(&t));
    let meta = Manifest::load(dir.path()).unwrap().tables.remove(0);
    let resident = OpenOptions {
        residency: Residency::Resident,
        ..OpenOptions::default()
    };
    let a = Table::open(dir.path(), &meta, 5..40).unwrap();
    let b = Table::open_with(dir.path(), &meta, 5..40, &resident).unwrap();
    assert_eq!(a.bytes(), b.bytes());
    assert_eq!(a.bytes(), Some(&t.bytes[5 * 96..40 * 96]));
    assert_eq!(b.row(5).unwrap(), &t.bytes[5 * 96..6 * 96]);
    assert!(b.row(4).is_none() && b.row(40).is_none());
}

/// The ways a lookup can be malformed, each with a piece of the expected message.
#[test]
fn malformed_lookups_are_errors() {
    let dir = bundle(&[sample("t", 10, 4, TableDtype::Float32)]);
    let set = TableSet::open(dir.path(), None, Some(2..8)).unwrap();
    let t = set.get("t").unwrap();
    let ids = [2_i64, 7, 3];
    let ok_offsets = [0_u32, 2, 3];
    let w3 = [1.0_f32; 3];
    let w2 = [1.0_f32; 2];
    struct Bad<'a> {
        ids: &'a [i64],
        offsets: &'a [u32],
        weights: Option<&'a [f32]>,
        pooling: Pooling,
        out: usize,
        counts: usize,
        expect: &'a str,
    }
    let bad = |ids, offsets, weights, pooling, out, counts, expect| Bad {
        ids,
        offsets,
        weights,
        pooling,
        out,
        counts,
        expect,
    };
    let cases = [
        bad(
            &[2, 8, 3][..],
            &ok_offsets[..],
            None,
            Pooling::Sum,
            8,
            2,
            "id 8 at position 1 is outside rows [2, 8)",
        ),
        bad(
            &[2, 7, 1],
            &ok_offsets,
            None,
            Pooling::Sum,
            8,
            2,
            "id 1 at position 2",
        ),
        bad(
            &[-1, 7, 3],
            &ok_offsets,
            None,
            Pooling::Max,
            8,
            2,
            "id -1 at position 0",
        ),
        bad(
            &[2, 7, i64::MAX],
            &ok_offsets,
            None,
            Pooling::Mean,
            8,
            2,
            "outside rows",
        ),
        bad(&ids, &[], None, Pooling::Sum, 0, 0, "offsets is empty"),
        bad(
            &ids,
            &[1, 2, 3],
            None,
            Pooling::Sum,
            8,
            2,
            "offsets[0] is 1, expected 0",
        ),
        bad(
            &ids,
            &[0, 3, 2, 3],
            None,
            Pooling::Sum,
            12,
            3,
            "offsets[1] = 3 > offsets[2] = 2",
        ),
        bad(
            &ids,
            &[0, 2],
            None,
            Pooling::Sum,
            4,
            1,
            "last offset is 2, expected the number of ids 3",
        ),
        bad(
            &ids,
            &[0, 2, 4],
            None,
            Pooling::Sum,
            8,
            2,
            "last offset is 4",
        ),
        bad(
            &ids,
            &ok_offsets,
            Some(&w2[..]),
            Pooling::Sum,
            8,
            2,
            "weights has 2 entries, expected one per id (3)",
        ),
        bad(
            &ids,
            &ok_offsets,
            Some(&w3[..]),
            Pooling::Mean,
            8,
            2,
            "weights need pooling \"sum\"",
        ),
        bad(
            &ids,
            &ok_offsets,
            None,
            Pooling::Sum,
            7,
            2,
            "output has 7 floats, expected bags 2 x dim 4 = 8",
        ),
        bad(
            &ids,
            &ok_offsets,
            None,
            Pooling::Sum,
            8,
            3,
            "counts has 3 entries, expected one per bag (2)",
        ),
    ];
    let engine = Engine::new(2);
    for c in &cases {
        let bags = Bags {
            ids: c.ids,
            offsets: c.offsets,
            weights: c.weights,
        };
        let (mut out, mut counts) = (vec![0.0; c.out], vec![0; c.counts]);
        for kernel in Kernel::available() {
            let err = cleave_embed::pool_with(kernel, t, &bags, c.pooling, &mut out, &mut counts)
                .unwrap_err();
            let text = message(err);
            assert!(
                text.contains(c.expect) && text.contains("\"t\""),
                "{}: {text}",
                c.expect
            );
        }
        let err = pool(t, &bags, c.pooling, &mut out, &mut counts).unwrap_err();
        assert!(message(err).contains(c.expect));
        let mut jobs = [PoolJob {
            table: t,
            bags,
            pooling: c.pooling,
            out: &mut out,
            counts: &mut counts,
        }];
        let text = message(engine.pool_many(&mut jobs).unwrap_err());
        assert!(text.contains(c.expect), "engine: {}: {text}", c.expect);
    }

    let mut out = vec![0.0; 8];
    let text = message(gather(t, &[2, 3, 4], &mut out).unwrap_err());
    assert!(
        text.contains("gather output has 8 floats, expected 3 ids x dim 4"),
        "{text}"
    );
    let text = message(gather(t, &[2, 9], &mut out).unwrap_err());
    assert!(text.contains("id 9 at position 1"), "{text}");
    let text = message(limit::gather_sum_prefetch(t, &[5, 0], 1, None).unwrap_err());
    assert!(text.contains("id 0 at position 1"), "{text}");
    let text = message(
        merge(
            Pooling::Sum,
            4,
            &mut [0.0; 8],
            &mut [0; 2],
            &[0.0; 4],
            &[0; 2],
        )
        .unwrap_err(),
    );
    assert!(text.contains("expected 2 counts and 8 floats"), "{text}");
}

/// An out-of-range id deep inside a large batch is found by whichever worker checks it, and
/// the error names its position in the caller's array.
#[test]
fn engine_reports_bad_ids_in_large_batches() {
    let dir = bundle(&[sample("t", 100, 16, TableDtype::Float32)]);
    let set = TableSet::open(dir.path(), None, None).unwrap();
    let t = set.get("t").unwrap();
    let mut ids: Vec<i64> = (0..50_000).map(|i| i % 100).collect();
    ids[41_234] = 100;
    let offsets: Vec<u32> = (0..=5_000).map(|b| b * 10).collect();
    let bags = Bags {
        ids: &ids,
        offsets: &offsets,
        weights: None,
    };
    let (mut out, mut counts) = (vec![0.0; 5_000 * 16], vec![0; 5_000]);
    let err = Engine::new(3)
        .pool(t, &bags, Pooling::Sum, &mut out, &mut counts)
        .unwrap_err();
    assert!(message(err).contains("id 100 at position 41234"));
}

#[test]
fn limit_loop_reads_the_rows_of_the_ids() {
    // 64-byte rows, 21-byte rows (not a multiple of 8), 328-byte rows (over four lines).
    for t in [
        sample("t", 64, 16, TableDtype::Float32),
        sample("t", 64, 13, TableDtype::Int8Rowwise),
        sample("t", 64, 82, TableDtype::Float32),
    ] {
        let dir = bundle(std::slice::from_ref(&t));
        let set = TableSet::open(dir.path(), None, None).unwrap();
        let ids: Vec<i64> = (0..1000).map(|i| (i * 37) % 64).collect();
        // The fold is the xor of every row's little-endian 8-byte words, zero-padded.
        let rb = t.row_bytes();
        let mut want = 0u64;
        for &id in &ids {
            for word in t.bytes[id as usize * rb..][..rb].chunks(8) {
                let mut padded = [0u8; 8];
                padded[..word.len()].copy_from_slice(word);
                want ^= u64::from_le_bytes(padded);
            }
        }
        for threads in [1, 2, 3] {
            let got =
                limit::gather_sum_prefetch(set.get("t").unwrap(), &ids, threads, None).unwrap();
            assert_eq!(got, want, "row_bytes {rb}, {threads} threads");
        }
    }
}
