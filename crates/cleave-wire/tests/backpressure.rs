//! Overload with large frames both ways: a burst of big requests against a server that answers
//! each with a bigger response and stops reading after a few owed replies. Both socket buffers
//! fill; the connection must keep going because each end goes on reading while it writes.
//! A deadlock shows up as calls (or socket reads and writes) failing with a timeout.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

mod common;

use bytes::Bytes;
use cleave_wire::frame::{encode_hello, kind};
use cleave_wire::{
    Address, Client, ClientConfig, ConnClass, Frame, Handler, IoThreads, Request, Responder,
    Server, ServerConfig,
};
use common::read_frame;

const BIG: u16 = 0x0100;
const REQUEST_LEN: usize = 256 << 10;
const RESPONSE_LEN: usize = 1 << 20;
const CALLS: u32 = 64;
/// Generous: the whole burst moves 80 MiB over loopback; only a hang comes near this.
const T: Duration = Duration::from_secs(20);

/// Answers each request with `RESPONSE_LEN` bytes repeating the request's first 4 bytes, so a
/// response that reached the wrong caller is caught.
struct Inflate;

impl Handler for Inflate {
    fn handle(&self, request: Request, responder: Responder) {
        let tag = &request.payload[..4];
        responder.reply(Bytes::from(tag.repeat(RESPONSE_LEN / 4)));
    }
}

fn burst(addr: &Address, connections: usize) {
    let server = Server::bind(
        addr,
        Arc::new(Inflate),
        ServerConfig {
            max_in_flight: 4,
            ..ServerConfig::default()
        },
    )
    .unwrap();
    let client = Client::new(
        server.local_addr().clone(),
        IoThreads::new("burst-client", 1).unwrap(),
        ClientConfig {
            connections,
            ..ClientConfig::default()
        },
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // Connections open up front, so the burst shares them rather than racing to open more.
        client.connect_all(T).await.unwrap();
        let calls: Vec<_> = (0..CALLS)
            .map(|i| {
                let c = client.clone();
                let tag = i.to_le_bytes();
                let payload = Bytes::from(tag.repeat(REQUEST_LEN / 4));
                tokio::spawn(async move { (tag, c.call(BIG, payload, T).await) })
            })
            .collect();
        for h in calls {
            let (tag, got) = h.await.unwrap();
            let got = got.unwrap_or_else(|e| panic!("call {}: {e}", u32::from_le_bytes(tag)));
            assert_eq!(got.len(), RESPONSE_LEN);
            assert!(
                got.chunks(4).all(|c| c == tag),
                "call {} got another call's response",
                u32::from_le_bytes(tag)
            );
        }
    });
    assert!(server.join(), "the server did not drain");
}

#[test]
fn a_burst_of_large_frames_both_ways_does_not_deadlock_tcp() {
    burst(&"127.0.0.1:0".parse().unwrap(), 1);
}

#[test]
fn a_burst_of_large_frames_on_several_connections_does_not_deadlock() {
    burst(&"127.0.0.1:0".parse().unwrap(), 2);
}

#[test]
fn a_burst_of_large_frames_both_ways_does_not_deadlock_unix() {
    let dir = std::env::temp_dir().join(format!("cleave-wire-bp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    burst(&Address::Unix(dir.join("s.sock")), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A peer that writes all its requests before reading any reply: the server must go on
/// reading while its replies wait for the peer (below `max_in_flight`, nothing pauses it).
#[test]
fn the_server_reads_on_while_a_peer_is_slow_to_take_replies() {
    let server = Server::bind(
        &"127.0.0.1:0".parse().unwrap(),
        Arc::new(Inflate),
        ServerConfig::default(),
    )
    .unwrap();
    let Address::Tcp(a) = server.local_addr() else {
        unreachable!()
    };
    let mut s = TcpStream::connect(a).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s.set_write_timeout(Some(T)).unwrap();
    s.write_all(&Frame::request(kind::HELLO, 0, encode_hello(ConnClass::Data)).to_bytes())
        .unwrap();
    let hello = read_frame(&mut s);
    assert!(hello.is_response() && !hello.is_error(), "{hello:?}");
    for i in 1..=CALLS {
        let payload = Bytes::from(i.to_le_bytes().repeat(REQUEST_LEN / 4));
        s.write_all(&Frame::request(BIG, i.into(), payload).to_bytes())
            .unwrap_or_else(|e| panic!("writing request {i}: {e} (the server stopped reading)"));
    }
    for i in 1..=CALLS {
        let f = read_frame(&mut s);
        assert!(f.is_response() && !f.is_error(), "{f:?}");
        assert_eq!((f.request_id, f.payload.len()), (i.into(), RESPONSE_LEN));
        assert!(f.payload.chunks(4).all(|c| c == i.to_le_bytes()));
    }
    drop(s);
    assert!(server.join(), "the server did not drain");
}

/// The same burst over shared memory: requests and responses travel as slot references,
/// and slots free as each side drops what it read.
#[test]
fn a_burst_of_large_frames_both_ways_does_not_deadlock_shm() {
    let dir = std::env::temp_dir().join(format!("cleave-wire-bp-shm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    burst(&Address::Shm(dir.join("s.sock")), 1);
    let _ = std::fs::remove_dir_all(&dir);
}
