"""`cleave.bench.stages`: per-stage means from two scrapes of the roles' metrics (the scrapes
of real deployments are in test_shm_transport.py and the bench tests)."""

from __future__ import annotations

import pytest
from cleave.bench.stages import breakdown


def scrape(transfer_s: float, trips: int, send_cpu_s: float, pickup_s: float) -> dict:
    """What `stages.scrape` returns for a router and a ranker, as far as these tests look."""
    return {
        "router": {
            "router.transfer.sum": transfer_s,
            "router.transfer.count": trips,
            "router.send_cpu": send_cpu_s,
        },
        "ranker-0": {"ranker.pickup.sum": pickup_s, "ranker.pickup.count": trips},
    }


def test_breakdown_gives_transfer_pickup_and_send_cpu_per_round_trip():
    got = breakdown(scrape(1.0, 100, 0.5, 0.1), scrape(1.2, 200, 0.6, 0.15))
    # The pickup is part of the rankers' queue, no longer taken out of transfer here.
    assert got["stages_us"] == pytest.approx({"transfer_us": 2000.0, "pickup_us": 500.0})
    assert got["send_cpu_us"] == pytest.approx(1000.0)


def test_breakdown_leaves_send_cpu_out_for_a_router_that_does_not_export_it():
    before = {"router": {"router.transfer.sum": 0.0, "router.transfer.count": 0}}
    after = {"router": {"router.transfer.sum": 0.1, "router.transfer.count": 10}}
    assert "send_cpu_us" not in breakdown(before, after)
