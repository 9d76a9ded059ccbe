//! A KeyedJaggedTensor input cut into its keys (docs/api.md, "KeyedJaggedTensor inputs").
//!
//! `lengths` holds one bag per key and sample, key-major: key `k`'s bag for sample `b` is
//! `lengths[k * B + b]`, and each key's ids follow the previous key's in `values`. This
//! checks the lengths against the values and the keys, then gives each key its segment of
//! the values and its bag bounds, so a key's lookup is an ordinary jagged lookup.

use std::ops::Range;

use super::validate::{quoted, weights_like};
use crate::error::RequestError;
use crate::model::{KjtGroup, Model};
use crate::tensor::Tensor;

/// One request's KJT, checked and cut by key.
#[derive(Debug)]
pub struct KjtSplit {
    pub values: Vec<i64>,
    pub weights: Option<Vec<f32>>,
    /// Per key: the range of `values` it covers.
    pub segments: Vec<Range<usize>>,
    /// Per key: bag bounds within its segment (`B + 1` entries, from 0).
    pub bags: Vec<Vec<usize>>,
}

/// Checks the KJT `group` of a request whose inputs are `inputs` (in manifest order).
pub fn split(model: &Model, group: &KjtGroup, inputs: &[Tensor]) -> Result<KjtSplit, RequestError> {
    let lengths_name = &model.inputs[group.lengths].name;
    let values_name = &model.inputs[group.values].name;
    let keys = group.keys.len();
    let lengths = inputs[group.lengths]
        .to_i64()
        .expect("integer lengths (checked at load)");
    if !lengths.len().is_multiple_of(keys) {
        return Err(RequestError::input(
            lengths_name,
            format!(
                "{} lengths, expected a multiple of {keys}: one bag per key ({}) and sample, \
                 key-major",
                lengths.len(),
                quoted(&group.keys)
            ),
        ));
    }
    let batch = lengths.len() / keys;
    let mut bags = Vec::with_capacity(keys);
    let mut segments = Vec::with_capacity(keys);
    let mut start = 0usize;
    for (k, key) in group.keys.iter().enumerate() {
        let mut bounds = Vec::with_capacity(batch + 1);
        let mut end = 0usize;
        bounds.push(0);
        for (b, &length) in lengths[k * batch..(k + 1) * batch].iter().enumerate() {
            if length < 0 {
                return Err(RequestError::input(
                    lengths_name,
                    format!(
                        "length {length} at position {} (key {key:?}, sample {b}) is negative",
                        k * batch + b
                    ),
                ));
            }
            end = end.saturating_add(length as usize);
            bounds.push(end);
        }
        segments.push(start..start.saturating_add(end));
        start = start.saturating_add(end);
        bags.push(bounds);
    }
    let values_t = &inputs[group.values];
    let n = values_t.dims.first().copied().unwrap_or(0);
    if start != n {
        let short = segments.iter().zip(&group.keys).find(|(s, _)| s.end > n);
        let detail = match short {
            Some((_, key)) => format!("; the values run out in key {key:?}"),
            None => "; values past the last key's bags belong to no key".to_string(),
        };
        return Err(RequestError::input(
            values_name,
            format!(
                "{n} values, but {lengths_name:?} give {start} ({}){detail}",
                per_key(&group.keys, &segments)
            ),
        ));
    }
    let weights = weights_like(model, inputs, group.weights, values_t, |dims| {
        format!(
            "shape {dims:?}, expected the shape of {values_name:?}, {:?}: one weight per value",
            values_t.dims
        )
    })?;
    let values = values_t.to_i64().expect("integer values (checked at load)");
    Ok(KjtSplit {
        values,
        weights,
        segments,
        bags,
    })
}

/// Key `key`'s lengths `[B]` of a checked request's KJT `group`, in the dtype they came in:
/// what the dense program of an EmbeddingCollection reads (docs/bundle.md, "kjts").
pub fn key_lengths(group: &KjtGroup, inputs: &[Tensor], key: usize) -> Tensor {
    let lengths = &inputs[group.lengths];
    let batch = lengths.numel() / group.keys.len();
    let size = lengths.dtype.itemsize();
    let bytes = lengths.data[key * batch * size..(key + 1) * batch * size].to_vec();
    Tensor::new(lengths.dtype, vec![batch], bytes).expect("a slice of whole items")
}

