//! The Open Inference Protocol (KServe v2) JSON forms: infer request in, infer response and
//! model metadata out. <https://kserve.github.io/website/latest/modelserving/data_plane/v2_protocol/>

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::error::RequestError;
use crate::json_tensor::{JsonData, JsonElements};
use crate::model::{Model, TensorSpec};
use crate::tensor::Tensor;
use crate::validate::check_declared;

/// An infer request, parsed and converted, not yet checked as a whole.
#[derive(Debug)]
pub struct InferRequest {
    pub id: Option<String>,
    /// `parameters.budget_ms`, when given.
    pub budget_ms: Option<f64>,
    /// Indexed like `model.inputs`; `None` where the request did not give the input.
    pub inputs: Vec<Option<Tensor>>,
    /// Indices into `model.outputs` the client asked for; `None` = all.
    pub outputs: Option<Vec<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequest<'a> {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    #[serde(borrow)]
    inputs: Vec<RawInput<'a>>,
    #[serde(default)]
    outputs: Option<Vec<RawOutput>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInput<'a> {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    // Kept raw so that a bad element is reported with the input's name.
    #[serde(borrow, default)]
    data: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOutput {
    name: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
}

/// The one answer to every part of the binary tensor data extension.
pub const NO_BINARY: &str =
    "binary tensor data is not supported yet (send JSON data, or binary_data: false)";

/// Rejects the binary tensor data extension in `parameters`: a flag among `flags` set to
/// anything but false, or a `binary_data_size`. Says which parameter it found.
fn check_not_binary(parameters: Option<&Map<String, Value>>, flags: &[&str]) -> Result<(), String> {
    let Some(p) = parameters else { return Ok(()) };
    for &flag in flags {
        match p.get(flag) {
            None | Some(Value::Bool(false)) => {}
            Some(v) => return Err(format!("parameters.{flag} is {v}: {NO_BINARY}")),
        }
    }
    match p.get("binary_data_size") {
        Some(v) => Err(format!("parameters.binary_data_size is {v}: {NO_BINARY}")),
        None => Ok(()),
    }
}

/// Reads a `budget_ms` value: a positive number of milliseconds.
pub fn budget_param(value: Option<&Value>) -> Result<Option<f64>, RequestError> {
    let Some(v) = value else { return Ok(None) };
    match v.as_f64() {
        Some(ms) if ms > 0.0 && ms.is_finite() => Ok(Some(ms)),
        _ => Err(RequestError::invalid(format!(
            "budget_ms is {v}, expected a positive number of milliseconds"
        ))),
    }
}

/// Parses an infer request body against the model.
pub fn parse_infer(model: &Model, body: &[u8]) -> Result<InferRequest, RequestError> {
    let raw: RawRequest = serde_json::from_slice(body).map_err(RequestError::json)?;
    check_not_binary(raw.parameters.as_ref(), &["binary_data_output"])
        .map_err(|e| RequestError::invalid(format!("request {e}")))?;
    let budget_ms = budget_param(raw.parameters.as_ref().and_then(|p| p.get("budget_ms")))?;
    let mut inputs: Vec<Option<Tensor>> = vec![None; model.inputs.len()];
    for input in raw.inputs {
        let index = model
            .input_index(&input.name)
            .ok_or_else(|| unknown_input(model, &input.name))?;
        if inputs[index].is_some() {
            return Err(RequestError::input(&input.name, "given twice"));
        }
        inputs[index] = Some(convert_input(&model.inputs[index], input)?);
    }
    let outputs = raw
        .outputs
        .map(|requested| select_outputs(model, &requested))
        .transpose()?;
    Ok(InferRequest {
        id: raw.id,
        budget_ms,
        inputs,
        outputs,
    })
}

/// Indices of the outputs a request names, in its order.
fn select_outputs(model: &Model, requested: &[RawOutput]) -> Result<Vec<usize>, RequestError> {
    if requested.is_empty() {
        return Err(RequestError::invalid(format!(
            "\"outputs\" is empty; name at least one output ({}), or leave \"outputs\" out \
             to get all of them",
            names(&model.outputs)
        )));
    }
    requested
        .iter()
        .map(|o| {
            check_not_binary(o.parameters.as_ref(), &["binary_data"])
                .map_err(|e| RequestError::invalid(format!("output {:?}: {e}", o.name)))?;
            model
                .outputs
                .iter()
                .position(|s| s.name == o.name)
                .ok_or_else(|| {
                    RequestError::invalid(format!(
                        "unknown output {:?}; the model returns {}",
                        o.name,
                        names(&model.outputs)
                    ))
                })
        })
        .collect()
}

pub fn unknown_input(model: &Model, name: &str) -> RequestError {
    RequestError::invalid(format!(
        "unknown input {name:?}; the model takes {}",
        names(&model.inputs)
    ))
}

fn names(specs: &[TensorSpec]) -> String {
    let q: Vec<String> = specs.iter().map(|s| format!("{:?}", s.name)).collect();
    q.join(", ")
}

fn convert_input(spec: &TensorSpec, input: RawInput) -> Result<Tensor, RequestError> {
    let shape = input
        .shape
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| {
            RequestError::input(
                &spec.name,
                format!("shape {:?} has a negative size", input.shape),
            )
        })?;
    check_not_binary(input.parameters.as_ref(), &["binary_data"])
        .map_err(|e| RequestError::input(&spec.name, e))?;
    check_declared(spec, &input.datatype, &shape)?;
    let raw = input
        .data
        .ok_or_else(|| RequestError::input(&spec.name, "no \"data\" given"))?;
    let data: JsonData = serde_json::from_str(raw.get())
        .map_err(|e| RequestError::input(&spec.name, format!("data: {e}")))?;
    data.into_tensor(spec.dtype, &shape)
        .map_err(|e| RequestError::input(&spec.name, e))
}

