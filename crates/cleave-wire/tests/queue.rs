//! Queue policies and deadline drops on the server side, over real sockets: a request with
//! less time left than the handler expects it to take is answered `deadline` without reaching
//! the handler (and counted); under EDF the earlier deadline starts first, under FIFO the
//! earlier arrival.

use std::io::Write;
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod common;

use bytes::{Bytes, BytesMut};
use cleave_wire::frame::{encode_hello, kind};
use cleave_wire::{
    unix_now_us, Address, ConnClass, ErrorBody, ErrorCode, Frame, Handler, QueuePolicy, Request,
    Responder, Server, ServerConfig,
};
use common::read_frame;

const ECHO: u16 = 0x0101;
/// Requests of this kind are expected to take 10 s: any shorter deadline cannot be met.
const SLOW: u16 = 0x0102;
const T: Duration = Duration::from_secs(10);

/// Echoes every request and records the order requests reached it.
#[derive(Default)]
struct Recorder {
    seen: Mutex<Vec<u64>>,
}

impl Handler for Recorder {
    fn handle(&self, request: Request, responder: Responder) {
        self.seen.lock().unwrap().push(request.request_id);
        responder.reply(request.payload);
    }

    fn expected_service_us(&self, kind: u16) -> u64 {
        if kind == SLOW {
            10_000_000
        } else {
            0
        }
    }
}

fn setup(queue: QueuePolicy) -> (Server, Arc<Recorder>, TcpStream) {
    let h = Arc::new(Recorder::default());
    let addr: Address = "127.0.0.1:0".parse().unwrap();
    let config = ServerConfig {
        queue,
        ..ServerConfig::default()
    };
    let s = Server::bind(&addr, h.clone(), config).unwrap();
    let Address::Tcp(a) = s.local_addr() else {
        unreachable!()
    };
    let mut c = TcpStream::connect(a).unwrap();
    c.set_read_timeout(Some(T)).unwrap();
    c.write_all(&Frame::request(kind::HELLO, 0, encode_hello(ConnClass::Data)).to_bytes())
        .unwrap();
    assert!(read_frame(&mut c).is_response());
    (s, h, c)
}

#[test]
fn a_request_that_cannot_make_its_deadline_never_reaches_the_handler() {
    for policy in [QueuePolicy::Fifo, QueuePolicy::Edf] {
        let (s, h, mut c) = setup(policy);
        // One second left, ten expected: dropped. No deadline: served, however slow.
        let soon = unix_now_us() + 1_000_000;
        let doomed = Frame::request(SLOW, 1, Bytes::from_static(b"a")).with_context(soon, 7);
        let patient = Frame::request(SLOW, 2, Bytes::from_static(b"b"));
        c.write_all(&doomed.to_bytes()).unwrap();
        c.write_all(&patient.to_bytes()).unwrap();
        let f = read_frame(&mut c);
        let body = ErrorBody::decode(&f.payload);
        assert!(f.is_error(), "{policy}: {f:?}");
        assert_eq!((f.request_id, body.code), (1, ErrorCode::Deadline));
        assert!(
            body.message.contains("cannot be met") && body.message.contains("10000000 us"),
            "{}",
            body.message
        );
        assert_eq!(f.trace_id, 7);
        let f = read_frame(&mut c);
        assert_eq!((f.request_id, f.is_error()), (2, false));
        assert_eq!(*h.seen.lock().unwrap(), vec![2], "{policy}");
        let stats = s.stats();
        assert_eq!(
            (stats.dropped_late(), stats.expired(), stats.queued()),
            (1, 0, 0)
        );
    }
}

