//! The served model as the router sees it: the bundle manifest resolved once at start-up into
//! indices and dtypes, so a request is checked without string lookups or re-parsing.

use std::collections::HashMap;
use std::path::Path;

use cleave_embed::bundle::{Dim, FeatureMeta, KjtMeta, Layout, Manifest, TensorMeta, Transform};

use crate::tensor::DType;

/// One named tensor of the model's interface (an input or an output).
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<Dim>,
    /// A KJT's values or lengths: sent as INT32 or INT64 (TorchRec makes either), held as
    /// `dtype` once decoded.
    pub either_int: bool,
}

impl TensorSpec {
    fn from_meta(meta: &TensorMeta, what: &str) -> Result<TensorSpec, String> {
        let dtype = DType::from_torch_name(&meta.dtype).ok_or_else(|| {
            format!(
                "{what} {:?} has dtype {:?}; the router serves {}",
                meta.name,
                meta.dtype,
                DType::ALL.map(|d| d.torch_name()).join(", ")
            )
        })?;
        Ok(TensorSpec {
            name: meta.name.clone(),
            dtype,
            shape: meta.shape.clone(),
            either_int: false,
        })
    }

    /// The shape as KServe metadata writes it: -1 for every symbol.
    pub fn kserve_shape(&self) -> Vec<i64> {
        self.shape
            .iter()
            .map(|d| match d {
                Dim::Static(n) => *n as i64,
                Dim::Symbol(_) => -1,
            })
            .collect()
    }

    /// The dtype a request's tensor is decoded as, given the datatype it declares: the
    /// spec's own, or the declared integer width of a KJT's values and lengths.
    pub fn sent_as(&self, datatype: &str) -> TensorSpec {
        let dtype = match datatype {
            "INT32" if self.either_int => DType::I32,
            "INT64" if self.either_int => DType::I64,
            _ => self.dtype,
        };
        TensorSpec {
            dtype,
            ..self.clone()
        }
    }

    /// Whether the leading dimension is the batch (`"B"`): one row per candidate.
    pub fn is_batch_major(&self) -> bool {
        matches!(self.shape.first(), Some(Dim::Symbol(s)) if s == BATCH)
    }
}

/// The batch symbol of docs/bundle.md.
pub const BATCH: &str = "B";

/// One lookup, with its inputs resolved to indices into [`Model::inputs`].
#[derive(Debug, Clone)]
pub struct Feature {
    pub name: String,
    pub table: String,
    pub rows: u64,
    pub dim: usize,
    pub ids: usize,
    pub offsets: Option<usize>,
    pub weights: Option<usize>,
    pub include_last_offset: bool,
    pub layout: Layout,
    pub transform: Vec<Transform>,
    /// The manifest's pooling; `None` for an unpooled gather.
    pub pooling: Option<cleave_embed::Pooling>,
    /// Index into [`Model::boundary`].
    pub output: usize,
    /// Layout `kjt`: (index into [`Model::kjts`], the key's position among its keys).
    pub kjt: Option<(usize, usize)>,
}

/// A KeyedJaggedTensor argument, its tensors resolved to indices into [`Model::inputs`].
#[derive(Debug, Clone)]
pub struct KjtGroup {
    pub name: String,
    pub keys: Vec<String>,
    pub values: usize,
    pub lengths: usize,
    pub weights: Option<usize>,
}

/// Where a dense-program input comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseSource {
    /// A model input, sent as the client gave it.
    Input(usize),
    /// The boundary tensor a feature produces.
    Feature(usize),
    /// Key `key`'s lengths `[B]` of KJT `kjt` (indices into [`Model::kjts`] and its keys).
    KeyLengths { kjt: usize, key: usize },
}

/// A jagged feature's inputs (`layout: "offsets"`), for the per-feature JSON form, which
/// takes a list of ids per candidate and builds the values + offsets pair.
#[derive(Debug, Clone)]
pub struct JaggedGroup {
    pub ids: usize,
    pub offsets: usize,
    pub weights: Option<usize>,
    pub include_last_offset: bool,
    /// Looked up once per request and broadcast (manifest `shared_inputs`).
    pub shared: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Lookups on the shards, the dense program on a ranker (RANK).
    Disaggregated,
    /// The whole model on a ranker (RANK_FULL).
    Monolithic,
}

#[derive(Debug, Clone)]
pub struct Model {
    pub name: String,
    /// The version this manifest is served as ("1" unless the router's config says).
    pub version: String,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    pub boundary: Vec<TensorSpec>,
    pub features: Vec<Feature>,
    pub dense: Vec<DenseSource>,
    pub jagged: Vec<JaggedGroup>,
    pub kjts: Vec<KjtGroup>,
    /// Per input: in manifest `shared_inputs`.
    pub shared: Vec<bool>,
    input_index: HashMap<String, usize>,
}

