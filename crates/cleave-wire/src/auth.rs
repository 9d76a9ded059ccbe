//! Authenticated HELLO (docs/security.md, "Internal connections"): when the process has a
//! shared secret in `CLEAVE_INTERNAL_SECRET` (the launcher copies it there from the variable
//! the plan names in `internal_secret_env`), a client's HELLO carries a proof that it knows the
//! secret, and a server refuses a HELLO without a valid one. Without the variable, HELLO is the
//! plain 4 bytes of frame.rs, as before.
//!
//! Payload with a proof (60 bytes): the 4 class bytes, the client's clock in Unix
//! milliseconds (u64 LE), a 16-byte random nonce, then HMAC-SHA256(secret, "cleave-hello-v1" ||
//! those 28 bytes). The server accepts clocks within `MAX_SKEW` of its own. One message, no
//! extra round trip; a HELLO captured on the wire could be replayed within that window, so the
//! internal network should still be private (a challenge from the server would close that).

use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use crate::frame::{decode_hello_with, encode_hello_with, ConnClass};

/// The environment variable holding the deployment's internal secret.
pub const SECRET_ENV: &str = "CLEAVE_INTERNAL_SECRET";
const CONTEXT: &[u8] = b"cleave-hello-v1";
const PROVEN_LEN: usize = 4 + 8 + 16 + 32;
/// How far a client's clock may be from the server's.
pub const MAX_SKEW: Duration = Duration::from_secs(60);

/// The process's secret, read from `CLEAVE_INTERNAL_SECRET` once.
fn process_key() -> Option<&'static hmac::Key> {
    static KEY: OnceLock<Option<hmac::Key>> = OnceLock::new();
    KEY.get_or_init(|| {
        let secret = std::env::var(SECRET_ENV).ok().filter(|s| !s.is_empty())?;
        Some(hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes()))
    })
    .as_ref()
}

/// The HELLO payload this process sends.
pub fn hello_payload(class: ConnClass) -> Bytes {
    hello_payload_with(class, 0)
}

/// The HELLO payload this process sends, with option bits (`frame::hello_options`); the
/// proof covers them.
pub fn hello_payload_with(class: ConnClass, options: u8) -> Bytes {
    match process_key() {
        Some(key) => proven_hello_with(class, options, key, now_ms()),
        None => encode_hello_with(class, options),
    }
}

/// Checks a HELLO payload as this process requires.
pub fn check_hello(payload: &[u8]) -> Result<ConnClass, String> {
    check_hello_with(payload).map(|(class, _)| class)
}

