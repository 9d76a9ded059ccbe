//! KServe v2 gRPC tensors: a `ModelInferRequest` into the router's tensors, the router's
//! outputs into a `ModelInferResponse`. Raw contents are taken as they are (one length check,
//! no per-element work); typed `contents` are checked field by field. Every problem names the
//! input and says what was expected and what arrived, as the REST decoders do.

use std::collections::HashMap;

use bytes::Bytes;

use crate::codec::grpc::pb::infer_parameter::ParameterChoice;
use crate::codec::grpc::pb::model_infer_request::InferInputTensor;
use crate::codec::grpc::pb::model_infer_response::InferOutputTensor;
use crate::codec::grpc::pb::{
    InferParameter, InferTensorContents, ModelInferRequest, ModelInferResponse,
};
use crate::codec::kserve::{input_shape, input_slot, output_index, InferRequest};
use crate::error::RequestError;
use crate::model::{Model, TensorSpec};
use crate::pipeline::validate::{check_declared, to_held};
use crate::tensor::{DType, Tensor};

/// A decoded request, and whether it sent its tensors raw (the reply then does too).
pub struct GrpcRequest {
    pub request: InferRequest,
    pub raw: bool,
}

/// Converts a `ModelInferRequest` against the model (its name is checked by the caller).
pub fn parse_grpc(model: &Model, req: ModelInferRequest) -> Result<GrpcRequest, RequestError> {
    let budget_ms = budget(&req.parameters)?;
    let raw = !req.raw_input_contents.is_empty();
    if raw && req.raw_input_contents.len() != req.inputs.len() {
        return Err(RequestError::invalid(format!(
            "raw_input_contents has {} entries but the request has {} inputs; give one raw \
             entry per input, in the order of the inputs",
            req.raw_input_contents.len(),
            req.inputs.len()
        )));
    }
    let mut inputs: Vec<Option<Tensor>> = vec![None; model.inputs.len()];
    let mut raws = req.raw_input_contents.into_iter();
    for input in req.inputs {
        let index = input_slot(model, &inputs, &input.name)?;
        let spec = &model.inputs[index];
        let tensor = convert_input(spec, input, raws.next())?;
        inputs[index] = Some(tensor);
    }
    let outputs = if req.outputs.is_empty() {
        None
    } else {
        let picked = req
            .outputs
            .iter()
            .map(|o| output_index(model, &o.name))
            .collect::<Result<Vec<usize>, _>>()?;
        Some(picked)
    };
    let id = (!req.id.is_empty()).then_some(req.id);
    Ok(GrpcRequest {
        request: InferRequest {
            id,
            budget_ms,
            // The message's model_version chose the version before the message was parsed.
            version: None,
            inputs,
            outputs,
            binary: vec![false; model.outputs.len()],
        },
        raw,
    })
}

/// The request parameter `budget_ms`: a positive number (double or integer) of milliseconds.
fn budget(params: &HashMap<String, InferParameter>) -> Result<Option<f64>, RequestError> {
    let Some(p) = params.get("budget_ms") else {
        return Ok(None);
    };
    let ms = match &p.parameter_choice {
        Some(ParameterChoice::DoubleParam(v)) => Some(*v),
        Some(ParameterChoice::Int64Param(v)) => Some(*v as f64),
        Some(ParameterChoice::Uint64Param(v)) => Some(*v as f64),
        _ => None,
    };
    match ms {
        Some(ms) if ms > 0.0 && ms.is_finite() => Ok(Some(ms)),
        _ => Err(RequestError::invalid(format!(
            "parameters.budget_ms is {}, expected a positive number of milliseconds",
            describe(p)
        ))),
    }
}

fn describe(p: &InferParameter) -> String {
    match &p.parameter_choice {
        None => "empty".into(),
        Some(ParameterChoice::BoolParam(v)) => format!("bool {v}"),
        Some(ParameterChoice::Int64Param(v)) => format!("int64 {v}"),
        Some(ParameterChoice::StringParam(v)) => format!("string {v:?}"),
        Some(ParameterChoice::DoubleParam(v)) => format!("double {v}"),
        Some(ParameterChoice::Uint64Param(v)) => format!("uint64 {v}"),
    }
}

fn convert_input(
    held: &TensorSpec,
    input: InferInputTensor,
    raw: Option<Bytes>,
) -> Result<Tensor, RequestError> {
    let spec = &held.sent_as(&input.datatype);
    let tensor = decode_input(spec, input, raw)?;
    to_held(held, tensor)
}

