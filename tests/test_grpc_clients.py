"""The clients people already use, over KServe v2 gRPC, unmodified and with their defaults:
Triton's `tritonclient.grpc` (sync and asyncio) and KServe's SDK (`InferenceGRPCClient`, and
its `InferenceRESTClient` over REST), against `cleave serve --grpc-port` of every reference
model. The scores equal the model's within 1e-5. One deployment per model serves them all.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import cleave
import numpy as np
import pytest

# In the dev extra: a missing client is a failure, not a skip.
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpc
from cleave.bench.loadgen import codec_counters
from cleave.launch.process import ServeProcess
from cleave.models import MODELS, RequestGenerator
from test_tritonclient import SCALES, check, inputs_and_scores, triton_inputs

pytestmark = pytest.mark.filterwarnings(
    "ignore:The given buffer is not writable", "ignore::DeprecationWarning"
)


def free_port() -> int:
    """A port nothing listens on now, for `--grpc-port` (the launcher does not report an
    ephemeral gRPC port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", sorted(SCALES))
def test_grpc_clients_get_the_models_scores(tmp_path, name):
    model, example = MODELS[name].factory(scale=SCALES[name], seed=0)
    model.eval()
    bundle = cleave.partition(model, example)
    bundle_dir = bundle.save(tmp_path / name)
    generator = RequestGenerator(name, scale=SCALES[name], seed=5, min_pooling=0)
    requests = [inputs_and_scores(model, bundle, generator, b) for b in (1, 13, 64)]
    port = free_port()
    flags = ["--shards", "1", "--rankers", "1", "--threads", "1", "--grpc-port", str(port)]
    with ServeProcess(bundle_dir, *flags) as server:
        target = f"127.0.0.1:{port}"
        model_name = bundle_dir.name

        client = grpcclient.InferenceServerClient(url=target)
        try:
            assert client.is_server_live()
            assert client.is_server_ready()
            assert client.is_model_ready(model_name)
            meta = client.get_model_metadata(model_name, as_json=True)
            outputs = [o["name"] for o in meta["outputs"]]
            for arrays, want in requests:
                result = client.infer(model_name, triton_inputs(grpcclient, arrays))
                check(result, outputs, want, f"{name} grpc sync")
            arrays, want = requests[1]
            asked = [grpcclient.InferRequestedOutput(o) for o in outputs]
            result = client.infer(model_name, triton_inputs(grpcclient, arrays), outputs=asked)
            check(result, outputs, want, f"{name} grpc sync, outputs named")
        finally:
            client.close()

        async def run_async():
            aclient = aiogrpc.InferenceServerClient(url=target)
            try:
                assert await aclient.is_server_live()
                results = await asyncio.gather(
                    *(
                        aclient.infer(model_name, triton_inputs(aiogrpc, arrays))
                        for arrays, _ in requests
                    )
                )
            finally:
                await aclient.close()
            for result, (_, want) in zip(results, requests, strict=True):
                check(result, outputs, want, f"{name} grpc async")

        asyncio.run(run_async())

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

        # tritonclient sends raw tensors: every gRPC request was counted under grpc.
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
            counters = codec_counters(resp.read().decode())
        sent = 2 * len(requests) + 1 + len(requests)  # triton sync, async; KServe's
        assert counters[("parse", "grpc")][1] == sent
        assert counters[("encode", "grpc")][1] == sent
