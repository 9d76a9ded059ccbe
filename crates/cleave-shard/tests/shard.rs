//! Shards in this process on loopback sockets, against a plain reference: routing over several
//! shards, merging partial pools, readiness, limits, and errors naming the shard.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cleave_embed::Pooling;
use cleave_shard::message::{decode_response, encode_request};
use cleave_shard::{
    ClientError, Lookup, Op, Route, RoutingTable, RowSpec, Shard, ShardClient, ShardClientConfig,
    ShardConfig, ShardService, LOOKUP,
};
use cleave_wire::{Address, Client, ClientConfig, ErrorCode, IoThreads, Server, ServerConfig};
use proptest::prelude::*;

const ROWS: u64 = 97;
const DIM: usize = 4;

/// Row r, element j is r * 10 + j (exact in f32, easy to check by hand).
fn value(r: u64, j: usize) -> f32 {
    (r * 10) as f32 + j as f32 - 300.0
}

fn write_bundle(dir: &Path) {
    std::fs::create_dir_all(dir.join("tables")).unwrap();
    let mut data = Vec::new();
    for r in 0..ROWS {
        for j in 0..DIM {
            data.extend_from_slice(&value(r, j).to_le_bytes());
        }
    }
    std::fs::write(dir.join("tables/t.bin"), &data).unwrap();
    let manifest = format!(
        r#"{{"format": "cleave-bundle", "version": 1, "tables": [{{"name": "t",
            "file": "tables/t.bin", "rows": {ROWS}, "dim": {DIM}, "dtype": "float32",
            "row_bytes": {}, "crc32": 0}}]}}"#,
        DIM * 4
    );
    std::fs::write(dir.join("manifest.json"), manifest).unwrap();
}

fn reference(l: &Lookup) -> Vec<f32> {
    let row = |i: usize| (0..DIM).map(move |j| value(l.ids[i] as u64, j));
    if l.op == Op::Gather {
        return (0..l.ids.len()).flat_map(row).collect();
    }
    let mut out = Vec::new();
    for bag in l.offsets.windows(2) {
        let (a, b) = (bag[0] as usize, bag[1] as usize);
        for j in 0..DIM {
            let xs = (a..b).map(|i| {
                let w = l.weights.as_ref().map_or(1.0, |w| w[i]);
                value(l.ids[i] as u64, j) * w
            });
            out.push(match l.op {
                Op::Pool(Pooling::Max) => xs.fold(f32::NEG_INFINITY, f32::max).max(if a == b {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }),
                Op::Pool(Pooling::Mean) if b > a => xs.sum::<f32>() / (b - a) as f32,
                _ => xs.sum::<f32>(),
            });
        }
    }
    out
}

struct Cluster {
    _dir: tempfile::TempDir,
    shards: Vec<Shard>,
    client: ShardClient,
    rt: tokio::runtime::Runtime,
}

/// `cuts` splits [0, ROWS) into one range per shard.
fn cluster(cuts: &[u64]) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    write_bundle(dir.path());
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(ROWS);
    let mut shards = Vec::new();
    let mut routes = Vec::new();
    for w in bounds.windows(2) {
        let mut config = ShardConfig::new(dir.path().to_owned(), "127.0.0.1:0".parse().unwrap());
        config.rows = RowSpec::Global(w[0]..w[1]);
        let shard = Shard::start(&config).unwrap();
        routes.push(Route {
            table: "t".into(),
            rows: w[0]..w[1],
            addr: shard.info().listen.clone(),
        });
        shards.push(shard);
    }
    let config = ShardClientConfig {
        timeout: Duration::from_secs(10),
        ..ShardClientConfig::default()
    };
    let client = ShardClient::new(RoutingTable::new(routes).unwrap(), &config).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    Cluster {
        _dir: dir,
        shards,
        client,
        rt,
    }
}

fn lookup(op: Op, ids: Vec<i64>, offsets: Vec<u32>, weights: Option<Vec<f32>>) -> Lookup {
    Lookup {
        table: "t".into(),
        op,
        ids,
        offsets,
        weights,
    }
}

