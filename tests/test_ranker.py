"""Unit tests of the ranker's pieces: payload codec, joining/splitting requests, the batching
loop (max batch, max wait, deadlines, bad requests, model errors). The loop runs on an
in-process queue with the FrameServer interface; the integration tests are in test_serve.py."""

from __future__ import annotations

import struct
import time

import pytest
import torch
import torch.nn.functional as F
from cleave import _native
from cleave.ranker.batcher import (
    ERR_BAD_REQUEST,
    ERR_DEADLINE,
    ERR_INTERNAL,
    ERR_OVERLOADED,
    Batcher,
)
from cleave.ranker.executor import DenseExecutor
from cleave.ranker.local import LocalQueue, RankerError
from cleave.ranker.payload import (
    KIND_RANK,
    KIND_RANK_FULL,
    PayloadError,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from cleave.ranker.signature import signature
from hypothesis import given, settings
from hypothesis import strategies as st
from support.dense import DENSE_MANIFEST, Dense, dense_request

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

# -- a tiny dense program and a tiny whole model, with manifests that describe them -----------


class Whole(torch.nn.Module):
    """The whole model: a lookup (with ids that may be out of range: an error) + Dense."""

    def __init__(self, include_last_offset=False):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(10, 3, generator=torch.Generator()))
        self.dense = Dense()
        self.include_last_offset = include_last_offset

    def forward(self, dense_x, ids, offsets):
        pooled = F.embedding_bag(
            ids, self.table, offsets, mode="sum", include_last_offset=self.include_last_offset
        )
        return self.dense(dense_x, pooled)


def full_request(rows: int, seed: int, include_last: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (rows,), generator=g)  # empty bags included
    ids = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    offsets = offsets if include_last else offsets[:-1]
    return [torch.randn(rows, 4, generator=g), ids, offsets]


def make_batcher(monolithic=False, manifest=DENSE_MANIFEST, module=None, **kw):
    sig = signature(manifest, monolithic)
    module = module or (Whole() if monolithic else Dense())
    queue = LocalQueue()
    kind = KIND_RANK_FULL if monolithic else KIND_RANK
    executor = DenseExecutor(module, sig, "cpu", threads=1)
    return queue, Batcher(queue, executor, sig, kind, **kw), module


def submit(queue, tensors, deadline_us=0, kind=KIND_RANK):
    return queue.submit(kind, encode_request(tensors), deadline_us)


# -- payloads ------------------------------------------------------------------------------


def test_payload_round_trip_every_dtype():
    tensors = [
        torch.randn(3, 4),
        torch.randn(2, 5).half(),
        torch.arange(-3, 4),
        torch.arange(6, dtype=torch.int32).reshape(2, 3),
        torch.arange(5, dtype=torch.uint8),
        torch.tensor([True, False, True]),
        torch.randn(3).to(torch.bfloat16),
        torch.zeros(0, 7),
        torch.tensor(2.5),
    ]
    request = decode_request(encode_request(tensors))
    for got, want in zip(request.tensors, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    response = decode_response(encode_response(1, 2, 3, 4, tensors[:2]))
    assert (response.queue_us, response.compute_us, response.batch_requests) == (1, 2, 3)
    assert response.queue_depth == 4 and torch.equal(response.tensors[1], tensors[1])


def test_request_tensors_share_the_payload_memory():
    payload = bytearray(encode_request([torch.zeros(4)]))
    tensor = decode_request(payload).tensors[0]
    payload[8 + 8 + 8] = 0x80  # first data byte after the header and one dim
    payload[8 + 8 + 8 + 3] = 0x3F
    assert tensor[0].item() != 0.0  # no copy was made


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[:5], "request header needs 8 bytes"),
        (lambda b: b[:12], "tensor 0 at byte 8: header needs 8 bytes"),
        (lambda b: b[:-8], "data bytes"),
        (lambda b: b + bytes(8), "payload has"),
        (lambda b: b[:8] + bytes([9]) + b[9:], "dtype code 9"),
        (lambda b: struct.pack("<I", 5) + b[4:], "payload ends"),
        (lambda b: b[:9] + bytes([200]) + b[10:], "200 dims, at most 16"),
        (lambda b: b[:9] + bytes([9]) + b[10:], "9 dims need 72 bytes"),
    ],
)
def test_malformed_payloads_are_errors(mutate, message):
    good = encode_request([torch.randn(2, 3)])
    with pytest.raises(PayloadError, match=message):
        decode_request(mutate(good))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256), st.integers(0, 200), st.binary(min_size=1, max_size=8))
