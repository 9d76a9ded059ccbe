"""Response credits end to end (docs/protocol.md, "Response credits"): real `cleave serve`
deployments whose router grants its shards credit for response bytes. Scores are the same,
exactly, with credits on and off; a window smaller than any lookup response starves every
response, and each request then fails cleanly with a 504 at the lookup stage instead of
hanging. The frame-level rules (nothing sent without credit, malformed CREDIT frames) are
tested over raw sockets in crates/cleave-wire/tests/credits.rs."""

from __future__ import annotations

import numpy as np
import pytest
from cleave import _native
from cleave.bench.loadgen import outputs_of
from cleave.launch.process import ServeProcess
from cleave.settings import RouterConfig
from support.client import post
from support.served import TOLERANCE, Served, infer_url

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    return Served("dlrm", tmp_path_factory.mktemp("credits"))


def serve_with(served: Served, tmp_path, credits: int, extra: str = "") -> ServeProcess:
    config = tmp_path / f"serve-{credits}.toml"
    config.write_text(
        f"shards = 2\n[ranker]\nthreads = 1\n[router]\nresponse_credits = {credits}\n{extra}"
    )
    return ServeProcess(served.dir, "--config", str(config))


def outputs(server: ServeProcess, served: Served, requests) -> list[list[np.ndarray]]:
    got = []
    for body, want in requests:
        status, reply = post(infer_url(server, served), body)
        assert status == 200, reply
        out = outputs_of(reply)
        for g, w in zip(out, want, strict=True):
            assert np.abs(g - w).max() <= TOLERANCE
        got.append(out)
    return got


@pytest.mark.slow  # two deployments, ten requests each
def test_scores_are_equal_with_credits_on_and_off(served, tmp_path):
    requests = [served.request(b) for b in (1, 7, *[64] * 8)]
    results = {}
    # 128 KiB per connection: more than the largest response (a batch of 64 from one shard),
    # far less than what each connection carries in all, so credit must come back.
    window = 128 << 10
    for credits in (0, window):
        with serve_with(served, tmp_path, credits) as server:
            results[credits] = outputs(server, served, requests)
    for off, on in zip(results[0], results[window], strict=True):
        for a, b in zip(off, on, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_credit_starved_request_fails_with_a_deadline_error(served, tmp_path):
    # One byte of credit covers no lookup response: every response is held until its deadline.
    with serve_with(served, tmp_path, 1, "budget_ms = 300\n") as server:
        for _ in range(2):
            body, _ = served.request(4)
            status, reply = post(infer_url(server, served), body)
            # The router's wait and the shard's held response end at the same deadline:
            # either way, a 504 at the lookup stage naming the shard.
            assert status == 504, reply
            assert reply["stage"] == "lookup", reply
            assert "shard" in reply["error"], reply
        assert not any("panicked" in line for line in server.log)


def test_the_switch_is_checked_and_the_codes_come_from_the_native_module():
    assert RouterConfig().response_credits == 0  # off unless asked for
    for name in ("KIND_CREDIT", "HELLO_CREDITS", "MAX_CREDIT_BALANCE"):
        assert isinstance(getattr(_native, name), int), name
