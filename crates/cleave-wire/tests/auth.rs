//! Authenticated HELLO over real sockets (src/auth.rs): this test binary is a process with
//! `CLEAVE_INTERNAL_SECRET` set, as every role of a deployment with `internal_secret_env` is.
//! A peer that sends a plain HELLO (it does not know the secret) is refused and can send
//! nothing else; the library's own client, which proves the secret, is served.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

mod common;

use bytes::Bytes;
use cleave_wire::frame::{encode_hello, kind};
use cleave_wire::{
    Address, Client, ClientConfig, ConnClass, ErrorBody, ErrorCode, Frame, Handler, IoThreads,
    Request, Responder, Server, ServerConfig,
};
use common::read_frame;

const ECHO: u16 = 0x0101;
const T: Duration = Duration::from_secs(10);

struct Echo;

impl Handler for Echo {
    fn handle(&self, request: Request, responder: Responder) {
        responder.reply(request.payload)
    }
}

#[test]
fn an_unauthenticated_hello_is_refused_and_a_proven_one_served() {
    // Before anything reads it: the secret is read once per process.
    std::env::set_var(cleave_wire::auth::SECRET_ENV, "test-secret-3c9e");
    let addr: Address = "127.0.0.1:0".parse().unwrap();
    let server = Server::bind(&addr, Arc::new(Echo), ServerConfig::default()).unwrap();
    let Address::Tcp(a) = server.local_addr().clone() else {
        unreachable!()
    };

    // A process without the secret: a plain HELLO.
    let mut raw = TcpStream::connect(a).unwrap();
    raw.set_read_timeout(Some(T)).unwrap();
    let hello = Frame::request(kind::HELLO, 0, encode_hello(ConnClass::Data));
    raw.write_all(&hello.to_bytes()).unwrap();
    let answer = read_frame(&mut raw);
    assert!(answer.is_error());
    let body = ErrorBody::decode(&answer.payload);
    assert_eq!(body.code, ErrorCode::Handshake);
    assert!(
        body.message.starts_with("unauthenticated HELLO refused"),
        "{}",
        body.message
    );
    // The connection is closed: a request after the refused HELLO reaches nothing.
    let _ = raw.write_all(&Frame::request(ECHO, 1, Bytes::from_static(b"x")).to_bytes());
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut raw, &mut rest);
    assert!(rest.is_empty(), "{} bytes after the refusal", rest.len());

    // The library's client proves the secret and is served.
    let client = Client::new(
        server.local_addr().clone(),
        IoThreads::new("auth-client", 1).unwrap(),
        ClientConfig::default(),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let got = rt
        .block_on(client.call(ECHO, Bytes::from_static(b"hello"), T))
        .unwrap();
    assert_eq!(&got[..], b"hello");
    server.shutdown();
}
