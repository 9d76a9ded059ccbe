//! The Open Inference Protocol (KServe v2) JSON forms: infer request in, infer response and
//! model metadata out. <https://kserve.github.io/website/latest/modelserving/data_plane/v2_protocol/>

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::codec::binary_tensor::{self, BinaryError, Sections, HEADER_LENGTH};
use crate::codec::json_tensor::{parse_tensor, parse_tensor_serde, JsonElements};
use crate::codec::kserve_cut::{self, Cut};
use crate::error::RequestError;
use crate::model::{Model, TensorSpec};
use crate::pipeline::validate::{check_declared, to_held};
use crate::tensor::{DType, Tensor};

/// An infer request, parsed and converted, not yet checked as a whole.
#[derive(Debug)]
pub struct InferRequest {
    pub id: Option<String>,
    /// `parameters.budget_ms`, when given.
    pub budget_ms: Option<f64>,
    /// The body's `model_version`, when given.
    pub version: Option<String>,
    /// Indexed like `model.inputs`; `None` where the request did not give the input.
    pub inputs: Vec<Option<Tensor>>,
    /// Indices into `model.outputs` the client asked for; `None` = all.
    pub outputs: Option<Vec<usize>>,
    /// Indexed like `model.outputs`: whether that output goes back as binary data.
    pub binary: Vec<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequest<'a> {
    #[serde(default)]
    id: Option<String>,
    // KServe's Python SDK names the model (and version) in the body too.
    #[serde(borrow, default)]
    model_name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    model_version: Option<Cow<'a, str>>,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    #[serde(borrow)]
    inputs: Vec<RawInput<'a>>,
    #[serde(default)]
    outputs: Option<Vec<RawOutput>>,
}

// Names borrow from the body where they can, and parameters keep only the two keys read (the
// rest are skipped unparsed): a binary body's JSON is little else than these, once per input.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInput<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    shape: Vec<i64>,
    #[serde(borrow)]
    datatype: Cow<'a, str>,
    #[serde(default)]
    parameters: Option<TensorParams>,
    // Kept raw so that a bad element is reported with the input's name.
    #[serde(borrow, default)]
    data: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOutput {
    name: String,
    #[serde(default)]
    parameters: Option<TensorParams>,
}

/// The parameters of an input or output that the binary extension defines; others are
/// allowed and ignored.
#[derive(Deserialize, Default)]
struct TensorParams {
    #[serde(default)]
    binary_data: Option<Value>,
    #[serde(default)]
    binary_data_size: Option<Value>,
}

/// A boolean parameter (`binary_data`, `binary_data_output`); absent is `None`.
fn flag(value: Option<&Value>, name: &str) -> Result<Option<bool>, String> {
    match value {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(format!("parameters.{name} is {v}, expected true or false")),
    }
}

/// An input's `binary_data_size`, when given: a non-negative integer.
fn binary_size(value: Option<&Value>) -> Result<Option<usize>, String> {
    match value {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| {
                format!("parameters.binary_data_size is {v}, expected a non-negative integer")
            }),
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

/// Parses an infer request body against the model. `header` is the request's
/// `Inference-Header-Content-Length`: when given, the body is that many bytes of JSON followed
/// by the binary tensors (docs/serving.md, "Binary tensors").
pub fn parse_infer(
    model: &Model,
    body: &[u8],
    header: Option<usize>,
) -> Result<InferRequest, RequestError> {
    parse_infer_with(model, body, header, JsonReader::Scan)
}

/// How a request's JSON is read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum JsonReader {
    /// The request path: the inputs' `data` cut out (kserve_cut.rs) and read by the scanner
    /// (json_scan.rs), serde_json reading the rest.
    Scan,
    /// serde_json alone: the router before the scanner, kept as `cleave bench json-parse`'s
    /// same-run reference.
    Serde,
}

