"""Triton's own HTTP client, unmodified and with its defaults (binary input tensors, binary
outputs), sync and asyncio, against `cleave serve` of every reference model: the scores equal
the model's within 1e-5.
"""

from __future__ import annotations

import urllib.request

import pytest

# In the dev extra: a missing client is a failure, not a skip.
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from cleave.bench.loadgen import codec_counters
from cleave.launch.process import ServeProcess
from cleave.models import MODELS
from support.served import SCALES, roomy_budget
from support.triton import served_model, triton_round_trips

pytestmark = pytest.mark.filterwarnings(
    "ignore:The given buffer is not writable", "ignore::DeprecationWarning"
)


def test_every_reference_model_is_covered():
    """(TorchRec's are tests/test_torchrec.py's, which sends them through tritonclient too.)"""
    assert sorted(SCALES) == sorted(name for name, entry in MODELS.items() if not entry.torchrec)


@pytest.mark.slow  # a deployment per reference model
@pytest.mark.parametrize("name", sorted(SCALES))
def test_tritonclient_http_sync_and_async_get_the_models_scores(tmp_path, name):
    bundle_dir, requests = served_model(tmp_path, name)
    flags = ["--shards", "1", "--rankers", "1", "--threads", "1"]
    with ServeProcess(bundle_dir, *flags, *roomy_budget(tmp_path)) as server:
        url = server.url.removeprefix("http://")
        model_name = bundle_dir.name
        with httpclient.InferenceServerClient(url=url) as client:
            outputs = [o["name"] for o in client.get_model_metadata(model_name)["outputs"]]
        triton_round_trips(httpclient, aioclient, url, model_name, outputs, requests, name)

        # Every request went through the binary path, both ways: the client's defaults.
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
            counters = codec_counters(resp.read().decode())
        sent = 2 * len(requests) + 1
        assert counters[("parse", "binary")][1] == sent
        assert counters[("encode", "binary")][1] == sent
        assert ("parse", "json") not in counters
