//! `manifest.json` of a bundle (docs/bundle.md): serde types and the checks a reader makes
//! before trusting it.

use std::collections::HashSet;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::EmbedError;

/// The `format` every bundle manifest carries.
pub const FORMAT: &str = "cleave-bundle";
/// The newest bundle version this reader understands.
pub const VERSION: u32 = 1;
/// The manifest's file name inside a bundle directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// A bundle's manifest. Unknown fields are ignored so that additions within a version stay
/// readable; everything Cleave relies on is checked by [`Manifest::load`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    #[serde(default)]
    pub producer: String,
    #[serde(default)]
    pub inputs: Vec<TensorMeta>,
    #[serde(default)]
    pub outputs: Vec<TensorMeta>,
    /// The model's return structure (torch.utils._pytree JSON); opaque to Rust.
    #[serde(default)]
    pub output_spec: serde_json::Value,
    pub tables: Vec<TableMeta>,
    #[serde(default)]
    pub features: Vec<FeatureMeta>,
    #[serde(default)]
    pub boundary: Vec<TensorMeta>,
    #[serde(default)]
    pub dense: Option<DenseMeta>,
    #[serde(default)]
    pub shared_inputs: Vec<String>,
    /// TorchRec KeyedJaggedTensor arguments, served as `<name>.values`, `.lengths`, `.weights`.
    #[serde(default)]
    pub kjts: Vec<KjtMeta>,
}

/// A KeyedJaggedTensor argument: key `k`'s bag for sample `b` has `lengths[k * B + b]` ids,
/// and each key's ids follow the previous key's in `values` (docs/bundle.md, "kjts").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KjtMeta {
    pub name: String,
    pub keys: Vec<String>,
    pub values: String,
    pub lengths: String,
    #[serde(default)]
    pub weights: Option<String>,
    /// The lengths cut by key, one `[B]` boundary tensor per key in key order, when the dense
    /// program reads them (an EmbeddingCollection's); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lengths_by_key: Vec<String>,
}

/// One embedding table file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableMeta {
    pub name: String,
    /// Path relative to the bundle directory, e.g. `tables/t0.bin`.
    pub file: String,
    pub rows: u64,
    pub dim: usize,
    pub dtype: TableDtype,
    pub row_bytes: usize,
    pub crc32: u32,
    #[serde(default)]
    pub source: Option<String>,
}

/// Storage type of a table's rows (see the table in docs/bundle.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TableDtype {
    /// `dim` × f32.
    Float32,
    /// `dim` × IEEE f16.
    Float16,
    /// `dim` × u8 `q`, then f32 `scale`, then f32 `bias`; value = `q * scale + bias`.
    Int8Rowwise,
    /// `ceil(dim / 2)` bytes of 4-bit `q` (element `2k` in the low nibble of byte `k`, `2k + 1`
    /// in the high one), then f32 `scale`, then f32 `bias`; value = `q * scale + bias`. Half
    /// the bytes of int8 per row: the cheapest bandwidth there is for the SSD tier.
    Int4Rowwise,
}

impl TableDtype {
    /// Bytes of one row of `dim` values.
    pub fn row_bytes(self, dim: usize) -> usize {
        match self {
            TableDtype::Float32 => 4 * dim,
            TableDtype::Float16 => 2 * dim,
            TableDtype::Int8Rowwise => dim + 8,
            TableDtype::Int4Rowwise => dim.div_ceil(2) + 8,
        }
    }

    /// The name used in manifests.
    pub fn as_str(self) -> &'static str {
        match self {
            TableDtype::Float32 => "float32",
            TableDtype::Float16 => "float16",
            TableDtype::Int8Rowwise => "int8_rowwise",
            TableDtype::Int4Rowwise => "int4_rowwise",
        }
    }
}

/// A named tensor of the model's interface or of the boundary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorMeta {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<Dim>,
    /// `ids`, `offsets`, `weights`, `dense` or `both` (inputs only).
    #[serde(default)]
    pub role: Option<String>,
}

/// One entry of a shape: a static size or a symbol (`"B"`, `"N0"`, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Dim {
    Static(u64),
    Symbol(String),
}

/// One lookup the sparse side performs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FeatureMeta {
    pub name: String,
    pub table: String,
    pub ids: String,
    #[serde(default)]
    pub transform: Vec<Transform>,
    pub layout: Layout,
    #[serde(default)]
    pub offsets: Option<String>,
    #[serde(default)]
    pub include_last_offset: bool,
    #[serde(default)]
    pub weights: Option<String>,
    pub pooling: FeaturePooling,
    pub output: String,
    /// Layout `kjt`: the KeyedJaggedTensor (a `kjts` name) and the key this feature reads.
    #[serde(default)]
    pub kjt: Option<String>,
    #[serde(default)]
    pub key: Option<String>,
}

