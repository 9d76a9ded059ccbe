//! A shard on the SSD tier with an access profile's hottest rows: warmed before it serves, so
//! its first lookups over the socket hit the row cache (the tier's counters say so), with the
//! values of the table; a placement keeps the other table in DRAM.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use cleave_embed::{Pooling, Tier, TierConfig};
use cleave_shard::{Lookup, Op, Route, RoutingTable, Shard, ShardClient, ShardClientConfig};
use cleave_shard::{ShardConfig, ShardInfo};

const ROWS: u64 = 4096;
const DIM: usize = 16;

fn value(r: u64, j: usize) -> f32 {
    (r * 100 + j as u64) as f32 * 0.5
}

fn write_bundle(dir: &Path) {
    std::fs::create_dir_all(dir.join("tables")).unwrap();
    let mut tables = Vec::new();
    for name in ["hot", "side"] {
        let data: Vec<u8> = (0..ROWS)
            .flat_map(|r| (0..DIM).flat_map(move |j| value(r, j).to_le_bytes()))
            .collect();
        std::fs::write(dir.join(format!("tables/{name}.bin")), &data).unwrap();
        tables.push(format!(
            r#"{{"name": "{name}", "file": "tables/{name}.bin", "rows": {ROWS}, "dim": {DIM},
                "dtype": "float32", "row_bytes": {}, "crc32": 0}}"#,
            DIM * 4
        ));
    }
    let manifest = format!(
        r#"{{"format": "cleave-bundle", "version": 1, "tables": [{}]}}"#,
        tables.join(",")
    );
    std::fs::write(dir.join("manifest.json"), manifest).unwrap();
}

#[test]
fn a_warmed_shard_answers_its_first_lookups_from_the_row_cache() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    write_bundle(dir.path());
    let hot: Vec<u64> = (0..500).map(|i| (i * 7 + 3) % ROWS).collect();
    let mut tier = TierConfig::new(1 << 20);
    tier.ssd_tables = Some(vec!["hot".into()]);
    tier.warm_rows = HashMap::from([("hot".to_string(), hot.clone())]);
    let tier = Tier::new(tier).unwrap();
    let mut config = ShardConfig::new(dir.path().to_owned(), "127.0.0.1:0".parse().unwrap());
    config.tier = Some(tier.clone());
    let shard = Shard::start(&config).unwrap();
    let info: &ShardInfo = shard.info();
    let routes = ["hot", "side"].map(|t| Route {
        table: t.into(),
        rows: 0..ROWS,
        addr: info.listen.clone(),
    });
    let client = ShardClient::new(
        RoutingTable::new(routes.to_vec()).unwrap(),
        &ShardClientConfig {
            timeout: Duration::from_secs(10),
            ..ShardClientConfig::default()
        },
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    assert_eq!(
        tier.stats().rows,
        0,
        "warm-up reads are not counted as serving"
    );

    // Bags of hot rows (sum pooling) and a lookup of the DRAM table.
    let ids: Vec<i64> = hot.iter().map(|&r| r as i64).collect();
    let offsets: Vec<u32> = (0..=50).map(|b| b * 10).collect();
    let batch = [
        Lookup {
            table: "hot".into(),
            op: Op::Pool(Pooling::Sum),
            ids: ids.clone(),
            offsets: offsets.clone(),
            weights: None,
        },
        Lookup {
            table: "side".into(),
            op: Op::Gather,
            ids: vec![1, 4095],
            offsets: vec![],
            weights: None,
        },
    ];
    let got = rt.block_on(client.lookup(&batch)).unwrap();
    for (b, bag) in offsets.windows(2).enumerate() {
        for j in 0..DIM {
            let want: f32 = ids[bag[0] as usize..bag[1] as usize]
                .iter()
                .map(|&r| value(r as u64, j))
                .sum();
            assert_eq!(got[0].values[b * DIM + j], want, "bag {b}");
        }
    }
    assert_eq!(got[1].values[DIM], value(4095, 0));
    let stats = tier.stats();
    assert_eq!(stats.rows, 500, "{stats:?}"); // only the SSD table goes through the tier
    assert_eq!(stats.row_hits, 500, "every first lookup hits: {stats:?}");
    assert_eq!(stats.device_reads, 0, "{stats:?}");
    shard.shutdown();
}

/// Lookups that miss the row cache are completed by miss workers (their reads off the I/O
/// thread); once their rows are cached the same lookups are served inline. Every answer,
/// including many cold ones in flight at once over one I/O thread, equals the table.
#[test]
fn lookups_that_miss_are_completed_off_the_io_thread_with_the_same_values() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    write_bundle(dir.path());
    let mut tier = TierConfig::new(1 << 20);
    tier.ssd_tables = Some(vec!["hot".into()]);
    let tier = Tier::new(tier).unwrap();
    let mut config = ShardConfig::new(dir.path().to_owned(), "127.0.0.1:0".parse().unwrap());
    config.tier = Some(tier.clone());
    config.io_threads = 1;
    config.miss_threads = 3;
    let shard = Shard::start(&config).unwrap();
    let route = Route {
        table: "hot".into(),
        rows: 0..ROWS,
        addr: shard.info().listen.clone(),
    };
    let client = ShardClient::new(
        RoutingTable::new(vec![route]).unwrap(),
        &ShardClientConfig {
            timeout: Duration::from_secs(10),
            ..ShardClientConfig::default()
        },
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let lookup = |first: u64| Lookup {
        table: "hot".into(),
        op: Op::Gather,
        ids: (0..8).map(|k| ((first + k * 97) % ROWS) as i64).collect(),
        offsets: vec![],
        weights: None,
    };
    let check = |first: u64, values: &[f32]| {
        for (k, row) in values.chunks(DIM).enumerate() {
            let r = (first + k as u64 * 97) % ROWS;
            assert_eq!(
                row,
                (0..DIM).map(|j| value(r, j)).collect::<Vec<_>>(),
                "row {r}"
            );
        }
    };
    let service = shard.service().clone();
    // 16 cold lookups in flight together.
    let firsts: Vec<u64> = (0..16).map(|i| i * 13).collect();
    let client = std::sync::Arc::new(client);
    let got = rt.block_on(async {
        let mut calls = tokio::task::JoinSet::new();
        for &f in &firsts {
            let client = client.clone();
            calls.spawn(async move { (f, client.lookup(&[lookup(f)]).await) });
        }
        calls.join_all().await
    });
    for (f, got) in got {
        check(f, &got.unwrap()[0].values);
    }
    assert_eq!(
        service.deferred_lookups(),
        16,
        "every cold lookup went to a miss worker"
    );
    // The same rows again: cached, so served on the I/O thread.
    let again = rt.block_on(client.lookup(&[lookup(0)])).unwrap();
    check(0, &again[0].values);
    assert_eq!(
        service.deferred_lookups(),
        16,
        "a lookup that hits is not deferred"
    );
    assert!(tier.stats().device_reads > 0);
    shard.shutdown();
}
