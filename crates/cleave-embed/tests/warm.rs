//! Placement and warm-up on the SSD tier (docs/tiers.md): a tier pinned to some tables leaves
//! the others in DRAM, and a warmed row cache answers the first lookups of the hot rows
//! without a device read, with the same values as DRAM.

mod common;

use std::collections::HashMap;

use cleave_embed::tier::warm_up;
use cleave_embed::{gather, Manifest, OpenOptions, Table, TableDtype, Tier, TierConfig};
use common::{write_bundle, TableData};

fn table(name: &str, rows: u64, dim: usize) -> TableData {
    let bytes = (0..rows as usize * dim)
        .flat_map(|i| ((i % 977) as f32 * 0.25 - 100.0).to_le_bytes())
        .collect();
    TableData {
        name: name.into(),
        rows,
        dim,
        dtype: TableDtype::Float32,
        bytes,
    }
}

fn open(dir: &std::path::Path, options: &OpenOptions) -> Vec<Table> {
    let manifest = Manifest::load(dir).unwrap();
    manifest
        .tables
        .iter()
        .map(|m| Table::open_with(dir, m, 0..m.rows, options).unwrap())
        .collect()
}

#[test]
fn a_warmed_cache_answers_the_first_lookups_of_hot_rows() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    write_bundle(
        dir.path(),
        &[table("hot", 8000, 64), table("dram", 500, 16)],
    );
    let hot: Vec<u64> = (0..300).map(|i| i * 17 + 5).collect();
    let mut config = TierConfig::new(1 << 20);
    config.ssd_tables = Some(vec!["hot".into()]);
    // Out-of-range and repeated ids are skipped, not errors.
    let mut listed = hot.clone();
    listed.extend([5, 1 << 40]);
    config.warm_rows = HashMap::from([("hot".to_string(), listed)]);
    let tier = Tier::new(config).unwrap();
    let options = OpenOptions {
        tier: Some(tier.clone()),
        ..OpenOptions::default()
    };
    let tables = open(dir.path(), &options);
    let kinds: Vec<_> = tables.iter().map(|t| t.store_kind()).collect();
    assert_eq!(kinds, ["ssd", "mapped"], "placement: only `hot` on SSD");

    let report = warm_up(&tier, &tables).unwrap();
    assert_eq!(report.rows.get("hot"), Some(&300));
    assert_eq!(report.skipped, 2);
    assert_eq!(tier.stats().rows, 0, "counters start at serving");

    let dram = open(dir.path(), &OpenOptions::default());
    let ids: Vec<i64> = hot.iter().rev().map(|&i| i as i64).collect();
    let (mut got, mut want) = (vec![0f32; ids.len() * 64], vec![0f32; ids.len() * 64]);
    gather(&tables[0], &ids, &mut got).unwrap();
    gather(&dram[0], &ids, &mut want).unwrap();
    assert_eq!(got, want);
    let stats = tier.stats();
    assert_eq!((stats.rows, stats.row_hits), (300, 300), "{stats:?}");
    assert_eq!(stats.device_reads, 0);

    // A cold row still misses: the counters can tell the two apart.
    gather(&tables[0], &[7], &mut got[..64]).unwrap();
    assert_eq!(tier.stats().device_reads, 1);
}

#[test]
fn without_hot_rows_the_cache_starts_cold() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    write_bundle(dir.path(), &[table("t", 8000, 64)]);
    let tier = Tier::new(TierConfig::new(1 << 20)).unwrap();
    let options = OpenOptions {
        tier: Some(tier.clone()),
        ..OpenOptions::default()
    };
    let tables = open(dir.path(), &options);
    let report = warm_up(&tier, &tables).unwrap();
    assert!(report.rows.is_empty());
    let mut out = vec![0f32; 64];
    gather(&tables[0], &[5], &mut out).unwrap();
    assert_eq!(tier.stats().row_hits, 0);
}
