"""Triton's own clients and KServe's, unmodified and with their defaults, against `cleave
serve` of every reference model, one deployment each, over HTTP and gRPC: tritonclient HTTP
(binary input tensors, binary outputs) and gRPC, sync and asyncio; KServe's SDK
(`InferenceGRPCClient`, and `InferenceRESTClient` over REST) in a child process
(tests/kserve_client.py says why). The scores equal the model's within 1e-5, and each
protocol's requests are counted under its codec.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

# In the dev extra: a missing client is a failure, not a skip.
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpc
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from cleave.bench.loadgen import codec_counters
from cleave.launch.process import ServeProcess
from cleave.models import MODELS
from support.served import SCALES, grpc_target, roomy_budget
from support.triton import served_model, triton_round_trips

pytestmark = pytest.mark.filterwarnings(
    "ignore:The given buffer is not writable", "ignore::DeprecationWarning"
)


def test_every_reference_model_is_covered():
    assert sorted(SCALES) == sorted(name for name, entry in MODELS.items() if not entry.torchrec)


@pytest.mark.slow  # a deployment per reference model
@pytest.mark.parametrize("name", sorted(SCALES))
def test_triton_and_kserve_clients_get_the_models_scores_over_http_and_grpc(tmp_path, name):
    bundle_dir, requests = served_model(tmp_path, name)
    flags = ["--shards", "1", "--rankers", "1", "--threads", "1", "--grpc-port", "0"]
    with ServeProcess(bundle_dir, *flags, *roomy_budget(tmp_path)) as server:
        url, target = server.url.removeprefix("http://"), grpc_target(server)
        model_name = bundle_dir.name
        with httpclient.InferenceServerClient(url=url) as client:
            outputs = [o["name"] for o in client.get_model_metadata(model_name)["outputs"]]
        triton_round_trips(httpclient, aioclient, url, model_name, outputs, requests, name)
        with grpcclient.InferenceServerClient(url=target) as client:
            assert client.is_server_ready()
            meta = client.get_model_metadata(model_name, as_json=True)
        assert [o["name"] for o in meta["outputs"]] == outputs
        what = f"{name} grpc"
        triton_round_trips(grpcclient, aiogrpc, target, model_name, outputs, requests, what)

        # KServe's clients run in their own process (tests/kserve_client.py says why).
        cases = {}
        for i, (arrays, want) in enumerate(requests):
            cases.update({f"in{i}_{k}": v for k, v in arrays.items()})
            cases.update({f"want{i}_{k}": w for k, w in enumerate(want)})
        np.savez(tmp_path / "cases.npz", **cases)
        script = Path(__file__).with_name("kserve_client.py")
        argv = [sys.executable, str(script), str(tmp_path / "cases.npz"), server.url, target]
        done = subprocess.run(
            [*argv, model_name, *outputs], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr

        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
            counters = codec_counters(resp.read().decode())
        # tritonclient sync (each request, then one with its outputs named) and async, then
        # KServe's: on HTTP every body parsed binary (both clients' defaults), replies binary
        # to tritonclient and JSON to KServe's REST client (its default); on gRPC raw tensors.
        triton, kserve = 2 * len(requests) + 1, len(requests)
        assert counters[("parse", "binary")][1] == triton + kserve
        assert counters[("encode", "binary")][1] == triton
        assert counters[("encode", "json")][1] == kserve
        assert ("parse", "json") not in counters
        for step in ("parse", "encode"):
            assert counters[(step, "grpc")][1] == triton + kserve, step
