//! The shared-memory transport over real Unix sockets: payloads through slots both ways and
//! bit-equal to Unix sockets, a full ring as back-pressure, malformed slot references as
//! error frames on a connection that goes on, and a peer gone mid-transfer as a retriable
//! failure after which a fresh connection (and region) serves the next call.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use cleave_wire::frame::{encode_hello_with, flags, hello_options, kind, HEADER_LEN};
use cleave_wire::shm::{recv_fd, send_fd, Region, ShmConfig, ShmTx, SlotRef};
use cleave_wire::{
    Address, Client, ClientConfig, ConnClass, ErrorBody, ErrorCode, Frame, Handler, Header,
    IoThreads, Request, Responder, Server, ServerConfig, WireError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

const ECHO: u16 = 0x0100;
/// Keeps the request's payload (so its slot stays held) and answers with an empty payload.
const KEEP: u16 = 0x0101;
/// Generous: only a hang comes near it.
const T: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Keeper(Mutex<Vec<Bytes>>);

impl Handler for Keeper {
    fn handle(&self, request: Request, responder: Responder) {
        match request.kind {
            ECHO => {
                // The reply is built from the payload read in place: a second region's slot.
                let mut out = request.payload.to_vec();
                out.reverse();
                responder.reply(Bytes::from(out));
            }
            KEEP => {
                self.0.lock().unwrap().push(request.payload);
                responder.reply(Bytes::new());
            }
            _ => {
                // Any other kind drops every payload KEEP kept.
                self.0.lock().unwrap().clear();
                responder.reply(Bytes::new());
            }
        }
    }
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cleave-shm-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn payload(n: usize, seed: u32) -> Bytes {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect::<Vec<u8>>()
        .into()
}

fn client(addr: Address, slots: u32) -> Client {
    let config = ClientConfig {
        connections: 1,
        shm: ShmConfig {
            slots,
            slot_bytes: 1 << 20,
        },
        ..ClientConfig::default()
    };
    Client::new(addr, IoThreads::new("shm-client", 1).unwrap(), config)
}

#[test]
fn payloads_cross_through_slots_and_equal_unix_sockets_bit_for_bit() {
    let d = dir("equal");
    let server = Server::bind(
        &Address::Shm(d.join("s.sock")),
        Arc::new(Keeper::default()),
        ServerConfig::default(),
    )
    .unwrap();
    assert_eq!(server.local_addr(), &Address::Shm(d.join("s.sock")));
    let shm = client(server.local_addr().clone(), 2);
    // The same server answers plain Unix clients.
    let unix = client(Address::Unix(d.join("s.sock")), 2);
    rt().block_on(async {
        // Far more calls than slots: each slot is reused many times, so releases work.
        for (i, n) in [10, 20_000, 300_000, 1 << 20, 5_000_000]
            .iter()
            .cycle()
            .take(40)
            .enumerate()
        {
            let p = payload(*n, i as u32);
            let a = shm.call(ECHO, p.clone(), T).await.unwrap();
            let b = unix.call(ECHO, p.clone(), T).await.unwrap();
            assert_eq!(a, b, "{n} bytes");
            let mut want = p.to_vec();
            want.reverse();
            assert_eq!(&a[..], &want[..]);
        }
    });
    let _ = std::fs::remove_dir_all(&d);
}

/// A shm server at `d/s.sock` that keeps every payload it is sent.
fn keeping_server(d: &std::path::Path) -> (Server, Arc<Keeper>) {
    let keeper = Arc::new(Keeper::default());
    let server = Server::bind(
        &Address::Shm(d.join("s.sock")),
        keeper.clone(),
        ServerConfig::default(),
    )
    .unwrap();
    (server, keeper)
}

#[test]
fn a_full_ring_sends_inline_and_no_call_waits_for_a_slot() {
    let d = dir("full");
    let (server, keeper) = keeping_server(&d);
    let c = client(server.local_addr().clone(), 2);
    rt().block_on(async {
        // The server keeps every payload: two hold both slots, the rest go inline, none waits
        // (a short budget is enough: only a wait for a slot would come near it).
        for i in 0..5 {
            let big = payload(100_000, i);
            c.call(KEEP, big, Duration::from_secs(2)).await.unwrap();
        }
    });
    let kept = keeper.0.lock().unwrap().clone();
    assert_eq!(kept.len(), 5);
    for (i, p) in kept.iter().enumerate() {
        assert_eq!(p, &payload(100_000, i as u32), "payload {i}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A payload the call writes itself (`Client::call_written`): `payload(len, seed)`'s bytes.
struct Written(Bytes);

impl cleave_wire::Payload for Written {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn write_to(&self, out: &mut [u8]) {
        out.copy_from_slice(&self.0);
    }
}

#[test]
fn a_payload_written_in_place_arrives_as_written_in_a_slot_or_inline() {
    let d = dir("written");
    let (server, keeper) = keeping_server(&d);
    let shm = client(server.local_addr().clone(), 2);
    let unix = client(Address::Unix(d.join("s.sock")), 2);
    rt().block_on(async {
        // Written into slots (reused many times: each echo frees its slot), and inline when
        // small, on a plain Unix connection, or with the ring full below.
        for (i, n) in [10, 20_000, 300_000, 1 << 20]
            .iter()
            .cycle()
            .take(12)
            .enumerate()
        {
            let p = payload(*n, i as u32);
            for c in [&shm, &unix] {
                let got = c
                    .call_written(ECHO, &Written(p.clone()), T, 0)
                    .await
                    .unwrap();
                let mut want = p.to_vec();
                want.reverse();
                assert_eq!(&got[..], &want[..], "{n} bytes");
            }
        }
        // The server keeps these: two hold both slots, the other three go inline.
        for i in 0..5 {
            let w = Written(payload(100_000, i));
            shm.call_written(KEEP, &w, T, 0).await.unwrap();
        }
    });
    let kept = keeper.0.lock().unwrap().clone();
    assert_eq!(kept.len(), 5);
    for (i, p) in kept.iter().enumerate() {
        assert_eq!(p, &payload(100_000, i as u32), "payload {i}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// Connects by hand, negotiates shared memory, and returns the stream and this side's region.
async fn raw_shm_client(path: &PathBuf) -> (UnixStream, ShmTx) {
    let mut s = UnixStream::connect(path).await.unwrap();
    let hello = encode_hello_with(ConnClass::Data, hello_options::SHM);
    s.write_all(&Frame::request(kind::HELLO, 0, hello).to_bytes())
        .await
        .unwrap();
    let reply = read_frame(&mut s).await;
    assert!(reply.is_response() && !reply.is_error(), "{reply:?}");
    let tx = ShmTx::new(ShmConfig {
        slots: 4,
        slot_bytes: 1 << 16,
    })
    .unwrap();
    send_fd(&s, std::os::fd::AsFd::as_fd(tx.region().fd()))
        .await
        .unwrap();
    let peer = Region::open(recv_fd(&s).await.unwrap()).unwrap();
    assert_eq!(peer.slots(), ShmConfig::default().slots);
    (s, tx)
}

async fn read_frame(s: &mut UnixStream) -> Frame {
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head).await.unwrap();
    let h = Header::decode(&head, u32::MAX).unwrap();
    let mut p = vec![0u8; h.payload_len as usize];
    s.read_exact(&mut p).await.unwrap();
    Frame::from_header(&h, p.into())
}

#[test]
fn a_malformed_slot_reference_is_an_error_frame_and_the_connection_goes_on() {
    let d = dir("bad");
    let _server = Server::bind(
        &Address::Shm(d.join("s.sock")),
        Arc::new(Keeper::default()),
        ServerConfig::default(),
    )
    .unwrap();
    rt().block_on(async {
        let (mut s, tx) = raw_shm_client(&d.join("s.sock")).await;
        let good = tx.write(&payload(30_000, 3)).unwrap();
        let cases: [(SlotRef, &str); 3] = [
            (
                SlotRef { index: 9, ..good },
                "index 9 out of range: expected < 4",
            ),
            (
                SlotRef {
                    len: 70_000,
                    ..good
                },
                "expected at most the slot size, 65536 bytes",
            ),
            (
                SlotRef {
                    generation: good.generation + 5,
                    ..good
                },
                "stale slot reference: expected slot 0 sent with generation 6, found it sent \
                 with generation 1",
            ),
        ];
        for (id, (r, want)) in cases.iter().enumerate() {
            let mut f = Frame::request(ECHO, id as u64 + 1, r.encode());
            f.flags |= flags::SHM;
            s.write_all(&f.to_bytes()).await.unwrap();
            let e = read_frame(&mut s).await;
            assert!(e.is_error(), "{e:?}");
            assert_eq!(e.request_id, id as u64 + 1);
            let body = ErrorBody::decode(&e.payload);
            assert_eq!(body.code, ErrorCode::BadRequest);
            assert!(body.message.contains(want), "{}", body.message);
        }
        // A reference of the wrong length is malformed the same way.
        let mut f = Frame::request(ECHO, 7, Bytes::from_static(&[1, 2, 3]));
        f.flags |= flags::SHM;
        s.write_all(&f.to_bytes()).await.unwrap();
        let e = read_frame(&mut s).await;
        assert!(ErrorBody::decode(&e.payload)
            .message
            .contains("must be 24 bytes"));
        // The good reference still works on the same connection, and its slot is freed.
        let mut f = Frame::request(ECHO, 8, good.encode());
        f.flags |= flags::SHM;
        s.write_all(&f.to_bytes()).await.unwrap();
        let r = read_frame(&mut s).await;
        assert_eq!(r.request_id, 8);
        assert!(
            r.flags & flags::SHM != 0,
            "a 30 kB reply comes back through a slot"
        );
        assert_eq!(tx.region().in_use(), 0);
    });
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_peer_gone_mid_transfer_fails_the_call_retriably_and_the_next_connection_serves() {
    let d = dir("gone");
    let path = d.join("s.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    listener.set_nonblocking(true).unwrap();
    let c = client(Address::Shm(path.clone()), 4);
    rt().block_on(async {
        let listener = UnixListener::from_std(listener).unwrap();
        // A fake server: accepts, negotiates, reads the request header, then vanishes as a
        // killed process would, leaving its slot reference unanswered.
        let fake = async {
            let (mut s, _) = listener.accept().await.unwrap();
            let hello = read_frame(&mut s).await;
            assert_eq!(hello.payload[1], hello_options::SHM);
            let mut reply = (64u32 << 20).to_le_bytes().to_vec();
            reply.truncate(4);
            s.write_all(&Frame::response(kind::HELLO, 0, reply.into()).to_bytes())
                .await
                .unwrap();
            let peer = Region::open(recv_fd(&s).await.unwrap()).unwrap();
            let own = ShmTx::new(ShmConfig::default()).unwrap();
            send_fd(&s, std::os::fd::AsFd::as_fd(own.region().fd()))
                .await
                .unwrap();
            let req = read_frame(&mut s).await;
            assert!(req.flags & flags::SHM != 0);
            assert_eq!(
                peer.in_use(),
                1,
                "the request's slot is the receiver's to free"
            );
            drop(s);
        };
        let call = c.call(ECHO, payload(200_000, 5), T);
        let (r, ()) = tokio::join!(call, fake);
        let e = r.unwrap_err();
        assert!(matches!(e, WireError::Closed { .. }), "{e}");
        drop(listener);
        let _ = std::fs::remove_file(&path);
    });
    // A real server at the same path now: the client opens a new connection and region.
    let server = Server::bind(
        &Address::Shm(path.clone()),
        Arc::new(Keeper::default()),
        ServerConfig::default(),
    )
    .unwrap();
    rt().block_on(async {
        let got = c.call(ECHO, payload(200_000, 6), T).await.unwrap();
        assert_eq!(got.len(), 200_000);
    });
    drop(server);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn shared_memory_is_refused_on_tcp_and_on_control_connections() {
    let server = Server::bind(
        &"127.0.0.1:0".parse().unwrap(),
        Arc::new(Keeper::default()),
        ServerConfig::default(),
    )
    .unwrap();
    let Address::Tcp(a) = server.local_addr().clone() else {
        unreachable!()
    };
    let mut s = std::net::TcpStream::connect(a).unwrap();
    let hello = encode_hello_with(ConnClass::Data, hello_options::SHM);
    std::io::Write::write_all(&mut s, &Frame::request(kind::HELLO, 0, hello).to_bytes()).unwrap();
    let mut head = [0u8; HEADER_LEN];
    std::io::Read::read_exact(&mut s, &mut head).unwrap();
    let h = Header::decode(&head, u32::MAX).unwrap();
    let mut p = vec![0u8; h.payload_len as usize];
    std::io::Read::read_exact(&mut s, &mut p).unwrap();
    let body = ErrorBody::decode(&p);
    assert!(
        body.message.contains("needs a Unix socket"),
        "{}",
        body.message
    );
    let e = cleave_wire::frame::decode_hello_with(&encode_hello_with(
        ConnClass::Control,
        hello_options::SHM,
    ))
    .unwrap_err();
    assert!(e.contains("data connections only"), "{e}");
}

#[test]
fn the_send_path_cpu_is_counted_when_asked_on_slots_and_on_sockets() {
    let d = dir("send-cpu");
    let (server, _) = keeping_server(&d);
    let counted = |addr: Address| {
        let total = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let config = ClientConfig {
            connections: 1,
            send_cpu: Some(total.clone()),
            ..ClientConfig::default()
        };
        (
            Client::new(addr, IoThreads::new("cpu-client", 1).unwrap(), config),
            total,
        )
    };
    let (shm, shm_cpu) = counted(server.local_addr().clone());
    let (unix, unix_cpu) = counted(Address::Unix(d.join("s.sock")));
    rt().block_on(async {
        for c in [&shm, &unix] {
            let w = Written(payload(1 << 20, 7));
            c.call_written(ECHO, &w, T, 0).await.unwrap();
        }
    });
    // A MiB written into a slot, or packed and written to a socket, takes CPU time.
    for (what, total) in [("shm", shm_cpu), ("unix", unix_cpu)] {
        assert!(
            total.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "{what}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}
