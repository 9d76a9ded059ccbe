//! Tensor data in JSON: KServe's `data` arrays (flat or nested, row-major) in, numbers out.
//!
//! A request's array is read by the scanner (json_scan.rs) straight into the dtype's bytes;
//! text the scanner does not take goes through serde_json's deserializer, which collects
//! numbers into one flat vector (no `serde_json::Value` tree per element). Both record the
//! nesting, so a ragged or mistyped array is reported with what was expected and what arrived.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeSeq, Serializer};

use crate::codec::json_scan;
use crate::tensor::{DType, Tensor};

/// A request's `data` text (a JSON array, flat or nested, or a bare number) as a tensor of
/// `dtype` and `shape`. The scanner reads it; text it refuses is read by
/// [`parse_tensor_serde`], whose answer (an error, mostly) is the request's.
pub fn parse_tensor(text: &str, dtype: DType, shape: &[usize]) -> Result<Tensor, String> {
    // Room for the values the shape declares, as many as the text can hold at most.
    let count = crate::tensor::numel(shape)
        .unwrap_or(0)
        .min(text.len() / 2 + 1);
    let mut data = JsonData::typed(dtype, count * dtype.itemsize());
    match json_scan::scan(text.as_bytes(), &mut data) {
        Ok(()) => data.finish().into_tensor(shape),
        Err(json_scan::Refused) => parse_tensor_serde(text, dtype, shape),
    }
}

/// [`parse_tensor`] through serde_json's deserializer alone: the request path before the
/// scanner, kept as its fallback and as `cleave bench json-parse`'s same-run reference. A
/// syntax error says "data: " first; a shape or conversion error does not.
pub fn parse_tensor_serde(text: &str, dtype: DType, shape: &[usize]) -> Result<Tensor, String> {
    let data: JsonData = serde_json::from_str(text).map_err(|e| format!("data: {e}"))?;
    data.into_tensor(dtype, shape)
}

/// Nesting deeper than this is refused (the parser's own stack limit is higher).
pub(crate) const MAX_DEPTH: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    Int(i64),
    UInt(u64),
    Float(f64),
    Bool(bool),
}

/// Where the numbers of an array go as the parser meets them.
pub trait Leaves {
    fn push(&mut self, s: Scalar) -> Result<(), String>;
    fn count(&self) -> usize;
}

/// Numbers kept as they came (the per-feature form stacks them before converting).
impl Leaves for Vec<Scalar> {
    fn push(&mut self, s: Scalar) -> Result<(), String> {
        Vec::push(self, s);
        Ok(())
    }

    fn count(&self) -> usize {
        self.len()
    }
}

/// Numbers converted on the fly to one dtype's little-endian bytes: a request body is never
/// held as 16-byte scalars.
#[derive(Debug, PartialEq)]
pub struct Typed {
    pub dtype: DType,
    pub bytes: Vec<u8>,
    count: usize,
}

impl Leaves for Typed {
    #[inline(always)]
    fn push(&mut self, s: Scalar) -> Result<(), String> {
        // A request's common pairs inline, each as push_converted converts it; the rest (and
        // every error) there.
        match (self.dtype, s) {
            (DType::F32, Scalar::Float(v)) => {
                self.bytes.extend_from_slice(&(v as f32).to_le_bytes())
            }
            (DType::I64, Scalar::UInt(v)) if v <= i64::MAX as u64 => {
                self.bytes.extend_from_slice(&(v as i64).to_le_bytes())
            }
            (DType::I64, Scalar::Int(v)) => self.bytes.extend_from_slice(&v.to_le_bytes()),
            _ => push_converted(&mut self.bytes, s, self.dtype, self.count)?,
        }
        self.count += 1;
        Ok(())
    }

    fn count(&self) -> usize {
        self.count
    }
}

/// The numbers of one JSON array, flattened, with its nesting.
#[derive(Debug, Default, PartialEq)]
pub struct JsonData<L = Vec<Scalar>> {
    pub values: L,
    /// The length seen at each depth (the first array met at that depth).
    pub extents: Vec<usize>,
    /// Arrays at one depth had different lengths, or numbers sat at different depths.
    pub ragged: bool,
    leaf_depth: Option<usize>,
    /// Per depth, the length of the first array closed there (inner arrays close first).
    seen: Vec<Option<usize>>,
}

impl<L: Leaves> JsonData<L> {
    /// A number (or boolean) met at `depth`.
    #[inline(always)]
    pub(crate) fn leaf(&mut self, depth: usize, s: Scalar) -> Result<(), String> {
        match self.leaf_depth {
            None => self.leaf_depth = Some(depth),
            Some(d) if d != depth => self.ragged = true,
            Some(_) => {}
        }
        self.values.push(s)
    }

