"""Requests of a shared-input model (one user, B candidates) joined into one ranker batch: the
partitioner's batched program (kept only when it scores joined requests as each alone), the
signature's `expand` join, and the real ranker on a partitioned DIN-style bundle."""

from __future__ import annotations

import cleave
import pytest
import torch
from cleave.bundle import load_bundle
from cleave.models import MODELS, RequestGenerator
from cleave.partitioner.batched import export_batched, per_request_inputs
from cleave.ranker.local import LocalQueue
from cleave.ranker.payload import KIND_RANK, decode_response, encode_request
from cleave.ranker.program import load_ranker
from cleave.ranker.signature import signature

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

SCALE = 0.002
TOLERANCE = 1e-5

MANIFEST = {
    "inputs": [{"name": "user", "dtype": "float32", "shape": [1, 4], "role": "dense"}],
    "outputs": [{"name": "output_0", "dtype": "float32", "shape": ["B", 1]}],
    "features": [],
    "boundary": [{"name": "items", "dtype": "float32", "shape": ["B", 4]}],
    "dense": {"program": "dense.pt2", "inputs": ["user", "items"]},
    "shared_inputs": ["user"],
}


class Broadcast(torch.nn.Module):
    """Row i of the user tensor meets candidate i: joinable once expanded."""

    def forward(self, user, items):
        return ((user * items).sum(1, keepdim=True) + user.mean(1, keepdim=True),)


class ReducesOverUsers(torch.nn.Module):
    """Sums over the user's leading dimension: expanded, it would count the user B times."""

    def forward(self, user, items):
        return (items.sum(1, keepdim=True) + user.sum(),)


def args(rows=3):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 4, generator=g), torch.randn(rows, 4, generator=g))


def test_per_request_inputs_are_the_leading_ones():
    assert per_request_inputs(MANIFEST) == ["user"]
    jagged = {**MANIFEST, "boundary": [{"name": "items", "dtype": "float32", "shape": ["N0"]}]}
    assert per_request_inputs(jagged) == []  # joined by other rules: not attempted
    no_user = {**MANIFEST, "dense": {"program": "dense.pt2", "inputs": ["items"]}}
    assert per_request_inputs(no_user) == []


def test_a_broadcasting_program_gets_a_batched_program():
    module = torch.fx.symbolic_trace(Broadcast())
    program, why_not = export_batched(module, ["user", "items"], args(), ["user"])
    assert program is not None, why_not
    user2, items2 = torch.randn(1, 4), torch.randn(2, 4)
    joined = [
        torch.cat([args()[0].expand(3, 4), user2.expand(2, 4)]),
        torch.cat([args()[1], items2]),
    ]
    got = program.module()(*joined)[0]
    want = torch.cat([Broadcast()(*args())[0], Broadcast()(user2, items2)[0]])
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE)


def test_a_program_reducing_over_the_user_keeps_one_request_per_batch():
    module = torch.fx.symbolic_trace(ReducesOverUsers())
    program, why_not = export_batched(module, ["user", "items"], args(), ["user"])
    assert program is None
    assert "do not score as each alone" in why_not


def test_expand_join_repeats_each_users_row_for_its_own_candidates():
    manifest = {**MANIFEST, "dense": {**MANIFEST["dense"], "batched": {"program": "b.pt2"}}}
    manifest["dense"]["batched"]["per_request"] = ["user"]
    sig = signature(manifest, monolithic=False, batched=True)
    assert sig.batchable and [s.join for s in sig.inputs] == ["expand", "batch"]
    a = [torch.full((1, 4), 1.0), torch.zeros(2, 4)]
    b = [torch.full((1, 4), 2.0), torch.zeros(3, 4)]
    user, items = sig.join([a, b])
    assert user[:, 0].tolist() == [1.0, 1.0, 2.0, 2.0, 2.0] and items.shape == (5, 4)
    assert sig.join([a])[0].shape == (2, 4)  # a batch of one request is expanded too
    assert not signature(manifest, monolithic=False).batchable  # without the batched program


@pytest.fixture(scope="module")
def din(tmp_path_factory):
    model, example = MODELS["din"].factory(scale=SCALE, seed=0)
    bundle = cleave.partition(model.eval(), example)
    return bundle.save(tmp_path_factory.mktemp("din") / "din"), model


def dense_requests(bundle, count):
    """`count` DIN requests of different users and candidate counts: dense inputs and the
    float32 dense program's scores for each alone."""
    gen = RequestGenerator("din", scale=SCALE, seed=3, min_pooling=0)
    dense = bundle.dense_module("float32")
    requests = []
    for n in range(count):
        inputs = bundle.named_inputs(*gen.batch(2 + n))
        values = {**inputs, **bundle.sparse_reference(inputs)}
        tensors = [values[name] for name in bundle.manifest["dense"]["inputs"]]
        with torch.inference_mode():
            requests.append((tensors, dense(*tensors)[0]))
    return requests


@pytest.mark.parametrize("shared_batching", [True, False])
def test_the_ranker_joins_din_requests_and_scores_each_exactly(din, shared_batching):
    path, _ = din
    bundle = load_bundle(path)
    assert bundle.per_request_inputs == ["user_hist_rows", "profile_ids_pooled"]
    queue = LocalQueue()
    requests = dense_requests(bundle, 4)  # 2 + 3 + 4 + 5 candidates
    # The batch starts when all 14 rows are there (or after a wait no test reaches).
    batcher = load_ranker(
        path, queue, threads=1, max_wait_s=30, max_batch=14, shared_batching=shared_batching
    )
    futures = [queue.submit(KIND_RANK, encode_request(t)) for t, _ in requests]
    for _ in range(20):
        if all(f.done() for f in futures):
            break
        batcher.step()
    sizes = []
    for future, (_, want) in zip(futures, requests, strict=True):
        response = decode_response(future.result(timeout=0))
        torch.testing.assert_close(response.tensors[0], want, rtol=0, atol=TOLERANCE)
        sizes.append(response.batch_requests)
    assert sizes == ([4] * 4 if shared_batching else [1] * 4)