/// Sends requests 1..=4 in one write (so that they are read before any starts) with deadlines
/// far, near, none, middle; returns the order the handler saw them in.
fn order_under(policy: QueuePolicy) -> Vec<u64> {
    let (_s, h, mut c) = setup(policy);
    let now = unix_now_us();
    let deadlines = [now + 40_000_000, now + 10_000_000, 0, now + 20_000_000];
    let mut burst = BytesMut::new();
    for (i, d) in deadlines.into_iter().enumerate() {
        let f = Frame::request(ECHO, i as u64 + 1, Bytes::from_static(b"x")).with_context(d, 0);
        burst.extend_from_slice(&f.to_bytes());
    }
    c.write_all(&burst).unwrap();
    let mut answered: Vec<u64> = (0..4).map(|_| read_frame(&mut c).request_id).collect();
    answered.sort_unstable();
    assert_eq!(answered, [1, 2, 3, 4], "every request answered once");
    let seen = h.seen.lock().unwrap().clone();
    seen
}

#[test]
fn edf_starts_the_earlier_deadline_first_and_fifo_the_earlier_arrival() {
    assert_eq!(order_under(QueuePolicy::Fifo), [1, 2, 3, 4]);
    // Near, middle, far; no deadline last.
    assert_eq!(order_under(QueuePolicy::Edf), [2, 4, 1, 3]);
}

/// Blocks its I/O thread on HELD requests until the test releases them; echoes the rest,
/// telling the test.
struct Blocking {
    release: Mutex<std::sync::mpsc::Receiver<()>>,
    echoed: Mutex<std::sync::mpsc::Sender<u64>>,
}

const HELD: u16 = 0x0103;

impl Handler for Blocking {
    fn handle(&self, request: Request, responder: Responder) {
        if request.kind == HELD {
            // Longer than the test waits for request 2, so that waiting for this one fails it.
            let _ = self.release.lock().unwrap().recv_timeout(T * 3);
        } else {
            let _ = self.echoed.lock().unwrap().send(request.request_id);
        }
        responder.reply(request.payload);
    }
}

#[test]
fn an_idle_io_thread_starts_work_a_busy_threads_connection_received() {
    let (release_tx, release_rx) = std::sync::mpsc::channel();
    let (echoed_tx, echoed_rx) = std::sync::mpsc::channel();
    let h = Arc::new(Blocking {
        release: Mutex::new(release_rx),
        echoed: Mutex::new(echoed_tx),
    });
    let config = ServerConfig {
        io_threads: 2,
        ..ServerConfig::default()
    };
    let s = Server::bind(&"127.0.0.1:0".parse().unwrap(), h, config).unwrap();
    let Address::Tcp(a) = s.local_addr() else {
        unreachable!()
    };
    let hello = Frame::request(kind::HELLO, 0, encode_hello(ConnClass::Data)).to_bytes();
    // Two connections: round robin puts them on the two I/O threads.
    let mut conns: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut c = TcpStream::connect(a).unwrap();
            c.set_read_timeout(Some(T)).unwrap();
            c.write_all(&hello).unwrap();
            assert!(read_frame(&mut c).is_response());
            c
        })
        .collect();
    // A round trip on the second connection parks its task, idle, on the other thread.
    conns[1]
        .write_all(&Frame::request(ECHO, 9, Bytes::from_static(b"p")).to_bytes())
        .unwrap();
    assert_eq!(read_frame(&mut conns[1]).request_id, 9);
    assert_eq!(echoed_rx.recv_timeout(T), Ok(9));
    // A request that blocks its thread, and one behind it on the same connection, in one
    // write: both are queued before the first starts.
    let mut burst = BytesMut::new();
    burst.extend_from_slice(&Frame::request(HELD, 1, Bytes::from_static(b"h")).to_bytes());
    burst.extend_from_slice(&Frame::request(ECHO, 2, Bytes::from_static(b"e")).to_bytes());
    conns[0].write_all(&burst).unwrap();
    // The other thread starts request 2 while request 1 still holds the first thread.
    assert_eq!(
        echoed_rx.recv_timeout(T),
        Ok(2),
        "request 2 waited for request 1"
    );
    release_tx.send(()).unwrap();
    let mut answered: Vec<u64> = (0..2)
        .map(|_| read_frame(&mut conns[0]).request_id)
        .collect();
    answered.sort_unstable();
    assert_eq!(answered, [1, 2]);
}
