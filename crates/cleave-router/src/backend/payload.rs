//! The ranker payloads (docs/protocol.md, "Ranker messages"): one request's tensors packed
//! into one contiguous buffer (Prism's FusedGraphOp), and the ranker's reply.
//!
//! ```text
//! tensor   := dtype:u8 ndim:u8 reserved:u16 reserved:u32 dims:u64[ndim] data pad(to 8)
//! request  := n_tensors:u32 max_batch:u32 tensor[n_tensors]
//! response := queue_us:u32 compute_us:u32 batch_requests:u32 queue_depth:u32
//!             n_tensors:u32 reserved:u32 tensor[n_tensors]
//! ```
//! All integers little-endian. Decoding checks every length against the buffer, so a
//! truncated or hostile payload is an error, never a panic or a huge allocation. The request's
//! deadline and trace id travel in the frame header (protocol version 2), not here.

use std::fmt;

use crate::tensor::{numel, DType, Tensor};

/// Frame kinds of the ranker messages (application kinds 0x0110..0x011f are the rankers').
pub const RANK: u16 = 0x0110;
pub const RANK_FULL: u16 = 0x0111;

/// Dims a tensor header may declare; more is a corrupt payload.
const MAX_NDIM: usize = 16;

/// A decoded ranker reply: timings and the model's flat outputs for this request.
#[derive(Clone, Debug, PartialEq)]
pub struct RankResponse {
    pub queue_us: u32,
    pub compute_us: u32,
    pub batch_requests: u32,
    pub queue_depth: u32,
    pub outputs: Vec<Tensor>,
}

/// A decoded RANK / RANK_FULL request (the ranker's side; the router uses it in tests).
#[derive(Clone, Debug, PartialEq)]
pub struct RankRequest {
    pub tensors: Vec<Tensor>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadError(pub String);

impl fmt::Display for PayloadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed ranker payload: {}", self.0)
    }
}

impl std::error::Error for PayloadError {}

fn tensor_len(t: &Tensor) -> usize {
    8 + 8 * t.dims.len() + t.data.len().next_multiple_of(8)
}

fn put_tensor(out: &mut Vec<u8>, t: &Tensor) {
    out.push(t.dtype.wire_code());
    out.push(t.dims.len() as u8);
    out.extend_from_slice(&[0u8; 6]);
    for &d in &t.dims {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    out.extend_from_slice(&t.data);
    out.resize(out.len().next_multiple_of(8), 0);
}

/// Packs one request's tensors, in one allocation.
pub fn encode_request<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Vec<u8> {
    encode_request_capped(tensors, 0)
}

/// A request that also tells the ranker the largest batch (rows) it may run now, what the
/// memory budget leaves beside the router's cache (docs/cache.md); 0: no cap beyond its own.
pub fn encode_request_capped<'a>(
    tensors: impl IntoIterator<Item = &'a Tensor>,
    max_batch: u32,
) -> Vec<u8> {
    let request = RankPayload::new(tensors, max_batch);
    let mut out = vec![0u8; request.len];
    request.write(&mut out);
    out
}

/// A RANK / RANK_FULL request not packed yet: the wire client writes it where the connection
/// wants it (`cleave_wire::Payload`), on `shm:` straight into a shared-memory slot, so the
/// fused payload is written once (docs/protocol.md, "Shared-memory transport").
pub struct RankPayload<'a> {
    tensors: Vec<&'a Tensor>,
    max_batch: u32,
    len: usize,
}

