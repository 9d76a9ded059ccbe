//! The router's HTTP API end to end on loopback, in monolithic mode (no shards): a real router
//! (`cleave_router::serve`) in front of a small ranker built on cleave-wire's server that
//! answers RANK_FULL with each candidate's dense row sum.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_router::backend::payload::{decode_request, encode_response, RankResponse, RANK_FULL};
use cleave_router::{RouterConfig, Tensor};
use cleave_wire::{ErrorCode, Handler, Request, Responder, Server, ServerConfig};
use serde_json::{json, Value};

const MANIFEST: &str = r#"{
  "format": "cleave-bundle", "version": 1, "producer": "test",
  "inputs": [
    {"name": "dense_x", "dtype": "float32", "shape": ["B", 3], "role": "dense"},
    {"name": "item_ids", "dtype": "int64", "shape": ["N0"], "role": "ids"},
    {"name": "item_offsets", "dtype": "int64", "shape": ["B"], "role": "offsets"}
  ],
  "outputs": [{"name": "output_0", "dtype": "float32", "shape": ["B", 1]}],
  "output_spec": "",
  "tables": [{"name": "t_item", "file": "tables/t_item.bin", "rows": 20, "dim": 4,
              "dtype": "float32", "row_bytes": 16, "crc32": 0}],
  "features": [{"name": "item", "table": "t_item", "ids": "item_ids",
                "transform": [{"op": "fmod", "divisor": 20}],
                "layout": "offsets", "offsets": "item_offsets", "include_last_offset": false,
                "weights": null, "pooling": "sum", "output": "item_pooled"}],
  "boundary": [{"name": "item_pooled", "dtype": "float32", "shape": ["B", 4]}],
  "dense": {"program": "dense.pt2", "inputs": ["dense_x", "item_pooled"]},
  "shared_inputs": []
}"#;

/// How the test ranker behaves.
#[derive(Clone, Copy)]
enum Behaviour {
    Sum,
    /// Sums, but reports this much compute time.
    Reports(u32),
    Slow(Duration),
    DropLate,
    /// Answers every request `overloaded` (its queue is full).
    Overloaded,
}

struct TestRanker(Behaviour);

impl Handler for TestRanker {
    fn handle(&self, request: Request, responder: Responder) {
        let behaviour = self.0;
        std::thread::spawn(move || {
            if request.kind != RANK_FULL {
                return responder.error(ErrorCode::UnknownKind, "expected RANK_FULL");
            }
            match behaviour {
                Behaviour::Slow(d) => std::thread::sleep(d),
                Behaviour::DropLate => {
                    return responder.error(ErrorCode::Deadline, "deadline passed 5 us ago")
                }
                Behaviour::Overloaded => {
                    return responder.error(ErrorCode::Overloaded, "queue full (1024 requests)")
                }
                Behaviour::Sum | Behaviour::Reports(_) => {}
            }
            let compute_us = match behaviour {
                Behaviour::Reports(us) => us,
                _ => 11,
            };
            let r = match decode_request(&request.payload) {
                Ok(r) => r,
                Err(e) => return responder.error(ErrorCode::BadRequest, &e.to_string()),
            };
            let dense = r.tensors[0].to_f32().unwrap();
            let rows: Vec<f32> = dense.chunks(3).map(|c| c.iter().sum()).collect();
            let out = Tensor::from_f32(vec![rows.len(), 1], &rows);
            let response = RankResponse {
                queue_us: 7,
                compute_us,
                batch_requests: 1,
                queue_depth: 0,
                outputs: vec![out],
            };
            responder.reply(Bytes::from(encode_response(&response)));
        });
    }
}

fn ranker(b: Behaviour) -> Server {
    let addr = "127.0.0.1:0".parse().unwrap();
    Server::bind(&addr, Arc::new(TestRanker(b)), ServerConfig::default()).unwrap()
}

/// A router serving on its own runtime; dropped, it stops.
struct Running {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
    _bundle: tempfile::TempDir,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.stop.take().unwrap().send(());
        let _ = self.thread.take().unwrap().join();
    }
}

