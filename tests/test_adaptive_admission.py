"""The adaptive admission rule against real processes (docs/api.md, "Admission control and
load shedding"): under a closed-loop overload far above capacity the router refuses at once
with 503 (its Retry-After: tests/test_overload_refusals.py), and almost every request it
admits finishes within its budget; once the load stops, every request is answered 200. No
timing is asserted: statuses and counters only."""

from __future__ import annotations

import http.client
import json
from collections import Counter

import pytest
from cleave.bench.loadgen import closed_loop
from support import front_door
from support.front_door import Router
from support.router import MODEL, good_request
from support.waiting import wait_for

INFER = f"/v2/models/{MODEL}/infer"
# Closed loop, from the Rust load generator: each client sends its next request when its last
# one is answered. (48 Python threads in the test's process sent too slowly on a machine busy
# with the rest of the suite to keep the router over its limit: no 503 came.)
CLIENTS = 64
LOAD_S = 4.0
BUDGET_MS = 2000  # far above a request's latency on a machine busy with other tests


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    d = front_door.backends(tmp_path_factory.mktemp("adaptive_admission"))
    yield d
    d.stop()


def test_overload_is_refused_at_once_and_admitted_work_finishes_in_time(backends):
    good, _ = good_request(backends, batch=256)
    raw = json.dumps({**good, "parameters": {"budget_ms": BUDGET_MS}}).encode()
    # Latency may fill 5% of the budget (100 ms), which the closed loop's clients exceed on
    # any machine: with the default half, the limit's latency target (at least a fifth of
    # what the budget allows) was 200 ms, met on a lightly loaded machine with all in flight.
    with Router(backends, admission="adaptive", admit_share=0.05) as router:
        samples = closed_loop(router.address + INFER, [raw], CLIENTS, LOAD_S, timeout_s=30)
        statuses = Counter(s.status for s in samples)
        assert set(statuses) <= {200, 503, 504}, statuses
        assert statuses[503] > 0 and statuses[200] > 0, statuses
        admitted = statuses[200] + statuses[504]
        assert statuses[504] <= max(2, 0.02 * admitted), statuses
        assert router.metric('cleave_router_shed_total{reason="limit"}') > 0
        assert router.metric("cleave_router_admission_limit") >= 1
        expired = router.metric("cleave_router_expired_after_admission_total")
        assert expired == statuses[504]

        # Once the load stops, nothing is refused: every request, one after another, is 200.
        wait_for(lambda: router.metric("cleave_router_in_flight") == 0, "the load drained")
        conn = http.client.HTTPConnection(router.host, router.port, timeout=30)
        for _ in range(20):
            conn.request("POST", INFER, body=raw, headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            reply.read()
            assert reply.status == 200, reply.status