    /// An array at `depth` closed with `len` elements (inner arrays close first).
    pub(crate) fn closed(&mut self, depth: usize, len: usize) {
        if self.seen.len() <= depth {
            self.seen.resize(depth + 1, None);
        }
        match self.seen[depth] {
            None => self.seen[depth] = Some(len),
            Some(first) if first != len => self.ragged = true,
            Some(_) => {}
        }
    }

    /// Every depth below the deepest array holds an array, so all are set; a bare number
    /// (a 0-d tensor) leaves `extents` empty.
    pub(crate) fn finish(mut self) -> Self {
        self.extents = self.seen.iter().map(|e| e.unwrap_or(0)).collect();
        self
    }

    /// Checks the nesting and count against a declared shape. The error says what was
    /// wrong, without the input's name (the caller adds it).
    fn check_shape(&self, shape: &[usize]) -> Result<(), String> {
        if self.ragged {
            return Err("data is a ragged nested array; rows must all have one length".into());
        }
        let want = crate::tensor::numel(shape).ok_or("shape overflows")?;
        // Nested data must nest exactly as the shape says; flat data only needs the count.
        if self.extents.len() > 1 && self.extents != shape {
            return Err(format!(
                "data nests as {:?} but shape is {:?}",
                self.extents, shape
            ));
        }
        if self.values.count() != want {
            return Err(format!(
                "shape {shape:?} needs {want} values, data has {}",
                self.values.count()
            ));
        }
        Ok(())
    }

    fn parse<'de, D: Deserializer<'de>>(mut data: JsonData<L>, d: D) -> Result<Self, D::Error> {
        Collector {
            out: &mut data,
            depth: 0,
        }
        .deserialize(d)?;
        Ok(data.finish())
    }
}

impl JsonData {
    pub fn from_values(values: Vec<Scalar>) -> JsonData {
        let extents = vec![values.len()];
        JsonData {
            values,
            extents,
            ..JsonData::default()
        }
    }

    /// Checks the data against a declared shape and converts it to `dtype`'s bytes.
    pub fn into_tensor(self, dtype: DType, shape: &[usize]) -> Result<Tensor, String> {
        self.check_shape(shape)?;
        let data = convert(&self.values, dtype)?;
        Ok(Tensor {
            dtype,
            dims: shape.to_vec(),
            data,
        })
    }
}

impl JsonData<Typed> {
    /// Nothing read yet; numbers will be converted to `dtype`'s bytes, `capacity` of them
    /// reserved.
    fn typed(dtype: DType, capacity: usize) -> JsonData<Typed> {
        JsonData {
            values: Typed {
                dtype,
                bytes: Vec::with_capacity(capacity),
                count: 0,
            },
            extents: Vec::new(),
            ragged: false,
            leaf_depth: None,
            seen: Vec::new(),
        }
    }

    /// Checks the data against a declared shape; the tensor keeps the converted bytes.
    pub fn into_tensor(self, shape: &[usize]) -> Result<Tensor, String> {
        self.check_shape(shape)?;
        Ok(Tensor {
            dtype: self.values.dtype,
            dims: shape.to_vec(),
            data: self.values.bytes,
        })
    }
}

fn describe(s: Scalar) -> String {
    match s {
        Scalar::Int(v) => v.to_string(),
        Scalar::UInt(v) => v.to_string(),
        Scalar::Float(v) => v.to_string(),
        Scalar::Bool(v) => v.to_string(),
    }
}

fn as_i64(s: Scalar) -> Option<i64> {
    match s {
        Scalar::Int(v) => Some(v),
        Scalar::UInt(v) => i64::try_from(v).ok(),
        Scalar::Float(_) | Scalar::Bool(_) => None,
    }
}

fn as_f64(s: Scalar) -> Option<f64> {
    match s {
        Scalar::Int(v) => Some(v as f64),
        Scalar::UInt(v) => Some(v as f64),
        Scalar::Float(v) => Some(v),
        Scalar::Bool(_) => None,
    }
}

/// Converts numbers to `dtype`'s little-endian bytes; integers must be integral and in range.
pub fn convert(values: &[Scalar], dtype: DType) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(values.len() * dtype.itemsize());
    for (i, &s) in values.iter().enumerate() {
        push_converted(&mut out, s, dtype, i)?;
    }
    Ok(out)
}

