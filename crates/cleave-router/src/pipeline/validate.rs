//! Checks a request's tensors against the manifest and prepares its lookups.
//!
//! Every rule of docs/bundle.md that a client can break is checked here, before any shard or
//! ranker sees the request: names, dtypes, shapes and their symbols, offsets, and ids after
//! the feature's transform. Each error names the input (or feature) and says what was
//! expected and what arrived.

use std::collections::HashMap;

use cleave_embed::bundle::{Dim, Layout, Transform};

use crate::error::RequestError;
use crate::model::{Feature, Model, TensorSpec};
use crate::pipeline::kjt::{self, KjtSplit};
use crate::tensor::Tensor;

/// The sizes the symbols of one request take, with the tensor that first fixed each.
///
/// A shape item is a size, a symbol (`"B"`, `"N0"`), or an expression over symbols
/// (`"N2 - 1"`, `"2*N0"`). Symbols bind on first sight; an expression is checked once all its
/// symbols are bound (expressions this reader cannot parse are left to the dense program).
#[derive(Debug, Default)]
pub struct Symbols {
    sizes: HashMap<String, (usize, String)>,
    /// Expressions met before their symbols were bound: (what, axis, expression, size).
    pending: Vec<(String, usize, String, usize)>,
}

impl Symbols {
    pub fn get(&self, symbol: &str) -> Option<usize> {
        self.sizes.get(symbol).map(|s| s.0)
    }

    /// Checks `dims` against `spec`'s shape, binding symbols met for the first time.
    /// `what` names the tensor in later messages ("input \"x\"").
    pub fn check(&mut self, spec: &[Dim], dims: &[usize], what: &str) -> Result<(), String> {
        if spec.len() != dims.len() {
            return Err(format!(
                "shape {dims:?} has {} dimensions, expected {} ({})",
                dims.len(),
                spec.len(),
                show_shape(spec)
            ));
        }
        for (axis, (want, &got)) in spec.iter().zip(dims).enumerate() {
            match want {
                Dim::Static(n) if *n as usize != got => {
                    return Err(format!(
                        "shape {dims:?}: dimension {axis} is {got}, expected {n} ({})",
                        show_shape(spec)
                    ))
                }
                Dim::Static(_) => {}
                Dim::Symbol(s) if is_identifier(s) => match self.sizes.get(s) {
                    Some((size, from)) if *size != got => {
                        return Err(format!(
                            "shape {dims:?}: dimension {axis} ({s}) is {got}, but {s} is {size} \
                             in {from}"
                        ))
                    }
                    Some(_) => {}
                    None => {
                        self.sizes.insert(s.clone(), (got, what.to_string()));
                    }
                },
                Dim::Symbol(expr) => self
                    .pending
                    .push((what.to_string(), axis, expr.clone(), got)),
            }
        }
        Ok(())
    }

    /// Checks the expressions whose symbols are all bound now; the message names the tensor.
    pub fn resolve(&mut self) -> Result<(), String> {
        let mut still = Vec::new();
        for (what, axis, expr, got) in std::mem::take(&mut self.pending) {
            match eval(&expr, &|name| self.get(name).map(|v| v as i128)) {
                Some(Some(want)) if want != got as i128 => {
                    return Err(format!(
                        "{what}: dimension {axis} is {got}, but {expr} is {want} in this request"
                    ))
                }
                Some(Some(_)) => {}
                Some(None) => still.push((what, axis, expr, got)),
                _ => {} // not parseable, or never bound: the dense program checks it
            }
        }
        self.pending = still;
        Ok(())
    }
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Evaluates a size expression of integers, symbols, `+`, `-`, `*` and parentheses.
/// `None`: not an expression of that form; `Some(None)`: a symbol is not bound yet.
pub fn eval(expr: &str, lookup: &dyn Fn(&str) -> Option<i128>) -> Option<Option<i128>> {
    let tokens = tokenize(expr)?;
    let mut p = Parser {
        tokens: &tokens,
        pos: 0,
        lookup,
        unbound: false,
    };
    let v = p.sum()?;
    if p.pos != tokens.len() {
        return None;
    }
    Some(if p.unbound { None } else { Some(v) })
}

#[derive(Debug, PartialEq)]
enum Token {
    Num(i128),
    Name(String),
    Op(char),
}

fn tokenize(s: &str) -> Option<Vec<Token>> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
        } else if c.is_ascii_digit() {
            let mut n: i128 = 0;
            while let Some(d) = chars.peek().and_then(|c| c.to_digit(10)) {
                n = n.checked_mul(10)?.checked_add(d as i128)?;
                chars.next();
            }
            out.push(Token::Num(n));
        } else if c.is_ascii_alphabetic() || c == '_' {
            let mut name = String::new();
            while let Some(&c) = chars
                .peek()
                .filter(|c| c.is_ascii_alphanumeric() || **c == '_')
            {
                name.push(c);
                chars.next();
            }
            out.push(Token::Name(name));
        } else if "+-*()".contains(c) {
            out.push(Token::Op(c));
            chars.next();
        } else {
            return None;
        }
    }
    Some(out)
}