impl Model {
    /// Reads `bundle_dir/manifest.json` and resolves it; the error names the bundle.
    pub fn load(name: &str, bundle_dir: &Path) -> Result<Model, String> {
        let manifest = Manifest::load(bundle_dir).map_err(|e| e.to_string())?;
        Model::from_manifest(name, &manifest)
            .map_err(|e| format!("{}: {e}", bundle_dir.join("manifest.json").display()))
    }

    pub fn from_manifest(name: &str, m: &Manifest) -> Result<Model, String> {
        let inputs = m
            .inputs
            .iter()
            .map(|i| TensorSpec::from_meta(i, "input"))
            .collect::<Result<Vec<_>, _>>()?;
        let outputs = m
            .outputs
            .iter()
            .map(|o| TensorSpec::from_meta(o, "output"))
            .collect::<Result<Vec<_>, _>>()?;
        let boundary = m
            .boundary
            .iter()
            .map(|b| TensorSpec::from_meta(b, "boundary tensor"))
            .collect::<Result<Vec<_>, _>>()?;
        let mut inputs = inputs;
        for k in &m.kjts {
            for name in [&k.values, &k.lengths] {
                if let Some(spec) = inputs.iter_mut().find(|i| i.name == *name) {
                    spec.either_int = spec.dtype.is_integer();
                }
            }
        }
        let mut input_index = HashMap::new();
        for (i, spec) in inputs.iter().enumerate() {
            if input_index.insert(spec.name.clone(), i).is_some() {
                return Err(format!("input {:?} appears twice", spec.name));
            }
        }
        let input = |name: &str, what: &str| {
            input_index
                .get(name)
                .copied()
                .ok_or_else(|| format!("{what} {name:?} is not among the inputs"))
        };
        let kjts = m
            .kjts
            .iter()
            .map(|k| resolve_kjt(k, &inputs, &input))
            .collect::<Result<Vec<_>, _>>()?;
        let features = m
            .features
            .iter()
            .map(|f| resolve_feature(f, m, &inputs, &boundary, &input))
            .collect::<Result<Vec<_>, _>>()?;

        let dense_names = m
            .dense
            .as_ref()
            .map(|d| d.inputs.as_slice())
            .unwrap_or_default();
        let dense = dense_names
            .iter()
            .map(|n| {
                let by_key = m.kjts.iter().enumerate().find_map(|(kjt, k)| {
                    let key = k.lengths_by_key.iter().position(|l| l == n)?;
                    Some(DenseSource::KeyLengths { kjt, key })
                });
                if let Some(f) = features.iter().position(|f| boundary[f.output].name == *n) {
                    Ok(DenseSource::Feature(f))
                } else if let Some(source) = by_key {
                    Ok(source)
                } else if let Some(&i) = input_index.get(n) {
                    Ok(DenseSource::Input(i))
                } else {
                    Err(format!(
                        "dense input {n:?} is neither a model input nor a feature's output"
                    ))
                }
            })
            .collect::<Result<Vec<_>, _>>()?;

        let mut shared = vec![false; inputs.len()];
        for n in &m.shared_inputs {
            shared[input(n, "shared input")?] = true;
        }
        let mut jagged: Vec<JaggedGroup> = Vec::new();
        for f in features.iter().filter(|f| f.layout == Layout::Offsets) {
            let offsets = f.offsets.expect("offsets layout has offsets (checked)");
            if let Some(g) = jagged.iter().find(|g| g.ids == f.ids) {
                if g.offsets != offsets || g.include_last_offset != f.include_last_offset {
                    return Err(format!(
                        "features on ids {:?} disagree on their offsets",
                        inputs[f.ids].name
                    ));
                }
                continue;
            }
            let members = [Some(f.ids), Some(offsets), f.weights];
            jagged.push(JaggedGroup {
                ids: f.ids,
                offsets,
                weights: f.weights,
                include_last_offset: f.include_last_offset,
                shared: members.into_iter().flatten().any(|i| shared[i]),
            });
        }
        Ok(Model {
            name: name.to_string(),
            version: "1".into(),
            inputs,
            outputs,
            boundary,
            features,
            dense,
            jagged,
            kjts,
            shared,
            input_index,
        })
    }

    pub fn input_index(&self, name: &str) -> Option<usize> {
        self.input_index.get(name).copied()
    }
}

