//! Every kernel this CPU has × dtype × pooling × weights against a plain f64 reference, on whole
//! tables and on tables split into 1, 2 and 5 row-range shards merged through the counts.

mod common;

use cleave_embed::{
    finish, gather_with, merge, pool_with, Bags, Engine, Kernel, Manifest, PoolJob, Pooling, Table,
    TableDtype,
};
use common::{assert_close, reference, table_data, tolerance, write_bundle, TableData};
use proptest::prelude::*;
use proptest::strategy::ValueTree;

#[derive(Debug, Clone)]
struct Case {
    table: TableData,
    bags: Vec<Vec<(i64, f32)>>,
    pooling: Pooling,
    weighted: bool,
    cuts: Vec<u64>,
}

impl Case {
    fn ids(&self) -> Vec<i64> {
        self.bags.iter().flatten().map(|&(id, _)| id).collect()
    }
    fn weights(&self) -> Option<Vec<f32>> {
        self.weighted
            .then(|| self.bags.iter().flatten().map(|&(_, w)| w).collect())
    }
    fn offsets(&self) -> Vec<u32> {
        offsets_of(self.bags.iter().map(Vec::len))
    }
    /// Row ranges of the shards: the cuts split [0, rows).
    fn shards(&self) -> Vec<std::ops::Range<u64>> {
        let mut points = vec![0];
        points.extend(self.cuts.iter().copied());
        points.push(self.table.rows);
        points.sort_unstable();
        points.windows(2).map(|w| w[0]..w[1]).collect()
    }
}

fn offsets_of(lens: impl Iterator<Item = usize>) -> Vec<u32> {
    let mut offsets = vec![0u32];
    for len in lens {
        offsets.push(offsets.last().unwrap() + len as u32);
    }
    offsets
}

fn case() -> impl Strategy<Value = Case> {
    let dtype = prop_oneof![
        Just(TableDtype::Float32),
        Just(TableDtype::Float16),
        Just(TableDtype::Int8Rowwise),
        Just(TableDtype::Int4Rowwise)
    ];
    // Dims around the 8-, 16- and 64-float blocks of the kernels, and one of three blocks.
    let dim = prop_oneof![4 => 1usize..=80, 1 => Just(64usize), 1 => Just(130usize)];
    let pooling = prop_oneof![Just(Pooling::Sum), Just(Pooling::Mean), Just(Pooling::Max)];
    let shards = prop_oneof![Just(1usize), Just(2usize), Just(5usize)];
    (dtype, 1u64..=48, dim, pooling, any::<bool>(), shards).prop_flat_map(
        |(dtype, rows, dim, pooling, weighted, shards)| {
            let last = rows as i64 - 1;
            // Boundary rows often, so shard edges and the table's ends are exercised.
            let id = prop_oneof![3 => 0..=last, 1 => Just(0i64), 1 => Just(last)];
            let bag = proptest::collection::vec((id, -2.0f32..2.0), 0..=12);
            (
                table_data("t", rows, dim, dtype),
                proptest::collection::vec(bag, 0..=8),
                proptest::collection::vec(0..=rows, shards - 1),
            )
                .prop_map(move |(table, bags, cuts)| Case {
                    table,
                    bags,
                    pooling,
                    weighted: weighted && pooling == Pooling::Sum,
                    cuts,
                })
        },
    )
}