struct Parser<'a> {
    tokens: &'a [Token],
    pos: usize,
    lookup: &'a dyn Fn(&str) -> Option<i128>,
    unbound: bool,
}

impl Parser<'_> {
    fn op(&mut self, c: char) -> bool {
        let hit = self.tokens.get(self.pos) == Some(&Token::Op(c));
        self.pos += hit as usize;
        hit
    }

    fn sum(&mut self) -> Option<i128> {
        let mut v = self.product()?;
        loop {
            if self.op('+') {
                v = v.checked_add(self.product()?)?;
            } else if self.op('-') {
                v = v.checked_sub(self.product()?)?;
            } else {
                return Some(v);
            }
        }
    }

    fn product(&mut self) -> Option<i128> {
        let mut v = self.factor()?;
        while self.op('*') {
            v = v.checked_mul(self.factor()?)?;
        }
        Some(v)
    }

    fn factor(&mut self) -> Option<i128> {
        if self.op('-') {
            return self.factor()?.checked_neg();
        }
        if self.op('(') {
            let v = self.sum()?;
            return self.op(')').then_some(v);
        }
        let t = self.tokens.get(self.pos)?;
        self.pos += 1;
        match t {
            Token::Num(n) => Some(*n),
            Token::Name(name) => Some((self.lookup)(name).unwrap_or_else(|| {
                self.unbound = true;
                0
            })),
            Token::Op(_) => None,
        }
    }
}

/// A manifest shape as people write it: `[B, 13]`.
pub fn show_shape(shape: &[Dim]) -> String {
    let items: Vec<String> = shape
        .iter()
        .map(|d| match d {
            Dim::Static(n) => n.to_string(),
            Dim::Symbol(s) => s.clone(),
        })
        .collect();
    format!("[{}]", items.join(", "))
}

/// One feature's lookup, ready for the shards.
#[derive(Debug, Clone, PartialEq)]
pub struct Lookup {
    /// Index into [`Model::features`].
    pub feature: usize,
    /// Ids after the feature's transform, each in `[0, rows)`.
    pub ids: Vec<i64>,
    /// Bag `b` is `ids[bags[b]..bags[b + 1]]`; `None` for an unpooled gather.
    pub bags: Option<Vec<usize>>,
    pub weights: Option<Vec<f32>>,
    /// The boundary tensor's dims: `[bags, dim]` pooled, `ids.dims + [dim]` gathered.
    pub out_dims: Vec<usize>,
}

/// A request that passed every check.
#[derive(Debug)]
pub struct Checked {
    /// The inputs in manifest order.
    pub inputs: Vec<Tensor>,
    pub lookups: Vec<Lookup>,
    pub symbols: Symbols,
}

/// Checks the datatype and declared shape of one named input before its data is converted.
pub fn check_declared(
    spec: &TensorSpec,
    datatype: &str,
    shape: &[usize],
) -> Result<(), RequestError> {
    if datatype != spec.dtype.kserve_name() {
        return Err(RequestError::input(
            &spec.name,
            format!(
                "datatype {datatype:?}, expected {:?} ({})",
                spec.dtype.kserve_name(),
                spec.dtype
            ),
        ));
    }
    if shape.len() != spec.shape.len() {
        return Err(RequestError::input(
            &spec.name,
            format!(
                "shape {shape:?} has {} dimensions, expected {} ({})",
                shape.len(),
                spec.shape.len(),
                show_shape(&spec.shape)
            ),
        ));
    }
    Ok(())
}

