//! Golden bytes of what the router exchanges with Python (docs/protocol.md, "Golden bytes"):
//! the RANK payload it sends the ranker and the reply it reads back, the gRPC request the
//! load generator encodes by hand and the reply the router encodes with prost, and the REST
//! bodies with binary tensors both ways (tests/test_golden_bytes.py checks the same files
//! from the Python side).

#[path = "../../../tests/golden/golden.rs"]
mod golden;

use std::collections::HashMap;
use std::path::Path;

use cleave_embed::Manifest;
use cleave_router::backend::payload::{
    decode_request, decode_response, encode_request, encode_response, RankResponse,
};
use cleave_router::codec::binary_tensor::split;
use cleave_router::codec::grpc::pb::infer_parameter::ParameterChoice;
use cleave_router::codec::grpc::pb::{InferParameter, ModelInferRequest, ModelInferResponse};
use cleave_router::codec::grpc_tensor::{grpc_response, parse_grpc};
use cleave_router::codec::kserve::{infer_response, parse_infer};
use cleave_router::{DType, Model, Tensor};
use golden::u64_of;
use prost::Message;
use serde_json::Value;

/// A sidecar tensor: torch dtype name, shape and flat values, as little-endian bytes.
fn tensor(spec: &Value) -> Tensor {
    let name = spec["dtype"].as_str().expect("dtype");
    let dtype = DType::from_torch_name(name).unwrap_or_else(|| panic!("dtype {name:?}"));
    let dims: Vec<usize> = spec["shape"]
        .as_array()
        .expect("shape")
        .iter()
        .map(|d| d.as_u64().expect("a dim") as usize)
        .collect();
    let values = spec["data"].as_array().expect("data");
    let float = |v: &Value| v.as_f64().expect("a number");
    let int = |v: &Value| v.as_i64().expect("an integer");
    let data: Vec<u8> = values
        .iter()
        .flat_map(|v| match dtype {
            DType::F32 => (float(v) as f32).to_le_bytes().to_vec(),
            DType::F16 => half::f16::from_f64(float(v)).to_le_bytes().to_vec(),
            DType::BF16 => half::bf16::from_f64(float(v)).to_le_bytes().to_vec(),
            DType::I64 => int(v).to_le_bytes().to_vec(),
            DType::I32 => (int(v) as i32).to_le_bytes().to_vec(),
            DType::U8 => vec![int(v) as u8],
            DType::Bool => vec![v.as_bool().expect("a bool") as u8],
        })
        .collect();
    Tensor::new(dtype, dims, data).expect("data that fits its shape")
}

fn tensors(list: &Value) -> Vec<Tensor> {
    list.as_array()
        .expect("a list")
        .iter()
        .map(tensor)
        .collect()
}

fn model(spec: &Value) -> Model {
    let text = spec["manifest"].to_string();
    let manifest = Manifest::parse(&text, Path::new("golden manifest")).unwrap();
    Model::from_manifest(spec["model_name"].as_str().expect("model_name"), &manifest).unwrap()
}

#[test]
fn rank_request_router_to_ranker() {
    let spec = golden::content("rank_request");
    let want = tensors(&spec["tensors"]);
    golden::check_encoded("rank_request", &encode_request(&want));
    assert_eq!(
        decode_request(&golden::bytes("rank_request"))
            .unwrap()
            .tensors,
        want
    );
}

#[test]
fn rank_response_ranker_to_router() {
    let spec = golden::content("rank_response");
    let want = RankResponse {
        queue_us: u64_of(&spec, "queue_us") as u32,
        compute_us: u64_of(&spec, "compute_us") as u32,
        batch_requests: u64_of(&spec, "batch_requests") as u32,
        queue_depth: u64_of(&spec, "queue_depth") as u32,
        outputs: tensors(&spec["tensors"]),
    };
    golden::check_encoded("rank_response", &encode_response(&want));
    assert_eq!(
        decode_response(&golden::bytes("rank_response")).unwrap(),
        want
    );
}

