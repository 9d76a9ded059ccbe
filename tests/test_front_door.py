"""The router's front door on real processes over loopback: per-connection timeouts (a head
that trickles in, a body that stalls, an idle keep-alive connection), the connection cap,
admission control (503 + Retry-After without parsing the body), x-request-id, the health
schema with a ranker down, and a graceful stop that finishes the request in progress.

Shards and a ranker are started once (tests/test_router_http.py's `Deployment`); each test
starts its own router with the settings it needs. Timing assertions are generous bounds that
only prove a connection was closed at all.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import pytest
from cleave._native import SURE_AFTER
from support import front_door
from support.client import post, request
from support.front_door import BOUND_S, Router, closed_within, get, post_head, read_response
from support.processes import cli
from support.router import MODEL, good_request, started
from support.waiting import wait_for

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    d = front_door.backends(tmp_path_factory.mktemp("front_door"))
    yield d
    d.stop()


def test_partial_header_is_closed_by_the_header_timeout(backends):
    with Router(backends, header_timeout_ms=1000, idle_timeout_ms=60000) as router:
        sock = router.connect()
        sock.sendall(b"POST /v2/models/shared/infer HTTP/1.1\r\n")
        # One byte every 0.25 s never finishes the head: closed after about 1 s.
        closed_within(sock, BOUND_S, trickle=b"Host: example.org\r\nX-Slow: " + b"a" * 200)
        sock.close()
        assert router.metric('cleave_router_connections_closed_total{reason="header_timeout"}') == 1
        # Other connections are unaffected.
        assert request(f"{router.address}/v2/health/ready")[0] == 200


def test_idle_keep_alive_connection_is_closed(backends):
    with Router(backends, idle_timeout_ms=1000) as router:
        sock = router.connect()
        status, headers, _ = get(sock, "/v2/health/live")
        assert status == 200 and headers.get("connection") != "close"
        closed_within(sock, BOUND_S)
        sock.close()
        silent = router.connect()  # never sends a byte
        closed_within(silent, BOUND_S)
        silent.close()
        assert router.metric('cleave_router_connections_closed_total{reason="idle_timeout"}') >= 2


def test_stalled_body_gets_408_and_is_closed(backends):
    with Router(backends, body_grace_ms=500, body_min_bytes_per_s=1000) as router:
        sock = router.connect()
        sock.sendall(post_head("/v2/models/shared/infer", 5000) + b'{"inputs": [')
        status, headers, body = read_response(sock)
        assert status == 408, body
        assert "request body too slow: 12 bytes" in json.loads(body)["error"]
        assert headers["connection"] == "close"
        assert len(headers["x-request-id"]) == 16
        closed_within(sock, BOUND_S)
        sock.close()
        assert router.metric('cleave_router_errors_total{kind="body_timeout"}') == 1


def test_connection_cap_refuses_the_extra_connection_only(backends):
    with Router(backends, max_connections=3) as router:
        held = [router.connect() for _ in range(3)]
        for sock in held:
            assert get(sock, "/v2/health/live")[0] == 200
        extra = router.connect()
        status, headers, body = read_response(extra)
        assert status == 503
        assert headers["connection"] == "close" and int(headers["retry-after"]) >= 1
        reply = json.loads(body)
        assert reply["stage"] == "admission" and "max_connections" in reply["error"]
        closed_within(extra, BOUND_S)
        extra.close()
        for sock in held:  # the others still work, on the same connections
            assert get(sock, "/v2/health/live")[0] == 200
        held.pop().close()

        def one_more_served():
            sock = router.connect()
            try:
                return get(sock, "/v2/health/live")[0] == 200
            except (AssertionError, ConnectionResetError):
                return False
            finally:
                sock.close()

        wait_for(one_more_served, "a connection is accepted again once one closed", BOUND_S)
        # Metrics over a connection already held: a new one might find the cap still reached.
        status, _, text = get(held[0], "/metrics")
        assert status == 200
        assert 'cleave_router_shed_total{reason="connections"} ' in text.decode()
        assert 'cleave_router_shed_total{reason="connections"} 0' not in text.decode()
        for sock in held:
            sock.close()


def test_in_flight_cap_sheds_without_parsing_the_body(backends):
    good, _ = good_request(backends)
    raw = json.dumps(good).encode()
    with Router(backends, max_in_flight=1, body_grace_ms=30000) as router:
        holder = router.connect()
        holder.sendall(post_head("/v2/models/shared/infer", len(raw)) + raw[:10])
        wait_for(
            lambda: router.metric("cleave_router_in_flight") == 1, "one request in flight", BOUND_S
        )
        sock = router.connect()
        sock.sendall(post_head("/v2/models/shared/infer", len(raw)) + raw)
        status, headers, body = read_response(sock)
        assert status == 503, body
        # A small body is read and dropped: the connection stays (test_overload_refusals.py).
        assert int(headers["retry-after"]) >= 1 and headers.get("connection") != "close"
        reply = json.loads(body)
        assert reply["stage"] == "admission" and "(max_in_flight) is 1" in reply["error"]
        sock.close()
        assert request(f"{router.address}/v2/health/ready")[0] == 200
        # The request in flight finishes when its body does.
        holder.sendall(raw[10:])
        status, _, body = read_response(holder)
        assert status == 200, body
        holder.close()
        assert post(f"{router.url}/infer", good)[0] == 200
        assert router.metric('cleave_router_shed_total{reason="in_flight"}') == 1
        assert router.metric('cleave_router_errors_total{kind="overloaded"}') == 1


@pytest.mark.parametrize(
    "rule, message",
    [
        # The estimate rule: the stages' averages and queues against a share of the budget.
        ("estimate", "exceeds 50% of the budget of 0.0 ms"),
        # The adaptive rule: the least latency measured for a request this size.
        ("adaptive", "the budget cannot be met: 0.0 ms of it left"),
    ],
)
def test_budget_that_cannot_be_met_is_shed_at_once(backends, rule, message):
    good, _ = good_request(backends)
    raw = json.dumps(good).encode()
    with Router(backends, admission=rule) as router:
        for _ in range(SURE_AFTER):  # measures the stages until the router trusts them
            assert post(f"{router.url}/infer", good)[0] == 200
        req = urllib.request.Request(
            f"{router.url}/infer",
            data=raw,
            headers={"Content-Type": "application/json", "cleave-budget-ms": "0.001"},
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=BOUND_S)
        assert err.value.code == 503
        assert int(err.value.headers["Retry-After"]) >= 1
        assert len(err.value.headers["x-request-id"]) == 16
        reply = json.loads(err.value.read())
        assert reply["stage"] == "admission"
        assert message in reply["error"], reply
        # The router stays healthy and serves requests with a budget it can meet.
        assert request(f"{router.address}/v2/health/ready")[0] == 200
        assert post(f"{router.url}/infer", good)[0] == 200
        assert router.metric('cleave_router_shed_total{reason="estimate"}') == 1


def test_a_request_that_waited_in_the_kernel_past_its_budget_is_not_served(backends):
    """The budget starts when the kernel received the request, not when the router read it:
    a router stopped (as one starved of CPU is) while a request waits in its socket finds the
    budget spent when it reads it."""
    good, _ = good_request(backends)
    body = json.dumps(good).encode()
    with front_door.kernel_stamping(), Router(backends) as router:
        assert post(f"{router.url}/infer", good)[0] == 200
        sock = router.connect()
        assert get(sock, "/v2/health/live")[0] == 200  # accepted, and read from since
        router.child.proc.send_signal(signal.SIGSTOP)
        try:
            sock.sendall(
                post_head(f"/v2/models/{MODEL}/infer", len(body), "cleave-budget-ms: 200\r\n")
            )
            sock.sendall(body)
            # Not a wait for a signal: the time the request must be seen to spend in the kernel.
            time.sleep(0.5)
        finally:
            router.child.proc.send_signal(signal.SIGCONT)
        status, _, reply = read_response(sock)
        assert status in (503, 504), reply
        assert "budget" in json.loads(reply)["error"], reply
        assert post(f"{router.url}/infer", good)[0] == 200, "fresh requests are served"


def test_request_ids_on_success_and_errors(backends):
    good, _ = good_request(backends)
    ids = []
    for body in (good, good, {"inputs": 7}):
        req = urllib.request.Request(
            f"{backends.router.address}/v2/models/{MODEL}/infer",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                ids.append(response.headers["x-request-id"])
        except urllib.error.HTTPError as err:
            assert err.code == 400
            ids.append(err.headers["x-request-id"])
    assert all(len(i) == 16 and int(i, 16) for i in ids), ids
    assert len(set(ids)) == 3


def test_health_schema_and_a_ranker_down_degrades(backends):
    status, text = request(f"{backends.router.address}/v2/health/ready")
    assert status == 200
    assert json.loads(text) == {
        "role": "router",
        "status": "ready",
        "ready": True,
        "degraded": [],
        "problems": [],
    }
    for path in ("/ready", "/live", "/v2/health/live", f"/v2/models/{MODEL}/ready"):
        status, text = request(f"{backends.router.address}{path}")
        assert status == 200 and json.loads(text)["role"] == "router", path

    spare = started(
        "ranker-2",
        cli("ranker", "--bundle", str(backends.dir), "--listen", "127.0.0.1:0", "--threads", "1"),
    )
    try:
        rankers = [*backends.base["rankers"], spare.address]
        with Router(backends, rankers=rankers, health_interval_ms=100) as router:
            spare.stop()

            def health():
                return json.loads(request(f"{router.address}/v2/health/ready")[1])

            wait_for(lambda: health()["status"] == "degraded", "degraded", BOUND_S)
            status, text = request(f"{router.address}/v2/health/ready")
            reply = json.loads(text)
            assert status == 200 and reply["ready"] and reply["problems"] == []
            assert any(spare.address in d for d in reply["degraded"]), reply
            good, _ = good_request(backends)
            assert post(f"{router.url}/infer", good)[0] == 200
    finally:
        spare.stop()


def test_sigterm_finishes_the_request_in_flight(backends):
    good, _ = good_request(backends)
    raw = json.dumps(good).encode()
    router = Router(backends, body_grace_ms=30000)
    try:
        sock = router.connect()
        sock.sendall(post_head("/v2/models/shared/infer", len(raw)) + raw[:10])
        wait_for(
            lambda: router.metric("cleave_router_in_flight") == 1, "one request in flight", BOUND_S
        )
        router.child.proc.terminate()
        # It got the signal once it stops accepting; it must still be there for the request.
        wait_for(router.refuses_connections, "the router to stop accepting", BOUND_S)
        assert router.child.proc.poll() is None, "the router left before its request finished"
        sock.sendall(raw[10:])
        status, headers, body = read_response(sock)
        assert status == 200, body
        sock.close()
        assert router.child.proc.wait(BOUND_S) == 0
    finally:
        router.child.stop()