def test_decoder_never_fails_other_than_with_payload_error(noise, at, patch):
    good = bytearray(encode_request([torch.randn(2, 3), torch.arange(4)]))
    mutated = good[:at] + patch + good[at + len(patch) :]
    for payload in (noise, bytes(mutated)):
        try:
            request = decode_request(payload)
        except PayloadError:
            continue
        assert all(isinstance(t, torch.Tensor) for t in request.tensors)


def test_signature_validates_names_dtypes_and_symbols():
    sig = signature(DENSE_MANIFEST, monolithic=False)
    from cleave.ranker.payload import RankRequest

    assert sig.check(RankRequest(dense_request(5, 0))) == 5
    with pytest.raises(PayloadError, match="expected 2 tensors"):
        sig.check(RankRequest(dense_request(5, 0)[:1]))
    with pytest.raises(PayloadError, match="'pooled_0': expected torch.float32"):
        sig.check(RankRequest([torch.randn(5, 4), torch.zeros(5, 3, dtype=torch.int64)]))
    with pytest.raises(PayloadError, match="'pooled_0' dim 1: expected 3, got 2"):
        sig.check(RankRequest([torch.randn(5, 4), torch.randn(5, 2)]))
    with pytest.raises(PayloadError, match=r"dim 0 \(B\) is 4, but input 'dense_x' has B = 5"):
        sig.check(RankRequest([torch.randn(5, 4), torch.randn(4, 3)]))


# -- joining and splitting -----------------------------------------------------------------


@pytest.mark.parametrize("include_last", [False, True])
def test_joined_jagged_requests_equal_separate_runs(include_last):
    manifest = {
        **DENSE_MANIFEST,
        "features": [{**DENSE_MANIFEST["features"][0], "include_last_offset": include_last}],
    }
    if include_last:
        manifest["inputs"] = [
            *manifest["inputs"][:2],
            {"name": "offsets", "dtype": "int64", "shape": ["L0"], "role": "offsets"},
        ]
    sig = signature(manifest, monolithic=True)
    assert sig.batchable, sig.why_not
    model = Whole(include_last_offset=include_last)
    requests = [full_request(rows, seed, include_last) for seed, rows in enumerate([3, 1, 5])]
    rows = [sig.rows(r) for r in requests]
    assert rows == [3, 1, 5]
    with torch.inference_mode():
        joined = sig.split(list(model(*sig.join(requests))), rows)
        for tensors, got in zip(requests, joined, strict=True):
            torch.testing.assert_close(got[0], model(*tensors)[0], rtol=0, atol=1e-6)


def test_shared_inputs_make_a_model_run_one_request_per_batch():
    manifest = {
        **DENSE_MANIFEST,
        "inputs": [{"name": "user", "dtype": "float32", "shape": [1, 4], "role": "dense"}],
        "dense": {"program": "dense.pt2", "inputs": ["user", "pooled_0"]},
        "shared_inputs": ["user"],
    }
    sig = signature(manifest, monolithic=False)
    assert not sig.batchable and "'user'" in sig.why_not

    class Broadcast(torch.nn.Module):
        def forward(self, user, pooled):
            return (pooled.sum(1, keepdim=True) + user.sum(),)

    queue, batcher, _ = make_batcher(manifest=manifest, module=Broadcast(), max_wait_s=10)
    futures = [submit(queue, [torch.randn(1, 4), torch.randn(3, 3)]) for _ in range(3)]
    while not all(f.done() for f in futures):
        batcher.step()
    assert [decode_response(f.result()).batch_requests for f in futures] == [1, 1, 1]


# -- the batching loop ---------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.ns = 0

    def __call__(self):
        return self.ns


def test_max_batch_caps_the_rows_of_a_batch():
    queue, batcher, model = make_batcher(max_batch=8, max_wait_s=0)
    requests = [dense_request(3, seed) for seed in range(5)]
    futures = [submit(queue, r) for r in requests]
    sizes = []
    while not all(f.done() for f in futures):
        if n := batcher.step():
            sizes.append(n)
    assert sizes == [2, 2, 1]  # 3 + 3 rows fit in 8, a third request would not
    for request, future in zip(requests, futures, strict=True):
        response = decode_response(future.result())
        torch.testing.assert_close(response.tensors[0], model(*request)[0])


