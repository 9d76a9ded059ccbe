"""The bounded-lag alltoallv (cleave.score.collective) on its own: its rules in one process,
and ordering, lag, buffer reuse, mismatched sizes and failing peers over three real ranks."""

from __future__ import annotations

import pytest
import torch
from cleave.score.collective import BoundedLagAlltoallv, CollectiveError
from support.bls_ranks import ITERATIONS, LAG, run_ranks

WORLD = 3


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    return run_ranks(tmp_path_factory.mktemp("bls"), WORLD)


def test_one_rank_round_trip_and_its_rules():
    bls = BoundedLagAlltoallv(1, torch.float32)
    bls.start(0, [torch.arange(3.0)])
    bls.start(1, [torch.arange(4.0)])
    with pytest.raises(CollectiveError, match="lag 1 allows 2: wait for iteration 0"):
        bls.start(2, [torch.zeros(1)])
    with pytest.raises(CollectiveError, match="waited for iteration 1, expected 0"):
        bls.wait(1)
    assert torch.equal(bls.wait(0)[0], torch.arange(3.0))
    with pytest.raises(CollectiveError, match="started iteration 5, expected 2"):
        bls.start(5, [torch.zeros(1)])
    with pytest.raises(CollectiveError, match="torch.int64 tensor to send"):
        bls.start(2, [torch.zeros(1, dtype=torch.int64)])
    with pytest.raises(CollectiveError, match="2 tensors to send, 1 expected"):
        bls.start(2, [torch.zeros(1)] * 2)
    with pytest.raises(CollectiveError, match="rank 0 sent 4 elements, 5 expected"):
        bls.wait(1, expect=[5])


def test_a_rank_runs_lag_iterations_ahead_without_waiting(found):
    # rank 0 started LAG + 1 iterations while its peers had started none
    assert found[0]["lag"]["ahead"] == LAG + 1


def test_messages_arrive_in_order_whole_and_in_reused_buffers(found):
    for rank in range(WORLD):
        assert found[rank]["order"] == {
            "rank": rank,
            "scenario": "order",
            "checked": ITERATIONS,
            "all_equal": True,
        }, found[rank]["exit"]
        # one receive buffer per slot and peer, reused every LAG + 1 iterations
        assert found[rank]["reuse"]["slots"] == LAG + 1
        assert found[rank]["reuse"]["per_slot"] == [WORLD - 1]


def test_mismatched_sizes_are_an_error_naming_the_peer(found):
    assert "rank 1 sent 4 elements, 3 expected" in found[0]["mismatch"]["error"]
    assert "rank 0 sent 3 elements, 4 expected" in found[1]["mismatch"]["error"]


def test_a_silent_peer_fails_the_wait_naming_it(found):
    for rank in range(WORLD - 1):
        assert found[rank]["silent"]["peer"] == WORLD - 1
        assert f"rank {WORLD - 1} failed during iteration 0" in found[rank]["silent"]["error"]


def test_a_dead_peer_fails_the_wait_naming_it(found):
    assert found[WORLD - 1]["exit"]["code"] == -9
    for rank in range(WORLD - 1):
        assert found[rank]["exit"]["code"] == 0, found[rank]["exit"]
        assert found[rank]["dead"]["peer"] == WORLD - 1, found[rank]["dead"]
