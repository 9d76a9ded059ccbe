"""Bad input over KServe v2 gRPC, against a real `cleave serve --grpc-port`: wrong datatypes,
raw contents of the wrong length, typed contents in the wrong field, unknown model, input and
output, a message over the size limit, bytes that are not protobuf. Each is a gRPC error with
the status code and message the router documents (docs/serving.md, "gRPC"), and the server
answers a good request afterwards.
"""

from __future__ import annotations

import cleave
import grpc
import numpy as np
import pytest
from cleave.launch.process import ServeProcess
from cleave.models import MODELS, RequestGenerator
from support.served import grpc_target

# tritonclient's generated messages: the published definition, not ours.
from tritonclient.grpc import service_pb2 as pb

SCALE = 0.002
LIMIT_MB = 0.25  # the router's body limit in this test: also its largest gRPC message


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpc_errors")
    model, example = MODELS["dlrm"].factory(scale=SCALE, seed=0)
    bundle = cleave.partition(model.eval(), example)
    bundle_dir = bundle.save(tmp / "dlrm")
    generator = RequestGenerator("dlrm", scale=SCALE, seed=5, min_pooling=0)
    arrays = {
        k: t.contiguous().numpy() for k, t in bundle.named_inputs(*generator.batch(4)).items()
    }
    config = tmp / "serve.toml"
    config.write_text(f"[router]\nbody_limit_mb = {LIMIT_MB}\n")
    flags = ["--shards", "1", "--rankers", "1", "--threads", "1", "--grpc-port", "0"]
    with ServeProcess(bundle_dir, "--config", str(config), *flags) as server:
        channel = grpc.insecure_channel(
            grpc_target(server), options=[("grpc.max_send_message_length", 64 << 20)]
        )
        try:
            yield channel, arrays
        finally:
            channel.close()


def infer_call(channel):
    return channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
        response_deserializer=pb.ModelInferResponse.FromString,
    )


def raw_request(arrays: dict, model: str = "dlrm") -> pb.ModelInferRequest:
    dtypes = {np.float32: "FP32", np.int64: "INT64", np.int32: "INT32"}
    req = pb.ModelInferRequest(model_name=model)
    for name, arr in arrays.items():
        tensor = req.inputs.add(name=name, datatype=dtypes[arr.dtype.type])
        tensor.shape.extend(arr.shape)
        req.raw_input_contents.append(arr.tobytes())
    return req


def fails(channel, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        infer_call(channel)(request, timeout=30)
    return caught.value


def test_a_good_request_is_answered(deployment):
    channel, arrays = deployment
    reply = infer_call(channel)(raw_request(arrays), timeout=30)
    assert len(reply.raw_output_contents) == len(reply.outputs) >= 1


def test_wrong_datatype(deployment):
    channel, arrays = deployment
    req = raw_request(arrays)
    req.inputs[0].datatype = "FP16" if req.inputs[0].datatype != "FP16" else "FP32"
    e = fails(channel, req)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f'input "{req.inputs[0].name}": datatype' in e.details(), e.details()
    assert "expected" in e.details()


def test_raw_contents_of_the_wrong_length(deployment):
    channel, arrays = deployment
    req = raw_request(arrays)
    req.raw_input_contents[0] = req.raw_input_contents[0][:-3]
    e = fails(channel, req)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents entry has" in e.details(), e.details()
    assert "bytes, expected" in e.details()
    short = raw_request(arrays)
    del short.raw_input_contents[-1]
    e = fails(channel, short)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "give one raw entry per input" in e.details(), e.details()


def test_typed_contents_in_the_wrong_field(deployment):
    channel, arrays = deployment
    req = raw_request(arrays)
    name, arr = next((k, v) for k, v in arrays.items() if v.dtype == np.float32)
    del req.raw_input_contents[:]
    for tensor in req.inputs:
        a = arrays[tensor.name]
        field = tensor.contents.fp32_contents if a.dtype == np.float32 else None
        if tensor.name == name:  # the floats sent as int64: the datatype says FP32
            tensor.contents.int64_contents.extend([0] * a.size)
        elif field is not None:
            field.extend(a.ravel().tolist())
        else:
            tensor.contents.int64_contents.extend(a.ravel().tolist())
    e = fails(channel, req)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "datatype FP32 takes its data in contents.fp32_contents, but "
        f"contents.int64_contents has {arr.size}" in e.details()
    ), e.details()


def test_unknown_model_input_and_output(deployment):
    channel, arrays = deployment
    e = fails(channel, raw_request(arrays, model="nope"))
    assert e.code() == grpc.StatusCode.NOT_FOUND
    assert 'unknown model "nope"; this router serves "dlrm"' in e.details()
    req = raw_request(arrays)
    req.inputs[0].name = "nope"
    e = fails(channel, req)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details().startswith('unknown input "nope"; the model takes'), e.details()
    req = raw_request(arrays)
    req.outputs.add(name="nope")
    e = fails(channel, req)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details().startswith('unknown output "nope"'), e.details()


def test_an_oversized_message_is_resource_exhausted(deployment):
    channel, arrays = deployment
    req = raw_request(arrays)
    req.id = "x" * int(LIMIT_MB * (1 << 20) + 1000)
    e = fails(channel, req)
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "more than this router accepts (262144 bytes" in e.details(), e.details()


def test_bytes_that_are_not_protobuf(deployment):
    channel, arrays = deployment
    e = fails(channel, b"\xff\xff\xff\xff not a message")
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid protobuf message" in e.details(), e.details()
    # And the server still serves.
    reply = infer_call(channel)(raw_request(arrays), timeout=30)
    assert len(reply.outputs) >= 1


def test_the_bench_load_path_speaks_the_published_messages(deployment):
    """`cleave bench serve --protocol grpc` encodes requests and decodes replies by hand:
    its request parses as the published ModelInferRequest, and its reply parser reads what
    the router sends (the scores equal those tritonclient's messages get)."""
    from cleave.bench.loadgen import grpc_infer_message, grpc_with_model, parse_grpc_reply

    channel, arrays = deployment
    import torch

    named = {k: torch.from_numpy(v) for k, v in arrays.items()}
    message = grpc_with_model(grpc_infer_message(named, budget_ms=5000.0), "dlrm")
    parsed = pb.ModelInferRequest.FromString(message)
    assert parsed.model_name == "dlrm"
    assert [i.name for i in parsed.inputs] == list(arrays)
    assert [list(i.shape) for i in parsed.inputs] == [list(a.shape) for a in arrays.values()]
    assert parsed.parameters["budget_ms"].double_param == 5000.0
    assert list(parsed.raw_input_contents) == [a.tobytes() for a in arrays.values()]
    raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(message, timeout=30)
    mine = parse_grpc_reply(raw)
    theirs = infer_call(channel)(raw_request(arrays), timeout=30)
    assert [o["name"] for o in mine["outputs"]] == [o.name for o in theirs.outputs]
    for out, want in zip(mine["outputs"], theirs.raw_output_contents, strict=True):
        assert out["data"].tobytes() == want
    assert mine["parameters"]["lookup_us"] >= 0
