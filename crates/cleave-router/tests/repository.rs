//! Versions on loopback: a router serving version 1 of a model with a real shard, a fake
//! repository controller (an axum server) staging version 2 (another ranker) and version 3
//! (a ranker that cannot be reached). A failed load is released and leaves version 1
//! serving; version 2 loads, serves when named, takes unversioned traffic only through a
//! rollout (kept in the rollout file), and unloads.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::Json;
use bytes::Bytes;
use cleave_router::backend::payload::{decode_request, encode_response, RankResponse, RANK};
use cleave_router::{RouterConfig, Tensor};
use cleave_shard::{RowSpec, Shard, ShardConfig};
use cleave_wire::{ErrorCode, Handler, Request, Responder, Server, ServerConfig};
use serde_json::{json, Value};

const MANIFEST: &str = r#"{
  "format": "cleave-bundle", "version": 1, "producer": "test",
  "inputs": [
    {"name": "dense_x", "dtype": "float32", "shape": ["B", 3], "role": "dense"},
    {"name": "item_ids", "dtype": "int64", "shape": ["N1"], "role": "ids"},
    {"name": "item_offsets", "dtype": "int64", "shape": ["B"], "role": "offsets"}
  ],
  "outputs": [{"name": "output_0", "dtype": "float32", "shape": ["B", 1]}],
  "output_spec": "",
  "tables": [
    {"name": "t_item", "file": "tables/t_item.bin", "rows": 20, "dim": 4,
     "dtype": "float32", "row_bytes": 16, "crc32": 0}
  ],
  "features": [
    {"name": "item", "table": "t_item", "ids": "item_ids", "transform": [],
     "layout": "offsets", "offsets": "item_offsets", "include_last_offset": false,
     "weights": null, "pooling": "sum", "output": "item_pooled"}
  ],
  "boundary": [{"name": "item_pooled", "dtype": "float32", "shape": ["B", 4]}],
  "dense": {"program": "dense.pt2", "inputs": ["dense_x", "item_pooled"]},
  "shared_inputs": []
}"#;

fn write_bundle(dir: &Path) {
    let mut manifest: Value = serde_json::from_str(MANIFEST).unwrap();
    std::fs::create_dir_all(dir.join("tables")).unwrap();
    let bytes: Vec<u8> = (0..80).flat_map(|v| (v as f32).to_le_bytes()).collect();
    manifest["tables"][0]["crc32"] = crc32fast::hash(&bytes).into();
    std::fs::write(dir.join("tables/t_item.bin"), bytes).unwrap();
    std::fs::write(dir.join("manifest.json"), manifest.to_string()).unwrap();
}

/// A ranker whose every score is `score`: which version answered shows in the output.
struct Constant(f32);

impl Handler for Constant {
    fn handle(&self, request: Request, responder: Responder) {
        if request.kind != RANK {
            return responder.error(ErrorCode::UnknownKind, "expected RANK");
        }
        let r = match decode_request(&request.payload) {
            Ok(r) => r,
            Err(e) => return responder.error(ErrorCode::BadRequest, &e.to_string()),
        };
        let b = r.tensors[0].dims[0];
        let response = RankResponse {
            queue_us: 1,
            compute_us: 2,
            batch_requests: 1,
            queue_depth: 0,
            outputs: vec![Tensor::from_f32(vec![b, 1], &vec![self.0; b])],
        };
        responder.reply(Bytes::from(encode_response(&response)));
    }
}

fn ranker(score: f32) -> Server {
    let addr = "127.0.0.1:0".parse().unwrap();
    Server::bind(&addr, Arc::new(Constant(score)), ServerConfig::default()).unwrap()
}

/// The fake controller: what it stages and the releases it was asked for.
struct Controller {
    bundle: PathBuf,
    shard: String,
    rankers: Vec<String>,
    released: Mutex<Vec<Value>>,
}

async fn controller_call(
    State(c): State<Arc<Controller>>,
    UrlPath(what): UrlPath<String>,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    match what.as_str() {
        "index" => (
            StatusCode::OK,
            Json(json!({"models": [{"name": "m", "versions": ["1", "2", "3"]}]})),
        ),
        "load" => {
            let version = body["version"].as_str().unwrap_or("").to_string();
            let ranker = match version.as_str() {
                "2" => c.rankers[0].clone(),
                "3" => "127.0.0.1:1".to_string(),
                _ => {
                    return (
                        StatusCode::NOT_FOUND,
                        Json(json!({"error": "no such version"})),
                    )
                }
            };
            let route = json!({"table": "t_item", "row_start": 0, "row_end": 20, "addr": c.shard});
            let add = json!({"model": "m", "version": version, "bundle": c.bundle,
                             "shards": [route], "rankers": [ranker]});
            (StatusCode::OK, Json(json!({"add": [add], "remove": []})))
        }
        "release" => {
            c.released.lock().unwrap().push(body);
            (StatusCode::OK, Json(json!({})))
        }
        _ => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "unknown call"})),
        ),
    }
}