fn resolve_kjt(
    k: &KjtMeta,
    inputs: &[TensorSpec],
    input: &dyn Fn(&str, &str) -> Result<usize, String>,
) -> Result<KjtGroup, String> {
    let where_ = format!("KJT {:?}", k.name);
    let values = input(&k.values, &format!("{where_}: values"))?;
    let lengths = input(&k.lengths, &format!("{where_}: lengths"))?;
    let weights = k
        .weights
        .as_deref()
        .map(|w| input(w, &format!("{where_}: weights")))
        .transpose()?;
    for i in [values, lengths] {
        if !inputs[i].dtype.is_integer() || inputs[i].shape.len() != 1 {
            return Err(format!(
                "{where_}: {:?} must be a 1-D integer input",
                inputs[i].name
            ));
        }
    }
    if k.keys.is_empty() {
        return Err(format!("{where_} has no keys"));
    }
    Ok(KjtGroup {
        name: k.name.clone(),
        keys: k.keys.clone(),
        values,
        lengths,
        weights,
    })
}

fn resolve_feature(
    f: &FeatureMeta,
    m: &Manifest,
    inputs: &[TensorSpec],
    boundary: &[TensorSpec],
    input: &dyn Fn(&str, &str) -> Result<usize, String>,
) -> Result<Feature, String> {
    let where_ = format!("feature {:?}", f.name);
    let table = m
        .table(&f.table)
        .ok_or_else(|| format!("{where_}: no table {:?}", f.table))?;
    let ids = input(&f.ids, &format!("{where_}: ids"))?;
    if !inputs[ids].dtype.is_integer() {
        return Err(format!(
            "{where_}: ids input {:?} has dtype {}, expected an integer dtype",
            f.ids, inputs[ids].dtype
        ));
    }
    let offsets = f
        .offsets
        .as_deref()
        .map(|o| input(o, &format!("{where_}: offsets")))
        .transpose()?;
    let weights = f
        .weights
        .as_deref()
        .map(|w| input(w, &format!("{where_}: weights")))
        .transpose()?;
    if let Some(o) = offsets {
        if !inputs[o].dtype.is_integer() || inputs[o].shape.len() != 1 {
            return Err(format!(
                "{where_}: offsets {:?} must be a 1-D integer input",
                f.offsets
            ));
        }
    }
    if let Some(w) = weights {
        if inputs[w].dtype.is_integer() || inputs[w].dtype == DType::Bool {
            return Err(format!(
                "{where_}: weights {:?} must be a floating input",
                f.weights
            ));
        }
    }
    let output = boundary
        .iter()
        .position(|b| b.name == f.output)
        .ok_or_else(|| {
            format!(
                "{where_}: output {:?} is not among the boundary tensors",
                f.output
            )
        })?;
    if boundary[output].dtype != DType::F32 {
        return Err(format!("{where_}: output {:?} must be float32", f.output));
    }
    let rank = inputs[ids].shape.len();
    match f.layout {
        Layout::Offsets if rank != 1 || offsets.is_none() => {
            return Err(format!(
                "{where_}: layout \"offsets\" needs 1-D ids and an offsets input"
            ))
        }
        Layout::Fixed if rank != 2 => {
            return Err(format!(
                "{where_}: layout \"fixed\" needs 2-D ids, found {rank}-D"
            ))
        }
        Layout::Kjt if kjt_key(f, m).is_none() => {
            return Err(format!(
                "{where_}: layout \"kjt\" needs a KJT of \"kjts\" and one of its keys"
            ))
        }
        _ => {}
    }
    Ok(Feature {
        name: f.name.clone(),
        table: f.table.clone(),
        rows: table.rows,
        dim: table.dim,
        ids,
        offsets,
        weights,
        include_last_offset: f.include_last_offset,
        layout: f.layout,
        transform: f.transform.clone(),
        pooling: f.pooling.pooling(),
        output,
        kjt: kjt_key(f, m),
    })
}