#[test]
fn grpc_infer_request_of_the_load_generator() {
    let spec = golden::content("grpc_infer_request");
    let msg = ModelInferRequest::decode(golden::bytes("grpc_infer_request").as_slice()).unwrap();
    let inputs = spec["inputs"].as_array().expect("inputs");
    assert_eq!(msg.model_name, spec["model_name"].as_str().unwrap());
    assert_eq!((msg.model_version.as_str(), msg.id.as_str()), ("", ""));
    assert!(msg.outputs.is_empty());
    let budget = msg.parameters.get("budget_ms").map(|p| &p.parameter_choice);
    let want_budget = spec["budget_ms"].as_f64().unwrap();
    assert_eq!(
        budget,
        Some(&Some(ParameterChoice::DoubleParam(want_budget)))
    );
    assert_eq!(msg.parameters.len(), 1);
    assert_eq!(msg.inputs.len(), inputs.len());
    for (got, want) in msg.inputs.iter().zip(inputs) {
        let shape: Vec<i64> = want["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_i64().unwrap())
            .collect();
        assert_eq!(got.name, want["name"].as_str().unwrap());
        assert_eq!(got.datatype, want["datatype"].as_str().unwrap());
        assert_eq!(got.shape, shape);
        assert!(
            got.parameters.is_empty() && got.contents.is_none(),
            "{}",
            got.name
        );
    }
    let raw: Vec<Vec<u8>> = inputs.iter().map(|i| tensor(i).data).collect();
    let got_raw: Vec<Vec<u8>> = msg.raw_input_contents.iter().map(|b| b.to_vec()).collect();
    assert_eq!(got_raw, raw);

    // And the router's own reading of it: every input in its slot, the budget taken.
    let parsed = parse_grpc(&model(&spec), msg).unwrap();
    assert!(parsed.raw);
    assert_eq!(parsed.request.budget_ms, Some(want_budget));
    let got: Vec<Tensor> = parsed
        .request
        .inputs
        .into_iter()
        .map(Option::unwrap)
        .collect();
    assert_eq!(got, tensors(&spec["inputs"]));
}

#[test]
fn grpc_infer_response_of_the_router() {
    let spec = golden::content("grpc_infer_response");
    let outputs = tensors(&spec["outputs"]);
    let parameters: HashMap<String, InferParameter> = spec["parameters"]
        .as_object()
        .expect("parameters")
        .iter()
        .map(|(k, v)| {
            let choice = ParameterChoice::Int64Param(v.as_i64().expect("an integer"));
            (
                k.clone(),
                InferParameter {
                    parameter_choice: Some(choice),
                },
            )
        })
        .collect();
    assert_eq!(
        parameters.len(),
        1,
        "prost writes a map in hash order: keep one entry"
    );
    let id = spec["id"].as_str().map(String::from);
    let reply = grpc_response(&model(&spec), id, outputs.clone(), None, true, parameters);
    golden::check_encoded("grpc_infer_response", &reply.encode_to_vec());

    let msg = ModelInferResponse::decode(golden::bytes("grpc_infer_response").as_slice()).unwrap();
    assert_eq!(msg, reply);
    assert_eq!(msg.model_name, spec["model_name"].as_str().unwrap());
    assert_eq!(msg.id, spec["id"].as_str().unwrap());
    let got: Vec<(&str, &str, &[i64])> = msg
        .outputs
        .iter()
        .map(|o| (o.name.as_str(), o.datatype.as_str(), o.shape.as_slice()))
        .collect();
    let shapes: Vec<Vec<i64>> = outputs
        .iter()
        .map(|t| t.dims.iter().map(|&d| d as i64).collect())
        .collect();
    let want: Vec<(&str, &str, &[i64])> = spec["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&shapes)
        .map(|(o, shape)| {
            (
                o["name"].as_str().unwrap(),
                o["datatype"].as_str().unwrap(),
                shape.as_slice(),
            )
        })
        .collect();
    assert_eq!(got, want);
    assert!(msg
        .outputs
        .iter()
        .all(|o| o.contents.is_none() && o.parameters.is_empty()));
    let raw: Vec<Vec<u8>> = msg.raw_output_contents.iter().map(|b| b.to_vec()).collect();
    assert_eq!(raw, outputs.into_iter().map(|t| t.data).collect::<Vec<_>>());
}

#[test]
fn kserve_binary_request_of_the_load_generator() {
    let name = "kserve_binary_request";
    let spec = golden::content(name);
    let model = model(&spec);
    let body = golden::bytes(name);
    let header = u64_of(&spec, "header_length") as usize;
    let request = parse_infer(&model, &body, Some(header)).unwrap();
    assert_eq!(request.budget_ms, spec["budget_ms"].as_f64());
    assert_eq!(
        request.binary,
        vec![true; model.outputs.len()],
        "binary_data_output"
    );
    let got: Vec<Tensor> = request.inputs.into_iter().map(Option::unwrap).collect();
    assert_eq!(got, tensors(&spec["inputs"]));
}

#[test]
fn kserve_binary_response_of_the_router() {
    let name = "kserve_binary_response";
    let spec = golden::content(name);
    let model = model(&spec);
    let outputs = tensors(&spec["outputs"]);
    let parameters = spec["parameters"].as_object().expect("parameters").clone();
    let binary = vec![true; outputs.len()];
    let id = spec["id"].as_str();
    let reply = infer_response(&model, id, &outputs, None, &binary, &parameters);
    golden::check_encoded(name, &reply.body);
    let header = reply.header.expect("binary outputs give a header length");
    golden::check_derived(name, "header_length", header as u64);

    let body = golden::bytes(name);
    let header = u64_of(&golden::content(name), "header_length") as usize; // as regenerated
    let (json, mut sections) = split(&body, header).unwrap();
    let json: Value = serde_json::from_slice(json).unwrap();
    assert_eq!(json["model_name"], spec["model_name"]);
    assert_eq!(json["id"], spec["id"]);
    assert_eq!(json["parameters"], spec["parameters"]);
    let listed = json["outputs"].as_array().expect("outputs");
    assert_eq!(listed.len(), outputs.len());
    for ((out, want), tensor) in listed
        .iter()
        .zip(spec["outputs"].as_array().unwrap())
        .zip(&outputs)
    {
        for key in ["name", "datatype", "shape"] {
            assert_eq!(out[key], want[key], "{key}");
        }
        let size = out["parameters"]["binary_data_size"]
            .as_u64()
            .expect("binary_data_size");
        assert_eq!(
            sections.take(size as usize).unwrap(),
            tensor.data.as_slice()
        );
    }
    sections.finish().unwrap();
}

/// tests/golden/kjt_split.json: a KJT request cut into each key's ids, bags and weights, and
/// its lengths by key, as the Python reference executor cuts it (tests/test_golden_bytes.py
/// checks the same file).
#[test]
fn kjt_requests_split_by_key_as_python_splits_them() {
    use cleave_router::pipeline::kjt::key_lengths;
    use cleave_router::pipeline::validate::check_request;

    let case = golden::content("kjt_split");
    let text = case["manifest"].to_string();
    let manifest = Manifest::parse(&text, Path::new("kjt_split.json")).unwrap();
    let model = Model::from_manifest("kjt", &manifest).unwrap();
    let request = &case["request"];
    let ints = |name: &str| -> Vec<i64> {
        let v = request[name].as_array().unwrap();
        v.iter().map(|x| x.as_i64().unwrap()).collect()
    };
    let values = ints("p.values");
    let lengths = ints("p.lengths");
    let weights: Vec<f32> = request["p.weights"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    let batch = lengths.len() / 3;
    let given = vec![
        Some(Tensor::from_f32(vec![batch, 2], &vec![0.0; batch * 2])),
        Some(Tensor::from_i64(vec![values.len()], &values)),
        Some(Tensor::from_f32(vec![weights.len()], &weights)),
        Some(Tensor::from_i64(vec![lengths.len()], &lengths)),
    ];
    let checked = check_request(&model, given).unwrap();
    for lookup in &checked.lookups {
        let feature = &model.features[lookup.feature];
        let want = &case["lookups"][&feature.name];
        let as_i64 = |v: &Value| -> Vec<i64> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap())
                .collect()
        };
        assert_eq!(lookup.ids, as_i64(&want["ids"]), "{}", feature.name);
        let bags: Vec<i64> = lookup
            .bags
            .as_ref()
            .unwrap()
            .iter()
            .map(|&b| b as i64)
            .collect();
        assert_eq!(bags, as_i64(&want["bags"]), "{}", feature.name);
        let w: Vec<f64> = lookup
            .weights
            .as_ref()
            .unwrap()
            .iter()
            .map(|&x| x as f64)
            .collect();
        let want_w: Vec<f64> = want["weights"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(w, want_w, "{}", feature.name);
    }
    // The lengths cut by key, as an EmbeddingCollection's dense program receives them.
    let group = &model.kjts[0];
    for (key, name) in case["manifest"]["kjts"][0]["lengths_by_key"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let cut = key_lengths(group, &checked.inputs, key).to_i64().unwrap();
        let want: Vec<i64> = case["key_lengths"][name.as_str().unwrap()]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect();
        assert_eq!(cut, want, "{name}");
    }
}
