//! Reading a request body under three bounds: its size (413), a minimum rate once a grace
//! period has passed (408: a client may not hold a request open by trickling its body), and
//! the time the request may spend reading (its budget; 504 at stage `parse`). And discarding
//! the body of a request the router refuses, so that its connection stays usable.

use std::future::poll_fn;
use std::pin::Pin;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes, HttpBody};

use crate::app::BodyLimits;
use crate::error::{ErrorKind, RequestError, Stage};

/// The largest unread body a refusal reads and drops to keep its connection open; a larger
/// one is answered at once and its connection closed (lingering: conn.rs). Closing does not
/// spare the reading, since the lingering close drains the same bytes, and the client then
/// pays a new connection (`cleave bench refusal`, docs/benchmarks.md): so the bound is
/// twice a 2,048-candidate DLRM request in JSON (1.07 MiB), and under what a lingering close
/// drains, so that a larger body still ends in an orderly close.
pub const DISCARD_BYTES: u64 = 2 << 20;
/// How long reading such a body may take before the refusal gives up on the connection.
pub const DISCARD_TIME: Duration = Duration::from_millis(100);

/// Reads the whole body. `declared` is its Content-Length, if given; `until` is when the
/// request's time to read runs out, with the budget it represents in ms (for the message).
pub async fn read_body(
    mut body: Body,
    declared: Option<u64>,
    limits: &BodyLimits,
    until: (Instant, f64),
    arrival: Instant,
) -> Result<Bytes, RequestError> {
    let too_large = || {
        RequestError::new(
            ErrorKind::TooLarge,
            format!(
                "request body is larger than the limit of {} bytes",
                limits.max_bytes
            ),
        )
    };
    if declared.is_some_and(|n| n > limits.max_bytes as u64) {
        return Err(too_large());
    }
    let start = Instant::now();
    let capacity = declared.map_or(0, |n| n as usize);
    let mut data: Vec<u8> = Vec::with_capacity(capacity);
    loop {
        let by_rate = limits.rate_deadline(start, data.len());
        let wait_until = by_rate.min(until.0);
        let next = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx));
        let frame = match tokio::time::timeout_at(wait_until.into(), next).await {
            Ok(frame) => frame,
            Err(_) if wait_until == until.0 => {
                let spent = arrival.elapsed().as_secs_f64() * 1e3;
                return Err(RequestError::deadline(Stage::Parse, until.1, spent));
            }
            Err(_) => return Err(too_slow(limits, data.len(), start.elapsed())),
        };
        match frame {
            None => break,
            Some(Ok(frame)) => {
                if let Ok(chunk) = frame.into_data() {
                    if data.len() + chunk.len() > limits.max_bytes {
                        return Err(too_large());
                    }
                    data.extend_from_slice(&chunk);
                }
            }
            Some(Err(e)) => {
                return Err(RequestError::new(
                    ErrorKind::InvalidJson,
                    format!(
                        "the request body could not be read after {} bytes: {e}",
                        data.len()
                    ),
                ))
            }
        }
    }
    Ok(Bytes::from(data))
}

/// Reads and drops the body of a request the router will not serve (refused, or failed before
/// its body was needed), so that the next request on the connection can be read. True when
/// it was read to its end within [`DISCARD_BYTES`] and [`DISCARD_TIME`].
pub async fn discard(mut body: Body, declared: Option<u64>) -> bool {
    if declared.is_some_and(|n| n > DISCARD_BYTES) {
        return false;
    }
    let read = async {
        let mut seen = 0;
        while let Some(frame) = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
            let Ok(frame) = frame else { return false };
            seen += frame.data_ref().map_or(0, |d| d.len() as u64);
            if seen > DISCARD_BYTES {
                return false;
            }
        }
        true
    };
    tokio::time::timeout(DISCARD_TIME, read)
        .await
        .unwrap_or(false)
}

fn too_slow(limits: &BodyLimits, received: usize, elapsed: Duration) -> RequestError {
    RequestError::new(
        ErrorKind::BodyTimeout,
        format!(
            "request body too slow: {received} bytes in {:.1} s, expected at least {} bytes/s \
             after the first {} ms",
            elapsed.as_secs_f64(),
            limits.min_bytes_per_s,
            limits.grace.as_millis()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> BodyLimits {
        BodyLimits {
            max_bytes: 10,
            min_bytes_per_s: 1000,
            grace: Duration::from_millis(500),
        }
    }

    #[test]
    fn rate_deadline_grows_with_what_arrived() {
        let t = Instant::now();
        assert_eq!(limits().rate_deadline(t, 0), t + Duration::from_millis(500));
        assert_eq!(
            limits().rate_deadline(t, 1500),
            t + Duration::from_millis(2000)
        );
    }

    fn far() -> (Instant, f64) {
        (Instant::now() + Duration::from_secs(60), 60_000.0)
    }

    #[tokio::test]
    async fn whole_bodies_and_limits() {
        let now = Instant::now();
        let got = read_body(Body::from("0123456789"), Some(10), &limits(), far(), now).await;
        assert_eq!(got.unwrap(), Bytes::from("0123456789"));
        let e = read_body(Body::from("x"), Some(11), &limits(), far(), now)
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::TooLarge);
        assert!(e.message.contains("limit of 10 bytes"), "{}", e.message);
        // Chunked (no length): caught while reading.
        let e = read_body(Body::from("0123456789a"), None, &limits(), far(), now)
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::TooLarge);
    }

    /// A body that never ends.
    struct Stalled;

    impl HttpBody for Stalled {
        type Data = Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
            std::task::Poll::Pending
        }
    }

    #[tokio::test]
    async fn small_whole_bodies_are_discarded_others_not() {
        let small = vec![b'x'; DISCARD_BYTES as usize];
        assert!(discard(Body::from(small.clone()), Some(DISCARD_BYTES)).await);
        assert!(discard(Body::from(small), None).await);
        assert!(discard(Body::empty(), Some(0)).await);
        // Declared too large: not read at all; chunked too large: given up while reading.
        assert!(!discard(Body::from("x"), Some(DISCARD_BYTES + 1)).await);
        let large = vec![b'x'; DISCARD_BYTES as usize + 1];
        assert!(!discard(Body::from(large), None).await);
        assert!(!discard(Body::new(Stalled), Some(5)).await);
    }

    #[tokio::test]
    async fn a_stalled_body_times_out_by_rate_or_budget() {
        let now = Instant::now();
        let body = Body::new(Stalled);
        let e = read_body(body, Some(5), &limits(), far(), now)
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::BodyTimeout);
        assert!(
            e.message.contains(
                "0 bytes in 0.5 s, expected at least 1000 bytes/s after the first 500 ms"
            ),
            "{}",
            e.message
        );
        let body = Body::new(Stalled);
        let soon = (Instant::now() + Duration::from_millis(50), 50.0);
        let e = read_body(body, Some(5), &limits(), soon, now)
            .await
            .unwrap_err();
        assert_eq!((e.kind, e.stage), (ErrorKind::Deadline, Some(Stage::Parse)));
    }
}
