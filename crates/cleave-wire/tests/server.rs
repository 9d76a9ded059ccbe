//! A real server and client on loopback sockets: pipelining, control frames, bad input,
//! timeouts, reconnects and draining on shutdown.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cleave_wire::frame::{encode_hello, kind, HEADER_LEN};
use cleave_wire::{
    Address, Client, ClientConfig, ConnClass, ErrorBody, ErrorCode, Frame, Handler, Header,
    IoThreads, Request, Responder, Server, ServerConfig, WireError,
};

const ECHO: u16 = 0x0100;
/// Replies after the number of milliseconds in the payload's first byte, from another thread.
const SLOW: u16 = 0x0101;
const PANIC: u16 = 0x0102;
const T: Duration = Duration::from_secs(5);

struct Echo;

impl Handler for Echo {
    fn handle(&self, request: Request, responder: Responder) {
        match request.kind {
            ECHO => responder.reply(request.payload),
            SLOW => {
                std::thread::spawn(move || {
                    let ms = request.payload.first().copied().unwrap_or(0);
                    std::thread::sleep(Duration::from_millis(ms as u64));
                    responder.reply(request.payload);
                });
            }
            PANIC => panic!("handler bug"),
            k => responder.error(ErrorCode::UnknownKind, &format!("no kind {k:#06x}")),
        }
    }
}

fn server(config: ServerConfig) -> Server {
    let addr: Address = "127.0.0.1:0".parse().unwrap();
    Server::bind(&addr, Arc::new(Echo), config).unwrap()
}

