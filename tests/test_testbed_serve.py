"""Serving across emulated hosts (docs/testbed.md): every reference model on a 4-host testbed
plan (router host, two shard hosts, ranker host) with 2 replicas per range, scored over HTTP
against the original model; then one shard host's link taken down under load: the other
replica answers, nothing fails or hangs. One deployment per model, one ranker thread (the
machine is shared)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from cleave.bench.loadgen import outputs_of
from cleave.launch.process import ServeProcess
from cleave.plan import emulated_hosts, make_plan, save_plan
from cleave.settings import RankerConfig, ServeConfig
from cleave.testbed import commands
from cleave.testbed.testbed import host_link, set_link
from support.client import post_retrying
from support.served import TOLERANCE, Served, check_outputs, check_scores, infer_url
from support.testbed import host_addresses
from support.waiting import wait_for

pytestmark = [
    pytest.mark.testbed,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
    pytest.mark.skipif(commands.unavailable() is not None, reason=commands.unavailable() or ""),
]

# A replica's part is retried on the other after half the budget; the retry must then start
# on a 2-core machine shared with the rest of the suite (one 500 ms budget's retry reached its
# shard 11 ms too late there): a budget for plumbing, not a latency claim.
BUDGET_MS = 2000
SLACK_S = 5.0  # for a loaded 2-core machine, not a performance claim: a hang takes 30 s


def plan_on_testbed(bundle_dir: Path, root: Path) -> Path:
    """Router on h0, each range on both shard hosts h1 and h2 (K = 2), the ranker on h3."""
    config = ServeConfig(ranker=RankerConfig(threads=1, device="cpu"))
    plan = make_plan(bundle_dir, emulated_hosts(4), 2, 2, 1, 1, serve_config=config)
    assert {s.host for s in plan.shards} == {"h1", "h2"}
    for group in {s.group for s in plan.shards}:
        assert sorted(s.host for s in plan.shards if s.group == group) == ["h1", "h2"]
    return save_plan(plan, root / f"{bundle_dir.name}.yaml")


class Bundles(dict):
    """Each model partitioned once for the module, when a test first asks for it."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Served:
        self[name] = Served(name, self.root)
        return self[name]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> Bundles:
    return Bundles(tmp_path_factory.mktemp("bundles"))


# Two models of different shapes (dlrm: per-candidate rows; din: a per-request history joined
# to its candidates): the runner and the links do not depend on the model, and every reference
# model's scores are checked served locally (tests/test_serve.py).
@pytest.mark.parametrize("model", ["din", "dlrm"])
def test_scores_equal_the_original_model_across_hosts(model, bundles, tmp_path):
    served = bundles[model]
    plan = plan_on_testbed(served.dir, tmp_path)
    with ServeProcess(None, "--plan", str(plan), "--runner", "testbed") as server:
        assert server.url.startswith("http://198.1"), server.url
        check_scores(server, served)
        # Concurrent clients: batching across hosts must not mix rows up. A shed request is
        # retried, as clients do: admission on a machine busy with other tests is not what
        # this checks (one was shed at 59 rows of a limit of 38 under the parallel suite).
        bodies = [served.request(b) for b in (3, 5, 9, 17, 2, 30)]
        url = infer_url(server, served)
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda bw: post_retrying(url, bw[0]), bodies))
        for (status, reply), (_, want) in zip(replies, bodies, strict=True):
            assert status == 200, reply
            for g, w in zip(outputs_of(reply), want, strict=True):
                assert np.abs(g - w).max() <= TOLERANCE
        assert server.stop() == 0


def post_with_budget(url: str, body: bytes, sheds: int = 5) -> tuple[int, dict, float]:
    """(status, reply, seconds of the last attempt); the budget rides in the header, the client
    gives up after 30 s (a request that takes that long has hung). A request the router's
    admission sheds (503, `Retry-After`) is sent again after that wait, at most `sheds` times,
    as clients of a shedding server do: admission is not what the failover test checks (the
    latency of a failover can lower the adaptive limit below three clients' rows)."""
    for _ in range(sheds + 1):
        start = time.monotonic()
        request = urllib.request.Request(
            url,
            data=body,
            headers={"Content-Type": "application/json", "cleave-budget-ms": str(BUDGET_MS)},
            method="POST",
        )
        retry_after = None
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status, reply = response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            text = err.read()
            try:
                status, reply = err.code, json.loads(text)
            except ValueError:
                status, reply = err.code, {"error": text.decode(errors="replace")}
            if err.code == 503 and reply.get("stage") == "admission":
                retry_after = float(err.headers.get("Retry-After", "1"))
        except (urllib.error.URLError, OSError) as err:  # no answer at all: a timeout is a hang
            status, reply = 0, {"error": f"no answer: {err}"}
        took = time.monotonic() - start
        if retry_after is None:
            break
        time.sleep(retry_after)
    return status, reply, took