/// One output tensor of a response.
#[derive(Serialize)]
struct ResponseOutput<'a> {
    name: &'a str,
    datatype: &'static str,
    shape: &'a [usize],
    data: JsonElements<'a>,
}

#[derive(Serialize)]
struct Response<'a> {
    model_name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    parameters: &'a Map<String, Value>,
    outputs: Vec<ResponseOutput<'a>>,
}

/// The infer response body. `outputs` are the model's flat outputs, in manifest order;
/// `selected` picks some of them.
pub fn infer_response(
    model: &Model,
    id: Option<&str>,
    outputs: &[Tensor],
    selected: Option<&[usize]>,
    parameters: &Map<String, Value>,
) -> Vec<u8> {
    let all: Vec<usize> = (0..outputs.len()).collect();
    let pick = selected.unwrap_or(&all);
    let response = Response {
        model_name: &model.name,
        id,
        parameters,
        outputs: pick
            .iter()
            .map(|&i| ResponseOutput {
                name: &model.outputs[i].name,
                datatype: outputs[i].dtype.kserve_name(),
                shape: &outputs[i].dims,
                data: JsonElements(&outputs[i]),
            })
            .collect(),
    };
    serde_json::to_vec(&response).expect("serializing numbers and strings cannot fail")
}

/// `GET /v2/models/{name}`: inputs and outputs, -1 for symbolic sizes.
pub fn model_metadata(model: &Model) -> Value {
    let tensors = |specs: &[TensorSpec]| -> Vec<Value> {
        specs
            .iter()
            .map(|s| {
                serde_json::json!({
                    "name": s.name,
                    "datatype": s.dtype.kserve_name(),
                    "shape": s.kserve_shape(),
                })
            })
            .collect()
    };
    serde_json::json!({
        "name": model.name,
        "versions": ["1"],
        "platform": "cleave",
        "inputs": tensors(&model.inputs),
        "outputs": tensors(&model.outputs),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::model::tests::model;

    fn body(inputs: Value) -> Vec<u8> {
        serde_json::json!({"inputs": inputs, "parameters": {"budget_ms": 25}})
            .to_string()
            .into_bytes()
    }

    fn dense(shape: Value, datatype: &str, data: Value) -> Value {
        serde_json::json!([{"name": "dense_x", "shape": shape, "datatype": datatype, "data": data}])
    }

    #[test]
    fn parses_inputs_and_parameters() {
        let m = model();
        let r = parse_infer(
            &m,
            &body(dense(
                [2, 3].into(),
                "FP32",
                serde_json::json!([[1, 2, 3], [4, 5, 6.5]]),
            )),
        )
        .unwrap();
        assert_eq!(r.budget_ms, Some(25.0));
        let t = r.inputs[0].as_ref().unwrap();
        assert_eq!(t.dims, vec![2, 3]);
        assert_eq!(t.to_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.5]);
        assert!(r.inputs[1].is_none());
    }

    fn err(b: &[u8]) -> RequestError {
        parse_infer(&model(), b).unwrap_err()
    }

    #[test]
    fn malformed_bodies() {
        let e = err(b"{not json");
        assert_eq!(e.kind, ErrorKind::InvalidJson);
        assert!(e.message.contains("line 1"), "{}", e.message);
        assert_eq!(err(b"[]").kind, ErrorKind::InvalidJson);
        assert_eq!(err(br#"{"inputs": 3}"#).kind, ErrorKind::InvalidJson);
        assert_eq!(
            err(br#"{"inputs": [], "bogus": 1}"#).kind,
            ErrorKind::InvalidJson
        );
        let e = err(&body(
            serde_json::json!([{"name": "nope", "shape": [1], "datatype": "FP32", "data": [1]}]),
        ));
        assert!(
            e.message
                .contains("unknown input \"nope\"; the model takes \"dense_x\""),
            "{}",
            e.message
        );
    }

    #[test]
    fn input_problems_name_the_input() {
        let cases: Vec<(Value, &str)> = vec![
            (
                dense([2, 3].into(), "FP64", [0; 6].into()),
                "datatype \"FP64\", expected \"FP32\"",
            ),
            (
                dense([6].into(), "FP32", [0; 6].into()),
                "has 1 dimensions, expected 2",
            ),
            (
                dense([2, -3].into(), "FP32", [0; 6].into()),
                "negative size",
            ),
            (
                dense([2, 3].into(), "FP32", [0; 5].into()),
                "needs 6 values, data has 5",
            ),
            (
                dense([2, 3].into(), "FP32", serde_json::json!(["a"])),
                "data: invalid type: string",
            ),
            (
                dense([2, 3].into(), "FP32", serde_json::json!([[1, 2], [3]])),
                "ragged",
            ),
            (
                serde_json::json!([{"name": "dense_x", "shape": [2, 3], "datatype": "FP32"}]),
                "no \"data\"",
            ),
            (
                serde_json::json!([{"name": "dense_x", "shape": [2, 3], "datatype": "FP32",
                                    "parameters": {"binary_data_size": 24}}]),
                "parameters.binary_data_size is 24: binary tensor data is not supported yet \
                 (send JSON data, or binary_data: false)",
            ),
            (
                serde_json::json!([{"name": "dense_x", "shape": [2, 3], "datatype": "FP32",
                                    "parameters": {"binary_data": true}}]),
                "parameters.binary_data is true: binary tensor data is not supported yet",
            ),
        ];
        for (inputs, want) in cases {
            let e = err(&body(inputs));
            assert_eq!(e.kind, ErrorKind::InvalidInput);
            assert!(
                e.message.starts_with("input \"dense_x\": "),
                "{}",
                e.message
            );
            assert!(e.message.contains(want), "{} / {want}", e.message);
        }
        let twice = serde_json::json!([
            {"name": "dense_x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]},
            {"name": "dense_x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}
        ]);
        assert!(err(&body(twice)).message.contains("given twice"));
    }

    #[test]
    fn budget_and_outputs() {
        let b = br#"{"inputs": [], "parameters": {"budget_ms": -1}}"#;
        assert!(err(b)
            .message
            .contains("budget_ms is -1, expected a positive number"));
        let b = br#"{"inputs": [], "parameters": {"budget_ms": "soon"}}"#;
        assert!(err(b).message.contains("budget_ms"));
        let b = br#"{"inputs": [], "outputs": [{"name": "nope"}]}"#;
        assert!(err(b)
            .message
            .contains("unknown output \"nope\"; the model returns \"output_0\""));
        let r = parse_infer(
            &model(),
            br#"{"inputs": [], "outputs": [{"name": "output_0"}]}"#,
        )
        .unwrap();
        assert_eq!(r.outputs, Some(vec![0]));
    }

    #[test]
    fn empty_outputs_and_binary_data() {
        let e = err(br#"{"inputs": [], "outputs": []}"#);
        assert_eq!(e.kind, ErrorKind::InvalidInput);
        assert!(
            e.message.contains(
                "\"outputs\" is empty; name at least one output (\"output_0\"), or leave \
                 \"outputs\" out"
            ),
            "{}",
            e.message
        );
        let b = br#"{"inputs": [], "outputs": [{"name": "output_0",
                     "parameters": {"binary_data": true}}]}"#;
        let e = err(b);
        assert_eq!(e.kind, ErrorKind::InvalidInput);
        assert!(
            e.message
                .starts_with("output \"output_0\": parameters.binary_data is true: binary"),
            "{}",
            e.message
        );
        let b = br#"{"inputs": [], "parameters": {"binary_data_output": true}}"#;
        assert!(err(b)
            .message
            .starts_with("request parameters.binary_data_output is true: binary"));
        // tritonclient's JSON mode says binary_data: false; that is JSON data, and fine.
        let b = br#"{"inputs": [{"name": "dense_x", "shape": [1, 3], "datatype": "FP32",
                                 "parameters": {"binary_data": false}, "data": [1, 2, 3]}],
                     "parameters": {"binary_data_output": false},
                     "outputs": [{"name": "output_0", "parameters": {"binary_data": false}}]}"#;
        let r = parse_infer(&model(), b).unwrap();
        assert_eq!(r.outputs, Some(vec![0]));
        assert!(r.inputs[0].is_some());
        let e = err(br#"{"inputs": [], "outputs": [{"name": "output_0", "x": 1}]}"#);
        assert_eq!(e.kind, ErrorKind::InvalidJson);
    }

    #[test]
    fn response_and_metadata() {
        let m = model();
        let out = Tensor::from_f32(vec![2, 1], &[0.5, 0.25]);
        let params = Map::new();
        let b = infer_response(&m, Some("r1"), &[out], None, &params);
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"model_name": "dlrm", "id": "r1", "parameters": {},
                "outputs": [{"name": "output_0", "datatype": "FP32", "shape": [2, 1],
                             "data": [0.5, 0.25]}]})
        );
        let meta = model_metadata(&m);
        assert_eq!(
            meta["inputs"][0],
            serde_json::json!({"name": "dense_x", "datatype": "FP32", "shape": [-1, 3]})
        );
        assert_eq!(meta["inputs"][6]["datatype"], "INT32");
        assert_eq!(meta["outputs"][0]["shape"], serde_json::json!([-1, 1]));
    }
}