/// A decoded tensor as the model holds it: a KJT's values or lengths sent at the other
/// integer width become the manifest's.
pub fn to_held(spec: &TensorSpec, tensor: Tensor) -> Result<Tensor, RequestError> {
    if tensor.dtype == spec.dtype {
        return Ok(tensor);
    }
    let sent = tensor.dtype;
    tensor.to_int(spec.dtype).ok_or_else(|| {
        RequestError::input(
            &spec.name,
            format!(
                "a value sent as {sent} does not fit the model's {}",
                spec.dtype
            ),
        )
    })
}

/// Checks a full set of inputs (indexed like `model.inputs`; `None` = not given).
pub fn check_request(model: &Model, given: Vec<Option<Tensor>>) -> Result<Checked, RequestError> {
    let missing: Vec<&str> = model
        .inputs
        .iter()
        .zip(&given)
        .filter(|(_, t)| t.is_none())
        .map(|(s, _)| s.name.as_str())
        .collect();
    if !missing.is_empty() {
        return Err(RequestError::invalid(format!(
            "missing input{} {}; the model takes {}",
            if missing.len() == 1 { "" } else { "s" },
            quoted(&missing),
            quoted(
                &model
                    .inputs
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
            )
        )));
    }
    let inputs: Vec<Tensor> = given.into_iter().flatten().collect();
    let mut symbols = Symbols::default();
    for (spec, t) in model.inputs.iter().zip(&inputs) {
        if t.dtype != spec.dtype {
            return Err(RequestError::input(
                &spec.name,
                format!("dtype {}, expected {}", t.dtype, spec.dtype),
            ));
        }
        let what = format!("input {:?}", spec.name);
        symbols
            .check(&spec.shape, &t.dims, &what)
            .map_err(|e| RequestError::input(&spec.name, e))?;
    }
    // Every input is in: expressions still waiting can be checked now, naming their input.
    symbols.resolve().map_err(RequestError::invalid)?;
    let kjts = model
        .kjts
        .iter()
        .map(|g| kjt::split(model, g, &inputs))
        .collect::<Result<Vec<_>, _>>()?;
    let lookups = model
        .features
        .iter()
        .enumerate()
        .map(|(i, f)| prepare_lookup(model, i, f, &inputs, &kjts, &mut symbols))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Checked {
        inputs,
        lookups,
        symbols,
    })
}

/// `"a", "b"`: names for an error message.
pub(super) fn quoted<S: AsRef<str>>(names: &[S]) -> String {
    let q: Vec<String> = names.iter().map(|n| format!("{:?}", n.as_ref())).collect();
    q.join(", ")
}

/// Per-id weights from input `w` (none without one), which must have the shape of `like`;
/// `mismatch` says, given the weights' shape, what was expected.
pub(super) fn weights_like(
    model: &Model,
    inputs: &[Tensor],
    w: Option<usize>,
    like: &Tensor,
    mismatch: impl FnOnce(&[usize]) -> String,
) -> Result<Option<Vec<f32>>, RequestError> {
    let Some(w) = w else { return Ok(None) };
    let (name, t) = (&model.inputs[w].name, &inputs[w]);
    if t.dims != like.dims {
        return Err(RequestError::input(name, mismatch(&t.dims)));
    }
    t.to_f32()
        .map(Some)
        .ok_or_else(|| RequestError::input(name, "weights must be floats"))
}

