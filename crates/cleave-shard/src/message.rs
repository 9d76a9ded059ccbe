//! The LOOKUP messages a shard answers (frame kind [`LOOKUP`]): layouts in docs/protocol.md.
//!
//! Request payload: `u32 count, u32 flags`, with flag bit 0 a `u64 as_of` (the request's
//! arrival, Unix µs: which table version it reads while an update switches), then `count`
//! lookups, each starting 8-byte aligned:
//!
//! ```text
//! u8 op (0 sum, 1 mean, 2 max, 3 gather) | u8 id dtype (0 int64, 1 int32) | u8 flags
//! (bit 0: f32 weights follow) | u8 0 | u16 table name bytes | u16 0 | u32 bags (0 for a
//! gather) | u32 ids
//! table name (UTF-8), pad to 8 | offsets: bags+1 × u32 (pooled only), pad to 8
//! ids: ids × i64 or i32, pad to 8 | weights: ids × f32, pad to 8
//! ```
//!
//! Response payload: `u32 count, u32 0`, then one result per lookup, each 8-byte aligned:
//!
//! ```text
//! u32 rows (bags, or ids for a gather) | u32 dim | u8 has_counts | 7 × u8 0
//! counts: rows × u32 (if has_counts), pad to 8 | values: rows × dim × f32, pad to 8
//! ```
//!
//! All integers and floats little-endian.

use std::fmt;

use bytes::Bytes;
use cleave_embed::Pooling;

// Results are written into the response as native f32/u32; the wire is little-endian.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "the shard protocol assumes little-endian"
);

/// Frame kind of a lookup request and its response.
pub const LOOKUP: u16 = 0x0100;
/// Frame kind of a model update step (stage, switch, abort; docs/tiers.md, "Updates"): a u32
/// header length, a JSON header, then the chunk's bytes. The reply is JSON.
pub const UPDATE: u16 = 0x0101;

const LOOKUP_HEADER: usize = 16;
const RESULT_HEADER: usize = 16;

/// What a lookup does with the rows of its ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Pool each bag (sum, mean or max).
    Pool(Pooling),
    /// Return each id's row (no bags).
    Gather,
}

impl Op {
    fn code(self) -> u8 {
        match self {
            Op::Pool(Pooling::Sum) => 0,
            Op::Pool(Pooling::Mean) => 1,
            Op::Pool(Pooling::Max) => 2,
            Op::Gather => 3,
        }
    }

    fn from_code(c: u8) -> Option<Op> {
        Some(match c {
            0 => Op::Pool(Pooling::Sum),
            1 => Op::Pool(Pooling::Mean),
            2 => Op::Pool(Pooling::Max),
            3 => Op::Gather,
            _ => return None,
        })
    }

    /// "sum", "mean", "max" or "none" (a gather), as in the bundle manifest.
    pub fn name(self) -> &'static str {
        match self {
            Op::Pool(p) => p.as_str(),
            Op::Gather => "none",
        }
    }

    pub fn parse(s: &str) -> Result<Op, String> {
        match s {
            "none" | "gather" => Ok(Op::Gather),
            other => other
                .parse::<Pooling>()
                .map(Op::Pool)
                .map_err(|_| format!("pooling must be sum, mean, max or none, got {other:?}")),
        }
    }
}

/// One lookup into one table: owned form (what a client builds and a shard decodes).
#[derive(Clone, Debug, PartialEq)]
pub struct Lookup {
    pub table: String,
    pub op: Op,
    /// Global row ids.
    pub ids: Vec<i64>,
    /// bags + 1 entries (`offsets[0] == 0`, last `== ids.len()`); empty for a gather.
    pub offsets: Vec<u32>,
    /// Per-sample weights (sum pooling only), one per id.
    pub weights: Option<Vec<f32>>,
}

