"""The adaptive admission rule against real processes (docs/api.md, "Admission control and
load shedding"): under a closed-loop overload far above capacity the router refuses at once
with 503 + Retry-After, and almost every request it admits finishes within its budget; once
the load stops, every request is answered 200. No timing is asserted: statuses and counters
only."""

from __future__ import annotations

import http.client
import json
import threading
from collections import Counter

import pytest
from support import front_door
from support.front_door import Router
from support.router import MODEL, good_request
from support.waiting import wait_for

INFER = f"/v2/models/{MODEL}/infer"
CLIENTS = 48  # closed loop: each sends its next request when the last is answered
PER_CLIENT = 25
BUDGET_MS = 2000  # far above a request's latency on a machine busy with other tests


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    d = front_door.backends(tmp_path_factory.mktemp("adaptive_admission"))
    yield d
    d.stop()


def post(conn: http.client.HTTPConnection, raw: bytes) -> int:
    headers = {"Content-Type": "application/json", "cleave-budget-ms": str(BUDGET_MS)}
    conn.request("POST", INFER, body=raw, headers=headers)
    reply = conn.getresponse()
    reply.read()
    if reply.status == 503:
        assert int(reply.headers["retry-after"]) >= 1
    return reply.status


def test_overload_is_refused_at_once_and_admitted_work_finishes_in_time(backends):
    good, _ = good_request(backends, batch=256)
    raw = json.dumps(good).encode()
    # Latency may fill 5% of the budget (100 ms): 48 closed-loop clients exceed that on any
    # machine. (With the default half, the limit's latency target, at least a fifth of it, was
    # 200 ms, which a lightly loaded machine met with all 48 in flight: nothing to refuse.)
    with Router(backends, admission="adaptive", admit_share=0.05) as router:
        statuses: Counter[int] = Counter()
        lock = threading.Lock()

        def client() -> None:
            conn = http.client.HTTPConnection(router.host, router.port, timeout=30)
            for _ in range(PER_CLIENT):
                status = post(conn, raw)
                with lock:
                    statuses[status] += 1
            conn.close()

        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
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
        after = [post(conn, raw) for _ in range(20)]
        assert after == [200] * 20, after
