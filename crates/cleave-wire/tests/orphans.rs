//! Replies nobody waits for any more: a request whose caller timed out may still be answered
//! (an error frame or a response) long after. That answer must not cost the other requests in
//! flight on the same connection anything.

use std::io::Write;
use std::net::TcpListener;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

mod common;

use bytes::Bytes;
use cleave_wire::frame::kind;
use cleave_wire::{
    Address, Client, ClientConfig, ClientStats, ErrorCode, Frame, Handler, IoThreads, Request,
    Responder, Server, ServerConfig, WireError,
};
use common::read_frame;

/// Held: the handler keeps the responder until the test releases it.
const HELD: u16 = 0x0100;
const ECHO: u16 = 0x0101;
const T: Duration = Duration::from_secs(10);

/// A HELD request handed to the test: its connection, payload and responder.
type Held = (u64, Bytes, Responder);

/// Keeps the responders of HELD requests (with the connection they came on) for the test.
struct Holder {
    held: Mutex<mpsc::Sender<Held>>,
    conns: Mutex<Vec<u64>>,
}

impl Handler for Holder {
    fn handle(&self, request: Request, responder: Responder) {
        self.conns.lock().unwrap().push(request.conn_id);
        match request.kind {
            HELD => {
                let tx = self.held.lock().unwrap();
                let _ = tx.send((request.conn_id, request.payload, responder));
            }
            _ => responder.reply(request.payload),
        }
    }
}

fn setup() -> (Server, Arc<Holder>, mpsc::Receiver<Held>, Client) {
    let (tx, rx) = mpsc::channel();
    let holder = Arc::new(Holder {
        held: Mutex::new(tx),
        conns: Mutex::new(Vec::new()),
    });
    let addr: Address = "127.0.0.1:0".parse().unwrap();
    let server = Server::bind(&addr, holder.clone(), ServerConfig::default()).unwrap();
    let client = Client::new(
        server.local_addr().clone(),
        IoThreads::new("orphan-client", 1).unwrap(),
        ClientConfig {
            connections: 1,
            ..ClientConfig::default()
        },
    );
    (server, holder, rx, client)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The client forgets a timed-out call (at once, or when it sweeps its table); waiting this
/// long makes sure it has, whichever way it does it, before the late answer arrives.
const FORGET: Duration = Duration::from_millis(2500);

/// The overload bug of version 1: request A times out at the caller; the server answers it
/// later with an error frame (the ranker's "deadline passed"), while request B is in flight on
/// the same connection. B must succeed and the connection must stay open.
#[test]
fn a_late_error_for_a_forgotten_request_leaves_the_connection_serving() {
    for late in ["error", "response"] {
        let (server, holder, held, client) = setup();
        let rt = rt();
        // A: the caller gives up while the server holds it.
        let err = rt
            .block_on(client.call(HELD, Bytes::from_static(b"A"), Duration::from_millis(50)))
            .unwrap_err();
        assert!(matches!(err, WireError::Timeout { .. }), "{err}");
        let (conn_a, _, a) = held.recv_timeout(T).unwrap();
        std::thread::sleep(FORGET);
        // B: in flight on the same (only) connection when A's late answer arrives.
        let b_call = {
            let c = client.clone();
            std::thread::spawn(move || rt_block(c.call(HELD, Bytes::from_static(b"B"), T)))
        };
        let (conn_b, payload, b) = held.recv_timeout(T).unwrap();
        assert_eq!((conn_b, &payload[..]), (conn_a, &b"B"[..]));
        match late {
            "error" => a.error(
                ErrorCode::Internal,
                "deadline passed 3 us before it started",
            ),
            _ => a.reply(Bytes::from_static(b"too late")),
        }
        b.reply(payload);
        let got = b_call.join().unwrap();
        assert_eq!(got.unwrap(), "B", "late {late}");
        // Still the same connection: the late answer did not close it.
        let c = rt
            .block_on(client.call(ECHO, Bytes::from_static(b"C"), T))
            .unwrap();
        assert_eq!(c, "C");
        let conns = holder.conns.lock().unwrap().clone();
        assert_eq!(
            conns,
            vec![conn_a; 3],
            "late {late}: the connection was replaced"
        );
        drop(server);
    }
}

fn rt_block<F: std::future::Future>(f: F) -> F::Output {
    rt().block_on(f)
}

/// A peer that answers ids nobody asked about (as a server that does not know CANCEL, or one
/// whose answer crossed the cancel, would): counted and dropped, the connection serves on. A
/// connection-level error for no call means the peer is closing: the calls in flight fail.
#[test]
fn answers_for_unknown_ids_are_counted_and_only_connection_errors_close() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr: Address = listener.local_addr().unwrap().to_string().parse().unwrap();
    let peer = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        let hello = read_frame(&mut s);
        assert_eq!(hello.kind, kind::HELLO);
        let limit = Bytes::copy_from_slice(&(1u32 << 20).to_le_bytes());
        s.write_all(&Frame::response(kind::HELLO, 0, limit).to_bytes())
            .unwrap();
        let first = read_frame(&mut s);
        assert!(first.deadline_unix_us > 0, "the call's deadline travels");
        assert_eq!(first.trace_id, 4242);
        let id = first.request_id;
        let strays = [
            Frame::error(
                ECHO,
                id + 100,
                ErrorCode::Deadline,
                "deadline passed 3 us ago",
            ),
            Frame::error(ECHO, id + 101, ErrorCode::Overloaded, "queue full"),
            Frame::response(ECHO, id + 102, Bytes::from_static(b"stray")),
            Frame::response(ECHO, id, first.payload),
        ];
        for f in strays {
            s.write_all(&f.to_bytes()).unwrap();
        }
        let second = read_frame(&mut s);
        let bye = Frame::error(kind::HELLO, 0, ErrorCode::MalformedFrame, "bad magic");
        s.write_all(&bye.to_bytes()).unwrap();
        second.request_id
    });
    let client = Client::new(
        addr,
        IoThreads::new("orphan-client", 1).unwrap(),
        ClientConfig {
            connections: 1,
            ..ClientConfig::default()
        },
    );
    let rt = rt();
    let got = rt
        .block_on(client.call_traced(ECHO, Bytes::from_static(b"one"), T, 4242))
        .unwrap();
    assert_eq!(got, "one");
    let want = ClientStats {
        orphan_responses: 3,
        cancels_sent: 0,
    };
    assert_eq!(client.stats(), want);
    let err = rt
        .block_on(client.call(ECHO, Bytes::from_static(b"two"), T))
        .unwrap_err();
    assert!(matches!(err, WireError::Closed { .. }), "{err}");
    assert!(
        err.to_string().contains("1 (malformed_frame): bad magic"),
        "{err}"
    );
    assert_eq!(
        client.stats(),
        want,
        "a connection-level error is no orphan"
    );
    peer.join().unwrap();
}