fn decode_input(
    spec: &TensorSpec,
    input: InferInputTensor,
    raw: Option<Bytes>,
) -> Result<Tensor, RequestError> {
    let fail = |e: String| RequestError::input(&spec.name, e);
    let shape = input_shape(spec, &input.shape)?;
    check_declared(spec, &input.datatype, &shape)?;
    let numel = crate::tensor::numel(&shape)
        .filter(|n| n.checked_mul(spec.dtype.itemsize()).is_some())
        .ok_or_else(|| fail(format!("shape {shape:?} overflows")))?;
    match (raw, input.contents) {
        (Some(_), Some(c)) if count(&c) > 0 => Err(fail(
            "has both contents and an entry in raw_input_contents; give one or the other".into(),
        )),
        (Some(bytes), _) => raw_input(spec, shape, numel, bytes).map_err(fail),
        (None, Some(c)) => typed_input(spec, shape, numel, &c).map_err(fail),
        (None, None) => Err(fail(
            "no data: neither contents nor raw_input_contents holds it".into(),
        )),
    }
}

/// The input's bytes as they are: numel × itemsize of them.
fn raw_input(
    spec: &TensorSpec,
    shape: Vec<usize>,
    numel: usize,
    bytes: Bytes,
) -> Result<Tensor, String> {
    let want = numel * spec.dtype.itemsize();
    if bytes.len() != want {
        return Err(format!(
            "its raw_input_contents entry has {} bytes, expected {want} (shape {shape:?} of {}, \
             {} bytes each)",
            bytes.len(),
            spec.dtype.kserve_name(),
            spec.dtype.itemsize()
        ));
    }
    // The one dtype whose bytes can be invalid: a bool is 0 or 1.
    if spec.dtype == DType::Bool {
        if let Some(at) = bytes.iter().position(|&b| b > 1) {
            return Err(format!(
                "element {at} of the BOOL raw contents is byte {}, expected 0 or 1",
                bytes[at]
            ));
        }
    }
    Tensor::new(spec.dtype, shape, bytes.to_vec())
        .ok_or_else(|| format!("raw contents of {want} bytes do not fit its shape"))
}

/// The `InferTensorContents` field each datatype uses (none for FP16 and BF16: raw only).
fn field(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("fp32_contents"),
        DType::I64 => Some("int64_contents"),
        DType::I32 => Some("int_contents"),
        DType::U8 => Some("uint_contents"),
        DType::Bool => Some("bool_contents"),
        DType::F16 | DType::BF16 => None,
    }
}

/// Elements in every field of `c`, and the names of the non-empty ones.
fn filled(c: &InferTensorContents) -> Vec<(&'static str, usize)> {
    [
        ("bool_contents", c.bool_contents.len()),
        ("int_contents", c.int_contents.len()),
        ("int64_contents", c.int64_contents.len()),
        ("uint_contents", c.uint_contents.len()),
        ("uint64_contents", c.uint64_contents.len()),
        ("fp32_contents", c.fp32_contents.len()),
        ("fp64_contents", c.fp64_contents.len()),
        ("bytes_contents", c.bytes_contents.len()),
    ]
    .into_iter()
    .filter(|(_, n)| *n > 0)
    .collect()
}

fn count(c: &InferTensorContents) -> usize {
    filled(c).iter().map(|(_, n)| n).sum()
}

fn typed_input(
    spec: &TensorSpec,
    shape: Vec<usize>,
    numel: usize,
    c: &InferTensorContents,
) -> Result<Tensor, String> {
    let name = spec.dtype.kserve_name();
    let Some(want) = field(spec.dtype) else {
        return Err(format!(
            "datatype {name} has no typed contents field; send it in raw_input_contents"
        ));
    };
    let given = filled(c);
    if let Some((other, n)) = given.iter().find(|(f, _)| *f != want) {
        return Err(format!(
            "datatype {name} takes its data in contents.{want}, but contents.{other} has {n} \
             elements"
        ));
    }
    let n = given.first().map_or(0, |(_, n)| *n);
    if n != numel {
        return Err(format!(
            "contents.{want} has {n} elements, expected {numel} (shape {shape:?})"
        ));
    }
    let data: Vec<u8> = match spec.dtype {
        DType::F32 => c
            .fp32_contents
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::I64 => c
            .int64_contents
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::I32 => c
            .int_contents
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::Bool => c.bool_contents.iter().map(|&b| b as u8).collect(),
        DType::U8 => {
            if let Some(at) = c.uint_contents.iter().position(|&v| v > 255) {
                return Err(format!(
                    "element {at} of contents.uint_contents is {}, beyond UINT8's 255",
                    c.uint_contents[at]
                ));
            }
            c.uint_contents.iter().map(|&v| v as u8).collect()
        }
        DType::F16 | DType::BF16 => unreachable!("no typed field; refused above"),
    };
    Tensor::new(spec.dtype, shape, data).ok_or_else(|| "contents do not fit its shape".into())
}

