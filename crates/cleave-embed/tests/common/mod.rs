//! Test bundles written to temporary directories, and a plain f64 reference of pooling.
#![allow(dead_code)]

use std::path::Path;

use cleave_embed::{Pooling, TableDtype};
use proptest::prelude::*;
use serde_json::json;

/// A table's contents as generated: raw stored bytes plus the value of every element as the
/// bundle format defines it (computed independently of the engine).
#[derive(Debug, Clone)]
pub struct TableData {
    pub name: String,
    pub rows: u64,
    pub dim: usize,
    pub dtype: TableDtype,
    pub bytes: Vec<u8>,
}

impl TableData {
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.dim)
    }

    /// Element `col` of row `row`, as f64 (int8: `q * scale + bias` computed in f32).
    pub fn value(&self, row: u64, col: usize) -> f64 {
        let r = &self.bytes[row as usize * self.row_bytes()..][..self.row_bytes()];
        match self.dtype {
            TableDtype::Float32 => {
                f32::from_le_bytes(r[4 * col..4 * col + 4].try_into().unwrap()) as f64
            }
            TableDtype::Float16 => half_value(u16::from_le_bytes([r[2 * col], r[2 * col + 1]])),
            TableDtype::Int8Rowwise => {
                let scale = f32::from_le_bytes(r[self.dim..self.dim + 4].try_into().unwrap());
                let bias = f32::from_le_bytes(r[self.dim + 4..self.dim + 8].try_into().unwrap());
                (r[col] as f32 * scale + bias) as f64
            }
            TableDtype::Int4Rowwise => {
                let at = self.dim.div_ceil(2);
                let scale = f32::from_le_bytes(r[at..at + 4].try_into().unwrap());
                let bias = f32::from_le_bytes(r[at + 4..at + 8].try_into().unwrap());
                (self.code(r, col) as f32 * scale + bias) as f64
            }
        }
    }

    /// The quantised code of element `col` of row bytes `r` (int8 and int4 tables).
    fn code(&self, r: &[u8], col: usize) -> u8 {
        match self.dtype {
            TableDtype::Int4Rowwise => (r[col / 2] >> (4 * (col % 2))) & 0x0f,
            _ => r[col],
        }
    }
}

impl TableData {
    /// The size the rounding error of a pooled element scales with: `|x|`, or for int8
    /// `|q * scale| + |bias|` (kernels fold the biases separately, so they may cancel late).
    pub fn magnitude(&self, row: u64, col: usize) -> f64 {
        let at = match self.dtype {
            TableDtype::Int8Rowwise => self.dim,
            TableDtype::Int4Rowwise => self.dim.div_ceil(2),
            _ => return self.value(row, col).abs(),
        };
        let r = &self.bytes[row as usize * self.row_bytes()..][..self.row_bytes()];
        let scale = f32::from_le_bytes(r[at..at + 4].try_into().unwrap()) as f64;
        let bias = f32::from_le_bytes(r[at + 4..at + 8].try_into().unwrap()) as f64;
        (self.code(r, col) as f64 * scale).abs() + bias.abs()
    }
}

/// IEEE half from its definition (finite values only).
pub fn half_value(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let mant = (h & 0x3ff) as f64;
    assert!(exp != 0x1f, "test tables hold finite halves only");
    if exp == 0 {
        sign * mant * 2f64.powi(-24)
    } else {
        sign * (1.0 + mant / 1024.0) * 2f64.powi(exp - 15)
    }
}

/// Random table contents: floats in [-4, 4), finite halves, int8 rows with scale in
/// [1e-3, 0.1) and bias in [-1, 1).
pub fn table_data(
    name: &str,
    rows: u64,
    dim: usize,
    dtype: TableDtype,
) -> impl Strategy<Value = TableData> {
    let name = name.to_string();
    let row_bytes = dtype.row_bytes(dim);
    let n = rows as usize;
    let bytes: BoxedStrategy<Vec<u8>> = match dtype {
        TableDtype::Float32 => proptest::collection::vec(-4.0f32..4.0, n * dim)
            .prop_map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .boxed(),
        TableDtype::Float16 => proptest::collection::vec(any::<u16>(), n * dim)
            // Clear the top exponent bit when all five are set: no infinities or NaNs.
            .prop_map(|v| {
                v.iter()
                    .map(|&h| if h & 0x7c00 == 0x7c00 { h & !0x4000 } else { h })
                    .flat_map(|h| h.to_le_bytes())
                    .collect()
            })
            .boxed(),
        TableDtype::Int8Rowwise | TableDtype::Int4Rowwise => proptest::collection::vec(
            (
                // Every byte is a code (int8) or two (int4, with dim odd a spare high nibble).
                proptest::collection::vec(any::<u8>(), row_bytes - 8),
                1e-3f32..0.1,
                -1.0f32..1.0,
            ),
            n,
        )
        .prop_map(|rows| {
            let mut bytes = Vec::new();
            for (q, scale, bias) in rows {
                bytes.extend_from_slice(&q);
                bytes.extend_from_slice(&scale.to_le_bytes());
                bytes.extend_from_slice(&bias.to_le_bytes());
            }
            bytes
        })
        .boxed(),
    };
    bytes.prop_map(move |bytes| {
        assert_eq!(bytes.len(), n * row_bytes);
        TableData {
            name: name.clone(),
            rows,
            dim,
            dtype,
            bytes,
        }
    })
}

