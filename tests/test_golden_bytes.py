"""Golden bytes (docs/protocol.md, "Golden bytes"): each format written on one side of the
Rust/Python boundary and read on the other is pinned by two files in tests/golden/: NAME.bin,
the bytes its writer produced, and NAME.json, their logical content (its "writer" says which
side produced them). Here Python (a) encodes the content and must produce exactly those bytes,
and (b) decodes those bytes and must find the content; crates/*/tests/golden.rs do the same in
Rust. A change on either side that the other would misread fails here or there.

After a deliberate format change, regenerate the Python-written files (the Rust-written ones:
the same variable with `cargo test --test golden`):
    CLEAVE_GOLDEN_REGEN=1 .venv/bin/python -m pytest -q tests/test_golden_bytes.py
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from cleave import _native, shard_update, update
from cleave.bench.loadgen import (
    binary_infer_body,
    grpc_infer_message,
    grpc_with_model,
    parse_grpc_reply,
    parse_reply,
)
from cleave.bundle import tables
from cleave.ranker import payload
from tritonclient.grpc import service_pb2 as pb

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("CLEAVE_GOLDEN_REGEN") == "1"


def content(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


def golden(name: str) -> bytes:
    return (GOLDEN / f"{name}.bin").read_bytes()


def check_encoded(name: str, encoded: bytes) -> None:
    """(a): `encoded` must be NAME.bin; when regenerating, Python's own files become it."""
    path = GOLDEN / f"{name}.bin"
    if REGEN and content(name)["writer"] == "python":
        path.write_bytes(encoded)
        return
    want = path.read_bytes()
    if encoded != want:
        at = next(
            (i for i, (x, y) in enumerate(zip(encoded, want, strict=False)) if x != y),
            min(len(encoded), len(want)),
        )
        pytest.fail(
            f"{path.name}: Python encodes {len(encoded)} bytes, the golden file has "
            f"{len(want)}; first difference at byte {at}: {encoded[at : at + 16].hex(' ')} "
            f"here, {want[at : at + 16].hex(' ')} in the file. After a deliberate format "
            'change regenerate (docs/protocol.md, "Golden bytes").'
        )


def check_derived(name: str, key: str, value: int) -> None:
    """A number in NAME.json derived from the bytes (a checksum, a header length) must be
    `value`; when regenerating, Python's own sidecars get it. The first `"key": N` is meant."""
    sidecar = GOLDEN / f"{name}.json"
    text = sidecar.read_text()
    if REGEN and content(name)["writer"] == "python":
        sidecar.write_text(re.sub(rf'"{key}": \d+', f'"{key}": {value}', text, count=1))
        return
    found = re.search(rf'"{key}": (\d+)', text)
    assert found and int(found.group(1)) == value, f"{name}.json: {key} should be {value}"


def tensor(spec: dict) -> torch.Tensor:
    """A sidecar tensor: torch dtype name, shape, flat values."""
    return torch.tensor(spec["data"], dtype=getattr(torch, spec["dtype"])).reshape(spec["shape"])


def raw(spec: dict) -> bytes:
    """A sidecar tensor's elements as little-endian bytes in C order."""
    return tensor(spec).reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_tensors(got: list[torch.Tensor], want: list[dict]) -> None:
    assert len(got) == len(want), f"{len(got)} tensors decoded, {len(want)} expected"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (str(g.dtype), list(g.shape)) == (f"torch.{w['dtype']}", w["shape"]), f"tensor {i}"
        assert torch.equal(g, tensor(w)), f"tensor {i}: {g} != {w['data']}"


def test_rank_request_router_to_ranker():
    spec = content("rank_request")
    check_encoded("rank_request", payload.encode_request([tensor(t) for t in spec["tensors"]]))
    assert_tensors(payload.decode_request(golden("rank_request")).tensors, spec["tensors"])


def test_rank_response_ranker_to_router():
    spec = content("rank_response")
    timings = [spec[k] for k in ("queue_us", "compute_us", "batch_requests", "queue_depth")]
    outputs = [tensor(t) for t in spec["tensors"]]
    check_encoded("rank_response", payload.encode_response(*timings, outputs))
    got = payload.decode_response(golden("rank_response"))
    assert [got.queue_us, got.compute_us, got.batch_requests, got.queue_depth] == timings
    assert_tensors(got.tensors, spec["tensors"])


def test_incast_control_frames():
    spec = content("control_frames")
    check_encoded("control_frames", b"".join(_native.encode_control(m) for m in spec["frames"]))
    buf, got = golden("control_frames"), []
    while buf:
        decoded = _native.decode_control(buf)
        assert decoded is not None, f"{len(buf)} bytes left that are not a whole frame"
        message, used = decoded
        got.append(message)
        buf = buf[used:]
    assert got == spec["frames"]


def test_delta_file(tmp_path):
    spec = content("delta")
    rows = np.array(spec["rows"])  # float64: the writer casts to the table's dtype
    written = update.write_delta(tmp_path / "delta.bin", spec["table"], spec["ids"], rows)
    check_encoded("delta", written.read_bytes())
    # Python's reader checks the header before sending the file; the shard parses the rest.
    assert update.read_delta_header(GOLDEN / "delta.bin", spec["table"]) == len(spec["ids"])


@pytest.mark.parametrize("name", ["update_stage", "update_switch", "update_abort"])
def test_update_frame_payloads(name):
    spec = content(name)
    check_encoded(name, shard_update._message(spec["header"], bytes(spec["data"])))


