//! The per-feature JSON form (`POST /v2/models/{name}/rank`, docs/api.md): one shared part
//! and a list of candidates, each an object of input name → value. The router turns it into
//! the model's named tensors — rows stacked into the batch, jagged id lists into values +
//! offsets — and then checks them exactly like an infer request.
//!
//! ```json
//! {"shared": {"user_ids": [1, 2]},
//!  "candidates": [{"dense_x": [0.1, 0.2, 0.3], "item_ids": [4, 5]}, ...],
//!  "budget_ms": 25}
//! ```

use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::codec::json_tensor::{JsonData, Scalar};
use crate::codec::kserve::unknown_input;
use crate::error::RequestError;
use crate::model::{JaggedGroup, Model};
use crate::tensor::{DType, Tensor};
use cleave_embed::bundle::Dim;

#[derive(Debug)]
pub struct RankRequest {
    pub id: Option<String>,
    pub budget_ms: Option<f64>,
    pub inputs: Vec<Option<Tensor>>,
    pub candidates: usize,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRank {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    shared: Map<String, Value>,
    candidates: Vec<Map<String, Value>>,
    #[serde(default)]
    budget_ms: Option<Value>,
}

/// How the per-feature form supplies one input.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Source {
    /// One row per candidate, stacked into the batch.
    Row,
    /// A list of ids per candidate (jagged group index).
    CandidateIds(usize),
    /// A list of weights per candidate, as long as its ids.
    CandidateWeights(usize),
    /// A list of ids (one bag) or a list of lists (bags) in "shared".
    SharedIds(usize),
    SharedWeights(usize),
    /// Built by the router from the id lists.
    Offsets(usize),
    /// The whole tensor, given once in "shared".
    Whole,
}

fn sources(model: &Model) -> Vec<Source> {
    let mut out: Vec<Source> = model
        .inputs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            if s.is_batch_major() && !model.shared[i] {
                Source::Row
            } else {
                Source::Whole
            }
        })
        .collect();
    for (g, group) in model.jagged.iter().enumerate() {
        out[group.offsets] = Source::Offsets(g);
        if group.shared {
            out[group.ids] = Source::SharedIds(g);
            if let Some(w) = group.weights {
                out[w] = Source::SharedWeights(g);
            }
        } else {
            out[group.ids] = Source::CandidateIds(g);
            if let Some(w) = group.weights {
                out[w] = Source::CandidateWeights(g);
            }
        }
    }
    out
}

fn in_candidate(s: Source) -> bool {
    matches!(
        s,
        Source::Row | Source::CandidateIds(_) | Source::CandidateWeights(_)
    )
}