fn config(bundle: &std::path::Path, rankers: &[String], extra: Value) -> RouterConfig {
    let mut c = json!({
        "model": "tiny", "bundle": bundle, "mode": "monolithic", "rankers": rankers,
        "body_limit_bytes": 4096, "ready_timeout_ms": 5000
    });
    c.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    RouterConfig::from_json(&c.to_string()).unwrap()
}

fn start(rankers: &[String], extra: Value) -> Result<Running, String> {
    let bundle = tempfile::tempdir().unwrap();
    std::fs::write(bundle.path().join("manifest.json"), MANIFEST).unwrap();
    let config = config(bundle.path(), rankers, extra);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let ready = ready_tx.clone();
        let r = rt.block_on(cleave_router::serve(
            config,
            async move {
                let _ = stop_rx.await;
            },
            move |addr| ready.send(Ok(addr)).unwrap(),
        ));
        if let Err(e) = &r {
            let _ = ready_tx.send(Err(e.clone()));
        }
        r
    });
    let addr = ready_rx
        .recv_timeout(Duration::from_secs(20))
        .map_err(|e| e.to_string())??;
    Ok(Running {
        addr,
        stop: Some(stop_tx),
        thread: Some(thread),
        _bundle: bundle,
    })
}

/// One HTTP/1.1 exchange: (status, body).
fn http(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body); // the server may answer 413 before reading everything
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).to_string();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, body.to_string().as_bytes());
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn good_infer() -> Value {
    json!({"id": "q1", "inputs": [
        {"name": "dense_x", "datatype": "FP32", "shape": [2, 3], "data": [[1, 2, 3], [4, 5, 6]]},
        {"name": "item_ids", "datatype": "INT64", "shape": [3], "data": [1, 25, 3]},
        {"name": "item_offsets", "datatype": "INT64", "shape": [2], "data": [0, 2]}
    ]})
}

#[test]
fn serves_both_json_forms_and_metadata() {
    let r = ranker(Behaviour::Sum);
    let router = start(&[r.local_addr().to_string()], json!({})).unwrap();
    let a = router.addr;

    let (status, v) = post(a, "/v2/models/tiny/infer", &good_infer());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["id"], "q1");
    assert_eq!(v["outputs"][0]["name"], "output_0");
    assert_eq!(v["outputs"][0]["shape"], json!([2, 1]));
    assert_eq!(v["outputs"][0]["data"], json!([6.0, 15.0]));
    assert_eq!(v["parameters"]["compute_us"], 11);
    assert_eq!(v["parameters"]["ranker"], r.local_addr().to_string());

    let rank = json!({"candidates": [
        {"dense_x": [1, 1, 1], "item_ids": [1, 2]},
        {"dense_x": [0, 0, 2], "item_ids": []},
        {"dense_x": [0, 0, 0.5], "item_ids": [7]}
    ], "budget_ms": 5000});
    let (status, v) = post(a, "/v2/models/tiny/rank", &rank);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["candidates"], 3);
    assert_eq!(v["outputs"]["output_0"], json!([[3.0], [2.0], [0.5]]));

    let (status, meta) = http(a, "GET", "/v2/models/tiny", b"");
    assert_eq!(status, 200);
    let meta: Value = serde_json::from_str(&meta).unwrap();
    assert_eq!(
        meta["inputs"][0],
        json!({"name": "dense_x", "datatype": "FP32", "shape": [-1, 3]})
    );
    assert_eq!(http(a, "GET", "/v2/health/live", b"").0, 200);
    assert_eq!(http(a, "GET", "/v2/health/ready", b"").0, 200);
    assert_eq!(http(a, "GET", "/v2/models/tiny/ready", b"").0, 200);
    assert_eq!(http(a, "GET", "/v2/models/other/ready", b"").0, 404);

    let (status, metrics) = http(a, "GET", "/metrics", b"");
    assert_eq!(status, 200);
    assert!(
        metrics.contains("cleave_router_stage_seconds_count{stage=\"total\"} 2"),
        "{metrics}"
    );
    assert!(metrics.contains("cleave_router_stage_seconds_count{stage=\"compute\"} 2"));
    assert!(metrics.contains("cleave_router_requests_total 2"));
}