/// [`parse_infer`] with its JSON read by `reader`.
pub fn parse_infer_with(
    model: &Model,
    body: &[u8],
    header: Option<usize>,
    reader: JsonReader,
) -> Result<InferRequest, RequestError> {
    if reader == JsonReader::Serde {
        return read_request(model, body, header, DataText::Whole(parse_tensor_serde));
    }
    // Where the cut body reads without error, the whole one does too (kserve_cut.rs); any
    // error is found again reading the whole body, which words it as it always has.
    let json = header.map_or(Some(body), |n| body.get(..n));
    if let Some(cut) = json.and_then(kserve_cut::cut) {
        if let Ok(request) = read_request(model, body, header, DataText::Cut(&cut)) {
            return Ok(request);
        }
    }
    read_request(model, body, header, DataText::Whole(parse_tensor))
}

/// Where the inputs' `data` text is and what reads it: in the body serde_json reads, or cut
/// out of it (named in it by index) and read by the scanner.
#[derive(Clone, Copy)]
enum DataText<'a> {
    Whole(fn(&str, DType, &[usize]) -> Result<Tensor, String>),
    Cut(&'a Cut<'a>),
}

impl DataText<'_> {
    fn tensor(self, raw: &RawValue, dtype: DType, shape: &[usize]) -> Result<Tensor, String> {
        match self {
            DataText::Whole(parse) => parse(raw.get(), dtype, shape),
            DataText::Cut(cut) => {
                let text = raw
                    .get()
                    .parse::<usize>()
                    .ok()
                    .and_then(|i| cut.data.get(i));
                parse_tensor(text.ok_or("data: not a cut value")?, dtype, shape)
            }
        }
    }
}

fn read_request(
    model: &Model,
    body: &[u8],
    header: Option<usize>,
    data: DataText,
) -> Result<InferRequest, RequestError> {
    let framing = |e: BinaryError| RequestError::invalid(format!("binary tensor data: {e}"));
    let (json, mut sections) = match header {
        Some(n) => binary_tensor::split(body, n).map_err(framing)?,
        None => (body, Sections::empty()),
    };
    let json = match data {
        DataText::Cut(cut) => &cut.frame[..],
        DataText::Whole(_) => json,
    };
    let raw: RawRequest = serde_json::from_slice(json).map_err(RequestError::json)?;
    if let Some(named) = raw.model_name.as_deref().filter(|n| *n != model.name) {
        return Err(RequestError::invalid(format!(
            "the body's model_name is {named:?} but the URL names {:?}",
            model.name
        )));
    }
    let binary_output = flag(
        raw.parameters
            .as_ref()
            .and_then(|p| p.get("binary_data_output")),
        "binary_data_output",
    )
    .map_err(|e| RequestError::invalid(format!("request {e}")))?
    .unwrap_or(false);
    let budget_ms = budget_param(raw.parameters.as_ref().and_then(|p| p.get("budget_ms")))?;
    let mut inputs: Vec<Option<Tensor>> = vec![None; model.inputs.len()];
    for input in raw.inputs {
        let index = input_slot(model, &inputs, &input.name)?;
        let spec = &model.inputs[index];
        let tensor = convert_input(spec, input, header.is_some(), &mut sections, data)?;
        inputs[index] = Some(tensor);
    }
    sections.finish().map_err(framing)?;
    let mut binary = vec![binary_output; model.outputs.len()];
    let outputs = raw
        .outputs
        .map(|requested| select_outputs(model, &requested, &mut binary))
        .transpose()?;
    Ok(InferRequest {
        id: raw.id,
        budget_ms,
        version: raw.model_version.map(Cow::into_owned),
        inputs,
        outputs,
        binary,
    })
}

/// Indices of the outputs a request names, in its order; sets `binary` for those that say.
fn select_outputs(
    model: &Model,
    requested: &[RawOutput],
    binary: &mut [bool],
) -> Result<Vec<usize>, RequestError> {
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
            let index = output_index(model, &o.name)?;
            let asked = flag(
                o.parameters.as_ref().and_then(|p| p.binary_data.as_ref()),
                "binary_data",
            )
            .map_err(|e| RequestError::invalid(format!("output {:?}: {e}", o.name)))?;
            if let Some(b) = asked {
                binary[index] = b;
            }
            Ok(index)
        })
        .collect()
}