/// Appends element `i`, converted to `dtype`.
fn push_converted(out: &mut Vec<u8>, s: Scalar, dtype: DType, i: usize) -> Result<(), String> {
    let bad = |what: &str| format!("element {i} is {}, expected {what}", describe(s));
    let number = || as_f64(s).ok_or_else(|| bad("a number"));
    match dtype {
        DType::F32 => out.extend_from_slice(&(number()? as f32).to_le_bytes()),
        DType::F16 => out.extend_from_slice(&half::f16::from_f64(number()?).to_le_bytes()),
        DType::BF16 => out.extend_from_slice(&half::bf16::from_f64(number()?).to_le_bytes()),
        DType::I64 => {
            out.extend_from_slice(&as_i64(s).ok_or_else(|| bad("an int64"))?.to_le_bytes())
        }
        DType::I32 => {
            let v = as_i64(s).and_then(|v| i32::try_from(v).ok());
            out.extend_from_slice(&v.ok_or_else(|| bad("an int32"))?.to_le_bytes())
        }
        DType::U8 => {
            let v = as_i64(s).and_then(|v| u8::try_from(v).ok());
            out.push(v.ok_or_else(|| bad("a uint8 (0..=255)"))?)
        }
        DType::Bool => out.push(match s {
            Scalar::Bool(b) => b as u8,
            Scalar::Int(0) | Scalar::UInt(0) => 0,
            Scalar::Int(1) | Scalar::UInt(1) => 1,
            _ => return Err(bad("true, false, 0 or 1")),
        }),
    }
    Ok(())
}

impl<'de> de::Deserialize<'de> for JsonData {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<JsonData, D::Error> {
        JsonData::parse(JsonData::default(), d)
    }
}

struct Collector<'a, L> {
    out: &'a mut JsonData<L>,
    depth: usize,
}

impl<'de, L: Leaves> DeserializeSeed<'de> for Collector<'_, L> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, L: Leaves> Visitor<'de> for Collector<'_, L> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a number, a boolean, or a (nested) array of them")
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.out.leaf(self.depth, Scalar::Int(v)).map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.out
            .leaf(self.depth, Scalar::UInt(v))
            .map_err(E::custom)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        self.out
            .leaf(self.depth, Scalar::Float(v))
            .map_err(E::custom)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.out
            .leaf(self.depth, Scalar::Bool(v))
            .map_err(E::custom)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        if self.depth >= MAX_DEPTH {
            return Err(de::Error::custom(format!(
                "arrays nest deeper than {MAX_DEPTH}"
            )));
        }
        let mut count = 0usize;
        while seq
            .next_element_seed(Collector {
                out: &mut *self.out,
                depth: self.depth + 1,
            })?
            .is_some()
        {
            count += 1;
        }
        self.out.closed(self.depth, count);
        Ok(())
    }
}

/// Serializes a tensor's elements as a flat JSON array of numbers (KServe's row-major `data`).
pub struct JsonElements<'a>(pub &'a Tensor);