fn client(addr: &Address) -> Client {
    Client::new(
        addr.clone(),
        IoThreads::new("test-client", 1).unwrap(),
        ClientConfig::default(),
    )
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A raw TCP connection that has done its HELLO.
fn raw(addr: &Address) -> TcpStream {
    let Address::Tcp(a) = addr else {
        unreachable!()
    };
    let mut s = TcpStream::connect(a).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s.write_all(&Frame::request(kind::HELLO, 0, encode_hello(ConnClass::Data)).to_bytes())
        .unwrap();
    let hello = read_frame(&mut s).unwrap();
    assert!(hello.is_response() && !hello.is_error());
    s
}

fn read_frame(s: &mut TcpStream) -> Option<Frame> {
    let mut head = [0u8; HEADER_LEN];
    if s.read_exact(&mut head).is_err() {
        return None;
    }
    let h = Header::decode(&head, u32::MAX).unwrap();
    let mut payload = vec![0u8; h.payload_len as usize];
    s.read_exact(&mut payload).unwrap();
    Some(Frame::from_header(&h, payload.into()))
}

fn assert_closed(s: &mut TcpStream) {
    let mut b = [0u8; 1];
    assert_eq!(
        s.read(&mut b).unwrap(),
        0,
        "expected the server to close the connection"
    );
}

fn error_of(f: &Frame) -> ErrorBody {
    assert!(f.is_error(), "expected an error frame, got {f:?}");
    ErrorBody::decode(&f.payload)
}

#[test]
fn pipelined_calls_match_out_of_order_responses() {
    let s = server(ServerConfig::default());
    let c = client(s.local_addr());
    rt().block_on(async {
        // The slowest request goes first; every response must reach its own caller.
        let calls = (0..40u8).map(|i| {
            let c = c.clone();
            async move {
                let payload = Bytes::from(vec![40 - i, i, 7]);
                let got = c.call(SLOW, payload.clone(), T).await.unwrap();
                assert_eq!(got, payload);
            }
        });
        let handles: Vec<_> = calls.map(tokio::spawn).collect();
        for h in handles {
            h.await.unwrap();
        }
        let big = Bytes::from((0..3_000_000u32).map(|i| i as u8).collect::<Vec<_>>());
        assert_eq!(c.call(ECHO, big.clone(), T).await.unwrap(), big);
    });
    assert!(s.join());
}

#[test]
fn control_frames_and_unix_sockets() {
    let dir = std::env::temp_dir().join(format!("cleave-wire-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let addr = Address::Unix(dir.join("s.sock"));
    let s = Server::bind(&addr, Arc::new(Echo), ServerConfig::default()).unwrap();
    let c = client(&addr);
    rt().block_on(async {
        c.ping(T).await.unwrap();
        assert!(c.ready(T).await.unwrap());
        assert_eq!(
            c.call(ECHO, Bytes::from_static(b"x"), T).await.unwrap(),
            "x"
        );
        let err = c.call(0x00ff, Bytes::new(), T).await.unwrap_err();
        assert_eq!(err.remote_code(), Some(ErrorCode::UnknownKind), "{err}");
        let err = c.call(0x0200, Bytes::new(), T).await.unwrap_err();
        assert!(err.to_string().contains("no kind 0x0200"), "{err}");
    });
    assert!(s.join());
    assert!(!dir.join("s.sock").exists(), "socket file left behind");
}

#[test]
fn a_panicking_handler_answers_internal_and_the_server_lives_on() {
    let s = server(ServerConfig::default());
    let c = client(s.local_addr());
    rt().block_on(async {
        let err = c.call(PANIC, Bytes::new(), T).await.unwrap_err();
        assert_eq!(err.remote_code(), Some(ErrorCode::Internal), "{err}");
        assert_eq!(
            c.call(ECHO, Bytes::from_static(b"ok"), T).await.unwrap(),
            "ok"
        );
    });
}

#[test]
fn malformed_frames_get_an_error_and_a_close_while_others_are_served() {
    let s = server(ServerConfig {
        max_payload: 1 << 20,
        ..ServerConfig::default()
    });
    let addr = s.local_addr().clone();
    let good = client(&addr);
    let rt = rt();

    let cases: Vec<(&str, Vec<u8>, ErrorCode)> = vec![
        (
            "bad magic",
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            ErrorCode::MalformedFrame,
        ),
        ("version", patched(4, 9), ErrorCode::UnsupportedVersion),
        ("flags", patched(5, 0x40), ErrorCode::MalformedFrame),
        ("reserved", patched(21, 1), ErrorCode::MalformedFrame),
        (
            "too large",
            {
                let mut b = Frame::request(ECHO, 5, Bytes::new()).to_bytes().to_vec();
                b[16..20].copy_from_slice(&(2u32 << 20).to_le_bytes());
                b
            },
            ErrorCode::FrameTooLarge,
        ),
    ];
    for (what, bytes, code) in cases {
        let mut s = raw(&addr);
        s.write_all(&bytes).unwrap();
        let f = read_frame(&mut s).unwrap_or_else(|| panic!("{what}: no error frame"));
        let body = error_of(&f);
        assert_eq!(body.code, code, "{what}: {}", body.message);
        assert_closed(&mut s);
        let ok = rt
            .block_on(good.call(ECHO, Bytes::from_static(b"still"), T))
            .unwrap();
        assert_eq!(ok, "still", "{what}");
    }
    // A response frame sent as a request is refused but the connection stays usable.
    let mut s = raw(&addr);
    s.write_all(&Frame::response(ECHO, 3, Bytes::new()).to_bytes())
        .unwrap();
    assert_eq!(
        error_of(&read_frame(&mut s).unwrap()).code,
        ErrorCode::BadRequest
    );
    s.write_all(&Frame::request(ECHO, 4, Bytes::from_static(b"y")).to_bytes())
        .unwrap();
    let f = read_frame(&mut s).unwrap();
    assert_eq!((f.request_id, &f.payload[..]), (4, &b"y"[..]));
}

/// A valid request frame with one header byte replaced.
fn patched(at: usize, value: u8) -> Vec<u8> {
    let mut b = Frame::request(ECHO, 5, Bytes::from_static(b"abc"))
        .to_bytes()
        .to_vec();
    b[at] = value;
    b
}

#[test]
fn handshake_is_required_and_silent_or_slow_clients_time_out() {
    let cfg = ServerConfig {
        frame_timeout: Duration::from_millis(200),
        idle_timeout: Some(Duration::from_millis(600)),
        ..ServerConfig::default()
    };
    let s = server(cfg);
    let addr = s.local_addr().clone();
    let Address::Tcp(a) = &addr else {
        unreachable!()
    };
    let good = client(&addr);
    let rt = rt();

    // No HELLO first.
    let mut c = TcpStream::connect(a).unwrap();
    c.set_read_timeout(Some(T)).unwrap();
    c.write_all(&Frame::request(ECHO, 1, Bytes::new()).to_bytes())
        .unwrap();
    let body = error_of(&read_frame(&mut c).unwrap());
    assert_eq!(body.code, ErrorCode::Handshake, "{}", body.message);
    assert!(body.message.contains("got kind 0x0100"), "{}", body.message);
    assert_closed(&mut c);

    // Connects and says nothing: timed out, while others are served meanwhile.
    let mut silent = TcpStream::connect(a).unwrap();
    silent.set_read_timeout(Some(T)).unwrap();
    assert_eq!(
        rt.block_on(good.call(ECHO, Bytes::from_static(b"a"), T))
            .unwrap(),
        "a"
    );
    let body = error_of(&read_frame(&mut silent).unwrap());
    assert_eq!(body.code, ErrorCode::Timeout, "{}", body.message);
    assert_closed(&mut silent);

    // Starts a frame and stalls.
    let mut stalled = raw(&addr);
    let frame = Frame::request(ECHO, 77, Bytes::from(vec![1u8; 100])).to_bytes();
    stalled.write_all(&frame[..50]).unwrap();
    let f = read_frame(&mut stalled).unwrap();
    assert_eq!(f.request_id, 77);
    assert_eq!(error_of(&f).code, ErrorCode::Timeout);
    assert_closed(&mut stalled);

    // Idle after a request: closed silently; the client reconnects on its next call.
    assert_eq!(
        rt.block_on(good.call(ECHO, Bytes::from_static(b"b"), T))
            .unwrap(),
        "b"
    );
    std::thread::sleep(Duration::from_millis(900));
    assert_eq!(
        rt.block_on(good.call(ECHO, Bytes::from_static(b"c"), T))
            .unwrap(),
        "c"
    );
}

#[test]
fn disconnect_mid_frame_leaves_the_server_serving() {
    let s = server(ServerConfig::default());
    let addr = s.local_addr().clone();
    let mut c = raw(&addr);
    let frame = Frame::request(ECHO, 1, Bytes::from(vec![1u8; 1000])).to_bytes();
    c.write_all(&frame[..500]).unwrap();
    drop(c);
    let good = client(&addr);
    assert_eq!(
        rt().block_on(good.call(ECHO, Bytes::from_static(b"z"), T))
            .unwrap(),
        "z"
    );
    assert!(s.join());
}

#[test]
fn client_errors_name_the_peer_and_arrive_fast() {
    let s = server(ServerConfig::default());
    let addr = s.local_addr().clone();
    let c = client(&addr);
    let rt = rt();
    assert_eq!(
        rt.block_on(c.call(ECHO, Bytes::from_static(b"1"), T))
            .unwrap(),
        "1"
    );
    // A call in flight when the server goes away fails with the peer's address.
    let slow = {
        let c = c.clone();
        std::thread::spawn(move || rt_block(c.call(SLOW, Bytes::from(vec![250u8]), T)))
    };
    std::thread::sleep(Duration::from_millis(50));
    drop(s); // stops threads at once, without draining
    let err = slow.join().unwrap().unwrap_err();
    assert!(matches!(err, WireError::Closed { .. }), "{err}");
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
    // Fails at once, not by timeout: refused on connect, or, when the call raced the close of
    // the old connection, closed on it.
    let err = rt.block_on(c.call(ECHO, Bytes::new(), T)).unwrap_err();
    assert!(
        matches!(err, WireError::Connect { .. } | WireError::Closed { .. }),
        "{err}"
    );
    assert!(err.to_string().contains(&addr.to_string()), "{err}");

    // Too large for the peer: refused locally, naming both sizes.
    let s = server(ServerConfig {
        max_payload: 10,
        ..ServerConfig::default()
    });
    let c = client(s.local_addr());
    let err = rt
        .block_on(c.call(ECHO, Bytes::from(vec![0u8; 11]), T))
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("11 bytes exceeds the peer's frame limit of 10"),
        "{err}"
    );
    // A timeout names the peer too.
    let err = rt.block_on(c.call(SLOW, Bytes::from(vec![200u8]), Duration::from_millis(20)));
    let err = err.unwrap_err();
    assert!(matches!(err, WireError::Timeout { .. }), "{err}");
    assert!(
        err.to_string().contains(&s.local_addr().to_string()),
        "{err}"
    );
}

fn rt_block<F: std::future::Future>(f: F) -> F::Output {
    rt().block_on(f)
}

#[test]
fn shutdown_finishes_requests_in_flight_and_partial_frames() {
    let s = server(ServerConfig::default());
    let addr = s.local_addr().clone();
    // One request being handled, one frame half received.
    let mut busy = raw(&addr);
    busy.write_all(&Frame::request(SLOW, 1, Bytes::from(vec![150u8])).to_bytes())
        .unwrap();
    let mut half = raw(&addr);
    let frame = Frame::request(ECHO, 2, Bytes::from(vec![9u8; 64])).to_bytes();
    half.write_all(&frame[..30]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    s.shutdown();
    std::thread::sleep(Duration::from_millis(50));
    half.write_all(&frame[30..]).unwrap();
    let joiner = std::thread::spawn(move || s.join());
    let f = read_frame(&mut busy).unwrap();
    assert_eq!((f.request_id, f.is_error()), (1, false));
    assert_closed(&mut busy);
    let f = read_frame(&mut half).unwrap();
    assert_eq!(
        (f.request_id, f.payload.len(), f.is_error()),
        (2, 64, false)
    );
    assert_closed(&mut half);
    assert!(joiner.join().unwrap(), "server did not drain");
    // Nothing listens any more.
    let Address::Tcp(a) = &addr else {
        unreachable!()
    };
    assert!(TcpStream::connect(a).is_err());
}

#[test]
fn idle_client_connections_close_themselves_and_reopen() {
    let s = server(ServerConfig::default());
    let stats = s.stats();
    let config = ClientConfig {
        connections: 1,
        idle_close: Duration::from_millis(100),
        ..ClientConfig::default()
    };
    let c = Client::new(
        s.local_addr().clone(),
        IoThreads::new("t", 1).unwrap(),
        config,
    );
    let rt = rt();
    assert_eq!(
        rt.block_on(c.call(ECHO, Bytes::from_static(b"1"), T))
            .unwrap(),
        "1"
    );
    assert_eq!(stats.connections(), 1);
    let deadline = std::time::Instant::now() + T;
    while stats.connections() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the idle connection stayed open"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        rt.block_on(c.call(ECHO, Bytes::from_static(b"2"), T))
            .unwrap(),
        "2"
    );
    assert_eq!(stats.connections(), 1);
}

#[test]
fn back_pressure_pauses_reading_without_losing_requests() {
    let s = server(ServerConfig {
        max_in_flight: 2,
        ..ServerConfig::default()
    });
    let config = ClientConfig {
        connections: 1,
        ..ClientConfig::default()
    };
    let c = Client::new(
        s.local_addr().clone(),
        IoThreads::new("t", 1).unwrap(),
        config,
    );
    rt().block_on(async {
        let calls: Vec<_> = (0..20u8)
            .map(|i| {
                let c = c.clone();
                tokio::spawn(async move { c.call(SLOW, Bytes::from(vec![5, i]), T).await })
            })
            .collect();
        for (i, h) in calls.into_iter().enumerate() {
            assert_eq!(h.await.unwrap().unwrap(), Bytes::from(vec![5, i as u8]));
        }
    });
    assert!(s.join());
}

#[test]
fn a_version_1_peer_is_refused_at_once_with_unsupported_version() {
    let s = server(ServerConfig::default());
    let Address::Tcp(a) = s.local_addr() else {
        unreachable!()
    };
    // A version 1 HELLO: its 24-byte header and 4-byte payload are shorter than a version 2
    // header, so the server must answer from the prefix rather than wait for 40 bytes.
    let mut v1 = Vec::new();
    v1.extend_from_slice(b"CLVW");
    v1.extend_from_slice(&[1, 0, 0, 0]);
    v1.extend_from_slice(&5u64.to_le_bytes());
    v1.extend_from_slice(&4u32.to_le_bytes());
    v1.extend_from_slice(&[0; 4]);
    v1.extend_from_slice(&[0; 4]);
    let mut c = TcpStream::connect(a).unwrap();
    c.set_read_timeout(Some(T)).unwrap();
    c.write_all(&v1).unwrap();
    let f = read_frame(&mut c).unwrap();
    let body = error_of(&f);
    assert_eq!(body.code, ErrorCode::UnsupportedVersion, "{}", body.message);
    assert!(
        body.message.contains("version 1; this peer speaks 2"),
        "{}",
        body.message
    );
    assert_eq!(f.request_id, 5);
    assert_closed(&mut c);
    // Mid-connection, too: a version 1 frame after a good HELLO.
    let mut c = raw(s.local_addr());
    c.write_all(&v1).unwrap();
    assert_eq!(
        error_of(&read_frame(&mut c).unwrap()).code,
        ErrorCode::UnsupportedVersion
    );
    assert_closed(&mut c);
}

/// The listed data sockets: each one's id and its peer's address.
fn listed(srv: &Server) -> Vec<(u64, std::net::SocketAddr)> {
    let mut out = Vec::new();
    srv.for_each_data_socket(|id, fd| {
        let sock = TcpStream::from(fd.try_clone_to_owned().unwrap());
        out.push((id, sock.peer_addr().unwrap()));
    });
    out
}

#[test]
fn data_sockets_are_listed_while_they_live_and_control_ones_never() {
    let srv = server(ServerConfig::default());
    let addr = srv.local_addr().clone();
    let mut control = TcpStream::connect(addr.to_string()).unwrap();
    control
        .write_all(&Frame::request(kind::HELLO, 0, encode_hello(ConnClass::Control)).to_bytes())
        .unwrap();
    read_frame(&mut control).expect("HELLO reply");
    let mut data = raw(&addr);
    data.write_all(&Frame::request(ECHO, 1, Bytes::from_static(b"x")).to_bytes())
        .unwrap();
    read_frame(&mut data).expect("echo");
    let seen = listed(&srv);
    assert_eq!(
        seen.len(),
        1,
        "one data connection, the control one left out: {seen:?}"
    );
    assert_eq!(
        seen[0].1,
        data.local_addr().unwrap(),
        "the listed socket is the client's"
    );
    drop(data);
    // The server notices the close on its I/O thread: bounded wait.
    let deadline = std::time::Instant::now() + T;
    while !listed(&srv).is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        listed(&srv).is_empty(),
        "a closed connection leaves the list"
    );
}