/// Where input `name` goes among `inputs` (one slot per model input, in the model's order):
/// an error for a name the model does not take or one already given. Every front door
/// (REST, gRPC) fills its slots through here.
pub fn input_slot(
    model: &Model,
    inputs: &[Option<Tensor>],
    name: &str,
) -> Result<usize, RequestError> {
    let index = model
        .input_index(name)
        .ok_or_else(|| unknown_input(model, name))?;
    if inputs[index].is_some() {
        return Err(RequestError::input(name, "given twice"));
    }
    Ok(index)
}

pub fn unknown_input(model: &Model, name: &str) -> RequestError {
    RequestError::invalid(format!(
        "unknown input {name:?}; the model takes {}",
        names(&model.inputs)
    ))
}

/// An input's shape as sizes: an error for a negative one.
pub fn input_shape(spec: &TensorSpec, dims: &[i64]) -> Result<Vec<usize>, RequestError> {
    dims.iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| RequestError::input(&spec.name, format!("shape {dims:?} has a negative size")))
}

/// The index of output `name`, or an error listing the model's outputs.
pub fn output_index(model: &Model, name: &str) -> Result<usize, RequestError> {
    model
        .outputs
        .iter()
        .position(|s| s.name == name)
        .ok_or_else(|| {
            RequestError::invalid(format!(
                "unknown output {name:?}; the model returns {}",
                names(&model.outputs)
            ))
        })
}

/// The tensors' names, quoted, for error messages.
pub fn names(specs: &[TensorSpec]) -> String {
    let q: Vec<String> = specs.iter().map(|s| format!("{:?}", s.name)).collect();
    q.join(", ")
}

fn convert_input(
    held: &TensorSpec,
    input: RawInput,
    framed: bool,
    sections: &mut Sections,
    data: DataText,
) -> Result<Tensor, RequestError> {
    let spec = &held.sent_as(&input.datatype);
    let tensor = decode_input(spec, input, framed, sections, data)?;
    to_held(held, tensor)
}

fn decode_input(
    spec: &TensorSpec,
    input: RawInput,
    framed: bool,
    sections: &mut Sections,
    data: DataText,
) -> Result<Tensor, RequestError> {
    let fail = |e: String| RequestError::input(&spec.name, e);
    let shape = input_shape(spec, &input.shape)?;
    let params = input.parameters.as_ref();
    let size = binary_size(params.and_then(|p| p.binary_data_size.as_ref())).map_err(fail)?;
    let flagged = flag(params.and_then(|p| p.binary_data.as_ref()), "binary_data").map_err(fail)?;
    check_declared(spec, &input.datatype, &shape)?;
    match (size, input.data) {
        (Some(_), Some(_)) | (None, Some(_)) if flagged == Some(true) => Err(fail(
            "parameters.binary_data is true but the input also has \"data\"; give one or the \
             other"
                .into(),
        )),
        (Some(size), Some(_)) => Err(fail(format!(
            "parameters.binary_data_size is {size} but the input also has \"data\"; give one \
             or the other"
        ))),
        (Some(size), None) => binary_input(spec, &shape, size, framed, sections).map_err(fail),
        (None, Some(raw)) => data.tensor(raw, spec.dtype, &shape).map_err(fail),
        (None, None) if flagged == Some(true) => Err(fail(
            "parameters.binary_data is true but no parameters.binary_data_size says how many \
             bytes it has"
                .into(),
        )),
        (None, None) => Err(fail(
            "no \"data\" given (nor parameters.binary_data_size for binary data)".into(),
        )),
    }
}