/// Checks a HELLO payload as this process requires; its class and option bits.
pub fn check_hello_with(payload: &[u8]) -> Result<(ConnClass, u8), String> {
    check_with(payload, process_key(), now_ms())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Equality whose time depends on the lengths only, not on where the bytes first differ, so
/// timing does not reveal a secret (the router's bearer and admin tokens).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
fn proven_hello(class: ConnClass, key: &hmac::Key, at_ms: u64) -> Bytes {
    proven_hello_with(class, 0, key, at_ms)
}

fn proven_hello_with(class: ConnClass, options: u8, key: &hmac::Key, at_ms: u64) -> Bytes {
    let mut out = encode_hello_with(class, options).to_vec();
    out.extend_from_slice(&at_ms.to_le_bytes());
    let mut nonce = [0u8; 16];
    // The nonce only makes two proofs of one millisecond differ; a failed read leaves zeros.
    let _ = SystemRandom::new().fill(&mut nonce);
    out.extend_from_slice(&nonce);
    let tag = hmac::sign(key, &[CONTEXT, &out].concat());
    out.extend_from_slice(tag.as_ref());
    Bytes::from(out)
}

#[cfg(test)]
fn check(payload: &[u8], key: Option<&hmac::Key>, now_ms: u64) -> Result<ConnClass, String> {
    check_with(payload, key, now_ms).map(|(class, _)| class)
}

fn check_with(
    payload: &[u8],
    key: Option<&hmac::Key>,
    now_ms: u64,
) -> Result<(ConnClass, u8), String> {
    let Some(key) = key else {
        if payload.len() == PROVEN_LEN {
            return Err(format!(
                "HELLO carries an authentication proof, but this process has no {SECRET_ENV}: \
                 give every process of the deployment the same secret, or none"
            ));
        }
        return decode_hello_with(payload);
    };
    if payload.len() != PROVEN_LEN {
        return Err(format!(
            "unauthenticated HELLO refused: this process requires a {PROVEN_LEN}-byte HELLO \
             proving the deployment's internal secret ({SECRET_ENV}), got {} bytes",
            payload.len()
        ));
    }
    let (signed, tag) = payload.split_at(28);
    hmac::verify(key, &[CONTEXT, signed].concat(), tag).map_err(|_| {
        "HELLO refused: its proof does not match this deployment's internal secret".to_string()
    })?;
    let at_ms = u64::from_le_bytes(signed[4..12].try_into().expect("8 bytes"));
    let skew = Duration::from_millis(now_ms.abs_diff(at_ms));
    if skew > MAX_SKEW {
        return Err(format!(
            "HELLO refused: its clock is {:.1} s from this host's, more than {} s",
            skew.as_secs_f64(),
            MAX_SKEW.as_secs()
        ));
    }
    decode_hello_with(&signed[..4])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_is_eq() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"ab\0", b"ab"));
    }
    use crate::frame::encode_hello;

    fn key(s: &str) -> hmac::Key {
        hmac::Key::new(hmac::HMAC_SHA256, s.as_bytes())
    }

    #[test]
    fn a_proof_of_the_same_secret_is_accepted() {
        let k = key("shared");
        let now = 1_800_000_000_000;
        let hello = proven_hello(ConnClass::Control, &k, now);
        assert_eq!(hello.len(), PROVEN_LEN);
        assert_eq!(check(&hello, Some(&k), now + 500), Ok(ConnClass::Control));
        let data = proven_hello(ConnClass::Data, &k, now);
        assert_eq!(check(&data, Some(&k), now), Ok(ConnClass::Data));
    }

    #[test]
    fn unauthenticated_wrong_tampered_or_stale_hellos_are_refused() {
        let k = key("shared");
        let now = 1_800_000_000_000;
        let plain = encode_hello(ConnClass::Data);
        let e = check(&plain, Some(&k), now).unwrap_err();
        assert!(e.starts_with("unauthenticated HELLO refused"), "{e}");
        let other = proven_hello(ConnClass::Data, &key("guess"), now);
        let e = check(&other, Some(&k), now).unwrap_err();
        assert!(e.contains("does not match"), "{e}");
        let mut tampered = proven_hello(ConnClass::Data, &k, now).to_vec();
        tampered[0] = 1; // data -> control without the secret
        assert!(check(&tampered, Some(&k), now)
            .unwrap_err()
            .contains("does not match"));
        let old = proven_hello(ConnClass::Data, &k, now - 61_000);
        assert!(check(&old, Some(&k), now)
            .unwrap_err()
            .contains("more than 60 s"));
        // A process without the secret refuses a proof rather than ignoring it.
        let e = check(&proven_hello(ConnClass::Data, &k, now), None, now).unwrap_err();
        assert!(
            e.contains("this process has no CLEAVE_INTERNAL_SECRET"),
            "{e}"
        );
        // And without a secret on either side, HELLO is what it was.
        assert_eq!(check(&plain, None, now), Ok(ConnClass::Data));
    }

    #[test]
    fn two_proofs_of_one_millisecond_differ() {
        let k = key("shared");
        assert_ne!(
            proven_hello(ConnClass::Data, &k, 5),
            proven_hello(ConnClass::Data, &k, 5)
        );
    }
}