impl Lookup {
    pub fn view(&self) -> LookupView<'_> {
        LookupView {
            table: &self.table,
            op: self.op,
            ids: &self.ids,
            offsets: &self.offsets,
            weights: self.weights.as_deref(),
        }
    }

    /// Number of output rows: bags, or ids for a gather.
    pub fn rows(&self) -> usize {
        self.view().rows()
    }
}

/// A lookup borrowing its arrays (encoding without copying them first).
#[derive(Clone, Copy, Debug)]
pub struct LookupView<'a> {
    pub table: &'a str,
    pub op: Op,
    pub ids: &'a [i64],
    pub offsets: &'a [u32],
    pub weights: Option<&'a [f32]>,
}

impl LookupView<'_> {
    pub fn rows(&self) -> usize {
        match self.op {
            Op::Gather => self.ids.len(),
            Op::Pool(_) => self.offsets.len().saturating_sub(1),
        }
    }

    fn encoded_len(&self) -> usize {
        let offsets = if self.op == Op::Gather {
            0
        } else {
            self.offsets.len() * 4
        };
        let weights = self.weights.map_or(0, |w| w.len() * 4);
        LOOKUP_HEADER + pad8(self.table.len()) + pad8(offsets) + self.ids.len() * 8 + pad8(weights)
    }

    /// Checks the shape rules of a lookup (offsets, weights) before it is sent or served.
    pub fn check(&self) -> Result<(), String> {
        if self.table.len() > u16::MAX as usize {
            return Err(format!(
                "table name of {} bytes, at most 65535",
                self.table.len()
            ));
        }
        if self.ids.len() > u32::MAX as usize {
            return Err(format!("{} ids, at most {}", self.ids.len(), u32::MAX));
        }
        if let Some(w) = self.weights {
            if self.op != Op::Pool(Pooling::Sum) {
                return Err(format!("weights need sum pooling, got {}", self.op.name()));
            }
            if w.len() != self.ids.len() {
                return Err(format!(
                    "{} weights for {} ids; expected one per id",
                    w.len(),
                    self.ids.len()
                ));
            }
        }
        match self.op {
            Op::Gather if !self.offsets.is_empty() => Err(format!(
                "a gather takes no offsets, got {}",
                self.offsets.len()
            )),
            Op::Gather => Ok(()),
            Op::Pool(_) => check_offsets(self.offsets, self.ids.len()),
        }
    }
}

/// `offsets` must be bags + 1 entries from 0 to `ids`, non-decreasing.
pub fn check_offsets(offsets: &[u32], ids: usize) -> Result<(), String> {
    let Some((&first, &last)) = offsets.first().zip(offsets.last()) else {
        return Err("offsets are empty; expected bags + 1 entries starting at 0".to_owned());
    };
    if first != 0 {
        return Err(format!("offsets[0] is {first}, expected 0"));
    }
    if last as usize != ids {
        return Err(format!(
            "last offset is {last}, expected the number of ids {ids} (offsets have bags + 1 entries)"
        ));
    }
    if let Some(b) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(format!(
            "offsets decrease at bag {b}: offsets[{b}] = {} > offsets[{}] = {}",
            offsets[b],
            b + 1,
            offsets[b + 1]
        ));
    }
    Ok(())
}

/// Why a payload is not a valid message; `Display` says where and what was expected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageError(pub String);

impl fmt::Display for MessageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for MessageError {}

fn pad8(n: usize) -> usize {
    n.div_ceil(8) * 8
}

/// Request header flag: a u64 `as_of` (Unix µs) follows the header.
const AS_OF: u32 = 1;

/// Encodes a lookup request (ids always as int64) without an `as_of`: the shard reads the
/// version its own clock says.
pub fn encode_request<'a>(lookups: impl IntoIterator<Item = LookupView<'a>> + Clone) -> Bytes {
    encode_request_as_of(lookups, None)
}

