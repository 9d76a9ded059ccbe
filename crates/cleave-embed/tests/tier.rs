//! The SSD tier against DRAM: every dtype, every pooling, per-sample weights, both eviction
//! policies, both I/O backends, with and without the pooled cache — bit for bit the same
//! results, with caches small enough that rows are evicted and read again.

mod common;

use std::path::Path;
use std::sync::Arc;

use cleave_embed::{
    gather, pool, Bags, EmbedError, Engine, IoMode, OpenOptions, PolicyKind, PoolJob, Pooling,
    TableDtype, TableSet, Tier, TierConfig,
};
use common::{write_bundle, TableData};

/// Deterministic table bytes (no proptest: the tables are a few MB).
fn table(name: &str, rows: u64, dim: usize, dtype: TableDtype, seed: u64) -> TableData {
    let mut state = seed;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut bytes = Vec::new();
    for _ in 0..rows {
        match dtype {
            TableDtype::Float32 => (0..dim).for_each(|_| {
                let v = (next() % 8000) as f32 / 1000.0 - 4.0;
                bytes.extend_from_slice(&v.to_le_bytes());
            }),
            TableDtype::Float16 => (0..dim).for_each(|_| {
                let h = (next() as u16) & !0x4000; // finite
                bytes.extend_from_slice(&h.to_le_bytes());
            }),
            TableDtype::Int8Rowwise | TableDtype::Int4Rowwise => {
                let codes = dtype.row_bytes(dim) - 8;
                (0..codes).for_each(|_| bytes.push(next() as u8));
                let scale = 1e-3 + (next() % 1000) as f32 * 1e-4;
                let bias = (next() % 2000) as f32 / 1000.0 - 1.0;
                bytes.extend_from_slice(&scale.to_le_bytes());
                bytes.extend_from_slice(&bias.to_le_bytes());
            }
        }
    }
    TableData {
        name: name.into(),
        rows,
        dim,
        dtype,
        bytes,
    }
}

fn bundle(dir: &Path) -> Vec<TableData> {
    let tables = vec![
        table("f32", 6000, 48, TableDtype::Float32, 1),
        table("f16", 9000, 40, TableDtype::Float16, 2),
        table("i8", 12000, 64, TableDtype::Int8Rowwise, 3),
        table("i4", 20000, 37, TableDtype::Int4Rowwise, 4),
    ];
    write_bundle(dir, &tables);
    tables
}

/// Requests of `bags` bags: a few hot ids repeated within and across bags (the user's
/// features every candidate shares), the rest spread over the table.
fn request(seed: u64, rows: u64, bags: usize) -> (Vec<i64>, Vec<u32>, Vec<f32>) {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let (mut ids, mut offsets, mut weights) = (Vec::new(), vec![0u32], Vec::new());
    for _ in 0..bags {
        let len = (next() % 12) as usize; // some empty bags too
        for _ in 0..len {
            let id = if next() % 3 == 0 {
                next() % 16
            } else {
                next() % rows
            };
            ids.push(id as i64);
            weights.push((next() % 100) as f32 / 37.0 - 1.0);
        }
        offsets.push(ids.len() as u32);
    }
    (ids, offsets, weights)
}

