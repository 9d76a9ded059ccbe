//! Tensors as the router holds them: a dtype, dims and little-endian bytes in C order.
//!
//! Bytes (rather than one typed vector per dtype) because the router mostly moves tensors:
//! JSON in, ranker payload out. Only ids and offsets are read element by element.

use std::fmt;

/// The element types the ranker payload can carry (docs/protocol.md, "Ranker messages").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    I64,
    I32,
    U8,
    Bool,
    BF16,
}

impl DType {
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F16,
        DType::I64,
        DType::I32,
        DType::U8,
        DType::Bool,
        DType::BF16,
    ];

    /// The code in the ranker payload's tensor header.
    pub fn wire_code(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::I64 => 2,
            DType::I32 => 3,
            DType::U8 => 4,
            DType::Bool => 5,
            DType::BF16 => 6,
        }
    }

    pub fn from_wire_code(code: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.wire_code() == code)
    }

    /// The torch dtype name the bundle manifest uses.
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::I64 => "int64",
            DType::I32 => "int32",
            DType::U8 => "uint8",
            DType::Bool => "bool",
            DType::BF16 => "bfloat16",
        }
    }

    pub fn from_torch_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.torch_name() == name)
    }

    /// The Open Inference Protocol (KServe v2) datatype name.
    pub fn kserve_name(self) -> &'static str {
        match self {
            DType::F32 => "FP32",
            DType::F16 => "FP16",
            DType::I64 => "INT64",
            DType::I32 => "INT32",
            DType::U8 => "UINT8",
            DType::Bool => "BOOL",
            DType::BF16 => "BF16",
        }
    }

    pub fn itemsize(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
            DType::U8 | DType::Bool => 1,
        }
    }

    pub fn is_integer(self) -> bool {
        matches!(self, DType::I64 | DType::I32 | DType::U8)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.torch_name())
    }
}

/// A dense tensor: `data` holds `numel * itemsize` little-endian bytes in C order.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub dtype: DType,
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
}

impl Tensor {
    /// A tensor over `data`; `None` when the byte count does not match dtype and dims.
    /// The same integers as `dtype` (I32 or I64): a KJT's values or lengths sent at the
    /// other width. Values past i32 cannot be narrowed: `None`.
    pub fn to_int(self, dtype: DType) -> Option<Tensor> {
        if self.dtype == dtype {
            return Some(self);
        }
        let values = self.to_i64()?;
        match dtype {
            DType::I64 => Some(Tensor::from_i64(self.dims, &values)),
            DType::I32 => {
                let mut data = Vec::with_capacity(values.len() * 4);
                for v in values {
                    data.extend(i32::try_from(v).ok()?.to_le_bytes());
                }
                Tensor::new(DType::I32, self.dims, data)
            }
            _ => None,
        }
    }

    pub fn new(dtype: DType, dims: Vec<usize>, data: Vec<u8>) -> Option<Tensor> {
        let bytes = numel(&dims)?.checked_mul(dtype.itemsize())?;
        (bytes == data.len()).then_some(Tensor { dtype, dims, data })
    }

    pub fn from_f32(dims: Vec<usize>, values: &[f32]) -> Tensor {
        debug_assert_eq!(numel(&dims), Some(values.len()));
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Tensor {
            dtype: DType::F32,
            dims,
            data,
        }
    }

    pub fn from_i64(dims: Vec<usize>, values: &[i64]) -> Tensor {
        debug_assert_eq!(numel(&dims), Some(values.len()));
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Tensor {
            dtype: DType::I64,
            dims,
            data,
        }
    }

    pub fn numel(&self) -> usize {
        self.data.len() / self.dtype.itemsize()
    }

    /// The elements as i64 (integer and bool dtypes); `None` for floating dtypes.
    pub fn to_i64(&self) -> Option<Vec<i64>> {
        let d = &self.data;
        Some(match self.dtype {
            DType::I64 => d
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8-byte chunk")))
                .collect(),
            DType::I32 => d
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().expect("4-byte chunk")) as i64)
                .collect(),
            DType::U8 | DType::Bool => d.iter().map(|&b| b as i64).collect(),
            DType::F32 | DType::F16 | DType::BF16 => return None,
        })
    }

    /// The elements as f32 (floating dtypes); `None` for integer dtypes.
    pub fn to_f32(&self) -> Option<Vec<f32>> {
        let d = &self.data;
        Some(match self.dtype {
            DType::F32 => d
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4-byte chunk")))
                .collect(),
            DType::F16 => d
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => d
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => return None,
        })
    }
}

/// The product of `dims`, `None` on overflow.
pub fn numel(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_change_width_only_when_they_fit() {
        let narrow = Tensor::new(
            DType::I32,
            vec![2],
            [7i32, -3].iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
        .unwrap();
        let wide = narrow.clone().to_int(DType::I64).unwrap();
        assert_eq!(wide.dtype, DType::I64);
        assert_eq!(wide.to_i64(), Some(vec![7, -3]));
        assert_eq!(wide.clone().to_int(DType::I32).unwrap().data, narrow.data);
        let big = Tensor::from_i64(vec![1], &[1 << 40]);
        assert!(big.to_int(DType::I32).is_none());
        assert!(Tensor::from_i64(vec![1], &[1]).to_int(DType::F32).is_none());
    }

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_wire_code(d.wire_code()), Some(d));
            assert_eq!(DType::from_torch_name(d.torch_name()), Some(d));
        }
        assert_eq!(DType::from_wire_code(7), None);
        assert_eq!(DType::from_torch_name("float64"), None);
    }

    #[test]
    fn new_checks_byte_count() {
        assert!(Tensor::new(DType::F32, vec![2, 3], vec![0; 24]).is_some());
        assert!(Tensor::new(DType::F32, vec![2, 3], vec![0; 23]).is_none());
        assert!(Tensor::new(DType::I64, vec![usize::MAX, 2], vec![]).is_none());
    }

    #[test]
    fn integer_views() {
        let t = Tensor::new(
            DType::I32,
            vec![2],
            [(-3i32).to_le_bytes(), 7i32.to_le_bytes()].concat(),
        )
        .unwrap();
        assert_eq!(t.to_i64(), Some(vec![-3, 7]));
        assert_eq!(t.to_f32(), None);
        let f = Tensor::from_f32(vec![2], &[1.5, -2.0]);
        assert_eq!(f.to_f32(), Some(vec![1.5, -2.0]));
        assert_eq!(f.to_i64(), None);
    }
}
