//! The cache against a model shard: results equal the shard's bit for bit, hits are not sent,
//! and a switch keys requests as of its time anew.

use cleave_embed::Pooling;
use cleave_shard::{Lookup as ShardLookup, Op, Pooled};

use super::policy::{CacheMode, PolicyConfig};
use super::*;

const DIM: usize = 3;

/// A shard's answer, row `id` of version `v` being `[id + v/8, id * 0.1, -id]`: sums in the
/// bag's order (so an order-invariant key would return wrong bits for a reordered bag).
fn shard(batch: &[ShardLookup], version: u32) -> Vec<Pooled> {
    let row = |id: i64| {
        let x = id as f32;
        [x + version as f32 / 8.0, x * 0.1 + 1e-7 * x * x, -x]
    };
    batch
        .iter()
        .map(|l| {
            let mut values = Vec::new();
            match l.op {
                Op::Gather => l.ids.iter().for_each(|&id| values.extend(row(id))),
                Op::Pool(_) => {
                    for w in l.offsets.windows(2) {
                        let mut acc = [0.0f32; DIM];
                        for j in w[0] as usize..w[1] as usize {
                            let s = l.weights.as_ref().map_or(1.0, |ws| ws[j]);
                            for (a, r) in acc.iter_mut().zip(row(l.ids[j])) {
                                *a += s * r;
                            }
                        }
                        values.extend(acc);
                    }
                }
            }
            Pooled {
                rows: values.len() / DIM,
                dim: DIM,
                values,
                counts: Vec::new(),
            }
        })
        .collect()
}

fn cache() -> EmbedCache {
    EmbedCache::new(PolicyConfig {
        mode: CacheMode::Fixed,
        cache_bytes: 1 << 20,
        budget_bytes: 0,
        activation_bytes_per_sample: 0,
        ranker_max_batch: 256,
        window: 8,
    })
}

fn batch() -> Vec<ShardLookup> {
    vec![
        ShardLookup {
            table: "g".into(),
            op: Op::Gather,
            ids: vec![5, 7, 5, 9],
            offsets: vec![],
            weights: None,
        },
        ShardLookup {
            table: "p".into(),
            op: Op::Pool(Pooling::Sum),
            ids: vec![1, 2, 3, 3, 2, 1, 1, 2, 3],
            offsets: vec![0, 3, 6, 9, 9],
            weights: Some(vec![0.3, 0.7, 1.1, 1.1, 0.7, 0.3, 0.3, 0.7, 1.1]),
        },
    ]
}

fn through(
    c: &EmbedCache,
    tables: &[u32],
    batch: &[ShardLookup],
    as_of: u64,
    v: u32,
) -> (Vec<Vec<f32>>, usize) {
    let split = c.split(batch, tables, as_of);
    let sent: usize = split.misses.iter().map(|l| l.rows()).sum();
    let fetched = shard(&split.misses, v);
    (c.finish(split, fetched, &[DIM, DIM]).unwrap(), sent)
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn hits_return_the_shards_bits_and_are_not_sent_again() {
    let c = cache();
    let tables = [c.table("g"), c.table("p")];
    let direct: Vec<Vec<f32>> = shard(&batch(), 0).into_iter().map(|p| p.values).collect();
    // Cold: each distinct row and bag is sent once (5 twice, bag 0 and 2 equal: 3 + 3 sent).
    let (cold, sent) = through(&c, &tables, &batch(), 1, 0);
    assert_eq!(sent, 3 + 3);
    assert_eq!(bits(&cold), bits(&direct));
    // The reordered bag (3, 2, 1) is its own entry: its sum's bits differ from (1, 2, 3)'s.
    assert_ne!(
        bits(&[direct[1][..DIM].to_vec()]),
        bits(&[direct[1][DIM..2 * DIM].to_vec()])
    );
    let (warm, sent) = through(&c, &tables, &batch(), 2, 0);
    assert_eq!(sent, 0);
    assert_eq!(bits(&warm), bits(&direct));
    let s = c.stats();
    assert_eq!((s.hits, s.misses), (4 + 4, 6));
    assert_eq!(s.ids_avoided, 4 + 9);
    assert!(s.bytes_not_sent > 0 && s.bytes > 0 && s.limit == 1 << 20);
}

#[test]
fn a_switch_keys_requests_from_its_time_on_anew() {
    let c = cache();
    let tables = [c.table("g"), c.table("p")];
    through(&c, &tables, &batch(), 100, 0);
    let t = cleave_wire::unix_now_us() + 1_000_000;
    c.switch("p", t).unwrap();
    // As of before T: version 0, still cached; as of T: version 1, fetched, never the old.
    let (before, sent) = through(&c, &tables, &batch(), t - 1, 0);
    assert_eq!(sent, 0);
    let (after, sent) = through(&c, &tables, &batch(), t, 1);
    assert_eq!(sent, 3, "the switched table's bags only");
    let new: Vec<Vec<f32>> = shard(&batch(), 1).into_iter().map(|p| p.values).collect();
    assert_eq!(bits(&after[1..]), bits(&new[1..]));
    assert_eq!(
        bits(&after[..1]),
        bits(&before[..1]),
        "table g did not switch"
    );
    assert_ne!(bits(&before[1..]), bits(&new[1..]));
}

#[test]
fn another_version_of_the_model_never_reads_this_ones_rows() {
    let c = cache();
    let v1 = [c.table("g"), c.table("p")];
    let v2 = [c.table("g"), c.table("p")];
    through(&c, &v1, &batch(), 1, 0);
    let (_, sent) = through(&c, &v2, &batch(), 1, 0);
    assert_eq!(sent, 6);
}

#[test]
fn a_short_answer_is_an_error_not_a_wrong_row() {
    let c = cache();
    let tables = [c.table("g"), c.table("p")];
    let split = c.split(&batch(), &tables, 1);
    let mut fetched = shard(&split.misses, 0);
    fetched[0].values.pop();
    assert!(c
        .finish(split, fetched, &[DIM, DIM])
        .unwrap_err()
        .contains("lookup 0"));
}
