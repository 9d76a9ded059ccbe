//! Response credits over real sockets: a server holds a response it has no credit for (nothing
//! reaches the socket) until a CREDIT on a control connection covers it; a held response whose
//! deadline passes becomes a `deadline` error; malformed CREDIT frames get error frames and
//! leave the connection usable; a `Client` with credits returns them as responses arrive.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

mod common;

use bytes::Bytes;
use cleave_wire::frame::{encode_hello, encode_hello_with, hello_options, kind};
use cleave_wire::{
    unix_now_us, Address, Client, ClientConfig, ConnClass, Credit, ErrorBody, ErrorCode, Frame,
    Handler, IoThreads, Request, Responder, Server, ServerConfig, WireError,
};
use common::read_frame;

const ECHO: u16 = 0x0100;
const T: Duration = Duration::from_secs(10);

struct Echo;

impl Handler for Echo {
    fn handle(&self, request: Request, responder: Responder) {
        responder.reply(request.payload)
    }
}

fn server() -> (Server, String) {
    let addr: Address = "127.0.0.1:0".parse().unwrap();
    let s = Server::bind(&addr, Arc::new(Echo), ServerConfig::default()).unwrap();
    let Address::Tcp(a) = s.local_addr().clone() else {
        unreachable!()
    };
    (s, a)
}

/// A raw connection after HELLO; the HELLO reply's payload.
fn connect(a: &str, hello: Bytes) -> (TcpStream, Frame) {
    let mut c = TcpStream::connect(a).unwrap();
    c.set_read_timeout(Some(T)).unwrap();
    c.write_all(&Frame::request(kind::HELLO, 0, hello).to_bytes())
        .unwrap();
    let reply = read_frame(&mut c);
    (c, reply)
}

/// A data connection with credits, and its id at the server.
fn credit_conn(a: &str) -> (TcpStream, u64) {
    let (c, reply) = connect(
        a,
        encode_hello_with(ConnClass::Data, hello_options::CREDITS),
    );
    assert!(reply.is_response() && !reply.is_error(), "{reply:?}");
    assert_eq!(
        reply.payload.len(),
        12,
        "max payload u32, then the connection id"
    );
    (
        c,
        u64::from_le_bytes(reply.payload[4..].try_into().unwrap()),
    )
}

fn grant(control: &mut TcpStream, id: u64, credit: Credit) -> Frame {
    let f = Frame::request(kind::CREDIT, id, credit.encode());
    control.write_all(&f.to_bytes()).unwrap();
    read_frame(control)
}