impl<'a> RankPayload<'a> {
    pub fn new(tensors: impl IntoIterator<Item = &'a Tensor>, max_batch: u32) -> RankPayload<'a> {
        let tensors: Vec<&Tensor> = tensors.into_iter().collect();
        let len = 8 + tensors.iter().map(|t| tensor_len(t)).sum::<usize>();
        RankPayload {
            tensors,
            max_batch,
            len,
        }
    }

    /// Writes every byte of the request into `out` (exactly `len` bytes, which may hold old
    /// bytes: padding and reserved fields are written as zeros).
    fn write(&self, out: &mut [u8]) {
        assert_eq!(out.len(), self.len, "a ranker request's buffer");
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            out[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        put(&(self.tensors.len() as u32).to_le_bytes());
        put(&self.max_batch.to_le_bytes());
        for t in &self.tensors {
            put(&[t.dtype.wire_code(), t.dims.len() as u8, 0, 0, 0, 0, 0, 0]);
            for &d in &t.dims {
                put(&(d as u64).to_le_bytes());
            }
            put(&t.data);
            put(&[0u8; 8][..t.data.len().next_multiple_of(8) - t.data.len()]);
        }
        debug_assert_eq!(at, self.len);
    }
}

impl cleave_wire::Payload for RankPayload<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn write_to(&self, out: &mut [u8]) {
        self.write(out)
    }
}

/// The ranker's side of the exchange; used by the router's tests and fake rankers.
pub fn encode_response(r: &RankResponse) -> Vec<u8> {
    let mut out = Vec::with_capacity(24 + r.outputs.iter().map(tensor_len).sum::<usize>());
    for v in [
        r.queue_us,
        r.compute_us,
        r.batch_requests,
        r.queue_depth,
        r.outputs.len() as u32,
        0,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    for t in &r.outputs {
        put_tensor(&mut out, t);
    }
    out
}

/// A bounds-checked reader over a payload.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], PayloadError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            return Err(PayloadError(format!(
                "{what} needs {n} bytes at offset {}, only {} left",
                self.pos,
                self.buf.len() - self.pos
            )));
        };
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u32(&mut self, what: &str) -> Result<u32, PayloadError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, PayloadError> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn tensor(&mut self, index: usize) -> Result<Tensor, PayloadError> {
        let header = self.take(8, "tensor header")?;
        let dtype = DType::from_wire_code(header[0]).ok_or_else(|| {
            PayloadError(format!("tensor {index}: unknown dtype code {}", header[0]))
        })?;
        let ndim = header[1] as usize;
        if ndim > MAX_NDIM {
            return Err(PayloadError(format!(
                "tensor {index}: {ndim} dims, at most {MAX_NDIM} expected"
            )));
        }
        let mut dims = Vec::with_capacity(ndim);
        for _ in 0..ndim {
            let d = self.u64("tensor dims")?;
            dims.push(usize::try_from(d).map_err(|_| {
                PayloadError(format!("tensor {index}: dim {d} does not fit in memory"))
            })?);
        }
        let bytes = numel(&dims)
            .and_then(|n| n.checked_mul(dtype.itemsize()))
            .ok_or_else(|| PayloadError(format!("tensor {index}: dims {dims:?} overflow")))?;
        let data = self.take(bytes, "tensor data")?.to_vec();
        self.take(bytes.next_multiple_of(8) - bytes, "tensor padding")?;
        Ok(Tensor { dtype, dims, data })
    }

    fn tensors(&mut self, count: u32) -> Result<Vec<Tensor>, PayloadError> {
        // Each tensor takes at least 8 bytes: bound the allocation by what is there.
        let mut out = Vec::with_capacity((count as usize).min(self.buf.len() / 8));
        for i in 0..count as usize {
            out.push(self.tensor(i)?);
        }
        if self.pos != self.buf.len() {
            return Err(PayloadError(format!(
                "{} trailing bytes after {count} tensors",
                self.buf.len() - self.pos
            )));
        }
        Ok(out)
    }
}

pub fn decode_response(buf: &[u8]) -> Result<RankResponse, PayloadError> {
    let mut r = Reader { buf, pos: 0 };
    let queue_us = r.u32("queue_us")?;
    let compute_us = r.u32("compute_us")?;
    let batch_requests = r.u32("batch_requests")?;
    let queue_depth = r.u32("queue_depth")?;
    let count = r.u32("n_tensors")?;
    r.u32("reserved")?;
    let outputs = r.tensors(count)?;
    Ok(RankResponse {
        queue_us,
        compute_us,
        batch_requests,
        queue_depth,
        outputs,
    })
}