/// The input's bytes, cut from the binary part as they are: shape × itemsize of them.
fn binary_input(
    spec: &TensorSpec,
    shape: &[usize],
    size: usize,
    framed: bool,
    sections: &mut Sections,
) -> Result<Tensor, String> {
    if !framed {
        return Err(format!(
            "parameters.binary_data_size is {size} but the request has no \
             {HEADER_LENGTH} header to say where its JSON ends"
        ));
    }
    let want = crate::tensor::numel(shape)
        .and_then(|n| n.checked_mul(spec.dtype.itemsize()))
        .ok_or_else(|| format!("shape {shape:?} overflows"))?;
    if size != want {
        return Err(format!(
            "parameters.binary_data_size is {size} bytes, expected {want} (shape {shape:?} \
             of {}, {} bytes each)",
            spec.dtype.kserve_name(),
            spec.dtype.itemsize()
        ));
    }
    let bytes = sections.take(size).map_err(|e| e.to_string())?;
    // The one dtype whose bytes can be invalid: a bool is 0 or 1.
    if spec.dtype == DType::Bool {
        if let Some(at) = bytes.iter().position(|&b| b > 1) {
            return Err(format!(
                "element {at} of the BOOL binary data is byte {}, expected 0 or 1",
                bytes[at]
            ));
        }
    }
    Tensor::new(spec.dtype, shape.to_vec(), bytes.to_vec())
        .ok_or_else(|| format!("shape {shape:?} does not match {size} bytes"))
}

/// The data of one output tensor: JSON numbers, or the size of its binary section.
#[derive(Serialize)]
#[serde(untagged)]
enum OutputData<'a> {
    Json { data: JsonElements<'a> },
    Binary { parameters: BinarySize },
}

#[derive(Serialize)]
struct BinarySize {
    binary_data_size: usize,
}

/// One output tensor of a response.
#[derive(Serialize)]
struct ResponseOutput<'a> {
    name: &'a str,
    datatype: &'static str,
    shape: &'a [usize],
    #[serde(flatten)]
    data: OutputData<'a>,
}

#[derive(Serialize)]
struct Response<'a> {
    model_name: &'a str,
    model_version: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    parameters: &'a Map<String, Value>,
    outputs: Vec<ResponseOutput<'a>>,
}

/// An infer response: its body, and the length of its JSON header when some outputs are
/// binary (the `Inference-Header-Content-Length` to send).
pub struct InferReply {
    pub body: Vec<u8>,
    pub header: Option<usize>,
}

/// The infer response. `outputs` are the model's flat outputs, in manifest order; `selected`
/// picks some of them; `binary` (indexed like `outputs`) says which go back as raw bytes.
pub fn infer_response(
    model: &Model,
    id: Option<&str>,
    outputs: &[Tensor],
    selected: Option<&[usize]>,
    binary: &[bool],
    parameters: &Map<String, Value>,
) -> InferReply {
    let all: Vec<usize> = (0..outputs.len()).collect();
    let pick = selected.unwrap_or(&all);
    let is_binary = |i: usize| binary.get(i).copied().unwrap_or(false);
    let response = Response {
        model_name: &model.name,
        model_version: &model.version,
        id,
        parameters,
        outputs: pick
            .iter()
            .map(|&i| ResponseOutput {
                name: &model.outputs[i].name,
                datatype: outputs[i].dtype.kserve_name(),
                shape: &outputs[i].dims,
                data: if is_binary(i) {
                    OutputData::Binary {
                        parameters: BinarySize {
                            binary_data_size: outputs[i].data.len(),
                        },
                    }
                } else {
                    OutputData::Json {
                        data: JsonElements(&outputs[i]),
                    }
                },
            })
            .collect(),
    };
    let json = serde_json::to_vec(&response).expect("serializing numbers and strings cannot fail");
    let sections: Vec<&[u8]> = pick
        .iter()
        .filter(|&&i| is_binary(i))
        .map(|&i| outputs[i].data.as_slice())
        .collect();
    if sections.is_empty() {
        return InferReply {
            body: json,
            header: None,
        };
    }
    let (body, header) = binary_tensor::join(json, &sections);
    InferReply {
        body,
        header: Some(header),
    }
}