def test_the_routers_cap_lowers_the_batch_until_it_rises():
    """The router's cache leaves less memory for batches (docs/cache.md): its cap, carried by
    each request, lowers the rows of a batch below max_batch; a later higher cap raises it."""
    queue, batcher, _ = make_batcher(max_batch=8, max_wait_s=0)
    capped = [queue.submit(KIND_RANK, encode_request(dense_request(2, s), 4), 0) for s in range(4)]
    sizes = []
    while not all(f.done() for f in capped):
        if n := batcher.step():
            sizes.append(n)
    assert sizes == [2, 2] and batcher.batch_limit() == 4  # 2 + 2 rows fit in the cap of 4
    raised = [queue.submit(KIND_RANK, encode_request(dense_request(2, s), 64), 0) for s in range(4)]
    sizes = []
    while not all(f.done() for f in raised):
        if n := batcher.step():
            sizes.append(n)
    assert sizes == [4] and batcher.batch_limit() == 8  # never above max_batch


def test_a_request_larger_than_max_batch_runs_alone():
    queue, batcher, _ = make_batcher(max_batch=4)
    future = submit(queue, dense_request(10, 0))
    while not future.done():
        batcher.step()
    response = decode_response(future.result())
    assert response.batch_requests == 1 and response.tensors[0].shape == (10, 1)


def test_max_wait_holds_a_batch_until_the_oldest_waited_long_enough():
    clock = FakeClock()
    queue, batcher, _ = make_batcher(max_batch=100, max_wait_s=0.002)
    queue.clock = batcher.clock = clock
    first = submit(queue, dense_request(2, 0))
    assert batcher.step() == 0  # alone and not waited yet
    clock.ns += 1_000_000
    second = submit(queue, dense_request(2, 1))
    assert batcher.step() == 0  # 1 ms < 2 ms
    clock.ns += 1_000_000
    assert batcher.step() == 2  # the oldest waited 2 ms: both go together
    a, b = decode_response(first.result()), decode_response(second.result())
    assert a.batch_requests == b.batch_requests == 2
    assert a.queue_us == 2000 and b.queue_us == 1000


def test_the_queue_time_reported_counts_the_wait_in_the_request_source():
    """A request that arrives while the loop computes another waits in the source (the frame
    server's inbox), not in the loop's own queue: that is queueing at the ranker all the same,
    and the router's `transfer` stage (round trip less queue and compute) must not count it."""
    clock = FakeClock()
    queue, batcher, _ = make_batcher()
    queue.clock = batcher.clock = clock
    first = submit(queue, dense_request(2, 0))
    clock.ns += 3_000_000  # the loop is busy elsewhere for 3 ms
    assert batcher.step() == 1
    assert decode_response(first.result()).queue_us == 3000


def test_full_batch_does_not_wait():
    clock = FakeClock()
    queue, batcher, _ = make_batcher(max_batch=4, max_wait_s=10.0)
    batcher.clock = clock
    futures = [submit(queue, dense_request(2, s)) for s in range(2)]
    assert batcher.step() == 2  # 4 rows reached: no waiting for max_wait
    assert all(f.done() for f in futures)


def test_queue_depth_counts_what_is_left():
    queue, batcher, _ = make_batcher(max_batch=2)
    futures = [submit(queue, dense_request(2, s)) for s in range(3)]
    while not all(f.done() for f in futures):
        batcher.step()
    depths = [decode_response(f.result()).queue_depth for f in futures]
    assert depths == [2, 1, 0]


def test_expired_deadline_is_dropped_and_others_are_served():
    queue, batcher, _ = make_batcher()
    now_us = int(time.time() * 1e6)
    late = submit(queue, dense_request(2, 0), deadline_us=now_us - 5_000)
    fine = submit(queue, dense_request(2, 1), deadline_us=now_us + 60_000_000)
    while not (late.done() and fine.done()):
        batcher.step()
    with pytest.raises(RankerError) as err:
        late.result()
    assert err.value.code == ERR_DEADLINE and "deadline passed" in err.value.message
    assert decode_response(fine.result()).batch_requests == 1
    assert batcher.stats.dropped_deadline == 1


def test_error_codes_are_the_wire_crates():
    assert (ERR_BAD_REQUEST, ERR_INTERNAL, ERR_DEADLINE, ERR_OVERLOADED) == (7, 12, 13, 14)
    assert _native.ERROR_CODES["cancelled"] == _native.ERR_CANCELLED == 15
    assert sorted(_native.ERROR_CODES.values()) == list(range(1, 16))