pub fn decode_request(buf: &[u8]) -> Result<RankRequest, PayloadError> {
    let mut r = Reader { buf, pos: 0 };
    let count = r.u32("n_tensors")?;
    r.u32("reserved")?;
    let tensors = r.tensors(count)?;
    Ok(RankRequest { tensors })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Tensor> {
        vec![
            Tensor::from_f32(vec![2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, -6.5]),
            Tensor::from_i64(vec![5], &[0, 1, 2, 3, i64::MAX]),
            Tensor::new(DType::U8, vec![3], vec![1, 2, 3]).unwrap(), // needs padding
            Tensor::new(DType::Bool, vec![0, 4], vec![]).unwrap(),
            Tensor::new(DType::F16, vec![], vec![0, 0x3c]).unwrap(), // a 0-d tensor
        ]
    }

    #[test]
    fn request_round_trip() {
        let tensors = sample();
        let buf = encode_request(&tensors);
        assert_eq!(buf.len() % 8, 0);
        let back = decode_request(&buf).unwrap();
        assert_eq!(back.tensors, tensors);
    }

    #[test]
    fn request_layout_is_the_documented_one() {
        let t = Tensor::new(DType::I32, vec![1], 7i32.to_le_bytes().to_vec()).unwrap();
        let buf = encode_request([&t]);
        let mut want = Vec::new();
        want.extend_from_slice(&1u32.to_le_bytes());
        want.extend_from_slice(&0u32.to_le_bytes());
        want.extend_from_slice(&[3, 1, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(&1u64.to_le_bytes());
        want.extend_from_slice(&[7, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(buf, want);
    }

    #[test]
    fn a_request_written_over_old_bytes_is_the_packed_one() {
        // A shared-memory slot holds its last payload: every byte, padding and reserved
        // fields included, must be written.
        use cleave_wire::Payload;
        let tensors = sample();
        let request = RankPayload::new(&tensors, 7);
        let mut slot = vec![0xA5u8; request.len()];
        request.write_to(&mut slot);
        assert_eq!(slot, encode_request_capped(&tensors, 7));
        assert_eq!(decode_request(&slot).unwrap().tensors, tensors);
    }

    #[test]
    fn response_round_trip() {
        let r = RankResponse {
            queue_us: 10,
            compute_us: 250,
            batch_requests: 3,
            queue_depth: 1,
            outputs: sample(),
        };
        assert_eq!(decode_response(&encode_response(&r)).unwrap(), r);
    }

    #[test]
    fn every_truncation_is_an_error() {
        let buf = encode_response(&RankResponse {
            queue_us: 1,
            compute_us: 2,
            batch_requests: 1,
            queue_depth: 0,
            outputs: sample(),
        });
        for cut in 0..buf.len() {
            assert!(decode_response(&buf[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = buf.clone();
        long.extend_from_slice(&[0; 8]);
        assert!(decode_response(&long).unwrap_err().0.contains("trailing"));
    }

    #[test]
    fn hostile_headers_are_errors() {
        let mut buf = Vec::new();
        buf.extend_from_slice(&u32::MAX.to_le_bytes()); // claims 4 billion tensors
        buf.extend_from_slice(&0u32.to_le_bytes());
        assert!(decode_request(&buf).is_err());

        let mut bad_dtype = encode_request(&[Tensor::from_f32(vec![1], &[1.0])]);
        bad_dtype[8] = 99;
        assert!(decode_request(&bad_dtype)
            .unwrap_err()
            .0
            .contains("dtype code 99"));

        let mut huge = encode_request(&[Tensor::from_f32(vec![1, 1], &[1.0])]);
        huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        huge[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode_request(&huge).is_err());

        let mut many_dims = encode_request(&[Tensor::from_f32(vec![1], &[1.0])]);
        many_dims[9] = 200;
        assert!(decode_request(&many_dims)
            .unwrap_err()
            .0
            .contains("200 dims"));
    }
}
