"""`cleave.bench.stages`: per-stage means from two scrapes of the roles' metrics (the scrapes
of real deployments are in test_shm_transport.py and the bench tests)."""

from __future__ import annotations

import pytest
from cleave.bench.stages import breakdown


def test_breakdown_gives_transfer_pickup_and_send_cpu_per_round_trip():
    before = {
        "router": {
            "router.transfer.sum": 1.0,
            "router.transfer.count": 100,
            "router.send_cpu": 0.5,
        },
        "ranker-0": {"ranker.pickup.sum": 0.1, "ranker.pickup.count": 100},
    }
    after = {
        "router": {
            "router.transfer.sum": 1.2,
            "router.transfer.count": 200,
            "router.send_cpu": 0.6,
        },
        "ranker-0": {"ranker.pickup.sum": 0.15, "ranker.pickup.count": 200},
    }
    got = breakdown(before, after)
    # The pickup is part of the rankers' queue, no longer taken out of transfer here.
    assert got["stages_us"] == pytest.approx({"transfer_us": 2000.0, "pickup_us": 500.0})
    assert got["send_cpu_us"] == pytest.approx(1000.0)


def test_breakdown_leaves_send_cpu_out_for_a_router_that_does_not_export_it():
    before = {"router": {"router.transfer.sum": 0.0, "router.transfer.count": 0}}
    after = {"router": {"router.transfer.sum": 0.1, "router.transfer.count": 10}}
    assert "send_cpu_us" not in breakdown(before, after)