/// Polls `f` until it holds, at most 10 s.
fn eventually(what: &str, f: impl Fn() -> bool) {
    for _ in 0..1000 {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("never happened: {what}");
}

#[test]
fn without_credit_nothing_is_sent_until_a_grant_covers_the_response() {
    let (s, a) = server();
    let (mut data, conn_id) = credit_conn(&a);
    let (mut control, _) = connect(&a, encode_hello(ConnClass::Control));
    let deadline = unix_now_us() + 60_000_000;
    let req = Frame::request(ECHO, 1, Bytes::from(vec![7u8; 100])).with_context(deadline, 3);
    data.write_all(&req.to_bytes()).unwrap();
    let stats = s.stats();
    eventually("the response is held", || stats.responses_held() == 1);
    // Held, so nothing is on the socket.
    data.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    let e = data.read(&mut byte).unwrap_err();
    assert_eq!(
        e.kind(),
        ErrorKind::WouldBlock,
        "a byte arrived without credit"
    );
    data.set_nonblocking(false).unwrap();
    // 99 bytes do not cover a 100-byte response; one more does.
    let ack = grant(&mut control, 1, Credit { conn_id, grant: 99 });
    assert!(
        ack.is_response() && !ack.is_error() && ack.payload.is_empty(),
        "{ack:?}"
    );
    assert_eq!(stats.responses_held(), 1);
    grant(&mut control, 2, Credit { conn_id, grant: 1 });
    let f = read_frame(&mut data);
    assert_eq!(
        (f.request_id, f.payload.len(), f.is_error()),
        (1, 100, false)
    );
    assert_eq!((f.deadline_unix_us, f.trace_id), (deadline, 3));
    eventually("the gauge returns to 0", || stats.responses_held() == 0);
    // Error frames need no credit: a PING on the data connection is answered at once.
    data.write_all(&Frame::request(kind::PING, 5, Bytes::new()).to_bytes())
        .unwrap();
    assert_eq!(read_frame(&mut data).request_id, 5);
}

#[test]
fn a_held_response_past_its_deadline_becomes_a_deadline_error() {
    let (s, a) = server();
    let (mut data, _) = credit_conn(&a);
    let deadline = unix_now_us() + 300_000;
    let req = Frame::request(ECHO, 9, Bytes::from(vec![1u8; 10])).with_context(deadline, 4);
    data.write_all(&req.to_bytes()).unwrap();
    let f = read_frame(&mut data);
    let body = ErrorBody::decode(&f.payload);
    assert!(f.is_error(), "{f:?}");
    assert_eq!(
        (f.request_id, body.code, f.trace_id),
        (9, ErrorCode::Deadline, 4)
    );
    assert!(
        body.message.contains("waited for credit"),
        "{}",
        body.message
    );
    assert!(unix_now_us() >= deadline);
    assert_eq!(
        (s.stats().credit_expired(), s.stats().responses_held()),
        (1, 0)
    );
}

#[test]
fn malformed_credits_get_error_frames_and_the_connection_goes_on() {
    let (_s, a) = server();
    let (mut data, conn_id) = credit_conn(&a);
    let (mut control, _) = connect(&a, encode_hello(ConnClass::Control));
    let code = |f: &Frame| {
        assert!(f.is_error(), "{f:?}");
        ErrorBody::decode(&f.payload)
    };
    let short = Frame::request(kind::CREDIT, 1, Bytes::from_static(&[0; 15]));
    control.write_all(&short.to_bytes()).unwrap();
    let b = code(&read_frame(&mut control));
    assert_eq!(b.code, ErrorCode::BadRequest);
    assert!(
        b.message.contains("16 bytes") && b.message.contains("got 15"),
        "{}",
        b.message
    );
    let b = code(&grant(
        &mut control,
        2,
        Credit {
            conn_id: conn_id + 1000,
            grant: 1,
        },
    ));
    assert_eq!(b.code, ErrorCode::NotFound, "{}", b.message);
    let max = cleave_wire::MAX_CREDIT_BALANCE;
    let ok = grant(
        &mut control,
        3,
        Credit {
            conn_id,
            grant: max,
        },
    );
    assert!(!ok.is_error(), "{ok:?}");
    let b = code(&grant(
        &mut control,
        4,
        Credit {
            conn_id,
            grant: u64::MAX,
        },
    ));
    assert_eq!(b.code, ErrorCode::OutOfRange, "{}", b.message);
    // CREDIT on a data connection is refused; the connection stays up.
    let f = Frame::request(kind::CREDIT, 6, Credit { conn_id, grant: 1 }.encode());
    data.write_all(&f.to_bytes()).unwrap();
    assert_eq!(code(&read_frame(&mut data)).code, ErrorCode::BadRequest);
    control
        .write_all(&Frame::request(kind::PING, 7, Bytes::new()).to_bytes())
        .unwrap();
    assert_eq!(read_frame(&mut control).request_id, 7);
    // CREDITS on a control connection is a handshake error.
    let (_c, reply) = connect(
        &a,
        encode_hello_with(ConnClass::Control, hello_options::CREDITS),
    );
    assert!(reply.is_error());
    let b = ErrorBody::decode(&reply.payload);
    assert_eq!(b.code, ErrorCode::Handshake);
    assert!(b.message.contains("data connections only"), "{}", b.message);
    // Option bits this version does not define are refused, not ignored.
    let (_c, reply) = connect(&a, encode_hello_with(ConnClass::Data, 0x04));
    let b = ErrorBody::decode(&reply.payload);
    assert_eq!(b.code, ErrorCode::Handshake);
    assert!(b.message.contains("options 0x04 unknown"), "{}", b.message);
}

#[test]
fn a_client_with_a_small_window_gets_every_response_and_returns_credit() {
    let (s, a) = server();
    let io = IoThreads::new("credit-test", 1).unwrap();
    let config = ClientConfig {
        connections: 2,
        response_credits: Some(256),
        ..ClientConfig::default()
    };
    let client = Client::new(Address::Tcp(a.clone()), io, config);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // 40 calls of 100 bytes: far more than the windows, so credit must come back.
        let calls: Vec<_> = (0..40u8)
            .map(|i| {
                let c = client.clone();
                tokio::spawn(async move { c.call(ECHO, Bytes::from(vec![i; 100]), T).await })
            })
            .collect();
        for (i, call) in calls.into_iter().enumerate() {
            assert_eq!(
                call.await.unwrap().unwrap(),
                Bytes::from(vec![i as u8; 100])
            );
        }
        // Larger than the window: held until its deadline, then a clean failure.
        let big = client
            .call(
                ECHO,
                Bytes::from(vec![0u8; 1000]),
                Duration::from_millis(300),
            )
            .await;
        assert!(
            matches!(
                big,
                Err(WireError::Timeout { .. })
                    | Err(WireError::Remote {
                        code: ErrorCode::Deadline,
                        ..
                    })
            ),
            "{big:?}"
        );
        // And the connection still serves what fits.
        let small = client.call(ECHO, Bytes::from_static(b"ok"), T).await;
        assert_eq!(small.unwrap(), Bytes::from_static(b"ok"));
    });
    assert_eq!(s.stats().responses_held(), 0);
}
