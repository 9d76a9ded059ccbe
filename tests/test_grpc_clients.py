"""The clients people already use, over KServe v2 gRPC, unmodified and with their defaults:
Triton's `tritonclient.grpc` (sync and asyncio) and KServe's SDK (`InferenceGRPCClient`, and
its `InferenceRESTClient` over REST), against `cleave serve --grpc-port` of every reference
model. The scores equal the model's within 1e-5. One deployment per model serves them all.
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
from cleave.bench.loadgen import codec_counters
from cleave.launch.process import ServeProcess
from support.served import SCALES, grpc_target, roomy_budget
from support.triton import served_model, triton_round_trips

pytestmark = pytest.mark.filterwarnings(
    "ignore:The given buffer is not writable", "ignore::DeprecationWarning"
)


@pytest.mark.slow  # a deployment per reference model
@pytest.mark.parametrize("name", sorted(SCALES))
def test_grpc_clients_get_the_models_scores(tmp_path, name):
    bundle_dir, requests = served_model(tmp_path, name)
    flags = ["--shards", "1", "--rankers", "1", "--threads", "1", "--grpc-port", "0"]
    with ServeProcess(bundle_dir, *flags, *roomy_budget(tmp_path)) as server:
        target = grpc_target(server)
        model_name = bundle_dir.name
        with grpcclient.InferenceServerClient(url=target) as client:
            assert client.is_server_ready()
            meta = client.get_model_metadata(model_name, as_json=True)
        outputs = [o["name"] for o in meta["outputs"]]
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

        # tritonclient sends raw tensors: every gRPC request was counted under grpc.
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
            counters = codec_counters(resp.read().decode())
        sent = 2 * len(requests) + 1 + len(requests)  # triton sync, async; KServe's
        assert counters[("parse", "grpc")][1] == sent
        assert counters[("encode", "grpc")][1] == sent