/// Encodes a lookup request read as of `as_of_unix_us` (the request's arrival): every shard
/// that gets one of its parts picks the same version of a table whose update is switching
/// (docs/tiers.md, "One version per request").
pub fn encode_request_as_of<'a>(
    lookups: impl IntoIterator<Item = LookupView<'a>> + Clone,
    as_of_unix_us: Option<u64>,
) -> Bytes {
    let header = if as_of_unix_us.is_some() { 16 } else { 8 };
    let len = header
        + lookups
            .clone()
            .into_iter()
            .map(|l| l.encoded_len())
            .sum::<usize>();
    let mut out = Vec::with_capacity(len);
    let count = lookups.clone().into_iter().count();
    out.extend_from_slice(&(count as u32).to_le_bytes());
    let flags = if as_of_unix_us.is_some() { AS_OF } else { 0 };
    out.extend_from_slice(&flags.to_le_bytes());
    if let Some(at) = as_of_unix_us {
        out.extend_from_slice(&at.to_le_bytes());
    }
    for l in lookups {
        let bags = if l.op == Op::Gather {
            0
        } else {
            l.rows() as u32
        };
        out.push(l.op.code());
        out.push(0); // int64 ids
        out.push(l.weights.is_some() as u8);
        out.push(0);
        out.extend_from_slice(&(l.table.len() as u16).to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&bags.to_le_bytes());
        out.extend_from_slice(&(l.ids.len() as u32).to_le_bytes());
        out.extend_from_slice(l.table.as_bytes());
        pad_to_8(&mut out);
        if l.op != Op::Gather {
            l.offsets
                .iter()
                .for_each(|o| out.extend_from_slice(&o.to_le_bytes()));
            pad_to_8(&mut out);
        }
        l.ids
            .iter()
            .for_each(|i| out.extend_from_slice(&i.to_le_bytes()));
        if let Some(w) = l.weights {
            w.iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
            pad_to_8(&mut out);
        }
    }
    debug_assert_eq!(out.len(), len);
    Bytes::from(out)
}

fn pad_to_8(out: &mut Vec<u8>) {
    out.resize(pad8(out.len()), 0);
}

/// Reads a payload front to back, with errors that say which lookup and field was short.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], MessageError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                MessageError(format!(
                    "payload truncated: {} needs {n} bytes at offset {}, only {} remain",
                    what(),
                    self.pos,
                    self.buf.len() - self.pos
                ))
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    /// Takes `n` bytes and the padding after them.
    fn take_padded(
        &mut self,
        n: usize,
        what: &dyn Fn() -> String,
    ) -> Result<&'a [u8], MessageError> {
        let s = self.take(n, what)?;
        self.take(pad8(n) - n, what)?;
        Ok(s)
    }
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"))
}

/// Decodes a lookup request. Checks layout, op, dtype and the offsets/weights rules; table
/// names and id ranges are the shard's to check.
pub fn decode_request(payload: &[u8]) -> Result<Vec<Lookup>, MessageError> {
    decode_request_as_of(payload).map(|(lookups, _)| lookups)
}