#[test]
fn lookups_split_over_shards_equal_the_reference() {
    let c = cluster(&[10, 11, 50]); // a one-row shard too
    let batch = vec![
        lookup(
            Op::Pool(Pooling::Sum),
            vec![9, 10, 11, 12, 96],
            vec![0, 2, 2, 5],
            None,
        ),
        lookup(
            Op::Pool(Pooling::Mean),
            vec![0, 10, 96, 50, 49],
            vec![0, 5],
            None,
        ),
        lookup(
            Op::Pool(Pooling::Max),
            vec![10, 60, 3],
            vec![0, 0, 1, 3],
            None,
        ),
        lookup(
            Op::Pool(Pooling::Sum),
            vec![1, 70, 70],
            vec![0, 3],
            Some(vec![0.5, -1.0, 2.0]),
        ),
        lookup(Op::Gather, vec![96, 0, 10, 10, 49], vec![], None),
        lookup(Op::Pool(Pooling::Mean), vec![], vec![0, 0], None),
        lookup(Op::Pool(Pooling::Sum), vec![20, 21], vec![0, 2], None), // one shard, whole
    ];
    let got = c.rt.block_on(c.client.lookup(&batch)).unwrap();
    for (l, p) in batch.iter().zip(&got) {
        assert_eq!((p.rows, p.dim), (l.rows(), DIM));
        assert_eq!(p.values, reference(l), "{l:?}");
    }
    assert_eq!(got[0].counts, vec![2, 0, 3]);
    assert_eq!(got[4].counts, Vec::<u32>::new());
    for s in c.shards {
        assert!(s.join());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn any_split_merges_to_the_reference(
        bags in proptest::collection::vec(proptest::collection::vec(0..ROWS as i64, 0..9), 1..6),
        op in prop_oneof![Just(Op::Pool(Pooling::Sum)), Just(Op::Pool(Pooling::Mean)), Just(Op::Pool(Pooling::Max)), Just(Op::Gather)],
    ) {
        thread_local!(static C: Cluster = cluster(&[13, 40, 41, 80]));
        let mut offsets = vec![0u32];
        let ids: Vec<i64> = bags.iter().flatten().copied().collect();
        for b in &bags {
            offsets.push(offsets.last().unwrap() + b.len() as u32);
        }
        if op == Op::Gather {
            offsets.clear();
        }
        let l = lookup(op, ids, offsets, None);
        let got = C.with(|c| c.rt.block_on(c.client.lookup(std::slice::from_ref(&l)))).unwrap();
        // Exact: the values are small integers, so every summation order agrees.
        prop_assert_eq!(&got[0].values, &reference(&l));
    }
}

#[test]
fn routing_errors_name_the_lookup_and_failures_name_the_shard() {
    let c = cluster(&[50]);
    let err = c.rt.block_on(
        c.client
            .lookup(&[lookup(Op::Gather, vec![97], vec![], None)]),
    );
    let err = err.unwrap_err().to_string();
    assert!(
        err.contains("lookup 0 (table \"t\"): id 97 at position 0 is outside every route"),
        "{err}"
    );
    let bad = Lookup {
        table: "u".into(),
        ..lookup(Op::Gather, vec![1], vec![], None)
    };
    let err =
        c.rt.block_on(c.client.lookup(&[bad]))
            .unwrap_err()
            .to_string();
    assert!(err.contains("no shard holds this table"), "{err}");
    let weights_on_max = lookup(Op::Pool(Pooling::Max), vec![1], vec![0, 1], Some(vec![1.0]));
    let err =
        c.rt.block_on(c.client.lookup(&[weights_on_max]))
            .unwrap_err()
            .to_string();
    assert!(err.contains("weights need sum pooling, got max"), "{err}");

    let mut shards = c.shards.into_iter();
    let (first, second) = (shards.next().unwrap(), shards.next().unwrap());
    let gone = second.info().listen.clone();
    drop(second); // stops at once
    let err = c.rt.block_on(
        c.client
            .lookup(&[lookup(Op::Gather, vec![1, 60], vec![], None)]),
    );
    match err.unwrap_err() {
        ClientError::Replica { source, holds } => {
            assert_eq!(source.addr(), &gone);
            assert!(
                source.to_string().starts_with(&gone.to_string()),
                "{source}"
            );
            assert!(holds.contains("table \"t\" rows ["), "{holds}");
        }
        other => panic!("expected a shard error, got {other}"),
    }
    // The other shard still answers.
    let ok = c.rt.block_on(
        c.client
            .lookup(&[lookup(Op::Gather, vec![1], vec![], None)]),
    );
    assert_eq!(
        ok.unwrap()[0].values,
        reference(&lookup(Op::Gather, vec![1], vec![], None))
    );
    assert!(first.join());
}

#[test]
fn a_shard_without_tables_is_not_ready_and_says_so() {
    let service = Arc::new(ShardService::new(1 << 20));
    let addr: Address = "127.0.0.1:0".parse().unwrap();
    let server = Server::bind(&addr, service.clone(), ServerConfig::default()).unwrap();
    let client = Client::new(
        server.local_addr().clone(),
        IoThreads::new("t", 1).unwrap(),
        ClientConfig::default(),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let t = Duration::from_secs(5);
    assert!(!rt.block_on(client.ready(t)).unwrap());
    let payload = encode_request([lookup(Op::Gather, vec![1], vec![], None).view()]);
    let err = rt.block_on(client.call(LOOKUP, payload, t)).unwrap_err();
    assert_eq!(err.remote_code(), Some(ErrorCode::NotReady), "{err}");
    let text = service.render_metrics(1, 0);
    assert!(text.contains("cleave_shard_ready 0"), "{text}");
    assert!(
        text.contains("cleave_shard_errors_total{code=\"not_ready\"} 1"),
        "{text}"
    );
}

#[test]
fn responses_over_the_frame_limit_are_refused_not_truncated() {
    let dir = tempfile::tempdir().unwrap();
    write_bundle(dir.path());
    let mut config = ShardConfig::new(dir.path().to_owned(), "127.0.0.1:0".parse().unwrap());
    config.max_payload = 4096;
    let shard = Shard::start(&config).unwrap();
    let client = Client::new(
        shard.info().listen.clone(),
        IoThreads::new("t", 1).unwrap(),
        ClientConfig::default(),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // 300 gathered rows of 16 bytes: a small request, a 4.8 KB response.
    let big = lookup(
        Op::Gather,
        (0..300).map(|i| i % ROWS as i64).collect(),
        vec![],
        None,
    );
    let err =
        rt.block_on(client.call(LOOKUP, encode_request([big.view()]), Duration::from_secs(5)));
    let err = err.unwrap_err();
    assert_eq!(err.remote_code(), Some(ErrorCode::BadRequest), "{err}");
    assert!(err.to_string().contains("would exceed 4096 bytes"), "{err}");
    let small = lookup(Op::Gather, vec![3], vec![], None);
    let reply = rt.block_on(client.call(
        LOOKUP,
        encode_request([small.view()]),
        Duration::from_secs(5),
    ));
    let got = decode_response(&reply.unwrap(), 1).unwrap();
    assert_eq!(got[0].values, reference(&small));
    assert!(shard.join());
}
