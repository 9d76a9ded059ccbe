//! The disaggregated path end to end on loopback: a router, two real shards (cleave-shard)
//! splitting a table by row range, and a ranker that records the RANK payload it receives.
//! The payload's tensors must be the boundary tensors the sparse reference would build:
//! weighted sums, means, maxima and gathers split across shards, hashed ids, raw inputs.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_router::backend::payload::{
    decode_request, encode_response, RankRequest, RankResponse, RANK,
};
use cleave_router::{DType, RouterConfig, Tensor};
use cleave_shard::{RowSpec, Shard, ShardConfig};
use cleave_wire::{ErrorCode, Handler, Request, Responder, Server, ServerConfig};
use serde_json::{json, Value};

const MANIFEST: &str = r#"{
  "format": "cleave-bundle", "version": 1, "producer": "test",
  "inputs": [
    {"name": "dense_x", "dtype": "float32", "shape": ["B", 3], "role": "dense"},
    {"name": "user_ids", "dtype": "int64", "shape": ["N0"], "role": "ids"},
    {"name": "user_offsets", "dtype": "int64", "shape": [1], "role": "offsets"},
    {"name": "item_ids", "dtype": "int64", "shape": ["N1"], "role": "ids"},
    {"name": "item_offsets", "dtype": "int64", "shape": ["B"], "role": "offsets"},
    {"name": "item_weights", "dtype": "float32", "shape": ["N1"], "role": "weights"},
    {"name": "cat", "dtype": "int32", "shape": ["B", 2], "role": "both"},
    {"name": "hist", "dtype": "int64", "shape": ["B", "N2"], "role": "ids"}
  ],
  "outputs": [{"name": "output_0", "dtype": "float32", "shape": ["B", 1]}],
  "output_spec": "",
  "tables": [
    {"name": "t_user", "file": "tables/t_user.bin", "rows": 10, "dim": 4,
     "dtype": "float32", "row_bytes": 16, "crc32": 0},
    {"name": "t_item", "file": "tables/t_item.bin", "rows": 20, "dim": 4,
     "dtype": "float32", "row_bytes": 16, "crc32": 0},
    {"name": "t_cat", "file": "tables/t_cat.bin", "rows": 7, "dim": 2,
     "dtype": "float32", "row_bytes": 8, "crc32": 0}
  ],
  "features": [
    {"name": "user", "table": "t_user", "ids": "user_ids", "transform": [],
     "layout": "offsets", "offsets": "user_offsets", "include_last_offset": false,
     "weights": null, "pooling": "mean", "output": "user_pooled"},
    {"name": "item", "table": "t_item", "ids": "item_ids", "transform": [],
     "layout": "offsets", "offsets": "item_offsets", "include_last_offset": false,
     "weights": "item_weights", "pooling": "sum", "output": "item_pooled"},
    {"name": "cat", "table": "t_cat", "ids": "cat",
     "transform": [{"op": "remainder", "divisor": 7}],
     "layout": "fixed", "offsets": null, "include_last_offset": false,
     "weights": null, "pooling": "max", "output": "cat_pooled"},
    {"name": "hist", "table": "t_item", "ids": "hist", "transform": [],
     "layout": "gather", "offsets": null, "include_last_offset": false,
     "weights": null, "pooling": "none", "output": "hist_rows"}
  ],
  "boundary": [
    {"name": "user_pooled", "dtype": "float32", "shape": [1, 4]},
    {"name": "item_pooled", "dtype": "float32", "shape": ["B", 4]},
    {"name": "cat_pooled", "dtype": "float32", "shape": ["B", 2]},
    {"name": "hist_rows", "dtype": "float32", "shape": ["B", "N2", 4]}
  ],
  "dense": {"program": "dense.pt2",
            "inputs": ["dense_x", "user_pooled", "item_pooled", "cat_pooled", "hist_rows", "cat"]},
  "shared_inputs": ["user_ids", "user_offsets"]
}"#;