fn rel(case: &Case) -> f64 {
    if case.pooling == Pooling::Max {
        0.0 // a max picks one value: exact
    } else {
        tolerance(case.table.dtype)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn pooled_lookups_match_reference(case in case()) {
        let dir = tempfile::tempdir().unwrap();
        write_bundle(dir.path(), std::slice::from_ref(&case.table));
        let meta = Manifest::load(dir.path()).unwrap().tables.remove(0);
        let (ids, offsets, weights) = (case.ids(), case.offsets(), case.weights());
        let want = reference(&case.table, &ids, &offsets, weights.as_deref(), case.pooling);
        let bags = Bags { ids: &ids, offsets: &offsets, weights: weights.as_deref() };
        let n = bags.len();
        let dim = case.table.dim;
        let whole = Table::open(dir.path(), &meta, 0..u64::MAX).unwrap();

        for kernel in Kernel::available() {
            let what = format!("{} {:?} {:?}", kernel.name(), case.table.dtype, case.pooling);
            // The whole table.
            let (mut out, mut counts) = (vec![f32::NAN; n * dim], vec![u32::MAX; n]);
            pool_with(kernel, &whole, &bags, case.pooling, &mut out, &mut counts).unwrap();
            assert_close(&out, &want, rel(&case), &what);
            let lens: Vec<u32> = case.bags.iter().map(|b| b.len() as u32).collect();
            prop_assert_eq!(&counts, &lens);

            // Shards: each pools the ids it holds, the caller merges.
            let (mut acc, mut acc_counts) = (vec![0.0; n * dim], vec![0u32; n]);
            for range in case.shards() {
                let shard = Table::open(dir.path(), &meta, range.clone()).unwrap();
                let mine: Vec<Vec<(i64, f32)>> = case
                    .bags
                    .iter()
                    .map(|b| b.iter().copied().filter(|(id, _)| range.contains(&(*id as u64))).collect())
                    .collect();
                let ids: Vec<i64> = mine.iter().flatten().map(|&(id, _)| id).collect();
                let w: Vec<f32> = mine.iter().flatten().map(|&(_, w)| w).collect();
                let offsets = offsets_of(mine.iter().map(Vec::len));
                let sub = Bags { ids: &ids, offsets: &offsets, weights: case.weighted.then_some(&w[..]) };
                let (mut part, mut part_counts) = (vec![f32::NAN; n * dim], vec![0u32; n]);
                pool_with(kernel, &shard, &sub, case.pooling.partial(), &mut part, &mut part_counts)
                    .unwrap();
                merge(case.pooling, dim, &mut acc, &mut acc_counts, &part, &part_counts).unwrap();
            }
            finish(case.pooling, dim, &mut acc, &acc_counts);
            assert_close(&acc, &want, rel(&case), &format!("{what} over {} shards", case.shards().len()));
            prop_assert_eq!(&acc_counts, &lens);

            // The engine splits bags over threads; per bag it runs the same kernel: same bits.
            let engine = Engine::with_kernel(3, kernel);
            let (mut out2, mut counts2) = (vec![f32::NAN; n * dim], vec![0u32; n]);
            engine.pool(&whole, &bags, case.pooling, &mut out2, &mut counts2).unwrap();
            prop_assert_eq!(out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            out2.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            prop_assert_eq!(&counts2, &counts);

            // Gather returns each row's values exactly.
            let mut rows = vec![f32::NAN; ids.len() * dim];
            gather_with(kernel, &whole, &ids, &mut rows).unwrap();
            for (i, &id) in ids.iter().enumerate() {
                for c in 0..dim {
                    prop_assert_eq!(rows[i * dim + c] as f64, case.table.value(id as u64, c),
                        "{} gather of id {} column {}", kernel.name(), id, c);
                }
            }
        }
    }
}

/// Many jobs over several tables, large enough that the engine splits them over its workers.
#[test]
fn engine_splits_jobs_over_threads_with_identical_results() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let tables: Vec<TableData> = [
        ("a", 500, 64, TableDtype::Float32),
        ("b", 300, 24, TableDtype::Int8Rowwise),
        ("c", 200, 40, TableDtype::Float16),
    ]
    .iter()
    .map(|&(name, rows, dim, dtype)| {
        table_data(name, rows, dim, dtype)
            .new_tree(&mut runner)
            .unwrap()
            .current()
    })
    .collect();
    let dir = tempfile::tempdir().unwrap();
    write_bundle(dir.path(), &tables);
    let set = cleave_embed::TableSet::open(dir.path(), None, None).unwrap();
    // 3 jobs x 2000 bags of 0..=30 ids: well above the inline threshold, and long enough bags
    // that where a chunk ends (and its prefetching stops) falls inside them.
    let inputs: Vec<(Vec<i64>, Vec<u32>, Pooling)> = tables
        .iter()
        .zip([Pooling::Sum, Pooling::Mean, Pooling::Max])
        .map(|(t, pooling)| {
            let lens: Vec<usize> = (0..2000).map(|b| (b * 7) % 31).collect();
            let total: usize = lens.iter().sum();
            let ids = (0..total)
                .map(|i| ((i * 7919) % t.rows as usize) as i64)
                .collect();
            (ids, offsets_of(lens.into_iter()), pooling)
        })
        .collect();
    let run = |engine: &Engine| {
        let mut outs: Vec<(Vec<f32>, Vec<u32>)> = tables
            .iter()
            .map(|t| (vec![f32::NAN; 2000 * t.dim], vec![0; 2000]))
            .collect();
        let mut jobs: Vec<PoolJob> = tables
            .iter()
            .zip(&inputs)
            .zip(outs.iter_mut())
            .map(|((t, (ids, offsets, pooling)), (out, counts))| PoolJob {
                table: set.get(&t.name).unwrap(),
                bags: Bags {
                    ids,
                    offsets,
                    weights: None,
                },
                pooling: *pooling,
                out,
                counts,
            })
            .collect();
        engine.pool_many(&mut jobs).unwrap();
        outs
    };
    let one = run(&Engine::new(1));
    for ((t, (ids, offsets, pooling)), (out, _)) in tables.iter().zip(&inputs).zip(&one) {
        let want = reference(t, ids, offsets, None, *pooling);
        let rel = if *pooling == Pooling::Max {
            0.0
        } else {
            tolerance(t.dtype)
        };
        assert_close(out, &want, rel, &t.name);
    }
    for threads in [2, 3, 5] {
        let engine = Engine::new(threads);
        for _ in 0..3 {
            let many = run(&engine);
            for ((a, ca), (b, cb)) in one.iter().zip(&many) {
                assert_eq!(ca, cb, "{threads} threads: counts");
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{threads} threads: pooled values differ from one thread"
                );
            }
        }
    }
}

