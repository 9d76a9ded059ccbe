//! The load generator against tiny servers on loopback: answers, silence, refusals, bad input.

use std::time::Duration;

use bytes::Bytes;
use cleave_loadgen::Run;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A server that answers every request on a connection with `reply`, or never answers when
/// `reply` is empty. Returns its port.
fn server(reply: &'static str) -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 1 << 16];
                    // One read takes a small request whole on loopback.
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 {
                            return;
                        }
                        if !reply.is_empty() && s.write_all(reply.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
    });
    port
}

fn run(
    url: String,
    times_s: Vec<f64>,
    timeout_ms: u64,
) -> Result<Vec<cleave_loadgen::Outcome>, String> {
    let order = vec![0; times_s.len()];
    Run {
        url,
        bodies: vec![Bytes::from_static(b"{}")],
        headers: vec![],
        times_s,
        order,
        timeout: Duration::from_millis(timeout_ms),
        keep_replies: true,
    }
    .execute()
}

#[test]
fn every_request_is_answered_in_schedule_order() {
    let port = server("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
    let out = run(
        format!("http://127.0.0.1:{port}/x"),
        vec![0.0, 0.01, 0.02],
        5000,
    )
    .unwrap();
    assert_eq!(out.len(), 3);
    for (o, t) in out.iter().zip([0.0, 0.01, 0.02]) {
        assert_eq!((o.status, o.error.as_str(), o.scheduled_s), (200, "", t));
        assert_eq!(o.reply.as_deref(), Some(&b"ok"[..]));
        assert!(o.latency_s > 0.0);
    }
}

#[test]
fn silence_is_a_timeout_and_a_closed_port_a_connection_error() {
    let port = server("");
    let out = run(format!("http://127.0.0.1:{port}/x"), vec![0.0], 200).unwrap();
    assert_eq!((out[0].status, out[0].error.as_str()), (0, "timeout"));
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let out = run(format!("http://127.0.0.1:{port}/x"), vec![0.0], 2000).unwrap();
    assert!(
        out[0].error.starts_with("connection: "),
        "{:?}",
        out[0].error
    );
}

#[test]
fn bad_input_is_refused_before_anything_is_sent() {
    let e = run("ftp://h/x".into(), vec![0.0], 10).unwrap_err();
    assert!(e.contains("expected http://"), "{e}");
    let e = run("http://127.0.0.1:1/x".into(), vec![-1.0], 10).unwrap_err();
    assert!(e.contains("finite and >= 0"), "{e}");
    let mut r = Run {
        url: "http://127.0.0.1:1/".into(),
        bodies: vec![],
        headers: vec![],
        times_s: vec![0.0],
        order: vec![0],
        timeout: Duration::from_millis(10),
        keep_replies: false,
    };
    assert!(r
        .execute()
        .unwrap_err()
        .contains("body index 0 out of range"));
    r = Run {
        url: "http://127.0.0.1:1/".into(),
        bodies: vec![Bytes::new()],
        headers: vec![],
        times_s: vec![0.0, 1.0],
        order: vec![0],
        timeout: Duration::from_millis(10),
        keep_replies: false,
    };
    assert!(r
        .execute()
        .unwrap_err()
        .contains("2 send times but 1 body indices"));
    r = Run {
        url: "http://127.0.0.1:1/".into(),
        bodies: vec![Bytes::new()],
        headers: vec![vec![("bad name".into(), "x".into())]],
        times_s: vec![0.0],
        order: vec![0],
        timeout: Duration::from_millis(10),
        keep_replies: false,
    };
    assert!(r
        .execute()
        .unwrap_err()
        .contains("header name \"bad name\""));
}
