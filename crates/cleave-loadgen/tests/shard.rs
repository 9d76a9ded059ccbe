//! The shard load generator against a real shard in this process on loopback: every request of
//! an open-loop and a closed-loop run answered, refusals counted as errors, bad input refused.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use cleave_loadgen::shard::{run_closed_loop, run_open_loop};
use cleave_shard::message::encode_request;
use cleave_shard::{Lookup, Op, Shard, ShardConfig};
use cleave_wire::Address;

const ROWS: u64 = 64;
const DIM: usize = 4;

fn write_bundle(dir: &Path) {
    std::fs::create_dir_all(dir.join("tables")).unwrap();
    let data: Vec<u8> = (0..ROWS as usize * DIM)
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect();
    std::fs::write(dir.join("tables/t.bin"), &data).unwrap();
    let manifest = format!(
        r#"{{"format": "cleave-bundle", "version": 1, "tables": [{{"name": "t",
            "file": "tables/t.bin", "rows": {ROWS}, "dim": {DIM}, "dtype": "float32",
            "row_bytes": {}, "crc32": 0}}]}}"#,
        DIM * 4
    );
    std::fs::write(dir.join("manifest.json"), manifest).unwrap();
}

fn payload(table: &str, ids: Vec<i64>) -> Bytes {
    let lookup = Lookup {
        table: table.into(),
        op: Op::Gather,
        ids,
        offsets: vec![],
        weights: None,
    };
    encode_request(std::iter::once(lookup.view()))
}

/// A shard over the test bundle; the TempDir must outlive it.
fn shard() -> (tempfile::TempDir, Shard, Address) {
    let dir = tempfile::tempdir().unwrap();
    write_bundle(dir.path());
    let config = ShardConfig::new(dir.path().to_owned(), "127.0.0.1:0".parse().unwrap());
    let shard = Shard::start(&config).unwrap();
    let addr = shard.info().listen.clone();
    (dir, shard, addr)
}

#[test]
fn open_loop_gets_every_request_answered() {
    let (_dir, _shard, addr) = shard();
    let payloads = vec![payload("t", vec![1, 2, 3]), payload("t", vec![63])];
    let (run, timeout) = (Duration::from_millis(300), Duration::from_secs(5));
    let report = run_open_loop(&addr, &payloads, 200.0, run, 2, timeout).unwrap();
    assert!(report.sent > 0, "{report:?}");
    assert_eq!(report.completed, report.sent, "{report:?}");
    assert_eq!((report.errors, report.lost), (0, 0));
    assert_eq!(report.latencies_ns.len() as u64, report.completed);
    assert!(report.latencies_ns.windows(2).all(|w| w[0] <= w[1]));
    assert!(report.quantile_us(0.99) >= report.quantile_us(0.5));
    assert_eq!(report.offered_rps, 200.0);
}

#[test]
fn closed_loop_keeps_its_window_and_counts_refusals() {
    let (_dir, _shard, addr) = shard();
    let good = vec![payload("t", vec![5])];
    let report = run_closed_loop(&addr, &good, Duration::from_millis(200), 1, 4).unwrap();
    assert!(report.completed > 0 && report.errors == 0, "{report:?}");
    // A table the shard does not hold: answered with an error, not lost.
    let bad = vec![payload("nope", vec![5])];
    let report = run_closed_loop(&addr, &bad, Duration::from_millis(200), 1, 1).unwrap();
    assert!(report.errors > 0 && report.completed == 0, "{report:?}");
}

#[test]
fn bad_input_is_refused_before_sending() {
    let (_dir, _shard, addr) = shard();
    let run = Duration::from_millis(50);
    let err = run_open_loop(&addr, &[], 10.0, run, 1, run).unwrap_err();
    assert!(err.to_string().contains("at least one payload"), "{err}");
    let one = vec![payload("t", vec![1])];
    let err = run_open_loop(&addr, &one, 0.0, run, 1, run).unwrap_err();
    assert!(err.to_string().contains("rate > 0"), "{err}");
    let err = run_closed_loop(&addr, &[], run, 1, 1).unwrap_err();
    assert!(err.to_string().contains("at least one payload"), "{err}");
}