/// `GET /v2/models/{name}`: inputs and outputs, -1 for symbolic sizes; a model with
/// KeyedJaggedTensor inputs lists each KJT's keys in order under `parameters.kjts`.
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
    let mut metadata = serde_json::json!({
        "name": model.name,
        "versions": [model.version],
        "platform": "cleave",
        "inputs": tensors(&model.inputs),
        "outputs": tensors(&model.outputs),
    });
    if !model.kjts.is_empty() {
        let input = |i: usize| model.inputs[i].name.clone();
        let kjts: Map<String, Value> = model
            .kjts
            .iter()
            .map(|k| {
                let kjt = serde_json::json!({
                    "keys": k.keys,
                    "values": input(k.values),
                    "lengths": input(k.lengths),
                    "weights": k.weights.map(input),
                });
                (k.name.clone(), kjt)
            })
            .collect();
        metadata["parameters"] = serde_json::json!({ "kjts": kjts });
    }
    metadata
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
    fn model_name_in_the_body_must_be_the_urls() {
        let mut v: Value = serde_json::from_slice(&body(serde_json::json!([]))).unwrap();
        v["model_name"] = "dlrm".into();
        v["model_version"] = "1".into();
        assert!(parse_infer(&model(), v.to_string().as_bytes(), None).is_ok());
        v["model_name"] = "other".into();
        let e = parse_infer(&model(), v.to_string().as_bytes(), None).unwrap_err();
        assert_eq!(
            e.message,
            "the body's model_name is \"other\" but the URL names \"dlrm\""
        );
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
            None,
        )
        .unwrap();
        assert_eq!(r.budget_ms, Some(25.0));
        let t = r.inputs[0].as_ref().unwrap();
        assert_eq!(t.dims, vec![2, 3]);
        assert_eq!(t.to_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.5]);
        assert!(r.inputs[1].is_none());
    }

    fn err(b: &[u8]) -> RequestError {
        parse_infer(&model(), b, None).unwrap_err()
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
                "parameters.binary_data_size is 24 but the request has no \
                 inference-header-content-length header",
            ),
            (
                serde_json::json!([{"name": "dense_x", "shape": [2, 3], "datatype": "FP32",
                                    "parameters": {"binary_data": true}}]),
                "parameters.binary_data is true but no parameters.binary_data_size",
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
            None,
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
                     "parameters": {"binary_data": "yes"}}]}"#;
        let e = err(b);
        assert_eq!(e.kind, ErrorKind::InvalidInput);
        assert_eq!(
            e.message,
            "output \"output_0\": parameters.binary_data is \"yes\", expected true or false"
        );
        let b = br#"{"inputs": [], "parameters": {"binary_data_output": 1}}"#;
        assert_eq!(
            err(b).message,
            "request parameters.binary_data_output is 1, expected true or false"
        );
        let b = br#"{"inputs": [], "parameters": {"binary_data_output": true},
                     "outputs": [{"name": "output_0", "parameters": {"binary_data": false}}]}"#;
        assert_eq!(parse_infer(&model(), b, None).unwrap().binary, vec![false]);
        let b = br#"{"inputs": [], "parameters": {"binary_data_output": true}}"#;
        assert_eq!(parse_infer(&model(), b, None).unwrap().binary, vec![true]);
        // tritonclient's JSON mode says binary_data: false; that is JSON data, and fine.
        let b = br#"{"inputs": [{"name": "dense_x", "shape": [1, 3], "datatype": "FP32",
                                 "parameters": {"binary_data": false}, "data": [1, 2, 3]}],
                     "parameters": {"binary_data_output": false},
                     "outputs": [{"name": "output_0", "parameters": {"binary_data": false}}]}"#;
        let r = parse_infer(&model(), b, None).unwrap();
        assert_eq!(r.outputs, Some(vec![0]));
        assert_eq!(r.binary, vec![false]);
        assert!(r.inputs[0].is_some());
        let e = err(br#"{"inputs": [], "outputs": [{"name": "output_0", "x": 1}]}"#);
        assert_eq!(e.kind, ErrorKind::InvalidJson);
    }

    #[test]
    fn response_and_metadata() {
        let m = model();
        let out = Tensor::from_f32(vec![2, 1], &[0.5, 0.25]);
        let params = Map::new();
        let reply = infer_response(
            &m,
            Some("r1"),
            std::slice::from_ref(&out),
            None,
            &[false],
            &params,
        );
        assert_eq!(reply.header, None);
        let v: Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"model_name": "dlrm", "model_version": "1", "id": "r1", "parameters": {},
                "outputs": [{"name": "output_0", "datatype": "FP32", "shape": [2, 1],
                             "data": [0.5, 0.25]}]})
        );
        // Binary: the JSON header says the size, the raw bytes follow it.
        let reply = infer_response(
            &m,
            None,
            std::slice::from_ref(&out),
            Some(&[0]),
            &[true],
            &params,
        );
        let n = reply.header.unwrap();
        let v: Value = serde_json::from_slice(&reply.body[..n]).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"model_name": "dlrm", "model_version": "1", "parameters": {},
                "outputs": [{"name": "output_0", "datatype": "FP32", "shape": [2, 1],
                             "parameters": {"binary_data_size": 8}}]})
        );
        assert_eq!(&reply.body[n..], out.data.as_slice());
        let meta = model_metadata(&m);
        assert_eq!(
            meta["inputs"][0],
            serde_json::json!({"name": "dense_x", "datatype": "FP32", "shape": [-1, 3]})
        );
        assert_eq!(meta["inputs"][6]["datatype"], "INT32");
        assert_eq!(meta["outputs"][0]["shape"], serde_json::json!([-1, 1]));
    }

    /// A body of JSON header + binary sections, and its header length.
    fn framed(header: Value, sections: &[&[u8]]) -> (Vec<u8>, usize) {
        binary_tensor::join(header.to_string().into_bytes(), sections)
    }

    fn dense_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn binary_inputs_mixed_with_json() {
        let m = model();
        let dense_le = dense_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.5]);
        let spec = &m.inputs[1];
        let header = serde_json::json!({"inputs": [
            {"name": "dense_x", "shape": [2, 3], "datatype": "FP32",
             "parameters": {"binary_data_size": 24}},
            {"name": spec.name, "shape": [2], "datatype": spec.dtype.kserve_name(),
             "data": [7, 9]},
        ], "parameters": {"binary_data_output": true}});
        let (framed_body, n) = framed(header, &[&dense_le]);
        let r = parse_infer(&m, &framed_body, Some(n)).unwrap();
        let t = r.inputs[0].as_ref().unwrap();
        assert_eq!(
            (t.dims.as_slice(), t.data.as_slice()),
            (&[2, 3][..], &dense_le[..])
        );
        assert_eq!(r.inputs[1].as_ref().unwrap().dims, vec![2]);
        assert_eq!(r.binary, vec![true]);
        // A header length with no binary tensor at all is a JSON body.
        let json = body(dense([1, 3].into(), "FP32", [1, 2, 3].into()));
        let n = json.len();
        assert!(parse_infer(&m, &json, Some(n)).unwrap().inputs[0].is_some());
    }

    fn binary_err(header: Value, sections: &[&[u8]], cut: usize) -> String {
        let (mut body, n) = framed(header, sections);
        body.truncate(body.len() - cut);
        let e = parse_infer(&model(), &body, Some(n)).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidInput, "{}", e.message);
        e.message
    }

    #[test]
    fn bad_binary_inputs_are_named() {
        let one = |params: Value, data: Option<Value>| {
            let mut input = serde_json::json!({"name": "dense_x", "shape": [2, 3],
                                               "datatype": "FP32", "parameters": params});
            if let Some(d) = data {
                input["data"] = d;
            }
            serde_json::json!({"inputs": [input]})
        };
        let six = dense_bytes(&[0.0; 6]);
        // Truncated: the section is cut short.
        let e = binary_err(
            one(serde_json::json!({"binary_data_size": 24}), None),
            &[&six],
            5,
        );
        assert_eq!(
            e,
            "input \"dense_x\": its binary data (24 bytes from byte 0 of the binary part) runs \
             past the end of the body: only 19 bytes are left"
        );
        // A size that disagrees with shape × dtype.
        let e = binary_err(
            one(serde_json::json!({"binary_data_size": 20}), None),
            &[&six],
            0,
        );
        assert_eq!(
            e,
            "input \"dense_x\": parameters.binary_data_size is 20 bytes, expected 24 (shape \
             [2, 3] of FP32, 4 bytes each)"
        );
        // Bytes left over after the last section.
        let e = binary_err(
            one(serde_json::json!({"binary_data_size": 24}), None),
            &[&six, b"xyz"],
            0,
        );
        assert!(e.contains("3 bytes after the last binary tensor"), "{e}");
        // Both data and binary.
        let e = binary_err(
            one(
                serde_json::json!({"binary_data_size": 24}),
                Some([0; 6].into()),
            ),
            &[&six],
            0,
        );
        assert!(
            e.starts_with("input \"dense_x\": parameters.binary_data_size is 24 but the input also has \"data\""),
            "{e}"
        );
        let e = binary_err(
            one(
                serde_json::json!({"binary_data": true}),
                Some([0; 6].into()),
            ),
            &[],
            0,
        );
        assert!(
            e.contains("binary_data is true but the input also has \"data\""),
            "{e}"
        );
        for bad in [
            serde_json::json!(-24),
            serde_json::json!(2.5),
            serde_json::json!("24"),
        ] {
            let e = binary_err(
                one(serde_json::json!({"binary_data_size": bad}), None),
                &[&six],
                0,
            );
            assert!(e.contains("expected a non-negative integer"), "{e}");
        }
        // The header says more than the body has.
        let (body, n) = framed(one(serde_json::json!({"binary_data_size": 24}), None), &[]);
        let e = parse_infer(&model(), &body, Some(n + 1)).unwrap_err();
        assert!(e.message.contains("but the body has only"), "{}", e.message);
        // The header cuts the JSON short: a JSON error, not a panic.
        let e = parse_infer(&model(), &body, Some(n - 2)).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidJson);
    }

    #[test]
    fn bool_binary_data_is_0_or_1() {
        let mut spec = model().inputs[0].clone();
        spec.dtype = DType::Bool;
        let cut = |bytes: &[u8]| {
            let (body, n) = binary_tensor::join(Vec::new(), &[bytes]);
            let (_, mut sections) = binary_tensor::split(&body, n).unwrap();
            binary_input(&spec, &[2, 3], 6, true, &mut sections)
        };
        assert_eq!(
            cut(&[0, 1, 1, 0, 0, 1]).unwrap().data,
            vec![0, 1, 1, 0, 0, 1]
        );
        assert_eq!(
            cut(&[0, 1, 2, 0, 0, 1]).unwrap_err(),
            "element 2 of the BOOL binary data is byte 2, expected 0 or 1"
        );
    }

    /// A request with its `data` as JSON (nested floats, ints), in the body's text.
    fn json_body() -> String {
        let m = model();
        let ids = &m.inputs[1];
        let inputs = serde_json::json!([
            {"name": "dense_x", "shape": [2, 3], "datatype": "FP32",
             "data": [[0.30000001192092896, -2.5, 1e-7], [4, -0.0, 6.000000000000001]]},
            {"name": ids.name, "shape": [2], "datatype": ids.dtype.kserve_name(), "data": [7, 9]},
        ]);
        String::from_utf8(body(inputs)).unwrap()
    }

    /// The request path (`data` cut out, read by the scanner) gives what serde_json alone
    /// gives: the same request, or the same error.
    fn same_as_serde(body: &[u8], header: Option<usize>) -> Result<(), String> {
        let m = model();
        let ours = format!("{:?}", parse_infer(&m, body, header));
        let theirs = format!(
            "{:?}",
            parse_infer_with(&m, body, header, JsonReader::Serde)
        );
        match ours == theirs {
            true => Ok(()),
            false => Err(format!(
                "{}: {ours} vs {theirs}",
                String::from_utf8_lossy(body)
            )),
        }
    }

    #[test]
    fn cut_requests_read_as_whole_ones() {
        let good = json_body();
        // The cut is read without falling back to the whole body.
        let cut = kserve_cut::cut(good.as_bytes()).unwrap();
        assert!(read_request(&model(), good.as_bytes(), None, DataText::Cut(&cut)).is_ok());
        same_as_serde(good.as_bytes(), None).unwrap();
        for (from, to) in [
            ("[7,9]", "[7,9.5]"),
            ("[7,9]", "[7,\"9\"]"),
            ("[7,9]", "[7, 9, 10]"),
            ("[7,9]", "[7 9]"),
            ("[7,9]", "[7,9]]"),
            ("[7,9]", "7"),
            ("\"data\":[7,9]", "\"d\\u0061ta\":[7,9]"),
            ("\"data\":[7,9]", "\"data\":[7,9],\"data\":[1,2]"),
            ("\"shape\":[2]", "\"shape\":[3]"),
            ("-2.5", "1e999"),
            ("\"inputs\"", "\"extra\":{\"data\":[1]},\"inputs\""),
            ("{\"budget_ms\":25}", "{\"budget_ms\":25,\"data\":[\"]\"]}"),
            ("}}", "}} x"),
        ] {
            assert!(good.contains(from), "{from} in {good}");
            same_as_serde(good.replacen(from, to, 1).as_bytes(), None).unwrap();
        }
        let header = serde_json::json!({"inputs": [
            {"name": "dense_x", "shape": [1, 3], "datatype": "FP32", "data": [1.5, 2, 3]},
            {"name": model().inputs[1].name, "shape": [2], "datatype": "INT64",
             "parameters": {"binary_data_size": 16}},
        ]});
        let ids: Vec<u8> = [7i64, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
        let (framed_body, n) = framed(header, &[&ids]);
        same_as_serde(&framed_body, Some(n)).unwrap();
        let cut = kserve_cut::cut(&framed_body[..n]).unwrap();
        assert!(read_request(&model(), &framed_body, Some(n), DataText::Cut(&cut)).is_ok());
    }

    proptest::proptest! {
        /// A good request with one byte changed: the same request or error as serde_json's.
        #[test]
        fn a_changed_byte_reads_as_with_serde(
            at in 0usize..1000,
            byte in proptest::sample::select(b"[]{}\",:0123456789 -.eE\\atnx".to_vec()),
        ) {
            let mut text = json_body().into_bytes();
            let at = at % text.len();
            text[at] = byte;
            same_as_serde(&text, None).map_err(proptest::test_runner::TestCaseError::fail)?;
        }

        /// Any bytes with any header length: an answer, never a panic.
        #[test]
        fn the_decoder_never_panics(
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
            header in proptest::option::of(0usize..220),
        ) {
            let _ = parse_infer(&model(), &body, header);
        }

        /// A well-formed header with sizes drawn at random: an answer, never a panic; when
        /// it succeeds the tensor holds exactly the bytes sent.
        #[test]
        fn random_sizes_never_panic(size in 0usize..64, tail in 0usize..64) {
            let header = serde_json::json!({"inputs": [{"name": "dense_x", "shape": [2, 3],
                "datatype": "FP32", "parameters": {"binary_data_size": size}}]});
            let payload = vec![1u8; tail];
            let (body, n) = framed(header, &[&payload]);
            match parse_infer(&model(), &body, Some(n)) {
                Ok(r) => {
                    proptest::prop_assert!(size == 24 && tail == 24);
                    proptest::prop_assert_eq!(&r.inputs[0].as_ref().unwrap().data, &payload);
                }
                Err(e) => proptest::prop_assert_eq!(e.kind, ErrorKind::InvalidInput),
            }
        }
    }
}