/// [`decode_request`] and the request's `as_of` (Unix µs), if it carries one.
pub fn decode_request_as_of(payload: &[u8]) -> Result<(Vec<Lookup>, Option<u64>), MessageError> {
    let mut c = Cursor {
        buf: payload,
        pos: 0,
    };
    let head = c.take(8, &|| "the request header (count, flags)".to_owned())?;
    let count = u32_at(head, 0) as usize;
    let flags = u32_at(head, 4);
    if flags & !AS_OF != 0 {
        return Err(MessageError(format!(
            "request header flags {flags:#x}: only bit 0 (a u64 as_of follows) is defined"
        )));
    }
    let as_of = if flags & AS_OF != 0 {
        let at = c.take(8, &|| {
            "the request's as_of (u64 after the header)".to_owned()
        })?;
        Some(u64::from_le_bytes(at.try_into().expect("8 bytes")))
    } else {
        None
    };
    // Each lookup takes at least its header, so a huge count in a short payload fails early.
    let room = (payload.len() - c.pos) / LOOKUP_HEADER;
    if count > room {
        return Err(MessageError(format!(
            "request announces {count} lookups but its {} bytes hold at most {room}",
            payload.len()
        )));
    }
    let mut lookups = Vec::with_capacity(count);
    for i in 0..count {
        let h = c.take(LOOKUP_HEADER, &|| format!("lookup {i}'s header"))?;
        let op = Op::from_code(h[0]).ok_or_else(|| {
            MessageError(format!(
                "lookup {i}: op {} unknown; expected 0 (sum), 1 (mean), 2 (max) or 3 (gather)",
                h[0]
            ))
        })?;
        let id_bytes = match h[1] {
            0 => 8,
            1 => 4,
            d => {
                return Err(MessageError(format!(
                    "lookup {i}: id dtype {d} unknown; expected 0 (int64) or 1 (int32)"
                )))
            }
        };
        let flags = h[2];
        if flags & !1 != 0 || h[3] != 0 || u16_at(h, 6) != 0 {
            return Err(MessageError(format!(
                "lookup {i}: flags {flags:#04x} and reserved bytes: expected only bit 0 (weights) \
                 and zeros"
            )));
        }
        let name_len = u16_at(h, 4) as usize;
        let bags = u32_at(h, 8) as usize;
        let n_ids = u32_at(h, 12) as usize;
        let name = c.take_padded(name_len, &|| format!("lookup {i}'s table name"))?;
        let table = std::str::from_utf8(name)
            .map_err(|_| MessageError(format!("lookup {i}: table name is not UTF-8")))?
            .to_owned();
        let offsets = if op == Op::Gather {
            if bags != 0 {
                return Err(MessageError(format!(
                    "lookup {i} (table {table:?}): a gather has 0 bags, got {bags}"
                )));
            }
            Vec::new()
        } else {
            let what = || format!("lookup {i} (table {table:?})'s {} offsets", bags + 1);
            let n = bags.checked_add(1).and_then(|b| b.checked_mul(4));
            let raw = c.take_padded(n.unwrap_or(usize::MAX), &what)?;
            raw.chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().expect("4")))
                .collect()
        };
        let what = || format!("lookup {i} (table {table:?})'s {n_ids} ids");
        let raw = c.take_padded(n_ids.saturating_mul(id_bytes), &what)?;
        let ids: Vec<i64> = if id_bytes == 8 {
            raw.chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8")))
                .collect()
        } else {
            raw.chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().expect("4")) as i64)
                .collect()
        };
        let weights = if flags & 1 != 0 {
            let what = || format!("lookup {i} (table {table:?})'s {n_ids} weights");
            let raw = c.take_padded(n_ids * 4, &what)?;
            Some(
                raw.chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().expect("4")))
                    .collect(),
            )
        } else {
            None
        };
        let lookup = Lookup {
            table,
            op,
            ids,
            offsets,
            weights,
        };
        lookup
            .view()
            .check()
            .map_err(|e| MessageError(format!("lookup {i} (table {:?}): {e}", lookup.table)))?;
        lookups.push(lookup);
    }
    if c.pos != payload.len() {
        return Err(MessageError(format!(
            "{} bytes after the last of {count} lookups; expected none",
            payload.len() - c.pos
        )));
    }
    Ok((lookups, as_of))
}

/// The result of one lookup. For a pooled lookup `rows` is bags and `counts` has one entry per
/// bag (the number of ids pooled, which a merge needs); for a gather `rows` is ids and `counts`
/// is empty.
#[derive(Clone, Debug, PartialEq)]
pub struct Pooled {
    pub rows: usize,
    pub dim: usize,
    /// rows × dim, row-major.
    pub values: Vec<f32>,
    pub counts: Vec<u32>,
}

