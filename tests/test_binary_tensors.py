"""The REST binary tensor data extension against a real `cleave serve` deployment, in raw HTTP
bodies: binary, JSON and mixed requests get the model's scores; binary replies carry their JSON
header length; every malformed binary body is a 400 naming the tensor or parameter, and the
router keeps serving. Then `cleave bench serve --protocol binary` end to end.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse

import cleave
import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from cleave.bench.loadgen import (
    HEADER_LENGTH,
    binary_infer_body,
    codec_counters,
    infer_body,
    outputs_of,
    parse_reply,
)
from cleave.launch.process import ServeProcess
from cleave.models import MODELS, RequestGenerator
from support.bench import FLOAT32, run_bench
from support.cli import refused

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

TOLERANCE = 1e-5


class Served:
    """dlrm at a small scale, served by one shard and one ranker."""

    def __init__(self, root):
        self.model, example = MODELS["dlrm"].factory(scale=0.002, seed=0)
        self.model.eval()
        self.bundle = cleave.partition(self.model, example)
        self.dir = self.bundle.save(root / "dlrm")
        self.generator = RequestGenerator("dlrm", scale=0.002, seed=3, min_pooling=0)
        self.server = ServeProcess(self.dir, "--shards", "1", "--rankers", "1", "--threads", "1")

    def request(self, batch: int) -> tuple[dict, list[np.ndarray]]:
        args = self.generator.batch(batch)
        with torch.inference_mode():
            want = [t.double().numpy() for t in pytree.tree_leaves(self.model(*args))]
        return self.bundle.named_inputs(*args), want

    @property
    def path(self) -> str:
        return f"/v2/models/{self.dir.name}/infer"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("binary"))
    with s.server:
        yield s


def post(served: Served, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    """One POST on a fresh connection: status, response headers (lower-case), body."""
    url = urllib.parse.urlsplit(served.server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("POST", served.path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def framed(header: dict, sections: list[bytes]) -> tuple[bytes, dict]:
    head = json.dumps(header).encode()
    return head + b"".join(sections), {HEADER_LENGTH: str(len(head))}


def assert_scores(reply: dict, want: list[np.ndarray]) -> None:
    got = outputs_of(reply)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w).max() <= TOLERANCE


def test_binary_json_and_mixed_requests_get_the_models_scores(served):
    named, want = served.request(9)
    # All binary, binary outputs (what tritonclient sends by default).
    body = binary_infer_body(named)
    status, headers, raw = post(served, body, body.headers)
    assert status == 200, raw[:500]
    assert headers["content-type"] == "application/octet-stream"
    n = int(headers[HEADER_LENGTH.lower()])
    header = json.loads(raw[:n])
    sizes = [o["parameters"]["binary_data_size"] for o in header["outputs"]]
    assert all("data" not in o for o in header["outputs"])
    assert n + sum(sizes) == len(raw)
    assert_scores(parse_reply(raw), want)

    # Mixed: every other input binary, the rest JSON; outputs as JSON.
    inputs, sections = [], []
    for i, (name, tensor) in enumerate(named.items()):
        one = json.loads(infer_body({name: tensor}))["inputs"][0]
        if i % 2 == 0:
            raw_bytes = tensor.contiguous().numpy().tobytes()
            del one["data"]
            one["parameters"] = {"binary_data_size": len(raw_bytes)}
            sections.append(raw_bytes)
        inputs.append(one)
    mixed, headers = framed({"inputs": inputs}, sections)
    status, got_headers, raw = post(served, mixed, headers)
    assert status == 200, raw[:500]
    assert got_headers["content-type"] == "application/json"
    assert HEADER_LENGTH.lower() not in got_headers
    assert_scores(json.loads(raw), want)

    # JSON in, one output asked for as binary.
    plain = json.loads(infer_body(named))
    plain["outputs"] = [{"name": "output_0", "parameters": {"binary_data": True}}]
    status, got_headers, raw = post(served, json.dumps(plain).encode(), {})
    assert status == 200, raw[:500]
    assert int(got_headers[HEADER_LENGTH.lower()]) < len(raw)
    assert_scores(parse_reply(raw), want)


def test_malformed_binary_bodies_are_400s_naming_what_is_wrong(served):
    named, want = served.request(4)
    dense_name, dense = next(iter(named.items()))
    others = dict(list(named.items())[1:])
    dense_bytes = dense.contiguous().numpy().tobytes()
    rest = json.loads(infer_body(others))["inputs"]

    def with_dense(params: dict, data=None) -> dict:
        entry = {
            "name": dense_name,
            "shape": list(dense.shape),
            "datatype": "FP32",
            "parameters": params,
        }
        if data is not None:
            entry["data"] = data
        return {"inputs": [entry, *rest]}

    size = len(dense_bytes)
    good, good_headers = framed(with_dense({"binary_data_size": size}), [dense_bytes])
    second_name, second_tensor = next(iter(others.items()))
    second_bytes = second_tensor.contiguous().numpy().tobytes()
    second = dict(rest[0], parameters={"binary_data_size": len(second_bytes)})
    del second["data"]
    two = {"inputs": [with_dense({"binary_data_size": size})["inputs"][0], second, *rest[1:]]}
    two_body, two_headers = framed(two, [dense_bytes, second_bytes[:4]])
    cases = [
        (
            "header length beyond the body",
            good,
            {HEADER_LENGTH: str(len(good) + 10)},
            [f"header inference-header-content-length is {len(good) + 10}", "only"],
        ),
        (
            "non-numeric header length",
            good,
            {HEADER_LENGTH: "twelve"},
            ['inference-header-content-length is "twelve"', "non-negative whole number"],
        ),
        (
            "truncated binary section",
            good[:-3],
            good_headers,
            [f'input "{dense_name}"', f"{size} bytes from byte 0", f"only {size - 3} bytes"],
        ),
        (
            "binary_data_size disagrees with the shape",
            *framed(with_dense({"binary_data_size": size - 4}), [dense_bytes[:-4]]),
            [f'input "{dense_name}"', f"binary_data_size is {size - 4} bytes, expected {size}"],
        ),
        (
            "sizes summing past the body",
            two_body,
            two_headers,
            [
                f'input "{second_name}"',
                f"{len(second_bytes)} bytes from byte {size}",
                "only 4 bytes are left",
            ],
        ),
        (
            "binary and JSON data at once",
            *framed(with_dense({"binary_data_size": size}, [0.0] * dense.numel()), [dense_bytes]),
            [f'input "{dense_name}"', 'but the input also has "data"'],
        ),
        (
            "bytes after the last tensor",
            good + b"xx",
            good_headers,
            ["2 bytes after the last binary tensor"],
        ),
        (
            "compressed body",
            good,
            {**good_headers, "Content-Encoding": "gzip"},
            ['content-encoding is "gzip": compressed request bodies are not supported'],
        ),
        (
            "binary_data_size without the header",
            good[: int(good_headers[HEADER_LENGTH])],
            {},
            [f'input "{dense_name}"', "no inference-header-content-length header"],
        ),
    ]
    for case, body, headers, needles in cases:
        status, _, raw = post(served, body, headers)
        assert status == 400, (case, raw[:300])
        message = json.loads(raw)["error"]
        for needle in needles:
            assert needle in message, (case, needle, message)

    # Unharmed: the good body gets the model's scores.
    status, _, raw = post(served, good, good_headers)
    assert status == 200, raw[:300]
    assert_scores(parse_reply(raw), want)

    # The parse and encode CPU counters saw both protocols.
    url = urllib.parse.urlsplit(served.server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("GET", "/metrics")
    counters = codec_counters(conn.getresponse().read().decode())
    conn.close()
    # All but three cases: two refused before their body is read, one without the header.
    assert counters[("parse", "binary")][1] >= len(cases) - 3
    assert counters[("encode", "json")][1] >= 1
    assert counters[("parse", "binary")][0] > 0.0


def test_bench_serve_drives_every_protocol_in_one_run_and_checks_their_scores(tmp_path):
    _, report = run_bench(
        tmp_path, "serve", "--quick", "--check",
        "--protocol", "binary,grpc,json", "--model", "dlrm", "--scale", "0.002",
        "--candidates", "16", "--requests", "8", *FLOAT32,
        # What this checks is each protocol's plumbing and scores, not latency: a budget that a
        # machine busy with other test workers meets (25 ms by default).
        "--budget-ms", "5000",
    )  # fmt: skip
    # One deployment per protocol; the first keeps its name.
    deps = report["deployments"]
    assert list(deps) == ["disaggregated", "disaggregated/grpc", "disaggregated/json"]
    for deployment in deps.values():
        for point in [deployment["single"], *deployment["rates"]]:
            assert point["ok"] > 0 and not point["errors"], point
        # Stage timings come from the replies (binary's JSON header, gRPC's parameters).
        assert "compute_us" in deployment["rates"][0]["stages_us"]
    # Each router counted the CPU of its own protocol's parsing.
    for name, protocol in (("disaggregated", "binary"), ("disaggregated/grpc", "grpc")):
        codec = deps[name]["rates"][0]["metrics"]["codec_cpu_us"]
        assert codec.get(f"parse_{protocol}", 0) > 0, codec
    ratios = report["ratios"]
    for key in ("max_rate", "max_goodput", "single_p50", "codec_cpu"):
        for protocol in ("grpc", "json"):
            assert f"{key}_{protocol}_over_binary" in ratios, ratios
    assert ratios["codec_cpu_json_over_binary"] > 0
    assert report["max_abs_diff"] is not None and report["max_abs_diff"] <= TOLERANCE


def test_bench_serve_refuses_a_bad_protocol_list(tmp_path):
    for bad in ("json,xml", "json,json", ","):
        message = "--protocol: expected distinct names of json, binary, grpc"
        assert message in refused("bench", "serve", "--protocol", bad)