@pytest.mark.parametrize("dtype", tables.TABLE_DTYPES.names)
def test_table_files(dtype):
    name = f"table_{dtype}"
    spec = content(name)
    meta, values = spec["table"], np.array(spec["values"], dtype=np.float32)
    assert meta["row_bytes"] == tables.row_bytes(dtype, meta["dim"])
    check_encoded(name, tables.encode(values, dtype).tobytes())
    path = GOLDEN / f"{name}.bin"
    # The CRC-32 a bundle's manifest records, which the shard verifies.
    check_derived(name, "crc32", tables.crc32_of(path))
    decoded = tables.decode(np.asarray(tables.open_rows(path, meta)), dtype, meta["dim"])
    np.testing.assert_array_equal(decoded, values)


def test_grpc_infer_request_of_the_load_generator():
    """The load generator's hand-written protobuf, read by the published message."""
    spec = content("grpc_infer_request")
    named = {i["name"]: tensor(i) for i in spec["inputs"]}
    message = grpc_infer_message(named, spec["budget_ms"])
    check_encoded("grpc_infer_request", grpc_with_model(message, spec["model_name"]))
    msg = pb.ModelInferRequest.FromString(golden("grpc_infer_request"))
    fields = {f.name for f, _ in msg.ListFields()}
    assert fields == {"model_name", "inputs", "parameters", "raw_input_contents"}
    assert msg.model_name == spec["model_name"]
    got = [(i.name, i.datatype, list(i.shape), len(i.ListFields())) for i in msg.inputs]
    assert got == [(i["name"], i["datatype"], i["shape"], 3) for i in spec["inputs"]]
    assert list(msg.parameters) == ["budget_ms"]
    budget = msg.parameters["budget_ms"]
    assert (budget.WhichOneof("parameter_choice"), budget.double_param) == (
        "double_param",
        spec["budget_ms"],
    )
    assert list(msg.raw_input_contents) == [raw(i) for i in spec["inputs"]]


def test_grpc_infer_response_of_the_router():
    """The router's reply (prost), read by the load generator's hand-written parser and by
    the published message."""
    spec = content("grpc_infer_response")
    bytes_ = golden("grpc_infer_response")
    mine = parse_grpc_reply(bytes_)
    assert mine["parameters"] == spec["parameters"]
    assert len(mine["outputs"]) == len(spec["outputs"])
    for out, want in zip(mine["outputs"], spec["outputs"], strict=True):
        assert (out["name"], out["datatype"], out["shape"]) == (
            want["name"],
            want["datatype"],
            want["shape"],
        )
        np.testing.assert_array_equal(out["data"], tensor(want).numpy())
    msg = pb.ModelInferResponse.FromString(bytes_)
    fields = {f.name for f, _ in msg.ListFields()}
    assert fields == {
        "model_name",
        "model_version",
        "id",
        "parameters",
        "outputs",
        "raw_output_contents",
    }
    assert (msg.model_name, msg.model_version, msg.id) == (spec["model_name"], "1", spec["id"])
    params = {k: v.int64_param for k, v in msg.parameters.items()}
    assert params == spec["parameters"]
    got = [(o.name, o.datatype, list(o.shape)) for o in msg.outputs]
    assert got == [(o["name"], o["datatype"], o["shape"]) for o in spec["outputs"]]
    assert list(msg.raw_output_contents) == [raw(o) for o in spec["outputs"]]


def test_kserve_binary_request_of_the_load_generator():
    """The REST body with binary tensors (`--protocol binary`): JSON header, then raw bytes."""
    spec = content("kserve_binary_request")
    body = binary_infer_body({i["name"]: tensor(i) for i in spec["inputs"]}, spec["budget_ms"])
    check_encoded("kserve_binary_request", bytes(body))
    check_derived("kserve_binary_request", "header_length", body.header_length)


def test_kserve_binary_response_of_the_router():
    spec = content("kserve_binary_response")
    body = golden("kserve_binary_response")
    # The JSON header is exactly the Inference-Header-Content-Length the router sends.
    header = json.loads(body[: spec["header_length"]])
    assert (header["model_name"], header["id"]) == (spec["model_name"], spec["id"])
    reply = parse_reply(body)
    assert reply["parameters"] == spec["parameters"]
    assert len(reply["outputs"]) == len(spec["outputs"])
    for out, want in zip(reply["outputs"], spec["outputs"], strict=True):
        assert (out["name"], out["datatype"], out["shape"]) == (
            want["name"],
            want["datatype"],
            want["shape"],
        )
        assert out["parameters"] == {"binary_data_size": len(raw(want))}
        np.testing.assert_array_equal(out["data"], tensor(want).numpy())


def test_kjt_requests_split_by_key_as_the_router_splits_them():
    """tests/golden/kjt_split.json: the reference executor cuts a KJT request into each key's
    ids, bags and weights, and its lengths by key, as crates/cleave-router/tests/golden.rs
    finds the router does."""
    from cleave.bundle.reference import key_lengths, kjt_segments

    case = content("kjt_split")
    request = case["request"]
    inputs = {
        "p.values": torch.tensor(request["p.values"]),
        "p.weights": torch.tensor(request["p.weights"]),
        "p.lengths": torch.tensor(request["p.lengths"]),
    }
    segments = kjt_segments(case["manifest"]["kjts"][0], inputs)
    for key, want in case["lookups"].items():
        got = segments[key]
        assert got["ids"].tolist() == want["ids"], key
        assert got["offsets"].tolist() == want["bags"], key
        assert got["weights"].tolist() == want["weights"], key
    cut = key_lengths(case["manifest"]["kjts"][0], inputs)
    assert {name: t.tolist() for name, t in cut.items()} == case["key_lengths"]