pub fn parse_rank(model: &Model, body: &[u8]) -> Result<RankRequest, RequestError> {
    let raw: RawRank = serde_json::from_slice(body).map_err(RequestError::json)?;
    let budget_ms = crate::codec::kserve::budget_param(raw.budget_ms.as_ref())?;
    let n = raw.candidates.len();
    if n == 0 {
        return Err(RequestError::invalid(
            "\"candidates\" is empty; give at least one",
        ));
    }
    let sources = sources(model);
    let index = |name: &str| {
        model
            .input_index(name)
            .ok_or_else(|| unknown_input(model, name))
    };

    for name in raw.shared.keys() {
        let i = index(name)?;
        match sources[i] {
            Source::Offsets(g) => return Err(offsets_given(model, &model.jagged[g], name)),
            s if in_candidate(s) => {
                return Err(RequestError::input(
                    name,
                    "has one value per candidate; give it in each candidate, not in \"shared\"",
                ))
            }
            _ => {}
        }
    }
    for (c, cand) in raw.candidates.iter().enumerate() {
        for name in cand.keys() {
            let i = index(name).map_err(|e| at_candidate(c, e))?;
            match sources[i] {
                Source::Offsets(g) => {
                    return Err(at_candidate(
                        c,
                        offsets_given(model, &model.jagged[g], name),
                    ))
                }
                s if !in_candidate(s) => {
                    return Err(at_candidate(
                        c,
                        RequestError::input(
                            name,
                            "is shared by all candidates; give it once in \"shared\"",
                        ),
                    ))
                }
                _ => {}
            }
        }
    }

    let mut inputs: Vec<Option<Tensor>> = vec![None; model.inputs.len()];
    for (i, spec) in model.inputs.iter().enumerate() {
        let name = &spec.name;
        match sources[i] {
            Source::Row => inputs[i] = Some(stack_rows(name, spec.dtype, &raw.candidates)?),
            Source::Whole => {
                let v = raw
                    .shared
                    .get(name)
                    .ok_or_else(|| RequestError::input(name, "missing; give it in \"shared\""))?;
                let mut data = parse_data(name, v)?;
                // A batch-of-one input may be given as its single row.
                if matches!(spec.shape.first(), Some(Dim::Static(1)))
                    && data.extents.len() + 1 == spec.shape.len()
                {
                    data.extents.insert(0, 1);
                }
                let dims = data.extents.clone();
                let t = data
                    .into_tensor(spec.dtype, &dims)
                    .map_err(|e| RequestError::input(name, e))?;
                inputs[i] = Some(t);
            }
            Source::CandidateIds(g) => {
                let group = &model.jagged[g];
                let bags: Vec<&Value> = raw
                    .candidates
                    .iter()
                    .enumerate()
                    .map(|(c, cand)| {
                        cand.get(name).ok_or_else(|| {
                            at_candidate(c, RequestError::input(name, "missing (a list of ids)"))
                        })
                    })
                    .collect::<Result<_, _>>()?;
                fill_jagged(
                    model,
                    group,
                    bags,
                    &raw.candidates,
                    None,
                    false,
                    &mut inputs,
                )?;
            }
            Source::SharedIds(g) => {
                let group = &model.jagged[g];
                let v = raw.shared.get(name).ok_or_else(|| {
                    RequestError::input(name, "missing; give its ids in \"shared\"")
                })?;
                // A flat list is one bag; a list of lists is several.
                let nested = matches!(v, Value::Array(items)
                    if !items.is_empty() && items.iter().all(Value::is_array));
                let bags: Vec<&Value> = match v {
                    Value::Array(items) if nested => items.iter().collect(),
                    other => vec![other],
                };
                let shared = Some(&raw.shared);
                fill_jagged(
                    model,
                    group,
                    bags,
                    &raw.candidates,
                    shared,
                    nested,
                    &mut inputs,
                )?;
            }
            Source::CandidateWeights(_) | Source::SharedWeights(_) | Source::Offsets(_) => {}
        }
    }
    Ok(RankRequest {
        id: raw.id,
        budget_ms,
        inputs,
        candidates: n,
    })
}

fn at_candidate(c: usize, mut e: RequestError) -> RequestError {
    e.message = format!("candidate {c}: {}", e.message);
    e
}

fn offsets_given(model: &Model, group: &JaggedGroup, name: &str) -> RequestError {
    RequestError::input(
        name,
        format!(
            "offsets are built by the router in this form; give a list of ids under {:?}",
            model.inputs[group.ids].name
        ),
    )
}

fn parse_data(name: &str, v: &Value) -> Result<JsonData, RequestError> {
    JsonData::deserialize(v).map_err(|e| RequestError::input(name, e))
}

