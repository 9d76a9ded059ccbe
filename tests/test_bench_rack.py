"""`cleave bench rack`'s workload without a testbed: Zipf ids put the hot rows on the first
shard host, in the share the harness sizes its load by; uniform ids spread evenly."""

from __future__ import annotations

import numpy as np
import pytest
from cleave.bench import rack


def test_zipf_ids_fall_on_the_first_shard_host_in_the_computed_share():
    rows = 80_000
    first = rows // (rack.RACKS * rack.HOSTS_PER_RACK)
    ids = np.concatenate(rack.request_ids("zipf", rows, 64, seed=1))
    assert ids.min() >= 0 and ids.max() < rows
    assert np.mean(ids < first) == pytest.approx(rack.hot_share(rows), abs=0.01)
    assert rack.hot_share(rows) > 0.8  # one host holds the hot rows
    uniform = np.concatenate(rack.request_ids("uniform", rows, 64, seed=1))
    assert np.mean(uniform < first) == pytest.approx(1 / 8, abs=0.01)
    again = rack.request_ids("zipf", rows, 64, seed=1)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(again, rack.request_ids("zipf", rows, 64, 1), strict=True)
    )
