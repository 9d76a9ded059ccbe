//! Load-aware I/O threads over real sockets: two data I/O threads, four connections accepted
//! alternately onto them, and all the load on the two of thread 0. A connection moves to the
//! idle thread (counted), and every request is answered, and reaches the handler once, before
//! and after the move.

use std::collections::HashMap;
use std::io::Write;
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod common;

use bytes::Bytes;
use cleave_wire::balance::BalanceConfig;
use cleave_wire::frame::{encode_hello, kind};
use cleave_wire::{Address, ConnClass, Frame, Handler, Request, Responder, Server, ServerConfig};
use common::read_frame;

const WORK: u16 = 0x0100;
const T: Duration = Duration::from_secs(10);

/// Holds every request until the test answers it; records the order requests started in.
#[derive(Default)]
struct Holding {
    held: Mutex<Vec<(Responder, Bytes)>>,
    started: Mutex<Vec<(u64, u64)>>,
}

impl Handler for Holding {
    fn handle(&self, request: Request, responder: Responder) {
        self.started
            .lock()
            .unwrap()
            .push((request.conn_id, request.request_id));
        self.held.lock().unwrap().push((responder, request.payload));
    }
}

impl Holding {
    fn wait_held(&self, n: usize) {
        for _ in 0..1000 {
            if self.held.lock().unwrap().len() >= n {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("the handler never held {n} requests");
    }

    fn answer_all(&self) {
        for (responder, payload) in self.held.lock().unwrap().drain(..) {
            responder.reply(payload);
        }
    }
}

fn send(c: &mut TcpStream, conn: u8, ids: std::ops::RangeInclusive<u64>) {
    let mut bytes = Vec::new();
    for id in ids {
        let payload = Bytes::from(vec![conn, id as u8]);
        bytes.extend_from_slice(&Frame::request(WORK, id, payload).to_bytes());
    }
    c.write_all(&bytes).unwrap();
}

fn receive(c: &mut TcpStream, conn: u8, n: usize) -> Vec<u64> {
    let mut ids: Vec<u64> = (0..n)
        .map(|_| {
            let f = read_frame(c);
            assert!(f.is_response() && !f.is_error(), "{f:?}");
            assert_eq!(
                &f.payload[..],
                &[conn, f.request_id as u8],
                "answer of another request"
            );
            f.request_id
        })
        .collect();
    ids.sort_unstable();
    ids
}

#[test]
fn a_busy_threads_connection_moves_to_the_idle_thread_losing_and_reordering_nothing() {
    let handler = Arc::new(Holding::default());
    let config = ServerConfig {
        io_threads: 2,
        balance: Some(BalanceConfig {
            min_load: 8,
            ratio: 2.0,
        }),
        ..ServerConfig::default()
    };
    let addr: Address = "127.0.0.1:0".parse().unwrap();
    let s = Server::bind(&addr, handler.clone(), config).unwrap();
    let Address::Tcp(a) = s.local_addr().clone() else {
        unreachable!()
    };
    // Accepted one after the other: threads 0, 1, 0, 1.
    let mut conns: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut c = TcpStream::connect(&a).unwrap();
            c.set_read_timeout(Some(T)).unwrap();
            c.write_all(&Frame::request(kind::HELLO, 0, encode_hello(ConnClass::Data)).to_bytes())
                .unwrap();
            assert!(read_frame(&mut c).is_response());
            c
        })
        .collect();
    // All the work on thread 0's two connections.
    send(&mut conns[0], 0, 1..=20);
    send(&mut conns[2], 2, 1..=20);
    handler.wait_held(40);
    assert!(s.stats().migrations() >= 1, "no connection moved");
    handler.answer_all();
    assert_eq!(receive(&mut conns[0], 0, 20), (1..=20).collect::<Vec<_>>());
    assert_eq!(receive(&mut conns[2], 2, 20), (1..=20).collect::<Vec<_>>());
    // Moved or not, every connection goes on serving.
    for (i, c) in conns.iter_mut().enumerate() {
        send(c, i as u8, 21..=22);
    }
    handler.wait_held(8);
    handler.answer_all();
    for (i, c) in conns.iter_mut().enumerate() {
        assert_eq!(receive(c, i as u8, 2), [21, 22]);
    }
    // Each request reached the handler exactly once. (Replies are matched by id: the
    // protocol promises no order between the requests of a connection, and two threads
    // starting requests may record them in either order.)
    let mut by_conn: HashMap<u64, Vec<u64>> = HashMap::new();
    for (conn, id) in handler.started.lock().unwrap().iter() {
        by_conn.entry(*conn).or_default().push(*id);
    }
    let mut counts: Vec<usize> = by_conn.values().map(Vec::len).collect();
    counts.sort_unstable();
    assert_eq!(counts, [2, 2, 22, 22]);
    for ids in by_conn.values_mut() {
        ids.sort_unstable();
        ids.dedup();
        assert!(
            ids.len() == 2 || ids.len() == 22,
            "a request started twice: {ids:?}"
        );
    }
    drop(conns);
    assert!(s.join());
}