/// One float32 table of 1,000 rows x 32 in a bundle on disk, and 1,000 bags of 20 ids each
/// (consecutive ids `stride` rows apart) with their summed rows.
struct Bagged {
    _dir: tempfile::TempDir,
    set: cleave_embed::TableSet,
    ids: Vec<i64>,
    offsets: Vec<u32>,
    want: common::Reference,
}

impl Bagged {
    fn new(stride: i64) -> Bagged {
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let t = table_data("t", 1000, 32, TableDtype::Float32)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        let dir = tempfile::tempdir().unwrap();
        write_bundle(dir.path(), std::slice::from_ref(&t));
        let set = cleave_embed::TableSet::open(dir.path(), None, None).unwrap();
        let ids: Vec<i64> = (0..20_000).map(|i| (i * stride) % 1000).collect();
        let offsets: Vec<u32> = (0..=1000).map(|b| b * 20).collect();
        let want = reference(&t, &ids, &offsets, None, Pooling::Sum);
        Bagged {
            _dir: dir,
            set,
            ids,
            offsets,
            want,
        }
    }

    /// Pools the bags on `engine` and checks the result.
    fn pool_on(&self, engine: &Engine, what: &str) {
        let bags = Bags {
            ids: &self.ids,
            offsets: &self.offsets,
            weights: None,
        };
        let (mut out, mut counts) = (vec![0.0; 1000 * 32], vec![0; 1000]);
        let table = self.set.get("t").unwrap();
        engine
            .pool(table, &bags, Pooling::Sum, &mut out, &mut counts)
            .unwrap();
        assert_close(&out, &self.want, 1e-6, what);
    }
}

/// Several callers share one engine at once.
#[test]
fn engine_serves_concurrent_callers() {
    let bagged = Bagged::new(31);
    let engine = Engine::new(2);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..5 {
                    bagged.pool_on(&engine, "concurrent caller");
                }
            });
        }
    });
}

/// `Engine::expect` wakes sleeping workers ahead of a call: with or without the call after it,
/// every call still completes with the one-thread result (a worker woken for nothing goes back
/// to waiting, and still takes the next batch).
#[test]
fn engine_woken_ahead_of_calls_still_pools_every_call() {
    let bagged = Bagged::new(37);
    let engine = Engine::new(2);
    for round in 0..20 {
        engine.expect(bagged.ids.len());
        if round % 3 == 0 {
            engine.expect(bagged.ids.len()); // a wake-up with no call after it
            continue;
        }
        bagged.pool_on(&engine, "woken ahead");
    }
}