#[test]
fn bad_requests_get_4xx_naming_the_problem_and_the_router_keeps_serving() {
    let r = ranker(Behaviour::Sum);
    let router = start(&[r.local_addr().to_string()], json!({})).unwrap();
    let a = router.addr;
    let with = |f: &dyn Fn(&mut Value)| {
        let mut v = good_infer();
        f(&mut v);
        v
    };
    let cases: Vec<(Value, u16, &str)> = vec![
        (
            with(&|v| v["inputs"][0]["datatype"] = "FP64".into()),
            400,
            "input \"dense_x\": datatype",
        ),
        (
            with(&|v| v["inputs"][1]["data"] = json!([1, -30, 3])),
            400,
            "input \"item_ids\": id -30 at position 1 becomes -10",
        ),
        (
            with(&|v| v["inputs"][2]["data"] = json!([1, 2])),
            400,
            "input \"item_offsets\": offsets[0] is 1",
        ),
        (
            with(&|v| v["inputs"][2]["data"] = json!([0, 9])),
            400,
            "input \"item_offsets\": offsets[1] is 9",
        ),
        (
            with(&|v| {
                v["inputs"].as_array_mut().unwrap().remove(2);
            }),
            400,
            "missing input \"item_offsets\"",
        ),
        (
            with(&|v| v["inputs"][0]["shape"] = json!([3, 3])),
            400,
            "input \"dense_x\": data nests as [2, 3] but shape is [3, 3]",
        ),
        (
            with(&|v| v["inputs"][2]["shape"] = json!([1])),
            400,
            "input \"item_offsets\"",
        ),
        (
            with(&|v| v["parameters"] = json!({"budget_ms": -5})),
            400,
            "budget_ms",
        ),
        (
            with(&|v| v["parameters"] = json!({"budget_ms": 1e9})),
            400,
            "more than this router allows",
        ),
    ];
    for (body, want_status, want) in cases {
        let (status, v) = post(a, "/v2/models/tiny/infer", &body);
        assert_eq!(status, want_status, "{v}");
        let msg = v["error"].as_str().unwrap_or_default();
        assert!(msg.contains(want), "{msg:?} should contain {want:?}");
    }
    let (status, v) = post(a, "/v2/models/nope/infer", &good_infer());
    assert_eq!(status, 404);
    assert!(v["error"]
        .as_str()
        .unwrap()
        .contains("unknown model \"nope\""));
    let (status, text) = http(a, "POST", "/v2/models/tiny/infer", b"{\"inputs\": [");
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("invalid JSON"), "{text}");
    let big = vec![b' '; 10_000];
    let (status, text) = http(a, "POST", "/v2/models/tiny/infer", &big);
    assert_eq!(status, 413, "{text}");
    assert!(text.contains("limit of 4096 bytes"), "{text}");

    // Still serving.
    assert_eq!(post(a, "/v2/models/tiny/infer", &good_infer()).0, 200);
    let (_, metrics) = http(a, "GET", "/metrics", b"");
    assert!(
        metrics.contains("cleave_router_errors_total{kind=\"invalid_input\"} 9"),
        "{metrics}"
    );
    assert!(metrics.contains("cleave_router_errors_total{kind=\"too_large\"} 1"));
}

#[test]
fn an_expired_budget_is_a_504_naming_the_stage() {
    let slow = ranker(Behaviour::Slow(Duration::from_millis(400)));
    let router = start(&[slow.local_addr().to_string()], json!({})).unwrap();
    let mut body = good_infer();
    body["parameters"] = json!({"budget_ms": 50});
    let t = Instant::now();
    let (status, v) = post(router.addr, "/v2/models/tiny/infer", &body);
    assert_eq!(status, 504, "{v}");
    assert_eq!(v["stage"], "ranker");
    assert!(v["error"]
        .as_str()
        .unwrap()
        .contains(&slow.local_addr().to_string()));
    assert!(
        t.elapsed() < Duration::from_millis(390),
        "answered at the budget, not the reply"
    );

    let late = ranker(Behaviour::DropLate);
    let router = start(&[late.local_addr().to_string()], json!({})).unwrap();
    let (status, v) = post(router.addr, "/v2/models/tiny/infer", &good_infer());
    assert_eq!(status, 504, "{v}");
    assert_eq!(v["stage"], "queue");
}

