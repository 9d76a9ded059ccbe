//! The request path's reader of KServe v2 `data` arrays: numbers, booleans and nested arrays
//! of them, in one pass over the bytes, eight digits at a time, straight into a [`JsonData`]
//! (json_tensor.rs; docs/benchmarks.md, "JSON parsing").
//!
//! It reads every number to the [`Scalar`] that serde_json's deserializer gives (the
//! reference): a non-negative integer as a u64, a negative one as an i64 (`-0`, and one below
//! i64's range, as a float), and any other number as serde_json computes it by default —
//! all its digits as one u64, then one multiplication or division by an exact power of ten.
//! A number off that path (more than 19 digits, a power of ten beyond 1e22) is handed to
//! serde_json itself. What the scanner does not take (bad syntax, a string, a value the dtype
//! refuses, too deep a nesting) is [`Refused`]: the caller reads the text again with
//! serde_json, whose answer is the error the request gets.

use crate::codec::json_tensor::{JsonData, Leaves, Scalar, MAX_DEPTH};

/// The scanner stopped where serde_json's reading must say why (module docs).
#[derive(Debug, PartialEq)]
pub struct Refused;

/// Reads `text`, one JSON value (an array, or a bare number or boolean), into `out`.
pub fn scan<L: Leaves>(text: &[u8], out: &mut JsonData<L>) -> Result<(), Refused> {
    let mut s = Scanner { bytes: text, at: 0 };
    s.skip_space();
    s.value(0, out)?;
    s.skip_space();
    match s.at == text.len() {
        true => Ok(()),
        false => Err(Refused),
    }
}

/// The powers of ten an f64 holds exactly: a u64 times or over one of them is a single
/// rounding, the one serde_json does.
const POW10: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
    1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
];

/// 10^n for the digits of one eight-byte chunk.
const SCALE: [u64; 9] = [
    1,
    10,
    100,
    1_000,
    10_000,
    100_000,
    1_000_000,
    10_000_000,
    100_000_000,
];

/// A u64 holds any 19 digits; with more, serde_json reads the number.
const MAX_DIGITS: usize = 19;