def test_a_full_queue_answers_overloaded_at_once_and_serves_the_rest():
    queue, batcher, _ = make_batcher(max_batch=2, max_queue=3)
    futures = [submit(queue, dense_request(2, s)) for s in range(5)]
    batcher._receive(0.0)  # all five arrive before any batch runs
    for f in futures[3:]:
        with pytest.raises(RankerError) as err:
            f.result(timeout=0)
        assert err.value.code == ERR_OVERLOADED and "queue full (3 requests)" in err.value.message
    while not all(f.done() for f in futures[:3]):
        batcher.step()
    assert [decode_response(f.result()).batch_requests for f in futures[:3]] == [1, 1, 1]
    assert batcher.stats.overloaded == 2 and batcher.stats.requests == 3


def test_cancelled_requests_leave_the_queue_unanswered():
    queue, batcher, _ = make_batcher(max_batch=2)
    futures = [submit(queue, dense_request(2, s)) for s in range(4)]
    queue.cancel(futures[0].request_id)  # still in the source: never received
    batcher._receive(0.0)
    queue.cancel(futures[2].request_id)  # already in the batcher's queue
    while not all(f.done() for f in futures):
        batcher.step()
    assert futures[0].cancelled() and futures[2].cancelled()
    served = [decode_response(f.result()).batch_requests for f in (futures[1], futures[3])]
    assert served == [1, 1]
    assert (batcher.stats.cancelled, batcher.stats.requests, batcher.queued_rows) == (1, 2, 0)


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\x00" * 5, "header needs 8 bytes"),
        (encode_request([torch.randn(2, 4)]), "expected 2 tensors"),
        (encode_request([torch.randn(2, 4), torch.randn(2, 3).half()]), "float32"),
    ],
    ids=["short header", "one tensor", "float16"],  # the same on every xdist worker
)
def test_bad_requests_get_errors_and_the_loop_goes_on(payload, message):
    queue, batcher, _ = make_batcher()
    bad = queue.submit(KIND_RANK, payload)
    good = submit(queue, dense_request(2, 0))
    while not (bad.done() and good.done()):
        batcher.step()
    with pytest.raises(RankerError) as err:
        bad.result()
    assert err.value.code == ERR_BAD_REQUEST and message in err.value.message
    assert decode_response(good.result()).tensors[0].shape == (2, 1)


def test_wrong_frame_kind_is_a_bad_request():
    queue, batcher, _ = make_batcher()
    future = submit(queue, dense_request(2, 0), kind=KIND_RANK_FULL)
    while not future.done():
        batcher.step()
    with pytest.raises(RankerError, match="serves frame kind 272, got 273"):
        future.result()


def test_a_failing_request_fails_alone():
    queue, batcher, model = make_batcher(monolithic=True, max_batch=100, max_wait_s=0)
    bad_ids = full_request(2, 0)
    bad_ids[1] = torch.full_like(bad_ids[1], 99)  # table has 10 rows
    if bad_ids[1].numel() == 0:
        bad_ids = [bad_ids[0], torch.tensor([99]), torch.tensor([0, 1])]
    good = [full_request(3, s) for s in (1, 2)]
    futures = [submit(queue, t, kind=KIND_RANK_FULL) for t in (good[0], bad_ids, good[1])]
    while not all(f.done() for f in futures):
        batcher.step()
    with pytest.raises(RankerError) as err:
        futures[1].result()
    assert err.value.code == ERR_INTERNAL and "dense program failed" in err.value.message
    for tensors, future in zip(good, [futures[0], futures[2]], strict=True):
        got = decode_response(future.result()).tensors[0]
        torch.testing.assert_close(got, model(*tensors)[0], rtol=0, atol=1e-6)


def test_warm_up_examples_follow_the_manifest():
    sig = signature(DENSE_MANIFEST, monolithic=True)
    dense_x, ids, offsets = sig.example(3)
    assert dense_x.shape == (3, 4) and ids.shape == (0,) and offsets.tolist() == [0, 0, 0]
    assert Whole()(dense_x, ids, offsets)[0].shape == (3, 1)  # three empty bags
    ragged = {
        **DENSE_MANIFEST,
        "inputs": [{"name": "seq", "dtype": "float32", "shape": ["B", "L0"], "role": "dense"}],
        "dense": {"program": "dense.pt2", "inputs": ["seq"]},
    }
    assert signature(ragged, monolithic=False).example(2) is None  # L0 has no safe size
