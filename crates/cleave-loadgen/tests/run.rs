//! The load generator against tiny servers on loopback: answers, silence, refusals, bad input.

use std::time::Duration;

use bytes::Bytes;
use cleave_loadgen::Run;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Serves loopback on a thread of its own, handing each accepted connection to `serve`.
/// Returns the port.
fn spawn_server<F, Fut>(serve: F) -> u16
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
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
                let (s, _) = listener.accept().await.unwrap();
                tokio::spawn(serve(s));
            }
        });
    });
    port
}

/// A server that answers every request on a connection with `reply`, or never answers when
/// `reply` is empty. Returns its port.
fn server(reply: &'static str) -> u16 {
    spawn_server(move |mut s| async move {
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
    })
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
        closed: None,
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
fn silence_is_a_timeout_and_a_connection_error_names_its_cause() {
    let port = server("");
    let out = run(format!("http://127.0.0.1:{port}/x"), vec![0.0], 200).unwrap();
    assert_eq!((out[0].status, out[0].error.as_str()), (0, "timeout"));
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let out = run(format!("http://127.0.0.1:{port}/x"), vec![0.0], 2000).unwrap();
    // The cause the OS gave, not only hyper's "client error (Connect)": a report must tell a
    // refused connect from a reset.
    let error = out[0].error.to_lowercase();
    assert!(
        error.starts_with("connection: ") && error.contains("refused"),
        "{error:?}"
    );
    // A server that reads the request and closes with a zero linger, which sends a reset: the
    // client says so.
    let port = spawn_server(|mut s| async move {
        let mut buf = vec![0u8; 1 << 16];
        let _ = s.read(&mut buf).await;
        #[allow(deprecated)] // a zero linger resets at once: only longer ones block on drop
        let _ = s.set_linger(Some(Duration::ZERO));
    });
    let out = run(format!("http://127.0.0.1:{port}/x"), vec![0.0], 2000).unwrap();
    let error = out[0].error.to_lowercase();
    assert!(
        error.starts_with("connection: ") && error.contains("reset"),
        "{error:?}"
    );
}

/// A gRPC server on HTTP/2 that answers each call with its own request message, or with
/// RESOURCE_EXHAUSTED (a trailers-only response) when the message is "busy". Returns its port.
fn grpc_echo_server() -> u16 {
    use http_body_util::{BodyExt, Full};
    use hyper::body::Incoming;
    use hyper_util::rt::{TokioExecutor, TokioIo};

    spawn_server(|s| async move {
        let echo = hyper::service::service_fn(|req: hyper::Request<Incoming>| async move {
            assert_eq!(req.uri().path(), "/pkg.Svc/Call");
            assert_eq!(req.headers()["content-type"], "application/grpc");
            let body = req.into_body().collect().await?.to_bytes();
            let mut reply = hyper::Response::builder();
            if &body[5..] == b"busy" {
                reply = reply.header("grpc-status", "8");
                return Ok::<_, hyper::Error>(reply.body(Full::new(Bytes::new()).boxed()).unwrap());
            }
            let mut trailers = hyper::HeaderMap::new();
            trailers.insert("grpc-status", "0".parse().unwrap());
            let body = Full::new(body).with_trailers(async { Some(Ok(trailers)) });
            Ok(reply.body(body.boxed()).unwrap())
        });
        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(s), echo)
            .await;
    })
}

#[test]
fn grpc_calls_carry_messages_and_statuses() {
    let port = grpc_echo_server();
    let out = Run {
        url: format!("grpc://127.0.0.1:{port}/pkg.Svc/Call"),
        bodies: vec![Bytes::from_static(b"hello"), Bytes::from_static(b"busy")],
        headers: vec![],
        times_s: vec![0.0, 0.01, 0.02],
        order: vec![0, 1, 0],
        timeout: Duration::from_secs(5),
        keep_replies: true,
        closed: None,
    }
    .execute()
    .unwrap();
    let got: Vec<_> = out
        .iter()
        .map(|o| (o.status, o.error.as_str(), o.reply.as_deref()))
        .collect();
    assert_eq!(
        got,
        [
            (200, "", Some(&b"hello"[..])),
            (200, "grpc_resource_exhausted", None),
            (200, "", Some(&b"hello"[..])),
        ]
    );
}

#[test]
fn bad_input_is_refused_before_anything_is_sent() {
    let e = run("grpc://127.0.0.1:1/NoMethod".into(), vec![0.0], 10).unwrap_err();
    assert!(e.contains("names the method"), "{e}");
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
        closed: None,
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
        closed: None,
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
        closed: None,
    };
    assert!(r
        .execute()
        .unwrap_err()
        .contains("header name \"bad name\""));
}

#[test]
fn a_closed_loop_keeps_at_most_its_clients_in_flight_and_cycles_the_bodies() {
    let port = server("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
    let closed = cleave_loadgen::ClosedLoop {
        clients: 3,
        duration: Duration::from_millis(300),
    };
    let out = Run {
        url: format!("http://127.0.0.1:{port}/x"),
        bodies: vec![Bytes::from_static(b"{}"), Bytes::from_static(b"[]")],
        headers: vec![],
        times_s: vec![],
        order: vec![0, 1],
        timeout: Duration::from_secs(5),
        keep_replies: false,
        closed: Some(closed),
    }
    .execute()
    .unwrap();
    assert!(out.len() > 3, "{} requests", out.len());
    assert!(out.iter().all(|o| o.status == 200 && o.error.is_empty()));
    assert!(
        out.iter().all(|o| o.scheduled_s < 0.3),
        "none sent after the duration"
    );
    // Sent in order of time; at each send, at most 3 requests (itself included) unanswered.
    for (i, o) in out.iter().enumerate() {
        let open = out[..i]
            .iter()
            .filter(|p| p.scheduled_s + p.latency_s > o.scheduled_s + 1e-7)
            .count();
        assert!(open < 3, "{open} in flight before request {i}");
    }
    let second = out.iter().filter(|o| o.body == 1).count();
    assert!(second > 0 && second < out.len(), "both bodies, in turn");
    // Closed-loop input that cannot run.
    let e = Run {
        url: format!("http://127.0.0.1:{port}/x"),
        bodies: vec![Bytes::from_static(b"{}")],
        headers: vec![],
        times_s: vec![0.0],
        order: vec![0],
        timeout: Duration::from_secs(1),
        keep_replies: false,
        closed: Some(closed),
    }
    .execute()
    .unwrap_err();
    assert!(e.contains("closed loop takes no send times"), "{e}");
}