/// (KJT index, key index) of a `kjt` feature; the manifest reader checked that both exist.
fn kjt_key(f: &FeatureMeta, m: &Manifest) -> Option<(usize, usize)> {
    let group = m
        .kjts
        .iter()
        .position(|k| Some(&k.name) == f.kjt.as_ref())?;
    let key = m.kjts[group]
        .keys
        .iter()
        .position(|k| Some(k) == f.key.as_ref())?;
    Some((group, key))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small DLRM-shaped manifest: dense features, two jagged features (one shared, one
    /// weighted), a fixed feature with a hashing transform and a gather feature.
    pub fn manifest_json() -> serde_json::Value {
        serde_json::json!({
            "format": "cleave-bundle", "version": 1, "producer": "test",
            "inputs": [
                {"name": "dense_x", "dtype": "float32", "shape": ["B", 3], "role": "dense"},
                {"name": "user_ids", "dtype": "int64", "shape": ["N0"], "role": "ids"},
                {"name": "user_offsets", "dtype": "int64", "shape": [1], "role": "offsets"},
                {"name": "item_ids", "dtype": "int64", "shape": ["N1"], "role": "ids"},
                {"name": "item_offsets", "dtype": "int64", "shape": ["B"], "role": "offsets"},
                {"name": "item_weights", "dtype": "float32", "shape": ["N1"], "role": "weights"},
                {"name": "cat", "dtype": "int32", "shape": ["B", 2], "role": "ids"},
                {"name": "hist", "dtype": "int64", "shape": ["B", "L0"], "role": "ids"}
            ],
            "outputs": [{"name": "output_0", "dtype": "float32", "shape": ["B", 1]}],
            "output_spec": "",
            "tables": [
                {"name": "t_user", "file": "tables/t_user.bin", "rows": 10, "dim": 4,
                 "dtype": "float32", "row_bytes": 16, "crc32": 0},
                {"name": "t_item", "file": "tables/t_item.bin", "rows": 20, "dim": 4,
                 "dtype": "float32", "row_bytes": 16, "crc32": 0},
                {"name": "t_cat", "file": "tables/t_cat.bin", "rows": 7, "dim": 2,
                 "dtype": "float32", "row_bytes": 8, "crc32": 0}
            ],
            "features": [
                {"name": "user", "table": "t_user", "ids": "user_ids", "transform": [],
                 "layout": "offsets", "offsets": "user_offsets", "include_last_offset": false,
                 "weights": null, "pooling": "mean", "output": "pooled_user"},
                {"name": "item", "table": "t_item", "ids": "item_ids", "transform": [],
                 "layout": "offsets", "offsets": "item_offsets", "include_last_offset": false,
                 "weights": "item_weights", "pooling": "sum", "output": "pooled_item"},
                {"name": "cat", "table": "t_cat", "ids": "cat",
                 "transform": [{"op": "remainder", "divisor": 7}],
                 "layout": "fixed", "offsets": null, "include_last_offset": false,
                 "weights": null, "pooling": "max", "output": "pooled_cat"},
                {"name": "hist", "table": "t_item", "ids": "hist", "transform": [],
                 "layout": "gather", "offsets": null, "include_last_offset": false,
                 "weights": null, "pooling": "none", "output": "rows_hist"}
            ],
            "boundary": [
                {"name": "pooled_user", "dtype": "float32", "shape": [1, 4]},
                {"name": "pooled_item", "dtype": "float32", "shape": ["B", 4]},
                {"name": "pooled_cat", "dtype": "float32", "shape": ["B", 2]},
                {"name": "rows_hist", "dtype": "float32", "shape": ["B", "L0", 4]}
            ],
            "dense": {"program": "dense.pt2",
                      "inputs": ["dense_x", "pooled_user", "pooled_item", "pooled_cat",
                                 "rows_hist", "cat"]},
            "shared_inputs": ["user_ids", "user_offsets"]
        })
    }

    pub fn model() -> Model {
        let text = manifest_json().to_string();
        let m = Manifest::parse(&text, Path::new("test/manifest.json")).unwrap();
        Model::from_manifest("dlrm", &m).unwrap()
    }

    #[test]
    fn resolves_the_manifest() {
        let m = model();
        assert_eq!(m.inputs.len(), 8);
        assert_eq!(m.features[1].weights, m.input_index("item_weights"));
        assert_eq!(m.features[3].pooling, None);
        assert_eq!(
            m.dense,
            vec![
                DenseSource::Input(0),
                DenseSource::Feature(0),
                DenseSource::Feature(1),
                DenseSource::Feature(2),
                DenseSource::Feature(3),
                DenseSource::Input(6),
            ]
        );
        assert_eq!(m.jagged.len(), 2);
        assert!(m.jagged[0].shared && !m.jagged[1].shared);
        assert_eq!(m.inputs[0].kserve_shape(), vec![-1, 3]);
        assert!(m.inputs[0].is_batch_major() && !m.inputs[1].is_batch_major());
    }

    #[test]
    fn refuses_what_it_cannot_serve() {
        let mut j = manifest_json();
        j["inputs"][0]["dtype"] = "float64".into();
        let m = Manifest::parse(&j.to_string(), Path::new("m.json")).unwrap();
        let e = Model::from_manifest("x", &m).unwrap_err();
        assert!(e.contains("\"dense_x\" has dtype \"float64\""), "{e}");

        let mut j = manifest_json();
        j["dense"]["inputs"][0] = "nope".into();
        let m = Manifest::parse(&j.to_string(), Path::new("m.json")).unwrap();
        assert!(Model::from_manifest("x", &m)
            .unwrap_err()
            .contains("\"nope\""));

        let mut j = manifest_json();
        j["features"][0]["ids"] = "dense_x".into();
        let m = Manifest::parse(&j.to_string(), Path::new("m.json")).unwrap();
        assert!(Model::from_manifest("x", &m)
            .unwrap_err()
            .contains("integer dtype"));
    }
}