struct Scanner<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Scanner<'_> {
    /// The byte at the cursor; 0 past the end (never valid where it is looked at).
    #[inline]
    fn peek(&self) -> u8 {
        self.bytes.get(self.at).copied().unwrap_or(0)
    }

    #[inline]
    fn skip_space(&mut self) {
        while let b' ' | b'\n' | b'\r' | b'\t' = self.peek() {
            self.at += 1;
        }
    }

    #[inline(always)]
    fn value<L: Leaves>(&mut self, depth: usize, out: &mut JsonData<L>) -> Result<(), Refused> {
        let s = match self.peek() {
            b'[' => return self.array(depth, out),
            b't' => self.word(b"true", Scalar::Bool(true))?,
            b'f' => self.word(b"false", Scalar::Bool(false))?,
            _ => self.number()?,
        };
        out.leaf(depth, s).map_err(|_| Refused)
    }

    fn word(&mut self, word: &[u8], s: Scalar) -> Result<Scalar, Refused> {
        if !self.bytes[self.at..].starts_with(word) {
            return Err(Refused);
        }
        self.at += word.len();
        Ok(s)
    }

    #[inline(never)]
    fn array<L: Leaves>(&mut self, depth: usize, out: &mut JsonData<L>) -> Result<(), Refused> {
        if depth >= MAX_DEPTH {
            return Err(Refused);
        }
        self.at += 1; // '['
        self.skip_space();
        let mut len = 0;
        if self.peek() != b']' {
            loop {
                self.value(depth + 1, out)?;
                len += 1;
                // `, ` between elements, as most clients write them, without a loop.
                if self.peek() == b',' {
                    self.at += 1;
                    if self.peek() == b' ' {
                        self.at += 1;
                    }
                    self.skip_space();
                    continue;
                }
                self.skip_space();
                match self.peek() {
                    b',' => {
                        self.at += 1;
                        self.skip_space();
                    }
                    b']' => break,
                    _ => return Err(Refused),
                }
            }
        }
        self.at += 1; // ']'
        out.closed(depth, len);
        Ok(())
    }

    /// An RFC 8259 number, -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?, read as serde_json
    /// reads it (module docs).
    #[inline(always)]
    fn number(&mut self) -> Result<Scalar, Refused> {
        let start = self.at;
        let negative = self.peek() == b'-';
        self.at += usize::from(negative);
        let first = self.peek();
        let (mut value, mut count) = self.digits(0);
        // One digit at least, and no leading zero.
        if count == 0 || (first == b'0' && count > 1) {
            return Err(Refused);
        }
        let mut integral = true;
        let mut exponent = 0i32;
        if self.peek() == b'.' {
            self.at += 1;
            let (v, fraction) = self.fraction(value);
            if fraction == 0 {
                return Err(Refused);
            }
            (value, count, integral) = (v, count + fraction, false);
            exponent = -(fraction.min(1 << 20) as i32);
        }
        if let b'e' | b'E' = self.peek() {
            self.at += 1;
            let sign = self.peek();
            self.at += usize::from(sign == b'-' || sign == b'+');
            let (e, digits) = self.digits(0);
            if digits == 0 {
                return Err(Refused);
            }
            // More than four digits is beyond any power of ten read here.
            let e = if digits > 4 { 1 << 20 } else { e as i32 };
            exponent += if sign == b'-' { -e } else { e };
            integral = false;
        }
        if count > MAX_DIGITS {
            return self.long_number(start);
        }
        if integral {
            if !negative {
                return Ok(Scalar::UInt(value));
            }
            let neg = (value as i64).wrapping_neg();
            return Ok(match neg >= 0 {
                true => Scalar::Float(-(value as f64)),
                false => Scalar::Int(neg),
            });
        }
        let Some(&power) = POW10.get(exponent.unsigned_abs() as usize) else {
            return self.long_number(start);
        };
        let magnitude = match exponent >= 0 {
            true => value as f64 * power,
            false => value as f64 / power,
        };
        Ok(Scalar::Float(if negative { -magnitude } else { magnitude }))
    }

    /// The number that began at `start` and ends at the cursor, read by serde_json.
    #[cold]
    fn long_number(&self, start: usize) -> Result<Scalar, Refused> {
        let n: serde_json::Number =
            serde_json::from_slice(&self.bytes[start..self.at]).map_err(|_| Refused)?;
        Ok(match (n.as_u64(), n.as_i64(), n.as_f64()) {
            (Some(v), _, _) => Scalar::UInt(v),
            (None, Some(v), _) => Scalar::Int(v),
            (None, None, Some(v)) => Scalar::Float(v),
            (None, None, None) => return Err(Refused),
        })
    }

    /// [`Self::digits`] for a fraction: a float's 15 to 17 fraction digits would end the
    /// chunk loop at its second or third turn, a mispredicted branch a number. Where 24
    /// bytes are left, three chunks are read at once instead.
    #[inline(always)]
    fn fraction(&mut self, value: u64) -> (u64, usize) {
        let Some(bytes) = self.bytes.get(self.at..self.at + 24) else {
            return self.digits(value);
        };
        let (x1, n1) = chunk_digits(&bytes[..8]);
        let (x2, n2) = chunk_digits(&bytes[8..16]);
        let (x3, n3) = chunk_digits(&bytes[16..]);
        // A chunk counts only when those before it were all digits.
        let n2 = if n1 == 8 { n2 } else { 0 };
        let n3 = if n2 == 8 { n3 } else { 0 };
        if n3 == 8 {
            return self.digits(value);
        }
        let value = value
            .wrapping_mul(SCALE[n1])
            .wrapping_add(leading(x1, n1))
            .wrapping_mul(SCALE[n2])
            .wrapping_add(leading(x2, n2))
            .wrapping_mul(SCALE[n3])
            .wrapping_add(leading(x3, n3));
        self.at += n1 + n2 + n3;
        (value, n1 + n2 + n3)
    }

    /// The run of digits at the cursor appended to `value` (times ten plus each, wrapping:
    /// the caller keeps no more than [`MAX_DIGITS`]), and how many there were. Eight bytes
    /// are looked at together while eight are left.
    #[inline(always)]
    fn digits(&mut self, mut value: u64) -> (u64, usize) {
        let start = self.at;
        while let Some(chunk) = self.bytes.get(self.at..self.at + 8) {
            let (x, n) = chunk_digits(chunk);
            if n == 0 {
                break;
            }
            value = value
                .wrapping_mul(SCALE[n])
                .wrapping_add(eight_digits(x << (8 * (8 - n))));
            self.at += n;
            if n < 8 {
                return (value, self.at - start);
            }
        }
        while let Some(&d @ b'0'..=b'9') = self.bytes.get(self.at) {
            value = value.wrapping_mul(10).wrapping_add(u64::from(d - b'0'));
            self.at += 1;
        }
        (value, self.at - start)
    }
}