/// Stacks each candidate's row of `name` into one `[n, row...]` tensor.
fn stack_rows(
    name: &str,
    dtype: DType,
    candidates: &[Map<String, Value>],
) -> Result<Tensor, RequestError> {
    let mut values: Vec<Scalar> = Vec::new();
    let mut row_dims: Option<Vec<usize>> = None;
    for (c, cand) in candidates.iter().enumerate() {
        let v = cand
            .get(name)
            .ok_or_else(|| at_candidate(c, RequestError::input(name, "missing")))?;
        let data = parse_data(name, v).map_err(|e| at_candidate(c, e))?;
        if data.ragged {
            return Err(at_candidate(
                c,
                RequestError::input(name, "is a ragged nested array"),
            ));
        }
        match &row_dims {
            None => row_dims = Some(data.extents.clone()),
            Some(first) if *first != data.extents => {
                return Err(at_candidate(
                    c,
                    RequestError::input(
                        name,
                        format!(
                            "row has shape {:?}, candidate 0's has {first:?}",
                            data.extents
                        ),
                    ),
                ))
            }
            Some(_) => {}
        }
        values.extend(data.values);
    }
    let mut dims = vec![candidates.len()];
    dims.extend(row_dims.unwrap_or_default());
    JsonData::from_values(values)
        .into_tensor(dtype, &dims)
        .map_err(|e| RequestError::input(name, e))
}

/// Builds a jagged group's ids, offsets and weights from one id list per bag.
fn fill_jagged(
    model: &Model,
    group: &JaggedGroup,
    bags: Vec<&Value>,
    candidates: &[Map<String, Value>],
    shared: Option<&Map<String, Value>>,
    nested: bool,
    inputs: &mut [Option<Tensor>],
) -> Result<(), RequestError> {
    let ids_spec = &model.inputs[group.ids];
    let where_ = |b: usize, e: RequestError| {
        if shared.is_some() {
            e
        } else {
            at_candidate(b, e)
        }
    };
    let mut ids: Vec<Scalar> = Vec::new();
    let mut offsets: Vec<i64> = Vec::with_capacity(bags.len() + 1);
    let mut lengths = Vec::with_capacity(bags.len());
    for (b, v) in bags.iter().enumerate() {
        let data = parse_data(&ids_spec.name, v).map_err(|e| where_(b, e))?;
        if data.extents.len() != 1 {
            return Err(where_(
                b,
                RequestError::input(&ids_spec.name, "must be a list of ids"),
            ));
        }
        offsets.push(ids.len() as i64);
        lengths.push(data.values.len());
        ids.extend(data.values);
    }
    if group.include_last_offset {
        offsets.push(ids.len() as i64);
    }
    let n_ids = ids.len();
    inputs[group.ids] = Some(
        JsonData::from_values(ids)
            .into_tensor(ids_spec.dtype, &[n_ids])
            .map_err(|e| RequestError::input(&ids_spec.name, e))?,
    );
    let off_spec = &model.inputs[group.offsets];
    let off = JsonData::from_values(offsets.iter().map(|&o| Scalar::Int(o)).collect());
    inputs[group.offsets] = Some(
        off.into_tensor(off_spec.dtype, &[offsets.len()])
            .map_err(|e| RequestError::input(&off_spec.name, e))?,
    );
    if let Some(w) = group.weights {
        let w_spec = &model.inputs[w];
        let lists: Vec<Option<&Value>> = match shared {
            Some(s) => match (s.get(&w_spec.name), nested) {
                (Some(Value::Array(items)), true) => items.iter().map(Some).collect(),
                (other, _) => vec![other],
            },
            None => candidates.iter().map(|c| c.get(&w_spec.name)).collect(),
        };
        if lists.len() != lengths.len() {
            return Err(RequestError::input(
                &w_spec.name,
                format!(
                    "has {} bags of weights, expected {}",
                    lists.len(),
                    lengths.len()
                ),
            ));
        }
        let mut weights = Vec::with_capacity(n_ids);
        for (b, (v, &len)) in lists.iter().zip(&lengths).enumerate() {
            let v = v.ok_or_else(|| {
                where_(
                    b,
                    RequestError::input(&w_spec.name, "missing (one weight per id)"),
                )
            })?;
            let data = parse_data(&w_spec.name, v).map_err(|e| where_(b, e))?;
            if data.extents != [len] {
                return Err(where_(
                    b,
                    RequestError::input(
                        &w_spec.name,
                        format!(
                            "has {:?} values, expected one weight per id of {:?} ({len})",
                            data.extents, ids_spec.name
                        ),
                    ),
                ));
            }
            weights.extend(data.values);
        }
        inputs[w] = Some(
            JsonData::from_values(weights)
                .into_tensor(w_spec.dtype, &[n_ids])
                .map_err(|e| RequestError::input(&w_spec.name, e))?,
        );
    }
    Ok(())
}