def test_a_torchrec_model_scores_across_hosts(tmp_path):
    """TorchRec's weighted DLRM_DCN (a table shared by two keys, the KJT's keys out of the
    tables' order) on the same plan: each key's ids reach its table's shard hosts."""
    import cleave
    import torch
    from cleave.client import request_body
    from cleave.models import torchrec_models as tm

    spec = tm.small(weighted=True)
    model, example = tm.build("dlrm_dcn", spec)
    bundle_dir = cleave.partition(model, example).save(tmp_path / "tr_dcn")
    plan = plan_on_testbed(bundle_dir, tmp_path)
    generator = torch.Generator().manual_seed(3)
    with ServeProcess(None, "--plan", str(plan), "--runner", "testbed") as server:
        for batch in (1, 9):
            args = tm.requests(spec, batch, generator)
            body = request_body(bundle_dir, *args, budget_ms=BUDGET_MS)
            status, reply = post_retrying(f"{server.url}/v2/models/tr_dcn/infer", body)
            assert status == 200, reply
            with torch.inference_mode():
                want = [model(*args).double().numpy()]
            check_outputs(reply, want, batch)


def test_a_shard_host_link_down_under_load_fails_over(bundles, tmp_path):
    served = bundles["shared"]
    plan = plan_on_testbed(served.dir, tmp_path)  # the default shard_timeout_ms
    requests = [served.request(16) for _ in range(4)]
    with ServeProcess(None, "--plan", str(plan), "--runner", "testbed") as server:
        url = infer_url(server, served)
        assert post_with_budget(url, requests[0][0])[0] == 200
        # h1 holds one replica of every range, h2 the other.
        netns, veth, bridge_port = host_link(host_addresses(server)["h1"])
        results: list[tuple[float, int, dict, float, list]] = []
        stop = threading.Event()

        def load(worker: int) -> None:
            for i in range(worker, worker + 10_000):  # bounded; stopped long before
                if stop.is_set():
                    return
                body, want = requests[i % len(requests)]
                status, reply, took = post_with_budget(url, body)
                results.append((time.monotonic(), status, reply, took, want))

        workers = [threading.Thread(target=load, args=(w,)) for w in range(3)]
        for w in workers:
            w.start()
        try:
            wait_for(lambda: len(results) >= 6, "requests before the link goes down")
            down_at = time.monotonic()
            set_link(netns, veth, bridge_port, up=False)
            # Requests keep arriving while the host is unreachable: a dozen sent after it
            # went down are answered (each within its budget, checked below) before it is up.
            wait_for(
                lambda: sum(1 for r in results if r[0] - r[3] > down_at) >= 12,
                "requests sent while the link is down to be answered",
                60,
            )
            up_at = time.monotonic()
            set_link(netns, veth, bridge_port, up=True)

            def recovered() -> bool:
                recent = [r for r in results if r[0] > up_at + 0.1]
                return len(recent) >= 3 and all(r[1] == 200 for r in recent[-3:])

            wait_for(recovered, "requests to succeed again after the link is up", 60)
        finally:
            set_link(netns, veth, bridge_port, up=True)
            stop.set()
            for w in workers:
                w.join(60)
        assert not any(w.is_alive() for w in workers), "a client hung"
        during = [r for r in results if down_at < r[0] - r[3] < up_at]
        assert during, "no request was sent while the link was down"
        failed = [(status, reply, took) for _, status, reply, took, _ in results if status != 200]
        for _, status, reply, took, want in results:
            assert took < BUDGET_MS / 1e3 + SLACK_S, (status, reply, took)  # nothing hung
            if status == 200:
                for g, w in zip(outputs_of(reply), want, strict=True):
                    assert np.abs(g - w).max() <= TOLERANCE
        # K = 2: a part stuck on h1 is retried on h2 after half the budget left (the default).
        assert not failed, failed[:5]
        assert server.stop() == 0