/// An element-wise step applied to ids before the lookup.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Transform {
    /// Python `%`: result in `[0, divisor)` for a positive divisor.
    Remainder { divisor: i64 },
    /// C `fmod`: keeps the sign of the id.
    Fmod { divisor: i64 },
    /// A dtype cast (`int64`, `int32`, ...).
    Cast { dtype: String },
}

impl Transform {
    /// Applies the step to one id; `None` where it is undefined (division by zero).
    pub fn apply(&self, id: i64) -> Option<i64> {
        match self {
            Transform::Remainder { divisor: 0 } | Transform::Fmod { divisor: 0 } => None,
            Transform::Remainder { divisor } => {
                // rem_euclid is non-negative; Python's % takes the divisor's sign.
                let r = id.wrapping_rem_euclid(*divisor);
                Some(if *divisor < 0 && r != 0 {
                    r + divisor
                } else {
                    r
                })
            }
            Transform::Fmod { divisor } => Some(id.wrapping_rem(*divisor)),
            Transform::Cast { dtype } => match dtype.as_str() {
                "int32" => Some(id as i32 as i64),
                "int16" => Some(id as i16 as i64),
                "int8" => Some(id as i8 as i64),
                "uint8" => Some(id as u8 as i64),
                _ => Some(id),
            },
        }
    }
}

/// How a feature's ids are grouped into bags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    Offsets,
    Fixed,
    Gather,
    /// One key of a KeyedJaggedTensor: its segment of the `values` and `lengths`.
    Kjt,
}

/// A feature's pooling mode as written in the manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FeaturePooling {
    Sum,
    Mean,
    Max,
    None,
}

impl FeaturePooling {
    /// The engine's pooling, `None` for an unpooled gather.
    pub fn pooling(self) -> Option<crate::Pooling> {
        match self {
            FeaturePooling::Sum => Some(crate::Pooling::Sum),
            FeaturePooling::Mean => Some(crate::Pooling::Mean),
            FeaturePooling::Max => Some(crate::Pooling::Max),
            FeaturePooling::None => None,
        }
    }
}

/// The dense program and its positional inputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DenseMeta {
    pub program: String,
    pub inputs: Vec<String>,
}