/// The response: outputs raw when the request sent raw inputs (or a chosen output has no
/// typed field), else in typed `contents`.
pub fn grpc_response(
    model: &Model,
    id: Option<String>,
    outputs: Vec<Tensor>,
    selected: Option<&[usize]>,
    raw: bool,
    parameters: HashMap<String, InferParameter>,
) -> ModelInferResponse {
    let all: Vec<usize> = (0..outputs.len()).collect();
    let pick = selected.unwrap_or(&all);
    let raw = raw || pick.iter().any(|&i| field(outputs[i].dtype).is_none());
    let mut tensors = Vec::with_capacity(pick.len());
    let mut raw_contents = Vec::new();
    for &i in pick {
        let t = &outputs[i];
        let contents = if raw {
            raw_contents.push(Bytes::copy_from_slice(&t.data));
            None
        } else {
            Some(typed_contents(t))
        };
        tensors.push(InferOutputTensor {
            name: model.outputs[i].name.clone(),
            datatype: t.dtype.kserve_name().into(),
            shape: t.dims.iter().map(|&d| d as i64).collect(),
            parameters: HashMap::new(),
            contents,
        });
    }
    ModelInferResponse {
        model_name: model.name.clone(),
        model_version: model.version.clone(),
        id: id.unwrap_or_default(),
        parameters,
        outputs: tensors,
        raw_output_contents: raw_contents,
    }
}