/// Writes `tables` as a bundle (manifest.json + tables/*.bin) into `dir`.
pub fn write_bundle(dir: &Path, tables: &[TableData]) {
    std::fs::create_dir_all(dir.join("tables")).unwrap();
    let mut metas = Vec::new();
    for t in tables {
        let file = format!("tables/{}.bin", t.name);
        std::fs::write(dir.join(&file), &t.bytes).unwrap();
        metas.push(json!({
            "name": t.name, "file": file, "rows": t.rows, "dim": t.dim,
            "dtype": t.dtype.as_str(), "row_bytes": t.row_bytes(),
            "crc32": crc32fast::hash(&t.bytes), "source": format!("emb.{}", t.name),
        }));
    }
    let manifest = json!({
        "format": "cleave-bundle", "version": 1, "producer": "cleave-embed tests",
        "inputs": [], "outputs": [], "output_spec": "", "tables": metas,
        "features": [], "boundary": [], "dense": {"program": "dense.pt2", "inputs": []},
        "shared_inputs": [],
    });
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec_pretty(&manifest).unwrap(),
    )
    .unwrap();
}

/// Reference pooled bags in f64, with per-element magnitudes `sum |w| * magnitude` for tolerances.
pub struct Reference {
    pub out: Vec<f64>,
    pub magnitude: Vec<f64>,
}

pub fn reference(
    t: &TableData,
    ids: &[i64],
    offsets: &[u32],
    weights: Option<&[f32]>,
    pooling: Pooling,
) -> Reference {
    let bags = offsets.len() - 1;
    let mut out = vec![0.0; bags * t.dim];
    let mut magnitude = vec![0.0; bags * t.dim];
    for b in 0..bags {
        let bag = offsets[b] as usize..offsets[b + 1] as usize;
        let n = bag.len();
        for c in 0..t.dim {
            let (mut acc, mut mag) = if pooling == Pooling::Max {
                (f64::NEG_INFINITY, 0.0)
            } else {
                (0.0, 0.0)
            };
            for p in bag.clone() {
                let w = weights.map_or(1.0, |w| w[p] as f64);
                let x = t.value(ids[p] as u64, c);
                if pooling == Pooling::Max {
                    acc = acc.max(x);
                } else {
                    acc += w * x;
                }
                mag += w.abs() * t.magnitude(ids[p] as u64, c);
            }
            if n == 0 {
                acc = 0.0;
            } else if pooling == Pooling::Mean {
                acc /= n as f64;
                mag /= n as f64;
            }
            out[b * t.dim + c] = acc;
            magnitude[b * t.dim + c] = mag;
        }
    }
    Reference { out, magnitude }
}

/// Fails with the first element whose error exceeds `rel * magnitude` (max pools: exact).
pub fn assert_close(got: &[f32], want: &Reference, rel: f64, what: &str) {
    assert_eq!(got.len(), want.out.len(), "{what}: output length");
    for (i, (&g, (&w, &m))) in got
        .iter()
        .zip(want.out.iter().zip(&want.magnitude))
        .enumerate()
    {
        let err = (g as f64 - w).abs();
        assert!(
            err <= rel * m,
            "{what}: element {i}: got {g}, want {w}, error {err:e} > {rel:e} x magnitude {m:e}"
        );
    }
}

/// Tolerance per dtype: f32 and f16 values are exact in f32; int8 sums also round
/// `scale * weight` and fold the biases separately.
pub fn tolerance(dtype: TableDtype) -> f64 {
    match dtype {
        TableDtype::Float32 | TableDtype::Float16 => 1e-6,
        TableDtype::Int8Rowwise | TableDtype::Int4Rowwise => 2e-6,
    }
}