/// Row `r`, column `c` of every table: distinct per table, exact in f32. Row 6 of t_cat is
/// negative so that max pooling is tested on signs.
fn value(table: &str, r: usize, c: usize) -> f32 {
    let base = match table {
        "t_user" => 100.0,
        "t_item" => 200.0,
        _ => 300.0,
    };
    let v = base + r as f32 + c as f32 / 8.0;
    if table == "t_cat" && r == 6 {
        -v
    } else {
        v
    }
}

fn row(table: &str, r: usize, dim: usize) -> Vec<f32> {
    (0..dim).map(|c| value(table, r, c)).collect()
}

fn write_bundle(dir: &Path) {
    let mut manifest: Value = serde_json::from_str(MANIFEST).unwrap();
    std::fs::create_dir_all(dir.join("tables")).unwrap();
    for t in manifest["tables"].as_array_mut().unwrap() {
        let (name, rows, dim) = (
            t["name"].as_str().unwrap().to_string(),
            t["rows"].as_u64().unwrap(),
            t["dim"].as_u64().unwrap(),
        );
        let bytes: Vec<u8> = (0..rows as usize)
            .flat_map(|r| row(&name, r, dim as usize))
            .flat_map(|v| v.to_le_bytes())
            .collect();
        t["crc32"] = crc32fast::hash(&bytes).into();
        std::fs::write(dir.join(t["file"].as_str().unwrap()), bytes).unwrap();
    }
    std::fs::write(dir.join("manifest.json"), manifest.to_string()).unwrap();
}

/// What the ranker received: the payload and the header's deadline and trace id.
struct Received {
    request: RankRequest,
    deadline_unix_us: u64,
    trace_id: u64,
}

/// A ranker that keeps every RANK request and answers zeros.
#[derive(Default)]
struct Recorder(Mutex<Vec<Received>>);

impl Handler for Recorder {
    fn handle(&self, request: Request, responder: Responder) {
        if request.kind != RANK {
            return responder.error(ErrorCode::UnknownKind, "expected RANK");
        }
        let r = match decode_request(&request.payload) {
            Ok(r) => r,
            Err(e) => return responder.error(ErrorCode::BadRequest, &e.to_string()),
        };
        let b = r.tensors[0].dims[0];
        self.0.lock().unwrap().push(Received {
            request: r,
            deadline_unix_us: request.deadline_unix_us,
            trace_id: request.trace_id,
        });
        let out = Tensor::from_f32(vec![b, 1], &vec![0.0; b]);
        let response = RankResponse {
            queue_us: 1,
            compute_us: 2,
            batch_requests: 1,
            queue_depth: 0,
            outputs: vec![out],
        };
        responder.reply(Bytes::from(encode_response(&response)));
    }
}

fn shard(bundle: &Path, rows: &str) -> Shard {
    let mut c = ShardConfig::new(bundle.to_path_buf(), "127.0.0.1:0".parse().unwrap());
    c.rows = RowSpec::parse(rows).unwrap();
    Shard::start(&c).unwrap()
}

struct Running {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.stop.take().unwrap().send(());
        let _ = self.thread.take().unwrap().join();
    }
}

fn start_router(config: RouterConfig) -> Running {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let r = rt.block_on(cleave_router::serve(
            config,
            async move {
                let _ = stop_rx.await;
            },
            move |addr| ready_tx.send(addr).unwrap(),
        ));
        r.unwrap();
    });
    let addr = ready_rx.recv_timeout(Duration::from_secs(20)).unwrap();
    Running {
        addr,
        stop: Some(stop_tx),
        thread: Some(thread),
    }
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let status = raw.split(' ').nth(1).unwrap().parse().unwrap();
    let body = raw.split_once("\r\n\r\n").unwrap().1;
    (status, serde_json::from_str(body).unwrap())
}

fn good_infer() -> Value {
    json!({"inputs": [
        {"name": "dense_x", "datatype": "FP32", "shape": [2, 3], "data": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]},
        {"name": "user_ids", "datatype": "INT64", "shape": [3], "data": [1, 2, 9]},
        {"name": "user_offsets", "datatype": "INT64", "shape": [1], "data": [0]},
        {"name": "item_ids", "datatype": "INT64", "shape": [3], "data": [4, 15, 19]},
        {"name": "item_offsets", "datatype": "INT64", "shape": [2], "data": [0, 2]},
        {"name": "item_weights", "datatype": "FP32", "shape": [3], "data": [1, 0.5, 2]},
        {"name": "cat", "datatype": "INT32", "shape": [2, 2], "data": [[3, -1], [8, 13]]},
        {"name": "hist", "datatype": "INT64", "shape": [2, 2], "data": [[0, 19], [12, 11]]}
    ]})
}