fn prepare_lookup(
    model: &Model,
    index: usize,
    f: &Feature,
    inputs: &[Tensor],
    kjts: &[KjtSplit],
    symbols: &mut Symbols,
) -> Result<Lookup, RequestError> {
    let ids_name = &model.inputs[f.ids].name;
    if let Some((group, key)) = f.kjt {
        let lookup = kjt_lookup(index, f, ids_name, &kjts[group], key)?;
        check_output(model, f, ids_name, &lookup.out_dims, symbols)?;
        return Ok(lookup);
    }
    let ids_t = &inputs[f.ids];
    let raw = ids_t
        .to_i64()
        .ok_or_else(|| RequestError::input(ids_name, "ids must be integers"))?;
    let ids = transform_ids(&raw, f, ids_name, 0)?;

    let weights = weights_like(model, inputs, f.weights, ids_t, |dims| {
        format!(
            "weights have shape {dims:?}, expected the shape of ids {ids_name:?}, {:?}",
            ids_t.dims
        )
    })?;

    let (bags, out_dims) = match f.layout {
        Layout::Offsets => {
            let o = f
                .offsets
                .expect("offsets layout has offsets (checked at load)");
            let name = &model.inputs[o].name;
            let offsets = inputs[o]
                .to_i64()
                .expect("integer offsets (checked at load)");
            let bags = bag_bounds(&offsets, ids.len(), f.include_last_offset)
                .map_err(|e| RequestError::input(name, e))?;
            let count = bags.len() - 1;
            (Some(bags), vec![count, f.dim])
        }
        Layout::Fixed => {
            let (rows, width) = (ids_t.dims[0], ids_t.dims[1]);
            (
                Some((0..=rows).map(|b| b * width).collect()),
                vec![rows, f.dim],
            )
        }
        Layout::Gather => {
            let mut dims = ids_t.dims.clone();
            dims.push(f.dim);
            (None, dims)
        }
        Layout::Kjt => unreachable!("KJT features return above"),
    };
    check_output(model, f, ids_name, &out_dims, symbols)?;
    Ok(Lookup {
        feature: index,
        ids,
        bags,
        weights,
        out_dims,
    })
}

/// Key `key`'s lookup: its segment of the KJT's values (and weights) and its bags; unpooled
/// (an EmbeddingCollection's), the segment's rows `[ids, dim]`.
fn kjt_lookup(
    index: usize,
    f: &Feature,
    values_name: &str,
    kjt: &KjtSplit,
    key: usize,
) -> Result<Lookup, RequestError> {
    let segment = kjt.segments[key].clone();
    let ids = transform_ids(&kjt.values[segment.clone()], f, values_name, segment.start)?;
    if f.pooling.is_none() {
        return Ok(Lookup {
            feature: index,
            out_dims: vec![ids.len(), f.dim],
            ids,
            bags: None,
            weights: None,
        });
    }
    let bags = kjt.bags[key].clone();
    Ok(Lookup {
        feature: index,
        ids,
        out_dims: vec![bags.len() - 1, f.dim],
        bags: Some(bags),
        weights: kjt.weights.as_ref().map(|w| w[segment].to_vec()),
    })
}

/// Checks a lookup's output dims against its boundary tensor's shape and the symbols.
fn check_output(
    model: &Model,
    f: &Feature,
    ids_name: &str,
    out_dims: &[usize],
    symbols: &mut Symbols,
) -> Result<(), RequestError> {
    let out = &model.boundary[f.output];
    let what = format!("boundary tensor {:?}", out.name);
    symbols
        .check(&out.shape, out_dims, &what)
        .and_then(|()| symbols.resolve())
        .map_err(|e| {
            RequestError::invalid(format!(
                "feature {:?} (ids {ids_name:?}) makes its output {:?} with shape {out_dims:?}, \
             which does not fit {}: {e}",
                f.name,
                out.name,
                show_shape(&out.shape)
            ))
        })
}

/// Applies the feature's transform and checks every id against the table's rows. `first`:
/// the position of `raw[0]` in its input (a KJT key's segment starts inside the values).
fn transform_ids(
    raw: &[i64],
    f: &Feature,
    input: &str,
    first: usize,
) -> Result<Vec<i64>, RequestError> {
    let mut out = Vec::with_capacity(raw.len());
    for (position, &id) in raw.iter().enumerate() {
        let mut v = id;
        for step in &f.transform {
            // Divisors are non-zero (checked when the manifest was read).
            v = step.apply(v).unwrap_or(v);
        }
        if v < 0 || v as u64 >= f.rows {
            let after = if f.transform.is_empty() {
                String::new()
            } else {
                format!(
                    " becomes {v} after the transform {} and",
                    show_transform(&f.transform)
                )
            };
            let of = if f.kjt.is_some() { "key" } else { "feature" };
            return Err(RequestError::input(
                input,
                format!(
                    "id {id} at position {}{after} is outside table {:?} of {of} {:?}, rows \
                     [0, {})",
                    first + position,
                    f.table,
                    f.name,
                    f.rows
                ),
            ));
        }
        out.push(v);
    }
    Ok(out)
}

