//! What several wire tests share: reading one whole frame from a blocking socket.

use std::io::Read;
use std::net::TcpStream;

use cleave_wire::frame::HEADER_LEN;
use cleave_wire::{Frame, Header};

/// The next frame on `s`; panics on a short read or a bad header (the tests' peers are ours).
pub fn read_frame(s: &mut TcpStream) -> Frame {
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head).unwrap();
    let h = Header::decode(&head, u32::MAX).unwrap();
    let mut payload = vec![0u8; h.payload_len as usize];
    s.read_exact(&mut payload).unwrap();
    Frame::from_header(&h, payload.into())
}