fn combine(rows: &[Vec<f32>], f: impl Fn(f32, f32) -> f32) -> Vec<f32> {
    rows[1..].iter().fold(rows[0].clone(), |acc, r| {
        acc.iter().zip(r).map(|(a, b)| f(*a, *b)).collect()
    })
}

/// What the sparse reference (python/cleave/bundle/reference.py) makes of `good_infer`.
fn expected() -> Vec<Tensor> {
    let user: Vec<Vec<f32>> = [1, 2, 9].iter().map(|&r| row("t_user", r, 4)).collect();
    let mean: Vec<f32> = combine(&user, |a, b| a + b)
        .iter()
        .map(|v| v / 3.0)
        .collect();
    let scale = |r: Vec<f32>, w: f32| -> Vec<f32> { r.iter().map(|v| v * w).collect() };
    let bag0 = combine(
        &[
            scale(row("t_item", 4, 4), 1.0),
            scale(row("t_item", 15, 4), 0.5),
        ],
        |a, b| a + b,
    );
    let bag1 = scale(row("t_item", 19, 4), 2.0);
    // remainder 7 (Python semantics): [3, -1] -> [3, 6]; [8, 13] -> [1, 6]
    let cat0 = combine(&[row("t_cat", 3, 2), row("t_cat", 6, 2)], f32::max);
    let cat1 = combine(&[row("t_cat", 1, 2), row("t_cat", 6, 2)], f32::max);
    let hist: Vec<f32> = [0, 19, 12, 11]
        .iter()
        .flat_map(|&r| row("t_item", r, 4))
        .collect();
    let cat_raw: Vec<u8> = [3i32, -1, 8, 13]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    vec![
        Tensor::from_f32(vec![2, 3], &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]),
        Tensor::from_f32(vec![1, 4], &mean),
        Tensor::from_f32(vec![2, 4], &[bag0, bag1].concat()),
        Tensor::from_f32(vec![2, 2], &[cat0, cat1].concat()),
        Tensor::from_f32(vec![2, 2, 4], &hist),
        Tensor::new(DType::I32, vec![2, 2], cat_raw).unwrap(),
    ]
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!((got.dtype, &got.dims), (want.dtype, &want.dims), "{what}");
    if got.dtype == DType::F32 {
        for (g, w) in got.to_f32().unwrap().iter().zip(want.to_f32().unwrap()) {
            assert!(
                (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                "{what}: {g} vs {w}"
            );
        }
    } else {
        assert_eq!(got.data, want.data, "{what}");
    }
}

