//! The gRPC message codec: prost's, timed. tonic decodes a request before the handler runs
//! and encodes the reply after it returns, so the CPU spent there is added to process-wide
//! counters that the handler folds into `cleave_router_codec_cpu_seconds_total
//! {protocol="grpc"}` with its own conversion time (a reply's serialization is counted with
//! a later request: totals over a run are exact, one request lags). A request that is not
//! valid protobuf is INVALID_ARGUMENT (prost's own codec says INTERNAL).

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;

use crate::metrics::thread_cpu;

static DECODE_NS: AtomicU64 = AtomicU64::new(0);
static ENCODE_NS: AtomicU64 = AtomicU64::new(0);

/// CPU spent decoding gRPC messages since the last call.
pub fn take_decode_cpu() -> Duration {
    Duration::from_nanos(DECODE_NS.swap(0, Ordering::Relaxed))
}

/// CPU spent encoding gRPC messages since the last call.
pub fn take_encode_cpu() -> Duration {
    Duration::from_nanos(ENCODE_NS.swap(0, Ordering::Relaxed))
}

fn add(counter: &AtomicU64, start: Duration) {
    let spent = thread_cpu().saturating_sub(start);
    counter.fetch_add(spent.as_nanos() as u64, Ordering::Relaxed);
}

/// tonic's codec for the generated service (build.rs names it).
pub struct TimedCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for TimedCodec<T, U> {
    fn default() -> Self {
        TimedCodec(PhantomData)
    }
}

impl<T, U> Codec for TimedCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = TimedEncoder<T>;
    type Decoder = TimedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        TimedEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        TimedDecoder(PhantomData)
    }
}

pub struct TimedEncoder<T>(PhantomData<T>);

impl<T: Message> Encoder for TimedEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        let start = thread_cpu();
        // EncodeBuf grows as needed: encoding cannot run out of space.
        let done = item
            .encode(buf)
            .map_err(|e| Status::internal(format!("encoding the reply: {e}")));
        add(&ENCODE_NS, start);
        done
    }
}

pub struct TimedDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for TimedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        let start = thread_cpu();
        let item = U::decode(buf).map_err(|e| {
            Status::invalid_argument(format!(
                "the request is not a valid protobuf message of this call: {e}"
            ))
        });
        add(&DECODE_NS, start);
        item.map(Some)
    }
}