impl Manifest {
    /// Reads and checks `bundle_dir/manifest.json`: format, version, then the table and
    /// feature rules of docs/bundle.md. Table files are checked when opened ([`crate::Table`]).
    pub fn load(bundle_dir: &Path) -> Result<Manifest, EmbedError> {
        let path = bundle_dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| EmbedError::io(&path, e))?;
        Manifest::parse(&text, &path)
    }

    /// Parses and checks manifest text; `path` is only used in error messages.
    pub fn parse(text: &str, path: &Path) -> Result<Manifest, EmbedError> {
        let bad = |reason: String| EmbedError::BadManifest {
            path: path.to_path_buf(),
            reason,
        };
        // Format and version first, so a newer bundle is reported as such rather than as a
        // field this reader does not know.
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let object = value
            .as_object()
            .ok_or_else(|| bad("expected a JSON object".into()))?;
        match object.get("format") {
            Some(serde_json::Value::String(s)) if s == FORMAT => {}
            Some(serde_json::Value::String(s)) => {
                return Err(EmbedError::WrongFormat {
                    path: path.to_path_buf(),
                    found: s.clone(),
                    expected: FORMAT,
                })
            }
            other => {
                return Err(bad(format!(
                    "\"format\" must be {FORMAT:?}, found {other:?}"
                )))
            }
        }
        match object.get("version").and_then(|v| v.as_u64()) {
            Some(v) if v > VERSION as u64 => {
                return Err(EmbedError::UnsupportedVersion {
                    path: path.to_path_buf(),
                    found: v,
                    supported: VERSION,
                })
            }
            Some(v) if v >= 1 => {}
            _ => {
                return Err(bad(format!(
                    "\"version\" must be an integer from 1 to {VERSION}, found {:?}",
                    object.get("version")
                )))
            }
        }
        let manifest: Manifest = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
        manifest.check().map_err(bad)?;
        Ok(manifest)
    }

    /// The table called `name`.
    pub fn table(&self, name: &str) -> Option<&TableMeta> {
        self.tables.iter().find(|t| t.name == name)
    }

    fn check(&self) -> Result<(), String> {
        let mut names = HashSet::new();
        for t in &self.tables {
            if !names.insert(t.name.as_str()) {
                return Err(format!("table {:?} appears twice", t.name));
            }
            if t.dim == 0 {
                return Err(format!("table {:?}: dim must be at least 1", t.name));
            }
            let expected = t.dtype.row_bytes(t.dim);
            if t.row_bytes != expected {
                return Err(format!(
                    "table {:?}: row_bytes is {}, expected {expected} for dim {} {}",
                    t.name,
                    t.row_bytes,
                    t.dim,
                    t.dtype.as_str()
                ));
            }
            if t.rows.checked_mul(t.row_bytes as u64).is_none() || t.rows > i64::MAX as u64 {
                return Err(format!("table {:?}: {} rows is too many", t.name, t.rows));
            }
            if !is_inside_bundle(&t.file) {
                return Err(format!(
                    "table {:?}: file {:?} must be a relative path inside the bundle",
                    t.name, t.file
                ));
            }
        }
        for k in &self.kjts {
            if !k.lengths_by_key.is_empty() && k.lengths_by_key.len() != k.keys.len() {
                return Err(format!(
                    "KJT {:?}: lengths_by_key has {} names, expected one per key ({})",
                    k.name,
                    k.lengths_by_key.len(),
                    k.keys.len()
                ));
            }
        }
        for f in &self.features {
            if !names.contains(f.table.as_str()) {
                return Err(format!(
                    "feature {:?} names table {:?}, which is not in \"tables\"",
                    f.name, f.table
                ));
            }
            for step in &f.transform {
                if let Transform::Remainder { divisor: 0 } | Transform::Fmod { divisor: 0 } = step {
                    return Err(format!(
                        "feature {:?}: transform divisor must not be 0",
                        f.name
                    ));
                }
            }
            // A KJT key is pooled (EmbeddingBagCollection) or read row by row (pooling "none",
            // EmbeddingCollection); a gather is never pooled.
            let unpooled = f.pooling == FeaturePooling::None;
            if (f.layout == Layout::Gather && !unpooled)
                || (unpooled && !matches!(f.layout, Layout::Gather | Layout::Kjt))
            {
                return Err(format!(
                    "feature {:?}: pooling \"none\" goes with layout \"gather\" or \"kjt\", \
                     and layout \"gather\" only with it (found layout {:?}, pooling {:?})",
                    f.name, f.layout, f.pooling
                ));
            }
            if f.layout == Layout::Offsets && f.offsets.is_none() {
                return Err(format!(
                    "feature {:?}: layout \"offsets\" needs \"offsets\"",
                    f.name
                ));
            }
            if f.layout == Layout::Kjt {
                self.check_kjt_feature(f)?;
            }
            if f.weights.is_some() && f.pooling != FeaturePooling::Sum {
                return Err(format!(
                    "feature {:?}: per-sample weights need pooling \"sum\", found {:?}",
                    f.name, f.pooling
                ));
            }
        }
        Ok(())
    }
}

impl Manifest {
    /// A `kjt` feature names a listed KJT and one of its keys, and reads its tensors.
    fn check_kjt_feature(&self, f: &FeatureMeta) -> Result<(), String> {
        let kjt = self
            .kjts
            .iter()
            .find(|k| Some(&k.name) == f.kjt.as_ref())
            .ok_or_else(|| {
                format!(
                    "feature {:?}: layout \"kjt\" names KJT {:?}, which is not in \"kjts\"",
                    f.name, f.kjt
                )
            })?;
        if !f.key.as_ref().is_some_and(|key| kjt.keys.contains(key)) {
            return Err(format!(
                "feature {:?}: key {:?} is not among KJT {:?}'s keys {:?}",
                f.name, f.key, kjt.name, kjt.keys
            ));
        }
        if f.ids != kjt.values || (f.weights.is_some() && f.weights != kjt.weights) {
            return Err(format!(
                "feature {:?}: ids and weights must be KJT {:?}'s values and weights",
                f.name, kjt.name
            ));
        }
        Ok(())
    }
}

/// Table files must stay inside the bundle: relative, without `..`.
fn is_inside_bundle(file: &str) -> bool {
    let path = PathBuf::from(file);
    !file.is_empty() && path.components().all(|c| matches!(c, Component::Normal(_)))
}