#[test]
fn the_fused_payload_holds_the_reference_boundary_tensors() {
    let dir = tempfile::tempdir().unwrap();
    write_bundle(dir.path());
    // t_item is split across the shards at row 12; the others live on shard a.
    let a = shard(dir.path(), "t_user=0:10,t_item=0:12,t_cat=0:7");
    let b = shard(dir.path(), "t_item=12:20");
    let recorder = Arc::new(Recorder::default());
    let ranker = Server::bind(
        &"127.0.0.1:0".parse().unwrap(),
        recorder.clone(),
        ServerConfig::default(),
    )
    .unwrap();
    let (sa, sb) = (a.info().listen.to_string(), b.info().listen.to_string());
    let route = |t: &str, s: u64, e: u64, addr: &str| json!({"table": t, "row_start": s, "row_end": e, "addr": addr});
    let config = json!({
        "model": "m", "bundle": dir.path(), "rankers": [ranker.local_addr().to_string()],
        "shards": [route("t_user", 0, 10, &sa), route("t_item", 0, 12, &sa),
                   route("t_cat", 0, 7, &sa), route("t_item", 12, 20, &sb)],
        "health_interval_ms": 50
    });
    let router = start_router(RouterConfig::from_json(&config.to_string()).unwrap());

    let (status, v) = post(router.addr, "/v2/models/m/infer", &good_infer());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["outputs"][0]["shape"], json!([2, 1]));
    let received = recorder.0.lock().unwrap().pop().unwrap();
    let got = &received.request;
    let want = expected();
    assert_eq!(got.tensors.len(), want.len());
    let names = [
        "dense_x",
        "user_pooled",
        "item_pooled",
        "cat_pooled",
        "hist_rows",
        "cat",
    ];
    for ((g, w), name) in got.tensors.iter().zip(&want).zip(names) {
        assert_close(g, w, name);
    }
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let deadline = received.deadline_unix_us;
    assert!(
        deadline > now_us && deadline < now_us + 2_000_000,
        "{deadline}"
    );
    assert_ne!(
        received.trace_id, 0,
        "the router's trace id travels to the ranker"
    );

    // The per-feature form builds the same payload.
    let rank = json!({
        "shared": {"user_ids": [1, 2, 9]},
        "candidates": [
            {"dense_x": [0.1, 0.2, 0.3], "item_ids": [4, 15], "item_weights": [1, 0.5],
             "cat": [3, -1], "hist": [0, 19]},
            {"dense_x": [0.4, 0.5, 0.6], "item_ids": [19], "item_weights": [2],
             "cat": [8, 13], "hist": [12, 11]}
        ]
    });
    let (status, v) = post(router.addr, "/v2/models/m/rank", &rank);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["outputs"]["output_0"], json!([[0.0], [0.0]]));
    let got = recorder.0.lock().unwrap().pop().unwrap().request;
    for ((g, w), name) in got.tensors.iter().zip(&want).zip(names) {
        assert_close(g, w, name);
    }

    // A shard that goes away: a fast 502/503 that names it, and readiness drops.
    drop(b);
    let t = Instant::now();
    let (status, v) = post(router.addr, "/v2/models/m/infer", &good_infer());
    assert!(status == 502 || status == 503, "{status} {v}");
    assert!(v["error"].as_str().unwrap().contains(&sb), "{v}");
    assert!(t.elapsed() < Duration::from_secs(2));
    // Lookups that stay on the live shard still work.
    let mut body = good_infer();
    body["inputs"][3]["data"] = json!([4, 5, 6]);
    body["inputs"][7]["data"] = json!([[0, 1], [2, 3]]);
    assert_eq!(post(router.addr, "/v2/models/m/infer", &body).0, 200);
}

/// An HTTP call with an optional bearer token; (status, JSON body).
fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: t\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let status = raw.split(' ').nth(1).unwrap().parse().unwrap();
    let body = raw.split_once("\r\n\r\n").unwrap().1;
    (status, serde_json::from_str(body).unwrap())
}

fn recorder_server() -> (Arc<Recorder>, Server) {
    let recorder = Arc::new(Recorder::default());
    let server = Server::bind(
        &"127.0.0.1:0".parse().unwrap(),
        recorder.clone(),
        ServerConfig::default(),
    )
    .unwrap();
    (recorder, server)
}