impl Serialize for JsonElements<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let t = self.0;
        let mut seq = s.serialize_seq(Some(t.numel()))?;
        match t.dtype {
            DType::F32 | DType::F16 | DType::BF16 => {
                for v in t.to_f32().expect("floating dtype") {
                    // JSON has no NaN/inf: they go out as null rather than failing the reply.
                    if v.is_finite() {
                        seq.serialize_element(&v)?
                    } else {
                        seq.serialize_element(&Option::<f32>::None)?
                    }
                }
            }
            DType::Bool => {
                for &b in &t.data {
                    seq.serialize_element(&(b != 0))?
                }
            }
            DType::I64 | DType::I32 | DType::U8 => {
                for v in t.to_i64().expect("integer dtype") {
                    seq.serialize_element(&v)?
                }
            }
        }
        seq.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> JsonData {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn flat_and_nested_agree() {
        let flat = parse("[1, 2, 3, 4, 5, 6]")
            .into_tensor(DType::I64, &[2, 3])
            .unwrap();
        let nested = parse("[[1, 2, 3], [4, 5, 6]]")
            .into_tensor(DType::I64, &[2, 3])
            .unwrap();
        assert_eq!(flat, nested);
        assert_eq!(flat.to_i64().unwrap(), vec![1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn ragged_and_misnested_are_errors() {
        let e = parse("[[1, 2], [3]]")
            .into_tensor(DType::I64, &[3])
            .unwrap_err();
        assert!(e.contains("ragged"), "{e}");
        let e = parse("[[1], 2]").into_tensor(DType::I64, &[2]).unwrap_err();
        assert!(e.contains("ragged"), "{e}");
        let e = parse("[[1, 2, 3], [4, 5, 6]]")
            .into_tensor(DType::I64, &[3, 2])
            .unwrap_err();
        assert!(e.contains("nests as [2, 3]"), "{e}");
        let e = parse("[1, 2, 3]")
            .into_tensor(DType::I64, &[2, 2])
            .unwrap_err();
        assert!(e.contains("needs 4 values, data has 3"), "{e}");
    }

    #[test]
    fn dtype_conversion_is_checked() {
        let e = parse("[1.5]").into_tensor(DType::I64, &[1]).unwrap_err();
        assert!(e.contains("element 0 is 1.5, expected an int64"), "{e}");
        assert!(parse("[3000000000]").into_tensor(DType::I32, &[1]).is_err());
        assert!(parse("[256]").into_tensor(DType::U8, &[1]).is_err());
        assert!(parse("[true]").into_tensor(DType::F32, &[1]).is_err());
        assert!(parse("[2]").into_tensor(DType::Bool, &[1]).is_err());
        let b = parse("[true, 0]").into_tensor(DType::Bool, &[2]).unwrap();
        assert_eq!(b.data, vec![1, 0]);
        let h = parse("[1, 0.5]").into_tensor(DType::F16, &[2]).unwrap();
        assert_eq!(h.to_f32().unwrap(), vec![1.0, 0.5]);
        assert!(parse("[18446744073709551615]")
            .into_tensor(DType::I64, &[1])
            .is_err());
    }

    #[test]
    fn strings_and_objects_are_refused() {
        assert!(serde_json::from_str::<JsonData>(r#"["a"]"#).is_err());
        assert!(serde_json::from_str::<JsonData>(r#"[{"x": 1}]"#).is_err());
        assert!(serde_json::from_str::<JsonData>(r#"[null]"#).is_err());
        let deep = "[".repeat(40) + &"]".repeat(40);
        assert!(serde_json::from_str::<JsonData>(&deep).is_err());
    }

    #[test]
    fn empty_arrays() {
        let t = parse("[]").into_tensor(DType::I64, &[0]).unwrap();
        assert_eq!(t.numel(), 0);
        assert!(parse("[]").into_tensor(DType::I64, &[1]).is_err());
    }

    #[test]
    fn scanner_agrees_with_serde() {
        for (text, dtype, shape) in [
            ("[[1, 2], [3, 4]]", DType::I64, vec![2, 2]),
            ("[1.5, -2, 3e2]", DType::F32, vec![3]),
            ("[true, 0, 1]", DType::Bool, vec![3]),
            ("[0.25, 2]", DType::BF16, vec![2]),
            ("[]", DType::I32, vec![0]),
            ("7", DType::I64, vec![]),
        ] {
            let scanned = parse_tensor(text, dtype, &shape).unwrap();
            assert_eq!(
                scanned,
                parse(text).into_tensor(dtype, &shape).unwrap(),
                "{text}"
            );
        }
        let e = parse_tensor("[1, 2.5]", DType::I64, &[2]).unwrap_err();
        assert_eq!(e, "element 1 is 2.5, expected an int64");
        let e = parse_tensor("[1, 2] x", DType::I64, &[2]).unwrap_err();
        assert!(e.starts_with("data: trailing characters"), "{e}");
        let e = parse_tensor("[[1], [2, 3]]", DType::I64, &[3]).unwrap_err();
        assert!(e.contains("ragged"), "{e}");
        // The shape is checked before the values convert, as serde_json's path does.
        let e = parse_tensor("[1.5, 2]", DType::I64, &[3]).unwrap_err();
        assert_eq!(e, "shape [3] needs 3 values, data has 2");
        let e = parse_tensor("[\"a\"]", DType::F32, &[1]).unwrap_err();
        assert!(
            e.starts_with("data: invalid type: string \"a\", expected a number"),
            "{e}"
        );
    }

    /// A number as a client may write it: integers of any size, floats of many digits,
    /// exponents, negative zero, huge and tiny (subnormal) values.
    fn number() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        prop_oneof![
            any::<i64>().prop_map(|v| v.to_string()),
            any::<u64>().prop_map(|v| v.to_string()),
            (0u8..=255).prop_map(|v| v.to_string()),
            any::<f32>()
                .prop_filter("finite", |v| v.is_finite())
                .prop_map(|v| f64::from(v).to_string()),
            any::<f64>()
                .prop_filter("finite", |v| v.is_finite())
                .prop_map(|v| format!("{v:e}")),
            any::<f64>()
                .prop_filter("finite", |v| v.is_finite())
                .prop_map(|v| v.to_string()),
            "-?(0|[1-9][0-9]{0,21})(\\.[0-9]{1,24})?([eE][+-]?[0-9]{1,3})?",
            proptest::sample::select(vec![
                "-0",
                "-0.0",
                "0.0",
                "1e308",
                "1.8e308",
                "4.9e-324",
                "2.2250738585072011e-308",
                "1e-400",
                "-1e400",
                "true",
                "false",
                "1",
                "0",
            ])
            .prop_map(str::to_string),
        ]
    }

    fn assert_same(text: &str, dtype: DType, shape: &[usize]) -> Result<(), String> {
        let scanned = parse_tensor(text, dtype, shape);
        let reference = parse_tensor_serde(text, dtype, shape);
        if scanned != reference {
            return Err(format!(
                "{dtype:?} {shape:?} {text}: {scanned:?} vs {reference:?}"
            ));
        }
        Ok(())
    }

    proptest::proptest! {
        /// Arrays of numbers, flat or in rows, any whitespace: every dtype's bytes (or error)
        /// from the scanner are serde_json's.
        #[test]
        fn scanned_arrays_are_serde_json_arrays(
            numbers in proptest::collection::vec(number(), 0..24),
            rows in 1usize..4,
            gap in proptest::sample::select(vec![",", ", ", " ,\n", ",\t\r "]),
            lead in proptest::sample::select(vec!["", " ", "\n  "]),
        ) {
            let cut = numbers.len() / rows * rows;
            let row_len = cut / rows;
            let flat = format!("{lead}[{}]{lead}", numbers.join(gap));
            let nested: Vec<String> = numbers[..cut]
                .chunks(row_len.max(1))
                .map(|r| format!("[{lead}{}{lead}]", r.join(gap)))
                .collect();
            let nested = format!("[{}]", nested.join(gap));
            for dtype in DType::ALL {
                assert_same(&flat, dtype, &[numbers.len()]).map_err(proptest::test_runner::TestCaseError::fail)?;
                assert_same(&flat, dtype, &[numbers.len() + 1]).map_err(proptest::test_runner::TestCaseError::fail)?;
                assert_same(&nested, dtype, &[rows, row_len]).map_err(proptest::test_runner::TestCaseError::fail)?;
                assert_same(&nested, dtype, &[cut]).map_err(proptest::test_runner::TestCaseError::fail)?;
            }
        }

        /// The scanner reads every number to serde_json's scalar, to the bit (a float's last
        /// bit seldom shows in a float32 tensor).
        #[test]
        fn scanned_numbers_are_serde_json_numbers(
            numbers in proptest::collection::vec(number(), 1..24),
        ) {
            let text = format!("[{}]", numbers.join(","));
            let theirs: Result<JsonData, _> = serde_json::from_str(&text);
            let mut ours: JsonData = JsonData::default();
            let scanned = json_scan::scan(text.as_bytes(), &mut ours);
            proptest::prop_assert_eq!(scanned.is_ok(), theirs.is_ok(), "{}", text);
            if let Ok(theirs) = theirs {
                let bits = |v: &[Scalar]| -> Vec<(u8, u64)> {
                    v.iter()
                        .map(|s| match *s {
                            Scalar::Int(v) => (0, v as u64),
                            Scalar::UInt(v) => (1, v),
                            Scalar::Float(v) => (2, v.to_bits()),
                            Scalar::Bool(v) => (3, u64::from(v)),
                        })
                        .collect()
                };
                proptest::prop_assert_eq!(bits(&ours.values), bits(&theirs.values), "{}", text);
            }
        }

        /// Malformed text: the same error (or the same tensor) as serde_json's path.
        #[test]
        fn malformed_text_fails_as_with_serde_json(
            text in "[\\[\\]0-9 ,.eE+\\-tfalsrun\"{}:]{0,40}",
        ) {
            for dtype in [DType::F32, DType::I64, DType::Bool] {
                for shape in [vec![1], vec![2], vec![]] {
                    assert_same(&text, dtype, &shape).map_err(proptest::test_runner::TestCaseError::fail)?;
                }
            }
        }
    }

    #[test]
    fn serializes_flat() {
        let t = Tensor::from_f32(vec![2, 1], &[0.25, f32::NAN]);
        assert_eq!(
            serde_json::to_string(&JsonElements(&t)).unwrap(),
            "[0.25,null]"
        );
        let i = Tensor::from_i64(vec![2], &[-1, 5]);
        assert_eq!(serde_json::to_string(&JsonElements(&i)).unwrap(), "[-1,5]");
    }
}
