//! The data connection's framing: a 24-byte header (kind, a, b, little-endian u64s), then for
//! a chunk `b` payload bytes of message `a`; a credit (`a` = its stamp) has no payload. Credits
//! piggybacked here wait behind whatever data is ahead of them: that is what the bench
//! measures against the priority control channel.

pub const HEADER: usize = 24;
pub const CHUNK: usize = 64 * 1024;
pub const KIND_CHUNK: u64 = 1;
pub const KIND_CREDIT: u64 = 2;

pub fn header(kind: u64, a: u64, b: u64) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..8].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&a.to_le_bytes());
    h[16..].copy_from_slice(&b.to_le_bytes());
    h
}

pub fn parse(h: &[u8; HEADER]) -> (u64, u64, u64) {
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&h[i..i + 8]);
        u64::from_le_bytes(w)
    };
    (word(0), word(8), word(16))
}