#[test]
fn replicas_fail_over_and_the_membership_changes_over_the_admin_api() {
    const TOKEN_ENV: &str = "CLEAVE_TEST_ROUTER_ADMIN_TOKEN";
    const TOKEN: &str = "s3cret";
    std::env::set_var(TOKEN_ENV, TOKEN);
    let dir = tempfile::tempdir().unwrap();
    write_bundle(dir.path());
    let group_a = "t_user=0:10,t_item=0:12,t_cat=0:7";
    let (a1, a2, b) = (
        shard(dir.path(), group_a),
        shard(dir.path(), group_a),
        shard(dir.path(), "t_item=12:20"),
    );
    let (recorder, ranker) = recorder_server();
    let route = |t: &str, s: u64, e: u64, addr: &str| json!({"table": t, "row_start": s, "row_end": e, "addr": addr});
    let group_routes = |addr: &str| {
        vec![
            route("t_user", 0, 10, addr),
            route("t_item", 0, 12, addr),
            route("t_cat", 0, 7, addr),
        ]
    };
    let (s1, s2, sb) = (
        a1.info().listen.to_string(),
        a2.info().listen.to_string(),
        b.info().listen.to_string(),
    );
    let mut routes = group_routes(&s1);
    routes.extend(group_routes(&s2));
    routes.push(route("t_item", 12, 20, &sb));
    let config = json!({
        "model": "m", "bundle": dir.path(), "rankers": [ranker.local_addr().to_string()],
        "shards": routes, "health_interval_ms": 50, "admin_token_env": TOKEN_ENV
    });
    let router = start_router(RouterConfig::from_json(&config.to_string()).unwrap());
    let admin = |method: &str, path: &str, body: &str| {
        call(
            router.addr,
            method,
            &format!("/admin/v1/{path}"),
            Some(TOKEN),
            body,
        )
    };
    let infer_ok = |n: usize| {
        for _ in 0..n {
            let (status, v) = post(router.addr, "/v2/models/m/infer", &good_infer());
            assert_eq!(status, 200, "{v}");
            let got = recorder.0.lock().unwrap().pop().unwrap().request;
            for (g, w) in got.tensors.iter().zip(&expected()) {
                assert_close(g, w, "a boundary tensor");
            }
        }
    };

    // Without the token, or with another, nothing is shown.
    assert_eq!(
        call(router.addr, "GET", "/admin/v1/members", None, "").0,
        401
    );
    let (status, v) = call(router.addr, "GET", "/admin/v1/members", Some("nope"), "");
    assert_eq!(status, 401);
    assert!(v["error"].as_str().unwrap().contains("Bearer"), "{v}");
    infer_ok(4);
    let (status, members) = admin("GET", "members", "");
    assert_eq!(status, 200);
    let shards = members["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 3);
    assert!(shards.iter().all(|s| s["state"] == "active"), "{members}");
    assert_eq!(members["rankers"][0]["state"], "active");

    // Kill the replica of group a that the next request picks (the lower EWMA): every
    // request still succeeds, the dead one is ejected, and the router is degraded.
    let ewma = |addr: &str| {
        shards.iter().find(|s| s["addr"] == addr).unwrap()["ewma_ms"]
            .as_f64()
            .unwrap()
    };
    let (dead, live, live_addr) = if ewma(&s1) <= ewma(&s2) {
        (a1, a2, s2.clone())
    } else {
        (a2, a1, s1.clone())
    };
    let dead_addr = dead.info().listen.to_string();
    drop(dead);
    infer_ok(6);
    let (_, members) = admin("GET", "members", "");
    let state = |m: &Value, addr: &str| {
        m["shards"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["addr"] == addr)
            .map(|s| s["state"].as_str().unwrap().to_owned())
    };
    assert_eq!(state(&members, &dead_addr).as_deref(), Some("ejected"));
    // Readiness: degraded (still 200) once the health loop has seen it, naming it. Bounded.
    let mut health = Value::Null;
    for _ in 0..200 {
        let (status, h) = call(router.addr, "GET", "/ready", None, "");
        assert_eq!(status, 200, "{h}");
        health = h;
        if health["status"] == "degraded" {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert_eq!(health["status"], "degraded", "{health}");
    assert!(
        health["degraded"][0].as_str().unwrap().contains(&dead_addr),
        "{health}"
    );

    // A new replica of group a joins; malformed and conflicting calls change nothing.
    let n = shard(dir.path(), group_a);
    let sn = n.info().listen.to_string();
    let add = json!({"addr": sn, "ranges": [
        {"table": "t_user", "row_start": 0, "row_end": 10},
        {"table": "t_item", "row_start": 0, "row_end": 12},
        {"table": "t_cat", "row_start": 0, "row_end": 7}]});
    let refused = [
        ("shards", "{", 400, "admin request body"),
        (
            "shards",
            r#"{"addr": "h:1"}"#,
            400,
            "missing field `ranges`",
        ),
        (
            "shards",
            r#"{"addr": 7, "ranges": []}"#,
            400,
            "invalid type",
        ),
        (
            "shards",
            r#"{"addr": "h:1", "ranges": [], "x": 1}"#,
            400,
            "unknown field `x`",
        ),
        (
            "shards",
            r#"{"addr": "h:1", "ranges": []}"#,
            400,
            "ranges: empty",
        ),
        (
            "shards",
            r#"{"addr": "h:1", "ranges": [{"table": "t_item", "row_start": 0, "row_end": 5}]}"#,
            400,
            "exactly the ranges of one replica group",
        ),
        (
            "shards",
            r#"{"addr": "h:1", "ranges": [{"table": "t_item", "row_start": 5, "row_end": 5}]}"#,
            400,
            "ranges[0]",
        ),
        ("shards/drain", r#"{"addr": "h:1"}"#, 404, "not a member"),
        (
            "shards/remove",
            r#"{"adr": "h:1"}"#,
            400,
            "unknown field `adr`",
        ),
        (
            "shards/remove",
            &format!(r#"{{"addr": "{sb}"}}"#),
            409,
            "last active replica",
        ),
        ("rankers", "[]", 400, "admin request body"),
    ];
    for (path, body, want, says) in refused {
        let (status, v) = admin("POST", path, body);
        assert_eq!(status, want, "{path} {body}: {v}");
        assert!(
            v["error"].as_str().unwrap().contains(says),
            "{path} {body}: {v}"
        );
    }
    let (status, v) = admin("POST", "shards", &add.to_string());
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        state(&v, &sn).as_deref(),
        Some("active"),
        "probed at once: {v}"
    );
    assert_eq!(admin("POST", "shards", &add.to_string()).0, 409);
    infer_ok(3);

    // The live old replica drains and leaves; the dead one leaves too.
    let body = |addr: &str| json!({ "addr": addr }).to_string();
    assert_eq!(admin("POST", "shards/drain", &body(&live_addr)).0, 200);
    let (status, v) = admin("POST", "shards/remove", &body(&sn));
    assert_eq!(status, 409, "the last active replica of group a: {v}");
    assert_eq!(admin("POST", "shards/remove", &body(&live_addr)).0, 200);
    assert_eq!(admin("POST", "shards/remove", &body(&dead_addr)).0, 200);
    infer_ok(3);
    let (_, members) = admin("GET", "members", "");
    assert_eq!(members["shards"].as_array().unwrap().len(), 2, "{members}");

    // A second ranker joins, the first drains and leaves; the last cannot.
    let (recorder2, ranker2) = recorder_server();
    let (r1, r2) = (
        ranker.local_addr().to_string(),
        ranker2.local_addr().to_string(),
    );
    assert_eq!(admin("POST", "rankers", &body(&r2)).0, 200);
    assert_eq!(admin("POST", "rankers", &body(&r2)).0, 409);
    assert_eq!(admin("POST", "rankers/drain", &body(&r1)).0, 200);
    assert_eq!(admin("POST", "rankers/remove", &body(&r1)).0, 200);
    assert_eq!(admin("POST", "rankers/remove", &body(&r2)).0, 409);
    let (status, v) = post(router.addr, "/v2/models/m/infer", &good_infer());
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        recorder2.0.lock().unwrap().len(),
        1,
        "the new ranker took it"
    );

    // The lone replica of t_item [12, 20) goes away: requests fail naming it, and the router
    // is not ready, naming the range (polled, bounded).
    drop(b);
    let (status, v) = post(router.addr, "/v2/models/m/infer", &good_infer());
    assert!(status == 502 || status == 503, "{status} {v}");
    assert!(v["error"].as_str().unwrap().contains(&sb), "{v}");
    let mut health = (0, Value::Null);
    for _ in 0..200 {
        health = call(router.addr, "GET", "/ready", None, "");
        if health.0 == 503 {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert_eq!(health.0, 503, "{}", health.1);
    let problem = health.1["problems"][0].as_str().unwrap().to_owned();
    let range = "no shard replica serves table \"t_item\" rows [12, 20)";
    assert!(
        problem.contains(range) && problem.contains(&sb),
        "{problem}"
    );
    drop(router);
    assert!(live.join() && n.join());
}