fn per_key(keys: &[String], segments: &[Range<usize>]) -> String {
    let parts: Vec<String> = keys
        .iter()
        .zip(segments)
        .map(|(k, s)| format!("key {k:?}: {}", s.len()))
        .collect();
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use cleave_embed::bundle::Manifest;

    use crate::error::RequestError;
    use crate::model::{DenseSource, Model};
    use crate::pipeline::validate::{check_request, Checked};
    use crate::tensor::Tensor;

    /// A TorchRec DLRM's interface: dense features and a weighted KJT whose keys are in
    /// another order than the tables, one table shared by two keys.
    fn model() -> Model {
        model_reading_rows(&[])
    }

    /// The same, keys `rows` read row by row (an EmbeddingCollection's: pooling "none").
    fn model_reading_rows(rows: &[&str]) -> Model {
        let keys = ["a", "b", "c"];
        let unpooled = |k: &str| rows.contains(&k);
        let output = |k: &str| format!("{k}_{}", if unpooled(k) { "rows" } else { "pooled" });
        let features: Vec<serde_json::Value> = keys
            .iter()
            .map(|k| {
                serde_json::json!({
                "name": k, "table": if *k == "c" { "t1" } else { "t0" },
                "ids": "p.values", "layout": "kjt", "kjt": "p", "key": k,
                "lengths": "p.lengths",
                "weights": if unpooled(k) { None } else { Some("p.weights") },
                "pooling": if unpooled(k) { "none" } else { "sum" },
                "output": output(k)})
            })
            .collect();
        let mut boundary: Vec<serde_json::Value> = keys
            .iter()
            .map(|k| {
                let rows: serde_json::Value = if unpooled(k) { "N1".into() } else { "B".into() };
                serde_json::json!({"name": output(k), "dtype": "float32", "shape": [rows, 2]})
            })
            .collect();
        // Keys read row by row: the dense program takes the lengths, cut by key.
        let by_key: Vec<String> = if rows.is_empty() {
            vec![]
        } else {
            ["c", "a", "b"].map(|k| format!("p.lengths.{k}")).to_vec()
        };
        let mut dense = vec!["dense".to_string(), output("a"), output("b"), output("c")];
        for name in &by_key {
            boundary.push(serde_json::json!({"name": name, "dtype": "int64", "shape": ["B"]}));
            dense.push(name.clone());
        }
        let m = serde_json::json!({
            "format": "cleave-bundle", "version": 1, "producer": "test",
            "inputs": [
                {"name": "dense", "dtype": "float32", "shape": ["B", 2], "role": "dense"},
                {"name": "p.values", "dtype": "int64", "shape": ["N0"], "role": "ids"},
                {"name": "p.weights", "dtype": "float32", "shape": ["N0"], "role": "weights"},
                {"name": "p.lengths", "dtype": "int64", "shape": ["3*B"], "role": "lengths"}
            ],
            "outputs": [{"name": "output_0", "dtype": "float32", "shape": ["B", 1]}],
            "output_spec": "",
            "tables": [
                {"name": "t0", "file": "tables/t0.bin", "rows": 10, "dim": 2,
                 "dtype": "float32", "row_bytes": 8, "crc32": 0},
                {"name": "t1", "file": "tables/t1.bin", "rows": 4, "dim": 2,
                 "dtype": "float32", "row_bytes": 8, "crc32": 0}
            ],
            "features": features,
            "boundary": boundary,
            "dense": {"program": "dense.pt2", "inputs": dense},
            "shared_inputs": [],
            "kjts": [{"name": "p", "keys": ["c", "a", "b"], "values": "p.values",
                      "weights": "p.weights", "lengths": "p.lengths",
                      "lengths_by_key": by_key}]
        });
        let m = Manifest::parse(&m.to_string(), Path::new("test/manifest.json")).unwrap();
        Model::from_manifest("kjt", &m).unwrap()
    }

    /// Batch 2: key c has bags [3] and [], key a [1, 2] and [9], key b [] and [0, 0].
    fn request(values: &[i64], lengths: &[i64], batch: usize) -> Result<Checked, RequestError> {
        request_to(&model(), values, lengths, batch)
    }

    fn request_to(
        model: &Model,
        values: &[i64],
        lengths: &[i64],
        batch: usize,
    ) -> Result<Checked, RequestError> {
        let n = values.len();
        check_request(
            model,
            vec![
                Some(Tensor::from_f32(vec![batch, 2], &vec![0.5; batch * 2])),
                Some(Tensor::from_i64(vec![n], values)),
                Some(Tensor::from_f32(vec![n], &vec![1.0; n])),
                Some(Tensor::from_i64(vec![lengths.len()], lengths)),
            ],
        )
    }

    const VALUES: [i64; 6] = [3, 1, 2, 9, 0, 0];
    const LENGTHS: [i64; 6] = [1, 0, 2, 1, 0, 2];

    fn message(r: Result<Checked, RequestError>) -> String {
        r.expect_err("a bad KJT is refused").to_string()
    }

    #[test]
    fn each_key_gets_its_segment_and_bags() {
        let checked = request(&VALUES, &LENGTHS, 2).unwrap();
        let by_feature: Vec<(Vec<i64>, Vec<usize>)> = checked
            .lookups
            .iter()
            .map(|l| (l.ids.clone(), l.bags.clone().unwrap()))
            .collect();
        // Features in manifest order a, b, c; keys in KJT order c, a, b.
        assert_eq!(by_feature[0], (vec![1, 2, 9], vec![0, 2, 3]));
        assert_eq!(by_feature[1], (vec![0, 0], vec![0, 0, 2]));
        assert_eq!(by_feature[2], (vec![3], vec![0, 1, 1]));
        assert_eq!(
            checked.lookups[0].weights.as_deref(),
            Some(&[1.0f32; 3][..])
        );
        assert_eq!(checked.lookups[2].out_dims, vec![2, 2]);
    }

    #[test]
    fn a_key_read_row_by_row_gets_its_ids_unpooled() {
        let checked = request_to(&model_reading_rows(&["a"]), &VALUES, &LENGTHS, 2).unwrap();
        let a = &checked.lookups[0];
        assert_eq!(a.ids, vec![1, 2, 9]);
        assert_eq!((a.bags.as_ref(), a.weights.as_ref()), (None, None));
        assert_eq!(a.out_dims, vec![3, 2]);
        // The other keys are pooled as before.
        assert_eq!(checked.lookups[1].bags.as_deref(), Some(&[0, 0, 2][..]));
        assert_eq!(checked.lookups[2].out_dims, vec![2, 2]);
    }

    #[test]
    fn the_dense_program_gets_the_lengths_cut_by_key() {
        let model = model_reading_rows(&["a"]);
        let sources = &model.dense[4..];
        let want: Vec<DenseSource> = (0..3)
            .map(|key| DenseSource::KeyLengths { kjt: 0, key })
            .collect();
        assert_eq!(sources, &want[..]);
        let checked = request_to(&model, &VALUES, &LENGTHS, 2).unwrap();
        let cut: Vec<Vec<i64>> = (0..3)
            .map(|key| {
                let t = super::key_lengths(&model.kjts[0], &checked.inputs, key);
                assert_eq!(t.dims, vec![2]);
                t.to_i64().unwrap()
            })
            .collect();
        assert_eq!(cut, vec![vec![1, 0], vec![2, 1], vec![0, 2]]);
    }

    #[test]
    fn values_shorter_than_the_lengths_name_the_key() {
        let m = message(request(&VALUES[..4], &LENGTHS, 2));
        assert!(m.contains("\"p.values\""), "{m}");
        assert!(m.contains("4 values, but \"p.lengths\" give 6"), "{m}");
        assert!(m.contains("run out in key \"b\""), "{m}");
    }

    #[test]
    fn a_negative_length_names_key_and_sample() {
        let m = message(request(&VALUES, &[1, 0, 2, 1, -1, 3], 2));
        assert!(m.contains("input \"p.lengths\""), "{m}");
        assert!(
            m.contains("length -1 at position 4 (key \"b\", sample 0)"),
            "{m}"
        );
    }

    #[test]
    fn lengths_must_be_keys_times_batch() {
        let m = message(request(&VALUES, &LENGTHS[..5], 2));
        assert!(m.contains("\"p.lengths\""), "{m}");
        assert!(m.contains("3*B"), "{m}");
    }

    #[test]
    fn an_id_outside_its_keys_table_names_the_key() {
        // Key c reads t1 (4 rows): 5 is out of range there, though t0 has 10 rows.
        let m = message(request(&[5, 1, 2, 9, 0, 0], &LENGTHS, 2));
        assert!(m.contains("input \"p.values\""), "{m}");
        assert!(m.contains("id 5 at position 0"), "{m}");
        assert!(m.contains("key \"c\""), "{m}");
    }

    #[test]
    fn weights_must_match_the_values() {
        let mut given = vec![
            Some(Tensor::from_f32(vec![2, 2], &[0.5; 4])),
            Some(Tensor::from_i64(vec![6], &VALUES)),
            Some(Tensor::from_f32(vec![5], &[1.0; 5])),
            Some(Tensor::from_i64(vec![6], &LENGTHS)),
        ];
        let m = message(check_request(&model(), given.clone()));
        assert!(m.contains("\"p.weights\""), "{m}");
        given[3] = None;
        let m = message(check_request(&model(), given));
        assert!(m.contains("missing input \"p.lengths\""), "{m}");
    }
}