/// Runs `future` on its own runtime in a thread until the returned sender is dropped.
fn background<F>(make: impl FnOnce() -> F + Send + 'static) -> tokio::sync::oneshot::Sender<()>
where
    F: std::future::Future<Output = ()>,
{
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            tokio::select! {
                _ = make() => {}
                _ = stop_rx => {}
            }
        });
    });
    stop_tx
}

fn call(addr: SocketAddr, path: &str, headers: &str, body: &Value) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: t\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let status = raw.split(' ').nth(1).unwrap().parse().unwrap();
    let body = raw.split_once("\r\n\r\n").unwrap().1;
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

fn get_text(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let head = format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
    s.write_all(head.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    raw
}

fn infer() -> Value {
    json!({"inputs": [
        {"name": "dense_x", "datatype": "FP32", "shape": [1, 3], "data": [0.1, 0.2, 0.3]},
        {"name": "item_ids", "datatype": "INT64", "shape": [2], "data": [4, 15]},
        {"name": "item_offsets", "datatype": "INT64", "shape": [1], "data": [0]}
    ]})
}

/// (version that answered, its score).
fn served(addr: SocketAddr, path: &str, headers: &str) -> (String, f64) {
    let (status, v) = call(addr, path, headers, &infer());
    assert_eq!(status, 200, "{path}: {v}");
    let version = v["model_version"].as_str().unwrap().to_string();
    (version, v["outputs"][0]["data"][0].as_f64().unwrap())
}

#[test]
fn versions_load_fail_cleanly_roll_out_and_unload() {
    let dir = tempfile::tempdir().unwrap();
    write_bundle(dir.path());
    let mut shard_config =
        ShardConfig::new(dir.path().to_path_buf(), "127.0.0.1:0".parse().unwrap());
    shard_config.rows = RowSpec::parse("t_item=0:20").unwrap();
    let shard = Shard::start(&shard_config).unwrap();
    let shard_addr = shard.info().listen.to_string();
    let (one, two) = (ranker(0.25), ranker(0.75));

    let controller = Arc::new(Controller {
        bundle: dir.path().to_path_buf(),
        shard: shard_addr.clone(),
        rankers: vec![two.local_addr().to_string()],
        released: Mutex::default(),
    });
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let controller_addr = listener.local_addr().unwrap();
    let app = axum::Router::new()
        .route("/s3cret/{what}", axum::routing::post(controller_call))
        .with_state(controller.clone());
    let _controller = background(move || async move {
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        axum::serve(listener, app).await.unwrap();
    });

    let rollout_file = dir.path().join("rollout.json");
    let config = json!({
        "model": "m", "bundle": dir.path(), "rankers": [one.local_addr().to_string()],
        "shards": [{"table": "t_item", "row_start": 0, "row_end": 20, "addr": shard_addr}],
        "repository_controller": format!("http://{controller_addr}/s3cret"),
        "rollout_file": rollout_file, "ready_timeout_ms": 1500
    });
    let config = RouterConfig::from_json(&config.to_string()).unwrap();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let _router = background(move || async move {
        let ready = move |addr| ready_tx.send(addr).unwrap();
        cleave_router::serve(config, std::future::pending(), ready)
            .await
            .unwrap();
    });
    let addr: SocketAddr = ready_rx.recv_timeout(Duration::from_secs(20)).unwrap();

    let states = |addr| {
        let (status, v) = call(addr, "/v2/repository/index", "", &json!({}));
        assert_eq!(status, 200, "{v}");
        v.as_array()
            .unwrap()
            .iter()
            .map(|e| {
                format!(
                    "{}/{} {}",
                    e["name"].as_str().unwrap(),
                    e["version"].as_str().unwrap(),
                    e["state"].as_str().unwrap()
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        states(addr),
        ["m/1 READY", "m/2 UNAVAILABLE", "m/3 UNAVAILABLE"]
    );
    assert_eq!(served(addr, "/v2/models/m/infer", ""), ("1".into(), 0.25));

    // Version 3's ranker never answers: the load fails, is released, version 1 serves on.
    let (status, v) = call(
        addr,
        "/v2/repository/models/m/load?version=3",
        "",
        &json!({}),
    );
    assert_eq!(status, 503, "{v}");
    let e = v["error"].as_str().unwrap();
    assert!(
        e.contains("loading m/3 failed") && e.contains("127.0.0.1:1"),
        "{e}"
    );
    assert_eq!(
        controller.released.lock().unwrap().pop(),
        Some(json!({"model": "m", "versions": ["3"]}))
    );
    assert_eq!(
        states(addr),
        ["m/1 READY", "m/2 UNAVAILABLE", "m/3 UNAVAILABLE"]
    );
    assert_eq!(served(addr, "/v2/models/m/infer", ""), ("1".into(), 0.25));

    // Version 2 loads; it serves when named, unversioned requests stay on the default.
    let load = json!({"parameters": {"version": "2"}});
    let (status, v) = call(addr, "/v2/repository/models/m/load", "", &load);
    assert_eq!((status, v), (200, json!({})));
    assert_eq!(states(addr), ["m/1 READY", "m/2 READY", "m/3 UNAVAILABLE"]);
    assert_eq!(
        served(addr, "/v2/models/m/versions/2/infer", ""),
        ("2".into(), 0.75)
    );
    assert_eq!(served(addr, "/v2/models/m/infer", ""), ("1".into(), 0.25));
    let mut named = infer();
    named["model_version"] = "1".into();
    let (status, v) = call(addr, "/v2/models/m/versions/2/infer", "", &named);
    assert_eq!(status, 400, "{v}");

    // A canary: a key always lands on the same version; promotion; rollback.
    let rollout = |body: Value| call(addr, "/admin/v1/rollout", "", &body);
    let (status, v) = rollout(json!({"model": "m", "version": "2", "percent": 50.0}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["models"]["m"]["canary"],
        json!({"version": "2", "percent": 50.0})
    );
    let mut versions = std::collections::BTreeSet::new();
    for i in 0..40 {
        let key = format!("cleave-request-key: user-{i}\r\n");
        let first = served(addr, "/v2/models/m/infer", &key);
        assert_eq!(served(addr, "/v2/models/m/infer", &key), first);
        versions.insert(first.0);
    }
    assert_eq!(versions.len(), 2, "40 keys all on one side of a 50% canary");
    let (status, _) = rollout(json!({"model": "m", "version": "2", "percent": 100.0}));
    assert_eq!(status, 200);
    assert_eq!(served(addr, "/v2/models/m/infer", ""), ("2".into(), 0.75));
    let saved: Value =
        serde_json::from_str(&std::fs::read_to_string(&rollout_file).unwrap()).unwrap();
    assert_eq!(saved["models"]["m"]["default"], "2");
    assert_eq!(saved["models"]["m"]["previous"], "1");
    let (status, v) = call(addr, "/admin/v1/rollback", "", &json!({"model": "m"}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(served(addr, "/v2/models/m/infer", ""), ("1".into(), 0.25));
    let (status, v) = rollout(json!({"model": "m", "version": "3", "percent": 10.0}));
    assert_eq!(status, 409, "{v}");

    // Membership calls must now name the version.
    let (status, v) = call(addr, "/admin/v1/rankers/drain", "", &json!({"addr": "x:1"}));
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("serves m/1, m/2"),
        "{v}"
    );

    // Unload: version 2 goes, is released, and its series stay on /metrics.
    let unload = json!({"parameters": {"version": "2"}});
    let (status, v) = call(addr, "/v2/repository/models/m/unload", "", &unload);
    assert_eq!((status, v), (200, json!({})));
    assert_eq!(
        controller.released.lock().unwrap().pop(),
        Some(json!({"model": "m", "versions": ["2"]}))
    );
    let (status, _) = call(addr, "/v2/models/m/versions/2/infer", "", &infer());
    assert_eq!(status, 404);
    let metrics = get_text(addr, "/metrics");
    assert!(
        metrics.contains("cleave_router_version_requests_total{model=\"m\",version=\"2\"}"),
        "{metrics}"
    );
    assert!(metrics
        .contains("cleave_router_version_score_bucket{model=\"m\",version=\"1\",le=\"0.25\"}"));
    drop(shard);
}