/// The rank response's outputs: name → nested rows (one per candidate for batch outputs).
pub struct NestedOutputs<'a>(pub Vec<(&'a str, &'a Tensor)>);

impl Serialize for NestedOutputs<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, t) in &self.0 {
            map.serialize_entry(
                name,
                &Nested {
                    values: &values_of(t),
                    dims: &t.dims,
                },
            )?;
        }
        map.end()
    }
}

fn values_of(t: &Tensor) -> Vec<Value> {
    match t.dtype {
        DType::Bool => t.data.iter().map(|&b| Value::Bool(b != 0)).collect(),
        DType::F32 | DType::F16 | DType::BF16 => t
            .to_f32()
            .expect("floating dtype")
            .into_iter()
            .map(|v| serde_json::Number::from_f64(v as f64).map_or(Value::Null, Value::Number))
            .collect(),
        _ => t
            .to_i64()
            .expect("integer dtype")
            .into_iter()
            .map(Value::from)
            .collect(),
    }
}

struct Nested<'a> {
    values: &'a [Value],
    dims: &'a [usize],
}

impl Serialize for Nested<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.dims.split_first() {
            None => self.values.first().unwrap_or(&Value::Null).serialize(s),
            Some((&n, rest)) => {
                let step = crate::tensor::numel(rest).unwrap_or(0);
                let mut seq = s.serialize_seq(Some(n))?;
                for i in 0..n {
                    let part = &self.values[i * step..(i + 1) * step];
                    seq.serialize_element(&Nested {
                        values: part,
                        dims: rest,
                    })?;
                }
                seq.end()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::model;
    use crate::pipeline::validate::check_request;
    use serde_json::json;

    fn good() -> Value {
        json!({
            "shared": {"user_ids": [1, 2, 9]},
            "candidates": [
                {"dense_x": [0.1, 0.2, 0.3], "item_ids": [4, 5], "item_weights": [1, 0.5],
                 "cat": [3, -1], "hist": [0]},
                {"dense_x": [0.4, 0.5, 0.6], "item_ids": [19], "item_weights": [2],
                 "cat": [8, 6], "hist": [19]}
            ],
            "budget_ms": 30
        })
    }

    fn parse(v: &Value) -> Result<RankRequest, RequestError> {
        parse_rank(&model(), v.to_string().as_bytes())
    }

    #[test]
    fn builds_the_same_tensors_as_the_infer_form() {
        let r = parse(&good()).unwrap();
        assert_eq!((r.candidates, r.budget_ms), (2, Some(30.0)));
        let t = |i: usize| r.inputs[i].clone().unwrap();
        assert_eq!(t(0).dims, vec![2, 3]);
        assert_eq!(t(1).to_i64().unwrap(), vec![1, 2, 9]);
        assert_eq!(t(2).to_i64().unwrap(), vec![0]); // one shared bag
        assert_eq!(t(3).to_i64().unwrap(), vec![4, 5, 19]);
        assert_eq!(t(4).to_i64().unwrap(), vec![0, 2]);
        assert_eq!(t(5).to_f32().unwrap(), vec![1.0, 0.5, 2.0]);
        assert_eq!((t(6).dtype, t(6).dims.clone()), (DType::I32, vec![2, 2]));
        assert_eq!(t(7).dims, vec![2, 1]);
        // Exactly the tensors the validation test's good KServe request holds.
        let checked = check_request(&model(), r.inputs).unwrap();
        assert_eq!(checked.lookups[1].bags.as_deref(), Some(&[0, 2, 3][..]));
    }

    #[test]
    fn shared_bags_as_list_of_lists() {
        let mut v = good();
        v["shared"]["user_ids"] = json!([[1], [2, 9]]);
        let r = parse(&v).unwrap();
        assert_eq!(r.inputs[2].as_ref().unwrap().to_i64().unwrap(), vec![0, 1]);
        // ... which the manifest's [1]-shaped user offsets then refuse, naming them.
        let e = check_request(&model(), r.inputs).unwrap_err().message;
        assert!(e.contains("input \"user_offsets\""), "{e}");
    }

    fn err(v: &Value) -> String {
        parse(v).unwrap_err().message
    }

    #[test]
    fn misplaced_and_missing_inputs() {
        let mut v = good();
        v["shared"]["dense_x"] = json!([1, 2, 3]);
        assert!(err(&v).contains("input \"dense_x\": has one value per candidate"));
        let mut v = good();
        v["candidates"][1]["user_ids"] = json!([1]);
        assert!(err(&v).contains("candidate 1: input \"user_ids\": is shared"));
        let mut v = good();
        v["candidates"][0]["item_offsets"] = json!([0]);
        let e = err(&v);
        assert!(
            e.contains("candidate 0: input \"item_offsets\": offsets are built"),
            "{e}"
        );
        assert!(e.contains("under \"item_ids\""), "{e}");
        let mut v = good();
        v["candidates"][1]
            .as_object_mut()
            .unwrap()
            .remove("dense_x");
        assert!(err(&v).contains("candidate 1: input \"dense_x\": missing"));
        let mut v = good();
        v["candidates"][1]
            .as_object_mut()
            .unwrap()
            .remove("item_ids");
        assert!(err(&v).contains("candidate 1: input \"item_ids\": missing"));
        let mut v = good();
        v["shared"].as_object_mut().unwrap().remove("user_ids");
        assert!(err(&v).contains("input \"user_ids\": missing"));
        let mut v = good();
        v["candidates"][0]["nope"] = json!(1);
        assert!(err(&v).contains("candidate 0: unknown input \"nope\""));
        let mut v = good();
        v["candidates"] = json!([]);
        assert!(err(&v).contains("\"candidates\" is empty"));
        assert_eq!(
            parse_rank(&model(), b"{\"shared\": 1}").unwrap_err().kind,
            crate::ErrorKind::InvalidJson
        );
    }

    #[test]
    fn misshapen_values() {
        let mut v = good();
        v["candidates"][1]["dense_x"] = json!([1, 2]);
        assert!(err(&v)
            .contains("candidate 1: input \"dense_x\": row has shape [2], candidate 0's has [3]"));
        let mut v = good();
        v["candidates"][1]["item_ids"] = json!(7);
        assert!(err(&v).contains("candidate 1: input \"item_ids\": must be a list of ids"));
        let mut v = good();
        v["candidates"][0]["item_weights"] = json!([1]);
        let e = err(&v);
        assert!(
            e.contains("candidate 0: input \"item_weights\"") && e.contains("(2)"),
            "{e}"
        );
        let mut v = good();
        v["candidates"][0]["item_ids"] = json!([1.5, 2]);
        assert!(err(&v).contains("input \"item_ids\": element 0 is 1.5, expected an int64"));
        let mut v = good();
        v["budget_ms"] = json!(0);
        assert!(err(&v).contains("budget_ms"));
    }

    #[test]
    fn nested_outputs() {
        let t = Tensor::from_f32(vec![2, 1], &[0.5, 0.25]);
        let s = serde_json::to_string(&NestedOutputs(vec![("output_0", &t)])).unwrap();
        assert_eq!(s, r#"{"output_0":[[0.5],[0.25]]}"#);
        let i = Tensor::from_i64(vec![3], &[1, 2, 3]);
        let s = serde_json::to_string(&NestedOutputs(vec![("k", &i)])).unwrap();
        assert_eq!(s, r#"{"k":[1,2,3]}"#);
    }
}