/// Lays out a response so results can be computed in place: the shard asks for the shape of
/// every result, then fills the returned slices.
pub struct ResponseBuilder {
    /// u64 storage keeps every section 8-byte aligned for in-place f32/u32 writes.
    words: Vec<u64>,
    len: usize,
    /// Per result: counts byte offset, count entries, values byte offset, value entries.
    sections: Vec<(usize, usize, usize, usize)>,
}

impl ResponseBuilder {
    /// `shapes`: per result (rows, dim, has_counts). Fails if the response would exceed
    /// `max_bytes`.
    pub fn new(
        shapes: &[(usize, usize, bool)],
        max_bytes: usize,
    ) -> Result<ResponseBuilder, MessageError> {
        let mut len = 8usize;
        let mut sections = Vec::with_capacity(shapes.len());
        for &(rows, dim, has_counts) in shapes {
            let values = rows.checked_mul(dim).filter(|v| v.checked_mul(4).is_some());
            let Some(values) = values else {
                return Err(MessageError(format!(
                    "a result of {rows} x {dim} floats is too large"
                )));
            };
            let counts_at = len + RESULT_HEADER;
            let values_at = counts_at + if has_counts { pad8(rows * 4) } else { 0 };
            len = values_at.saturating_add(pad8(values * 4));
            sections.push((
                counts_at,
                if has_counts { rows } else { 0 },
                values_at,
                values,
            ));
            if len > max_bytes {
                return Err(MessageError(format!(
                    "the response would exceed {max_bytes} bytes (the frame limit); split the request"
                )));
            }
        }
        let mut b = ResponseBuilder {
            words: vec![0u64; len / 8],
            len,
            sections,
        };
        let bytes = b.bytes_mut();
        bytes[0..4].copy_from_slice(&(shapes.len() as u32).to_le_bytes());
        for (&(rows, dim, has_counts), &(counts_at, ..)) in shapes.iter().zip(&b.sections.clone()) {
            let h = counts_at - RESULT_HEADER;
            let bytes = b.bytes_mut();
            bytes[h..h + 4].copy_from_slice(&(rows as u32).to_le_bytes());
            bytes[h + 4..h + 8].copy_from_slice(&(dim as u32).to_le_bytes());
            bytes[h + 8] = has_counts as u8;
        }
        Ok(b)
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        // SAFETY: u64 storage viewed as bytes: same memory, every bit pattern valid for u8.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), len) }
    }

    /// Mutable (values, counts) of every result, disjoint, in order.
    pub fn slices(&mut self) -> Vec<(&mut [f32], &mut [u32])> {
        let sections = self.sections.clone();
        let mut rest: &mut [u8] = self.bytes_mut();
        let mut consumed = 0usize;
        let mut out = Vec::with_capacity(sections.len());
        for (counts_at, rows, values_at, values) in sections {
            let (_, tail) = rest.split_at_mut(counts_at - consumed);
            let (counts, tail) = tail.split_at_mut(values_at - counts_at);
            let (vals, tail) = tail.split_at_mut(values * 4);
            consumed = values_at + values * 4;
            rest = tail;
            out.push((
                cast_mut::<f32>(vals),
                cast_mut::<u32>(&mut counts[..rows * 4]),
            ));
        }
        out
    }

    /// The finished payload, without copying.
    pub fn finish(self) -> Bytes {
        Bytes::from_owner(Words {
            words: self.words,
            len: self.len,
        })
    }
}

/// Views 8-byte-aligned bytes as `T` (f32 or u32: every bit pattern valid). Trailing bytes
/// (padding) are left out.
fn cast_mut<T: Copy>(bytes: &mut [u8]) -> &mut [T] {
    let n = bytes.len() / std::mem::size_of::<T>();
    assert_eq!(
        bytes.as_ptr() as usize % std::mem::align_of::<T>(),
        0,
        "unaligned section"
    );
    // SAFETY: aligned (checked), within `bytes`, and T is a plain number type.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<T>(), n) }
}