fn show_transform(steps: &[Transform]) -> String {
    let parts: Vec<String> = steps
        .iter()
        .map(|s| match s {
            Transform::Remainder { divisor } => format!("remainder {divisor}"),
            Transform::Fmod { divisor } => format!("fmod {divisor}"),
            Transform::Cast { dtype } => format!("cast {dtype}"),
        })
        .collect();
    parts.join(", ")
}

/// Bag boundaries (`bags + 1` entries) from PyTorch `embedding_bag` offsets: they start at 0,
/// never decrease and stay within the ids; the last bag ends at `n_ids`, or at the extra final
/// offset with `include_last_offset`.
pub fn bag_bounds(offsets: &[i64], n_ids: usize, include_last: bool) -> Result<Vec<usize>, String> {
    if include_last && offsets.is_empty() {
        return Err("offsets are empty, expected at least one (include_last_offset)".into());
    }
    if let Some(&first) = offsets.first() {
        if first != 0 {
            return Err(format!(
                "offsets[0] is {first}, expected 0 (the first bag starts at id 0)"
            ));
        }
    }
    let mut bounds = Vec::with_capacity(offsets.len() + 1);
    for (i, &o) in offsets.iter().enumerate() {
        if o < 0 || o as u64 > n_ids as u64 {
            return Err(format!(
                "offsets[{i}] is {o}, outside [0, {n_ids}] (the number of ids)"
            ));
        }
        if let Some(&prev) = bounds.last() {
            if (o as usize) < prev {
                return Err(format!(
                    "offsets[{i}] is {o}, less than offsets[{}] = {prev}; offsets must not \
                     decrease",
                    i - 1
                ));
            }
        }
        bounds.push(o as usize);
    }
    if !include_last {
        bounds.push(n_ids);
    }
    Ok(bounds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::model;
    use crate::tensor::DType;

    /// A good request for the test model: 2 candidates, 1 user bag.
    pub fn good_inputs() -> Vec<Option<Tensor>> {
        vec![
            Some(Tensor::from_f32(
                vec![2, 3],
                &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
            )),
            Some(Tensor::from_i64(vec![3], &[1, 2, 9])),
            Some(Tensor::from_i64(vec![1], &[0])),
            Some(Tensor::from_i64(vec![3], &[4, 5, 19])),
            Some(Tensor::from_i64(vec![2], &[0, 2])),
            Some(Tensor::from_f32(vec![3], &[1.0, 0.5, 2.0])),
            Some(i32s(vec![2, 2], &[3, -1, 8, 6])),
            Some(Tensor::from_i64(vec![2, 1], &[0, 19])),
        ]
    }

    fn i32s(dims: Vec<usize>, v: &[i32]) -> Tensor {
        Tensor::new(
            DType::I32,
            dims,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
        .unwrap()
    }

    fn err(inputs: Vec<Option<Tensor>>) -> String {
        check_request(&model(), inputs).unwrap_err().message
    }

    #[test]
    fn a_good_request_yields_its_lookups() {
        let c = check_request(&model(), good_inputs()).unwrap();
        assert_eq!(c.symbols.get("B"), Some(2));
        let item = &c.lookups[1];
        assert_eq!(item.bags.as_deref(), Some(&[0, 2, 3][..]));
        assert_eq!(item.weights.as_deref(), Some(&[1.0, 0.5, 2.0][..]));
        assert_eq!(item.out_dims, vec![2, 4]);
        // remainder 7 in Python semantics: -1 % 7 == 6, 8 % 7 == 1
        assert_eq!(c.lookups[2].ids, vec![3, 6, 1, 6]);
        assert_eq!(c.lookups[2].bags.as_deref(), Some(&[0, 2, 4][..]));
        assert_eq!(c.lookups[3].bags, None);
        assert_eq!(c.lookups[3].out_dims, vec![2, 1, 4]);
        assert_eq!(c.lookups[0].out_dims, vec![1, 4]);
    }

    #[test]
    fn missing_inputs_are_named() {
        let mut inputs = good_inputs();
        inputs[4] = None;
        inputs[5] = None;
        let e = err(inputs);
        assert!(
            e.contains("missing inputs \"item_offsets\", \"item_weights\""),
            "{e}"
        );
    }

    #[test]
    fn wrong_dtype_and_rank() {
        let mut inputs = good_inputs();
        inputs[1] = Some(i32s(vec![3], &[1, 2, 3]));
        assert!(err(inputs).contains("input \"user_ids\": dtype int32, expected int64"));
        let mut inputs = good_inputs();
        inputs[0] = Some(Tensor::from_f32(vec![6], &[0.0; 6]));
        let e = err(inputs);
        assert!(
            e.contains("input \"dense_x\": shape [6] has 1 dimensions, expected 2"),
            "{e}"
        );
        let mut inputs = good_inputs();
        inputs[0] = Some(Tensor::from_f32(vec![3, 2], &[0.0; 6]));
        let e = err(inputs);
        assert!(e.contains("dimension 1 is 2, expected 3 ([B, 3])"), "{e}");
    }

    #[test]
    fn inconsistent_symbols() {
        let mut inputs = good_inputs();
        inputs[4] = Some(Tensor::from_i64(vec![3], &[0, 1, 2]));
        let e = err(inputs);
        assert!(
            e.contains("input \"item_offsets\"")
                && e.contains("(B) is 3, but B is 2 in input \"dense_x\""),
            "{e}"
        );
        let mut inputs = good_inputs();
        inputs[5] = Some(Tensor::from_f32(vec![2], &[1.0, 1.0]));
        let e = err(inputs);
        assert!(
            e.contains("input \"item_weights\"") && e.contains("(N1) is 2, but N1 is 3"),
            "{e}"
        );
    }

    #[test]
    fn ids_out_of_range_after_transform() {
        let mut inputs = good_inputs();
        inputs[3] = Some(Tensor::from_i64(vec![3], &[4, 20, 1]));
        let e = err(inputs);
        assert!(
            e.contains("input \"item_ids\": id 20 at position 1 is outside table \"t_item\"")
                && e.contains("rows [0, 20)"),
            "{e}"
        );
        let mut inputs = good_inputs();
        inputs[3] = Some(Tensor::from_i64(vec![3], &[4, -1, 1]));
        assert!(err(inputs).contains("id -1 at position 1"));
        // The hashing transform maps any id into range: a huge id is fine.
        let mut inputs = good_inputs();
        inputs[6] = Some(i32s(vec![2, 2], &[i32::MAX, i32::MIN, 0, 1]));
        assert!(check_request(&model(), inputs).is_ok());
    }

    #[test]
    fn fmod_keeps_the_sign_and_is_refused_below_zero() {
        let mut j = crate::model::tests::manifest_json();
        j["features"][2]["transform"] = serde_json::json!([{"op": "fmod", "divisor": 7}]);
        let m = cleave_embed::bundle::Manifest::parse(&j.to_string(), "m".as_ref()).unwrap();
        let model = Model::from_manifest("x", &m).unwrap();
        let e = check_request(&model, good_inputs()).unwrap_err().message;
        assert!(
            e.contains("input \"cat\": id -1 at position 1 becomes -1 after the transform fmod 7"),
            "{e}"
        );
    }

    #[test]
    fn bad_offsets() {
        let cases: [(&[i64], &str); 4] = [
            (&[1, 2], "offsets[0] is 1, expected 0"),
            (&[0, 4], "offsets[1] is 4, outside [0, 3]"),
            (&[0, -2], "offsets[1] is -2"),
            (&[0, 0], ""), // two bags, the first empty: fine
        ];
        for (offsets, want) in cases {
            let mut inputs = good_inputs();
            inputs[4] = Some(Tensor::from_i64(vec![2], offsets));
            let r = check_request(&model(), inputs);
            if want.is_empty() {
                assert!(r.is_ok(), "{offsets:?}");
            } else {
                let e = r.unwrap_err().message;
                assert!(
                    e.contains("input \"item_offsets\"") && e.contains(want),
                    "{e}"
                );
            }
        }
        assert!(bag_bounds(&[0, 2, 1], 3, false)
            .unwrap_err()
            .contains("must not decrease"));
        assert_eq!(bag_bounds(&[0, 1, 3], 3, true).unwrap(), vec![0, 1, 3]);
        assert_eq!(bag_bounds(&[0, 1, 2], 3, true).unwrap(), vec![0, 1, 2]);
        assert!(bag_bounds(&[], 0, true).is_err());
        assert_eq!(bag_bounds(&[], 0, false).unwrap(), vec![0]);
    }

    #[test]
    fn weights_must_match_ids() {
        let mut j = crate::model::tests::manifest_json();
        j["inputs"][5]["shape"] = serde_json::json!(["N2"]);
        let m = cleave_embed::bundle::Manifest::parse(&j.to_string(), "m".as_ref()).unwrap();
        let model = Model::from_manifest("x", &m).unwrap();
        let mut inputs = good_inputs();
        inputs[5] = Some(Tensor::from_f32(vec![2], &[1.0, 1.0]));
        let e = check_request(&model, inputs).unwrap_err().message;
        assert!(
            e.contains("input \"item_weights\": weights have shape [2]"),
            "{e}"
        );
    }

    #[test]
    fn bag_count_must_fit_the_boundary() {
        // The shared user feature's boundary is [1, 4]: two user bags do not fit.
        let mut j = crate::model::tests::manifest_json();
        j["inputs"][2]["shape"] = serde_json::json!(["L9"]);
        let m = cleave_embed::bundle::Manifest::parse(&j.to_string(), "m".as_ref()).unwrap();
        let model = Model::from_manifest("x", &m).unwrap();
        let mut inputs = good_inputs();
        inputs[2] = Some(Tensor::from_i64(vec![2], &[0, 1]));
        let e = check_request(&model, inputs).unwrap_err().message;
        assert!(
            e.contains("feature \"user\"") && e.contains("dimension 0 is 2, expected 1"),
            "{e}"
        );
    }

    #[test]
    fn size_expressions() {
        let bound = |name: &str| match name {
            "N0" => Some(5),
            "B" => Some(3),
            _ => None,
        };
        assert_eq!(eval("N0 - 1", &bound), Some(Some(4)));
        assert_eq!(eval("2*N0 + B", &bound), Some(Some(13)));
        assert_eq!(eval("(N0 + 1)*(B - 1)", &bound), Some(Some(12)));
        assert_eq!(eval("-B + 10", &bound), Some(Some(7)));
        assert_eq!(eval("N7 + 1", &bound), Some(None)); // not bound yet
        assert_eq!(eval("Max(1, N0)", &bound), None); // not an expression this reader knows
        assert_eq!(eval("N0 //2", &bound), None);
        assert_eq!(eval("(N0", &bound), None);
        assert_eq!(
            eval("99999999999999999999999999999999999999999", &bound),
            None
        );
    }

    #[test]
    fn expressions_in_shapes_are_checked_once_bound() {
        // include_last_offset: offsets have one more entry than there are bags.
        let mut j = crate::model::tests::manifest_json();
        j["inputs"][4]["shape"] = serde_json::json!(["B + 1"]);
        j["features"][1]["include_last_offset"] = true.into();
        let m = cleave_embed::bundle::Manifest::parse(&j.to_string(), "m".as_ref()).unwrap();
        let model = Model::from_manifest("x", &m).unwrap();
        let mut inputs = good_inputs();
        inputs[4] = Some(Tensor::from_i64(vec![3], &[0, 2, 3]));
        let c = check_request(&model, inputs).unwrap();
        assert_eq!(c.lookups[1].bags.as_deref(), Some(&[0, 2, 3][..]));
        let mut inputs = good_inputs();
        inputs[4] = Some(Tensor::from_i64(vec![2], &[0, 2]));
        let e = check_request(&model, inputs).unwrap_err().message;
        assert!(
            e.contains("input \"item_offsets\": dimension 0 is 2, but B + 1 is 3 in this request"),
            "{e}"
        );
    }
}
