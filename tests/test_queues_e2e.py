"""Queue policies and deadline drops on real processes over loopback: a shard (`cleave shard`)
and a ranker (`cleave ranker`) run with `--queue edf` behind a router (`cleave-router`),
serving the `shared` reference model. Requests get the model's own scores; a request whose
deadline cannot be met is answered 504 naming the stage, and neither the shard nor the ranker
computes it (their metrics say so)."""

from __future__ import annotations

import json
import urllib.request

import cleave
import pytest
import torch
from cleave._native import SURE_AFTER
from cleave.launch.supervisor import find_executable
from cleave.models import MODELS
from support.client import post, request
from support.processes import Process, cli
from support.router import MODEL, SCALE, good_request, started, whole_tables
from support.served import TOLERANCE

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


class Deployment:
    def __init__(self, root):
        self.model, example = MODELS[MODEL].factory(scale=SCALE, seed=0)
        self.model.eval()
        self.bundle = cleave.partition(self.model, example)
        self.dir = self.bundle.save(root / "bundle")
        self.manifest = self.bundle.manifest
        self.children: list[Process] = []
        try:
            self._start_all(root)
        except BaseException:
            self.stop()
            raise

    def _start_all(self, root):
        common = ["--bundle", str(self.dir), "--listen", "127.0.0.1:0", "--metrics-port", "0"]
        self.shard = self._start("shard", cli("shard", *common, "--queue", "edf"))
        self.ranker = self._start(
            "ranker", cli("ranker", *common, "--queue", "edf", "--threads", "1")
        )
        routes = whole_tables(self.manifest, self.shard.address)
        config = {
            "model": MODEL,
            "bundle": str(self.dir),
            "http_port": 0,
            "shards": routes,
            "rankers": [self.ranker.address],
            "budget_ms": 20000,
            "body_limit_bytes": 64 << 20,
            "threads": 1,
        }
        path = root / "router.json"
        path.write_text(json.dumps(config))
        self.router = self._start("router", [find_executable("cleave-router"), str(path)])
        self.url = f"{self.router.address}/v2/models/{MODEL}"

    def _start(self, name, argv) -> Process:
        child = started(name, argv)
        self.children.append(child)
        return child

    def stop(self):
        for child in reversed(self.children):
            child.stop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("queues"))
    yield d
    d.stop()


def counter(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in {url}/metrics:\n{text}")


def test_edf_roles_answer_with_the_models_scores(deployment):
    body, want = good_request(deployment, batch=8, seed=1)
    status, reply = post(f"{deployment.url}/infer", body)
    assert status == 200, reply
    for out, w in zip(reply["outputs"], want, strict=True):
        got = torch.tensor(out["data"], dtype=torch.float64).reshape(out["shape"])
        assert (got - w).abs().max().item() <= TOLERANCE


def test_a_request_that_cannot_make_it_is_504_naming_the_stage_and_never_computed(deployment):
    # Large requests teach the router how long the shard's lookups take (it refuses on its
    # estimate after SURE_AFTER of them).
    big, _ = good_request(deployment, batch=4096, seed=2)
    for _ in range(SURE_AFTER):
        status, reply = post(f"{deployment.url}/infer", big)
        assert status == 200, reply
    status, text = request(f"{deployment.router.address}/admin/v1/members")
    assert status == 200, text
    shard_ms = json.loads(text)["shards"][0]["ewma_ms"]
    assert shard_ms > 0, text
    shard_ok = 'cleave_shard_requests_total{status="ok"}'
    ranker_ok = 'cleave_ranker_requests_total{outcome="ok"}'
    shard_url, ranker_url = deployment.shard.metrics_url, deployment.ranker.metrics_url
    before = counter(shard_url, shard_ok), counter(ranker_url, ranker_ok)

    # Half the shard's usual time: the lookup cannot make it, so it is never sent. A router
    # starved of CPU (other test workers) can spend that budget before the lookup, naming
    # "parse" (seen in a full run: 2.8 ms of a 1.4 ms budget): then it is sent again.
    small, _ = good_request(deployment, batch=1, seed=3)
    small["parameters"] = {"budget_ms": shard_ms / 2}
    for _ in range(10):
        status, reply = post(f"{deployment.url}/infer", small)
        assert status == 504, reply
        if reply["stage"] != "parse":
            break
    assert reply["stage"] == "lookup", reply
    assert "not sent to shard" in reply["error"], reply
    assert (counter(shard_url, shard_ok), counter(ranker_url, ranker_ok)) == before

    # With time enough, the same request is served.
    small["parameters"] = {"budget_ms": 20000}
    status, reply = post(f"{deployment.url}/infer", small)
    assert status == 200, reply
    assert counter(shard_url, shard_ok) == before[0] + 1
    assert counter(ranker_url, ranker_ok) == before[1] + 1
