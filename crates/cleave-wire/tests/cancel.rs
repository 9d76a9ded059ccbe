//! Deadlines and CANCEL on the server side, over raw sockets: a late request never reaches the
//! handler; a cancelled request gets no reply whatever its handler does; a CANCEL for an id
//! that is not in flight is ignored; nothing of it disturbs the other requests.

use std::io::Write;
use std::net::TcpStream;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

mod common;

use bytes::Bytes;
use cleave_wire::frame::{encode_hello, kind};
use cleave_wire::{
    unix_now_us, Address, ConnClass, ErrorBody, ErrorCode, Frame, Handler, Request, Responder,
    Server, ServerConfig,
};
use common::read_frame;

const HELD: u16 = 0x0100;
const ECHO: u16 = 0x0101;
const T: Duration = Duration::from_secs(10);

/// Echoes ECHO; hands HELD requests to the test. Records the cancel hook's calls.
struct Held {
    held: Mutex<mpsc::Sender<(Request, Responder)>>,
    seen: Mutex<Vec<u64>>,
    cancelled: Mutex<Vec<(u64, u64)>>,
}

impl Handler for Held {
    fn handle(&self, request: Request, responder: Responder) {
        self.seen.lock().unwrap().push(request.request_id);
        match request.kind {
            HELD => {
                let _ = self.held.lock().unwrap().send((request, responder));
            }
            _ => responder.reply(request.payload),
        }
    }

    fn cancelled(&self, conn_id: u64, request_id: u64) {
        self.cancelled.lock().unwrap().push((conn_id, request_id));
    }
}

fn setup() -> (
    Server,
    Arc<Held>,
    mpsc::Receiver<(Request, Responder)>,
    TcpStream,
) {
    let (tx, rx) = mpsc::channel();
    let h = Arc::new(Held {
        held: Mutex::new(tx),
        seen: Mutex::new(Vec::new()),
        cancelled: Mutex::new(Vec::new()),
    });
    let addr: Address = "127.0.0.1:0".parse().unwrap();
    let s = Server::bind(&addr, h.clone(), ServerConfig::default()).unwrap();
    let Address::Tcp(a) = s.local_addr() else {
        unreachable!()
    };
    let mut c = TcpStream::connect(a).unwrap();
    c.set_read_timeout(Some(T)).unwrap();
    c.write_all(&Frame::request(kind::HELLO, 0, encode_hello(ConnClass::Data)).to_bytes())
        .unwrap();
    assert!(read_frame(&mut c).is_response());
    (s, h, rx, c)
}

#[test]
fn a_request_past_its_deadline_is_answered_deadline_without_the_handler() {
    let (s, h, _held, mut c) = setup();
    let past = unix_now_us() - 1_000;
    let late = Frame::request(ECHO, 1, Bytes::from_static(b"late")).with_context(past, 77);
    let future = unix_now_us() + 60_000_000;
    let fine = Frame::request(ECHO, 2, Bytes::from_static(b"fine")).with_context(future, 78);
    c.write_all(&late.to_bytes()).unwrap();
    c.write_all(&fine.to_bytes()).unwrap();
    let f = read_frame(&mut c);
    let body = ErrorBody::decode(&f.payload);
    assert!(f.is_error(), "{f:?}");
    assert_eq!((f.request_id, body.code), (1, ErrorCode::Deadline));
    assert!(body.message.contains("deadline passed"), "{}", body.message);
    assert_eq!(f.trace_id, 77, "the reply echoes the trace id");
    let f = read_frame(&mut c);
    assert_eq!(
        (f.request_id, &f.payload[..], f.is_error()),
        (2, &b"fine"[..], false)
    );
    assert_eq!((f.deadline_unix_us, f.trace_id), (future, 78));
    assert_eq!(
        *h.seen.lock().unwrap(),
        vec![2],
        "the late request reached the handler"
    );
    assert_eq!(s.stats().expired(), 1);
}

#[test]
fn a_cancelled_request_gets_no_reply_and_others_go_on() {
    let (s, h, held, mut c) = setup();
    let deadline = unix_now_us() + 60_000_000;
    c.write_all(
        &Frame::request(HELD, 1, Bytes::from_static(b"a"))
            .with_context(deadline, 5)
            .to_bytes(),
    )
    .unwrap();
    let (request, responder) = held.recv_timeout(T).unwrap();
    assert_eq!((request.deadline_unix_us, request.trace_id), (deadline, 5));
    assert!(!request.is_cancelled());
    // Cancel it, and cancel ids that are not in flight (never sent; the cancel itself).
    for id in [1, 99, 1] {
        c.write_all(&Frame::cancel(HELD, id).to_bytes()).unwrap();
    }
    // An ECHO behind the cancels: once answered, the cancels have been read.
    c.write_all(&Frame::request(ECHO, 2, Bytes::from_static(b"b")).to_bytes())
        .unwrap();
    let f = read_frame(&mut c);
    assert_eq!((f.request_id, &f.payload[..]), (2, &b"b"[..]));
    assert!(request.is_cancelled());
    assert_eq!(
        h.cancelled.lock().unwrap().len(),
        1,
        "one hook call per cancelled request"
    );
    assert_eq!(s.stats().cancelled(), 1);
    // The handler answers anyway: nothing goes out. The next reply on the wire is request 3's.
    responder.reply(Bytes::from_static(b"ignored"));
    c.write_all(&Frame::request(ECHO, 3, Bytes::from_static(b"c")).to_bytes())
        .unwrap();
    let f = read_frame(&mut c);
    assert_eq!((f.request_id, &f.payload[..]), (3, &b"c"[..]));
    // A cancel after the reply changes nothing.
    c.write_all(&Frame::cancel(ECHO, 3).to_bytes()).unwrap();
    c.write_all(&Frame::request(ECHO, 4, Bytes::from_static(b"d")).to_bytes())
        .unwrap();
    assert_eq!(read_frame(&mut c).request_id, 4);
    assert_eq!(s.stats().cancelled(), 1);
    // A CANCEL with a payload is a malformed frame: error, then close.
    let mut bad = Frame::cancel(HELD, 9).to_bytes().to_vec();
    bad[16] = 1;
    bad.push(0);
    c.write_all(&bad).unwrap();
    let f = read_frame(&mut c);
    assert_eq!(
        ErrorBody::decode(&f.payload).code,
        ErrorCode::MalformedFrame
    );
    assert!(s.join());
}