fn typed_contents(t: &Tensor) -> InferTensorContents {
    let mut c = InferTensorContents::default();
    let words4 = || t.data.chunks_exact(4).map(|b| [b[0], b[1], b[2], b[3]]);
    match t.dtype {
        DType::F32 => c.fp32_contents = words4().map(f32::from_le_bytes).collect(),
        DType::I32 => c.int_contents = words4().map(i32::from_le_bytes).collect(),
        DType::I64 => {
            c.int64_contents = t
                .data
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()))
                .collect()
        }
        DType::U8 => c.uint_contents = t.data.iter().map(|&b| b as u32).collect(),
        DType::Bool => c.bool_contents = t.data.iter().map(|&b| b != 0).collect(),
        DType::F16 | DType::BF16 => {} // never: such outputs make the whole reply raw
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::model::tests::model;

    fn dense(shape: Vec<i64>) -> InferInputTensor {
        InferInputTensor {
            name: "dense_x".into(),
            datatype: "FP32".into(),
            shape,
            parameters: HashMap::new(),
            contents: None,
        }
    }

    fn request(inputs: Vec<InferInputTensor>, raw: Vec<Vec<u8>>) -> ModelInferRequest {
        ModelInferRequest {
            model_name: "dlrm".into(),
            inputs,
            raw_input_contents: raw.into_iter().map(Bytes::from).collect(),
            ..Default::default()
        }
    }

    fn err(req: ModelInferRequest) -> String {
        let e = parse_grpc(&model(), req).map(|_| ()).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidInput, "{}", e.message);
        e.message
    }

    #[test]
    fn raw_and_typed_contents_give_the_same_tensor() {
        let values: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let raw = parse_grpc(
            &model(),
            request(vec![dense(vec![2, 3])], vec![bytes.clone()]),
        )
        .unwrap();
        assert!(raw.raw);
        let mut typed = dense(vec![2, 3]);
        typed.contents = Some(InferTensorContents {
            fp32_contents: values,
            ..Default::default()
        });
        let typed = parse_grpc(&model(), request(vec![typed], vec![])).unwrap();
        assert!(!typed.raw);
        let idx = model().input_index("dense_x").unwrap();
        assert_eq!(raw.request.inputs[idx], typed.request.inputs[idx]);
        assert_eq!(raw.request.inputs[idx].as_ref().unwrap().data, bytes);
    }

    #[test]
    fn bad_tensors_say_what_was_expected() {
        assert_eq!(
            err(request(vec![dense(vec![2, 3])], vec![vec![0; 20]])),
            "input \"dense_x\": its raw_input_contents entry has 20 bytes, expected 24 (shape \
             [2, 3] of FP32, 4 bytes each)"
        );
        assert!(
            err(request(vec![dense(vec![2, 3])], vec![vec![0; 24], vec![]]))
                .starts_with("raw_input_contents has 2 entries but the request has 1 inputs")
        );
        let mut wrong_type = dense(vec![2, 3]);
        wrong_type.datatype = "INT64".into();
        assert!(err(request(vec![wrong_type], vec![vec![0; 48]]))
            .contains("datatype \"INT64\", expected \"FP32\""));
        let mut wrong_field = dense(vec![2, 3]);
        wrong_field.contents = Some(InferTensorContents {
            int64_contents: vec![0; 6],
            ..Default::default()
        });
        assert_eq!(
            err(request(vec![wrong_field], vec![])),
            "input \"dense_x\": datatype FP32 takes its data in contents.fp32_contents, but \
             contents.int64_contents has 6 elements"
        );
        let mut short = dense(vec![2, 3]);
        short.contents = Some(InferTensorContents {
            fp32_contents: vec![0.0; 5],
            ..Default::default()
        });
        assert!(err(request(vec![short], vec![]))
            .contains("contents.fp32_contents has 5 elements, expected 6"));
        assert!(err(request(vec![dense(vec![2, 3])], vec![])).contains("no data"));
        let mut unknown = dense(vec![2, 3]);
        unknown.name = "nope".into();
        assert!(
            err(request(vec![unknown], vec![vec![0; 24]])).starts_with("unknown input \"nope\"")
        );
        assert!(err(request(vec![dense(vec![-1, 3])], vec![vec![]])).contains("negative size"));
    }

    #[test]
    fn budget_is_a_positive_number() {
        let mut req = request(vec![dense(vec![2, 3])], vec![vec![0; 24]]);
        req.parameters.insert(
            "budget_ms".into(),
            InferParameter {
                parameter_choice: Some(ParameterChoice::Int64Param(25)),
            },
        );
        assert_eq!(
            parse_grpc(&model(), req.clone()).unwrap().request.budget_ms,
            Some(25.0)
        );
        req.parameters.insert(
            "budget_ms".into(),
            InferParameter {
                parameter_choice: Some(ParameterChoice::StringParam("soon".into())),
            },
        );
        assert!(err(req).contains("budget_ms is string \"soon\", expected a positive number"));
    }

    #[test]
    fn replies_are_raw_when_asked_raw_else_typed() {
        let m = model();
        let out = vec![Tensor::from_f32(vec![2, 1], &[0.25, 0.75]); m.outputs.len()];
        let typed = grpc_response(&m, None, out.clone(), None, false, HashMap::new());
        assert!(typed.raw_output_contents.is_empty());
        assert_eq!(
            typed.outputs[0].contents.as_ref().unwrap().fp32_contents,
            vec![0.25, 0.75]
        );
        let raw = grpc_response(&m, Some("a".into()), out, Some(&[0]), true, HashMap::new());
        assert_eq!(raw.outputs.len(), 1);
        assert_eq!(raw.id, "a");
        assert_eq!(raw.raw_output_contents[0].len(), 8);
        assert!(raw.outputs[0].contents.is_none());
    }

    proptest::proptest! {
        /// Any bytes decoded as a request and converted: an answer, never a panic.
        #[test]
        fn the_decoder_never_panics(
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
        ) {
            use prost::Message;
            if let Ok(req) = ModelInferRequest::decode(body.as_slice()) {
                let _ = parse_grpc(&model(), req);
            }
        }

        /// Well-formed messages with random shapes, sizes and fields: never a panic; when
        /// it succeeds the tensor holds exactly the bytes sent.
        #[test]
        fn random_tensors_never_panic(
            shape in proptest::collection::vec(-2i64..5, 0..4),
            size in 0usize..64,
            dtype in proptest::sample::select(vec!["FP32", "INT64", "BF16", "BOOL", "x"]),
            typed in proptest::collection::vec(proptest::prelude::any::<f32>(), 0..10),
        ) {
            let mut t = dense(shape);
            t.datatype = dtype.into();
            let raw_bytes = vec![1u8; size];
            let raw = parse_grpc(&model(), request(vec![t.clone()], vec![raw_bytes.clone()]));
            if let Ok(r) = raw {
                let idx = model().input_index("dense_x").unwrap();
                proptest::prop_assert_eq!(&r.request.inputs[idx].as_ref().unwrap().data, &raw_bytes);
            }
            t.contents = Some(InferTensorContents { fp32_contents: typed, ..Default::default() });
            let _ = parse_grpc(&model(), request(vec![t], vec![]));
        }
    }
}