struct Words {
    words: Vec<u64>,
    len: usize,
}

impl AsRef<[u8]> for Words {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: u64 storage viewed as its first `len` bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }
}

/// Decodes a response. `expected` is the number of results the request asked for.
pub fn decode_response(payload: &[u8], expected: usize) -> Result<Vec<Pooled>, MessageError> {
    let mut c = Cursor {
        buf: payload,
        pos: 0,
    };
    let head = c.take(8, &|| "the response header".to_owned())?;
    let count = u32_at(head, 0) as usize;
    if count != expected {
        return Err(MessageError(format!(
            "response has {count} results, expected {expected}"
        )));
    }
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let h = c.take(RESULT_HEADER, &|| format!("result {i}'s header"))?;
        let rows = u32_at(h, 0) as usize;
        let dim = u32_at(h, 4) as usize;
        let has_counts = h[8] != 0;
        let counts = if has_counts {
            let raw = c.take_padded(rows * 4, &|| format!("result {i}'s {rows} counts"))?;
            raw.chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().expect("4")))
                .collect()
        } else {
            Vec::new()
        };
        let n = rows
            .checked_mul(dim)
            .and_then(|n| n.checked_mul(4))
            .unwrap_or(usize::MAX);
        let raw = c.take_padded(n, &|| format!("result {i}'s {rows} x {dim} values"))?;
        let values = raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4")))
            .collect();
        out.push(Pooled {
            rows,
            dim,
            values,
            counts,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Lookup> {
        vec![
            Lookup {
                table: "t0".into(),
                op: Op::Pool(Pooling::Sum),
                ids: vec![1, 2, 3],
                offsets: vec![0, 2, 3],
                weights: Some(vec![0.5, 1.0, 2.0]),
            },
            Lookup {
                table: "a_longer_name".into(),
                op: Op::Gather,
                ids: vec![9, -1],
                offsets: vec![],
                weights: None,
            },
            Lookup {
                table: "t".into(),
                op: Op::Pool(Pooling::Max),
                ids: vec![],
                offsets: vec![0, 0],
                weights: None,
            },
        ]
    }

    #[test]
    fn requests_round_trip_with_aligned_sections() {
        let lookups = sample();
        let bytes = encode_request(lookups.iter().map(Lookup::view));
        assert_eq!(bytes.len() % 8, 0);
        assert_eq!(decode_request(&bytes).unwrap(), lookups);
        assert_eq!(
            decode_request(&encode_request(std::iter::empty())).unwrap(),
            vec![]
        );
    }

    #[test]
    fn int32_ids_are_widened() {
        let mut b = encode_request([Lookup {
            table: "t".into(),
            op: Op::Gather,
            ids: vec![],
            offsets: vec![],
            weights: None,
        }
        .view()])
        .to_vec();
        b[8 + 1] = 1; // id dtype int32
        b[8 + 12..8 + 16].copy_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&7i32.to_le_bytes());
        b.extend_from_slice(&(-3i32).to_le_bytes());
        assert_eq!(decode_request(&b).unwrap()[0].ids, vec![7, -3]);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = encode_request(sample().iter().map(Lookup::view));
        for cut in 0..bytes.len() {
            let err = decode_request(&bytes[..cut]).unwrap_err();
            assert!(
                err.0.contains("truncated") || err.0.contains("announces"),
                "cut {cut}: {err}"
            );
        }
        let mut longer = bytes.to_vec();
        longer.extend_from_slice(&[0; 8]);
        assert!(decode_request(&longer)
            .unwrap_err()
            .0
            .contains("8 bytes after the last"));
    }

    #[test]
    fn as_of_round_trips_and_its_absence_decodes_as_none() {
        let views = || sample().into_iter().collect::<Vec<_>>();
        let lookups = views();
        let with = encode_request_as_of(
            lookups.iter().map(Lookup::view),
            Some(1_700_000_000_123_456),
        );
        let (back, as_of) = decode_request_as_of(&with).unwrap();
        assert_eq!(
            (back, as_of),
            (lookups.clone(), Some(1_700_000_000_123_456))
        );
        let without = encode_request(lookups.iter().map(Lookup::view));
        assert_eq!(with.len(), without.len() + 8);
        assert_eq!(decode_request_as_of(&without).unwrap().1, None);
        let err = decode_request(&with[..12]).unwrap_err().0;
        assert!(err.contains("the request's as_of"), "{err}");
    }

    #[test]
    fn bad_fields_are_named() {
        let bytes = encode_request(sample().iter().map(Lookup::view)).to_vec();
        let cases: [(usize, u8, &str); 4] = [
            (8, 9, "op 9 unknown"),
            (9, 5, "id dtype 5 unknown"),
            (10, 4, "flags 0x04"),
            (4, 2, "request header flags 0x2: only bit 0"),
        ];
        for (at, value, expect) in cases {
            let mut b = bytes.clone();
            b[at] = value;
            let err = decode_request(&b).unwrap_err().0;
            assert!(err.contains(expect), "{err}");
        }
        // Offsets that decrease.
        let bad = Lookup {
            offsets: vec![0, 3, 2, 3],
            ..sample()[0].clone()
        };
        let b = encode_request([LookupView {
            weights: None,
            ..bad.view()
        }]);
        let err = decode_request(&b).unwrap_err().0;
        assert!(err.contains("offsets decrease at bag 1"), "{err}");
    }

    proptest::proptest! {
        #[test]
        fn random_or_mutated_payloads_never_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
            flips in proptest::collection::vec((0usize..4096, 1u8..=255), 0..6),
        ) {
            let _ = decode_request(&bytes);
            let _ = decode_response(&bytes, 1);
            let mut valid = encode_request(sample().iter().map(Lookup::view)).to_vec();
            for (at, x) in flips {
                let i = at % valid.len();
                valid[i] ^= x;
            }
            // Whatever decodes must satisfy the lookup rules.
            if let Ok(lookups) = decode_request(&valid) {
                for l in &lookups {
                    proptest::prop_assert!(l.view().check().is_ok());
                }
            }
        }
    }

    #[test]
    fn responses_are_built_in_place_and_decoded() {
        let shapes = [(2, 3, true), (1, 4, false), (0, 5, true)];
        let mut b = ResponseBuilder::new(&shapes, 1 << 20).unwrap();
        for (k, (vals, counts)) in b.slices().into_iter().enumerate() {
            vals.iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = (k * 100 + i) as f32);
            counts
                .iter_mut()
                .enumerate()
                .for_each(|(i, c)| *c = i as u32 + 1);
        }
        let bytes = b.finish();
        let got = decode_response(&bytes, 3).unwrap();
        assert_eq!(
            got[0],
            Pooled {
                rows: 2,
                dim: 3,
                values: vec![0., 1., 2., 3., 4., 5.],
                counts: vec![1, 2]
            }
        );
        assert_eq!(
            got[1],
            Pooled {
                rows: 1,
                dim: 4,
                values: vec![100., 101., 102., 103.],
                counts: vec![]
            }
        );
        assert_eq!(
            got[2],
            Pooled {
                rows: 0,
                dim: 5,
                values: vec![],
                counts: vec![]
            }
        );
        assert!(decode_response(&bytes, 2)
            .unwrap_err()
            .0
            .contains("expected 2"));
        for cut in 0..bytes.len() {
            assert!(decode_response(&bytes[..cut], 3).is_err());
        }
        let err = ResponseBuilder::new(&[(1000, 1000, false)], 1 << 20)
            .err()
            .unwrap();
        assert!(err.0.contains("exceed"), "{err}");
    }
}