#[test]
fn a_ranker_that_goes_away_is_reported_fast() {
    let r = ranker(Behaviour::Sum);
    let addr = r.local_addr().to_string();
    let router = start(
        std::slice::from_ref(&addr),
        json!({"health_interval_ms": 50}),
    )
    .unwrap();
    assert_eq!(
        post(router.addr, "/v2/models/tiny/infer", &good_infer()).0,
        200
    );
    drop(r);
    let t = Instant::now();
    let (status, v) = post(router.addr, "/v2/models/tiny/infer", &good_infer());
    assert!(status == 502 || status == 503, "{status} {v}");
    assert!(v["error"].as_str().unwrap().contains(&addr), "{v}");
    assert!(t.elapsed() < Duration::from_secs(2));
    // Readiness follows within a few probes.
    let mut ready = 200;
    for _ in 0..100 {
        ready = http(router.addr, "GET", "/v2/health/ready", b"").0;
        if ready == 503 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(ready, 503);
}

#[test]
fn start_up_fails_when_a_ranker_never_answers() {
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = nobody.local_addr().unwrap().to_string();
    drop(nobody);
    let e = start(
        std::slice::from_ref(&addr),
        json!({"ready_timeout_ms": 300}),
    )
    .err()
    .unwrap();
    assert!(
        e.contains("backends not ready after 300 ms") && e.contains(&addr),
        "{e}"
    );
}

#[test]
fn requests_go_to_the_ranker_that_reports_the_lowest_latency() {
    let fast = ranker(Behaviour::Reports(100));
    let slow = ranker(Behaviour::Reports(50_000));
    let addrs = [slow.local_addr().to_string(), fast.local_addr().to_string()];
    let router = start(&addrs, json!({})).unwrap();
    let mut served = std::collections::HashMap::<String, usize>::new();
    for _ in 0..20 {
        let (status, v) = post(router.addr, "/v2/models/tiny/infer", &good_infer());
        assert_eq!(status, 200, "{v}");
        *served
            .entry(v["parameters"]["ranker"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    // Each is tried once while unmeasured; then the fast one takes everything (sequential
    // requests: nothing outstanding to tip the balance).
    assert_eq!(served.get(&addrs[0]), Some(&1), "{served:?}");
    assert_eq!(served.get(&addrs[1]), Some(&19), "{served:?}");
    let (_, metrics) = http(router.addr, "GET", "/metrics", b"");
    let line = format!(
        "cleave_router_ranker_latency_seconds{{ranker=\"{}\"}} 0.050007",
        addrs[0]
    );
    assert!(metrics.contains(&line), "{metrics}");
}

/// Requests are pure, so a ranker that cannot take one (overloaded, or killed: its
/// connections close or refuse) hands it to the next: every request still succeeds.
#[test]
fn requests_fail_over_to_a_ranker_that_can_take_them() {
    let good = ranker(Behaviour::Sum);
    let busy = ranker(Behaviour::Overloaded);
    let doomed = ranker(Behaviour::Sum);
    let addrs = [
        busy.local_addr().to_string(),
        doomed.local_addr().to_string(),
        good.local_addr().to_string(),
    ];
    let router = start(&addrs, json!({})).unwrap();
    // Every ranker holds a connection from the router now (readiness probes, a first request).
    let (status, v) = post(router.addr, "/v2/models/tiny/infer", &good_infer());
    assert_eq!(status, 200, "{v}");
    drop(doomed);
    for i in 0..12 {
        let (status, v) = post(router.addr, "/v2/models/tiny/infer", &good_infer());
        assert_eq!(status, 200, "request {i}: {v}");
        assert_eq!(v["outputs"][0]["data"], json!([6.0, 15.0]));
        assert_eq!(v["parameters"]["ranker"], addrs[2], "request {i}");
    }

    // When no ranker can take it: 503, naming each.
    let router = start(&addrs[..1], json!({})).unwrap();
    let (status, v) = post(router.addr, "/v2/models/tiny/infer", &good_infer());
    assert_eq!(status, 503, "{v}");
    let msg = v["error"].as_str().unwrap();
    assert!(
        msg.contains(&addrs[0]) && msg.contains("overloaded"),
        "{msg}"
    );
}