/// A chunk's digit values (each byte's, over 9 where it is not a digit) and how many digits
/// lead it.
#[inline(always)]
fn chunk_digits(bytes: &[u8]) -> (u64, usize) {
    let chunk = u64::from_le_bytes(bytes.try_into().expect("eight bytes"));
    let x = chunk ^ 0x3030_3030_3030_3030;
    // A byte's top bit set where it is over 9. A carry out of a byte over 0x89 only reaches
    // bytes after it, which are not read.
    let over = (x.wrapping_add(0x7676_7676_7676_7676) | x) & 0x8080_8080_8080_8080;
    (x, (over.trailing_zeros() / 8) as usize)
}

/// The value of a chunk's `n` leading digits (none: 0).
#[inline(always)]
fn leading(x: u64, n: usize) -> u64 {
    // Two shifts: all eight bytes shift out when n is 0.
    let half = 4 * (8 - n) as u32;
    eight_digits((x << half) << half)
}

/// The number written by eight digit values, one per byte, the first in the lowest byte:
/// pairs, then fours, then all eight, combined in place.
#[inline]
fn eight_digits(x: u64) -> u64 {
    let x = (x.wrapping_mul(10) + (x >> 8)) & 0x00ff_00ff_00ff_00ff;
    let x = (x.wrapping_mul(100) + (x >> 16)) & 0x0000_ffff_0000_ffff;
    (x.wrapping_mul(10_000) + (x >> 32)) & 0xffff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scalars(text: &str) -> Result<Vec<Scalar>, Refused> {
        let mut data = JsonData::default();
        scan(text.as_bytes(), &mut data)?;
        Ok(data.values)
    }

    fn serde_scalars(text: &str) -> Option<Vec<Scalar>> {
        serde_json::from_str::<JsonData>(text)
            .ok()
            .map(|d| d.values)
    }

    #[test]
    fn eight_digits_at_once() {
        let x = u64::from_le_bytes(*b"12345678") ^ 0x3030_3030_3030_3030;
        assert_eq!(eight_digits(x), 12_345_678);
        let x = u64::from_le_bytes(*b"00000001") ^ 0x3030_3030_3030_3030;
        assert_eq!(eight_digits(x), 1);
    }

    #[test]
    fn numbers_read_as_serde_json_reads_them() {
        let text = "[0, 7, -3, 18446744073709551615, -9223372036854775808, \
                    -9223372036854775809, -0, -0.0, 1.5, -2e3, 1E-2, 0.30000001192092896, \
                    12345678901234567890, 1e-30, 123456789.123456789123, 1e400000000000]";
        let want = serde_scalars(&text.replace(", 1e400000000000", "")).unwrap();
        assert!(scalars(text).is_err(), "1e400000000000 is out of range");
        let got = scalars(&text.replace(", 1e400000000000", "")).unwrap();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            match (g, w) {
                (Scalar::Float(g), Scalar::Float(w)) => assert_eq!(g.to_bits(), w.to_bits()),
                _ => assert_eq!(g, w),
            }
        }
        assert_eq!(got[6], Scalar::Float(-0.0));
        assert!(matches!(got[6], Scalar::Float(z) if z.is_sign_negative()));
        assert_eq!(got[3], Scalar::UInt(u64::MAX));
        assert_eq!(got[12], Scalar::UInt(12_345_678_901_234_567_890));
    }

    #[test]
    fn nesting_is_recorded_as_serde_json_records_it() {
        for text in [
            " [ [1 , true], [false,2] ]\n",
            "[]",
            "[[], []]",
            "5",
            "[[1], 2]",
        ] {
            let mut ours = JsonData::default();
            scan(text.as_bytes(), &mut ours).unwrap();
            let ours = ours.finish();
            let theirs: JsonData = serde_json::from_str(text).unwrap();
            assert_eq!(ours, theirs, "{text}");
        }
    }

    #[test]
    fn what_it_does_not_read_is_refused() {
        for text in [
            "[01]", "[1.]", "[.5]", "[-]", "[1e]", "[1e+]", "[1,]", "[,1]", "[1 2]", "[1", "",
            "[1] x", "[tru]", "[\"a\"]", "[{}]", "[null]", "[NaN]", "[+1]", "[1.5.3]", "]", "[1]]",
            "[--1]", "[1e5e3]", "[0x10]",
        ] {
            assert_eq!(scalars(text), Err(Refused), "{text}");
            assert!(serde_scalars(text).is_none(), "serde_json reads {text}");
        }
        let deep = "[".repeat(33) + &"]".repeat(33);
        assert_eq!(scalars(&deep), Err(Refused));
        let deep = "[".repeat(32) + &"]".repeat(32);
        assert!(scalars(&deep).is_ok());
    }
}