fn tier(policy: PolicyKind, io: IoMode, pooled: f64) -> Arc<Tier> {
    let mut config = TierConfig::new(1 << 20);
    config.policy = policy;
    config.io = io;
    config.pooled_fraction = pooled;
    Tier::new(config).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn ssd_tier_equals_dram_bit_for_bit() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let tables = bundle(dir.path());
    let dram = TableSet::open(dir.path(), None, None).unwrap();
    for (policy, io, pooled) in [
        (PolicyKind::Sieve, IoMode::Auto, 0.0),
        (PolicyKind::Lru, IoMode::Pread, 0.25),
        (PolicyKind::Sieve, IoMode::Auto, 0.25),
    ] {
        let tier = tier(policy, io, pooled);
        let options = OpenOptions {
            tier: Some(tier.clone()),
            ..OpenOptions::default()
        };
        let ssd = TableSet::open_with(dir.path(), None, None, &options).unwrap();
        for t in &tables {
            let (a, b) = (dram.get(&t.name).unwrap(), ssd.get(&t.name).unwrap());
            assert_eq!(b.store_kind(), "ssd");
            // Each request twice: the second finds its rows (and bags) cached.
            for round in 0..40u64 {
                let (ids, offsets, weights) = request(round / 2, t.rows, 64);
                for (pooling, w) in [
                    (Pooling::Sum, None),
                    (Pooling::Sum, Some(&weights[..])),
                    (Pooling::Mean, None),
                    (Pooling::Max, None),
                ] {
                    let bags = Bags {
                        ids: &ids,
                        offsets: &offsets,
                        weights: w,
                    };
                    let n = bags.len();
                    let (mut want, mut got) = (vec![0.0; n * t.dim], vec![1.0; n * t.dim]);
                    let (mut wc, mut gc) = (vec![0; n], vec![0; n]);
                    pool(a, &bags, pooling, &mut want, &mut wc).unwrap();
                    pool(b, &bags, pooling, &mut got, &mut gc).unwrap();
                    let what = format!("{} {pooling:?} weights={} {policy:?}", t.name, w.is_some());
                    assert_eq!(bits(&got), bits(&want), "{what}");
                    assert_eq!(gc, wc, "{what}");
                }
                let (mut want, mut got) =
                    (vec![0.0; ids.len() * t.dim], vec![1.0; ids.len() * t.dim]);
                gather(a, &ids, &mut want).unwrap();
                gather(b, &ids, &mut got).unwrap();
                assert_eq!(bits(&got), bits(&want), "{} gather", t.name);
            }
        }
        let stats = tier.stats();
        assert!(stats.row_hits > 0 && stats.device_reads > 0, "{stats:?}");
        assert!(stats.rows < stats.ids, "de-duplication: {stats:?}");
        // Rows of 56-192 bytes read in 512-byte (or 4 KiB) blocks, never a whole table.
        assert!(stats.read_amplification() >= 1.0, "{stats:?}");
        if pooled > 0.0 {
            assert!(stats.pooled_hits > 0, "{stats:?}");
        } else {
            assert_eq!(stats.pooled_lookups, 0, "{stats:?}");
        }
        for (row_bytes, capacity, held) in tier.row_cache_shape() {
            assert!(held <= capacity, "{row_bytes}: {held} > {capacity}");
        }
    }
}

#[test]
fn engine_threads_on_the_ssd_tier_equal_dram() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let tables = bundle(dir.path());
    let dram = TableSet::open(dir.path(), None, None).unwrap();
    let options = OpenOptions {
        tier: Some(tier(PolicyKind::Sieve, IoMode::Auto, 0.1)),
        ..OpenOptions::default()
    };
    let ssd = TableSet::open_with(dir.path(), None, None, &options).unwrap();
    let engine = Engine::new(3);
    for t in &tables {
        let (ids, offsets, weights) = request(7, t.rows, 500);
        let bags = Bags {
            ids: &ids,
            offsets: &offsets,
            weights: Some(&weights),
        };
        let n = bags.len();
        let run = |set: &TableSet| {
            let (mut out, mut counts) = (vec![0.0; n * t.dim], vec![0; n]);
            let mut jobs = vec![PoolJob {
                table: set.get(&t.name).unwrap(),
                bags,
                pooling: Pooling::Sum,
                out: &mut out,
                counts: &mut counts,
            }];
            engine.pool_many(&mut jobs).unwrap();
            (bits(&out), counts)
        };
        assert_eq!(run(&ssd), run(&dram), "{}", t.name);
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    bundle(dir.path());
    // A budget below the minimum names the value and the minimum.
    let err = Tier::new(TierConfig::new(4096)).unwrap_err().to_string();
    assert!(err.contains("4096") && err.contains("minimum"), "{err}");
    let options = OpenOptions {
        tier: Some(tier(PolicyKind::Sieve, IoMode::Auto, 0.0)),
        ..OpenOptions::default()
    };
    // A truncated table file names the file and both sizes.
    let f16 = dir.path().join("tables/f16.bin");
    let file = std::fs::OpenOptions::new().write(true).open(&f16).unwrap();
    file.set_len(1000).unwrap();
    let err = TableSet::open_with(dir.path(), None, None, &options).unwrap_err();
    assert!(matches!(err, EmbedError::SizeMismatch { .. }), "{err}");
    assert!(
        err.to_string().contains("f16.bin") && err.to_string().contains("1000"),
        "{err}"
    );
    // A missing one names the file.
    std::fs::remove_file(&f16).unwrap();
    let err = TableSet::open_with(dir.path(), None, None, &options)
        .unwrap_err()
        .to_string();
    assert!(err.contains("f16.bin"), "{err}");
    // An id outside the table is refused before any read.
    let set = TableSet::open_with(dir.path(), Some(&["f32".into()]), None, &options).unwrap();
    let t = set.get("f32").unwrap();
    let mut out = vec![0.0; t.dim()];
    let err = gather(t, &[6000], &mut out).unwrap_err().to_string();
    assert!(err.contains("6000"), "{err}");
}

#[test]
fn io_uring_is_used_where_the_kernel_allows_it_and_forcing_pread_works() {
    let auto = tier(PolicyKind::Sieve, IoMode::Auto, 0.0);
    assert!(["io_uring", "pread"].contains(&auto.io_backend()));
    assert_eq!(
        tier(PolicyKind::Lru, IoMode::Pread, 0.0).io_backend(),
        "pread"
    );
}
