"""Refusing a request does not break its connection, and shedding is logged and counted
cheaply (docs/api.md, "Admission control and load shedding"; docs/serving.md, "Metrics"):

* a shed request whose body is small (at most 64 KiB) gets 503 + Retry-After; its body is
  read and dropped, and the same connection answers the next request;
* a shed request with a larger body gets its 503 and then an orderly close: reading to the
  end sees EOF, not a reset;
* a connection over `max_connections` gets its 503 and an orderly close, its request unread;
* a shed gRPC call is UNAVAILABLE on its stream, and its HTTP/2 connection carries the next;
* many shed requests make a few WARN summary lines whose counts add up to the shed counter,
  and admitted, shed, expired-after-admission and the in-flight limit are metrics. The
  router's CPU per refusal is printed (run with -s), not asserted.

Shedding is forced with `max_in_flight = 1` and one REST request held in flight.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from pathlib import Path

import h2.connection
import h2.events
import pytest
from support import front_door
from support.front_door import BOUND_S, Router, get, post_head, read_response
from support.router import MODEL, good_request
from support.waiting import wait_for
from tritonclient.grpc import service_pb2 as pb

INFER = f"/v2/models/{MODEL}/infer"
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
# Above the router's bound on bodies it discards (front/body.rs, DISCARD_BYTES = 2 MiB), within
# what its lingering close drains (conn.rs, LINGER_BYTES = 4 MiB).
LARGE = 3 << 20
# A 2,048-candidate DLRM request's size (1.07 MiB): under the bound, read and dropped.
MEDIUM = 1100 << 10
SUMMARY = re.compile(r"requests shed.*total=(\d+)")


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    d = front_door.backends(tmp_path_factory.mktemp("overload_refusals"))
    yield d
    d.stop()


class Held:
    """One request admitted and kept in flight (its body half sent) until `release`."""

    def __init__(self, router: Router, raw: bytes, extra: str = ""):
        self.raw, self.sock = raw, router.connect()
        self.sock.sendall(post_head(INFER, len(raw), extra) + raw[:10])
        wait_for(lambda: router.metric("cleave_router_in_flight") == 1, "one request in flight")

    def release(self) -> int:
        self.sock.sendall(self.raw[10:])
        status, _, body = read_response(self.sock)
        self.sock.close()
        return status


def shed(sock, body: bytes) -> dict[str, str]:
    sock.sendall(post_head(INFER, len(body)) + body)
    status, headers, reply = read_response(sock)
    assert status == 503, reply
    assert int(headers["retry-after"]) >= 1, headers
    assert json.loads(reply)["stage"] == "admission", reply
    return headers


def cpu_s(pid: int) -> float:
    """CPU seconds the threads of process `pid` have run so far (schedstat: nanoseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


@pytest.mark.parametrize("size", [None, MEDIUM])
def test_a_shed_request_with_a_body_under_the_bound_keeps_its_connection(backends, size):
    good, _ = good_request(backends)
    raw = json.dumps(good).encode()
    # JSON with leading spaces: still a good body (refused before its size is judged).
    padded = b" " * (size - len(raw)) + raw if size else raw
    with Router(backends, max_in_flight=1, body_grace_ms=30000) as router:
        held = Held(router, raw)
        sock = router.connect()
        headers = shed(sock, padded)
        assert headers.get("connection") != "close", headers
        assert shed(sock, padded).get("connection") != "close"  # the same connection again
        assert held.release() == 200
        sock.sendall(post_head(INFER, len(raw)) + raw)  # and it serves once there is room
        status, headers, body = read_response(sock)
        assert status == 200, body
        sock.close()
        assert router.metric('cleave_router_shed_total{reason="in_flight"}') == 2


def test_a_shed_request_with_a_large_body_gets_its_answer_then_an_orderly_close(backends):
    good, _ = good_request(backends)
    raw = json.dumps(good).encode()
    large = b" " * (LARGE - len(raw)) + raw  # JSON with leading spaces: still a good body
    with Router(backends, max_in_flight=1, body_grace_ms=30000) as router:
        held = Held(router, raw)
        sock = router.connect()
        sending = threading.Thread(target=lambda: sock.sendall(post_head(INFER, LARGE) + large))
        sending.start()
        status, headers, body = read_response(sock)
        assert status == 503, body
        assert headers["connection"] == "close" and int(headers["retry-after"]) >= 1
        sending.join(BOUND_S)
        assert not sending.is_alive(), "the router stopped reading the refused body"
        rest = sock.recv(65536)  # ConnectionResetError here would be the reset
        while rest:
            rest = sock.recv(65536)
        sock.close()
        assert held.release() == 200


def test_a_connection_over_the_cap_gets_its_answer_then_an_orderly_close(backends):
    good, _ = good_request(backends)
    raw = json.dumps(good).encode()
    with Router(backends, max_connections=1) as router:
        held = router.connect()
        assert get(held, "/v2/health/live")[0] == 200
        extra = router.connect()
        extra.sendall(post_head(INFER, len(raw)) + raw)
        status, headers, body = read_response(extra)
        assert status == 503 and headers["connection"] == "close", body
        while extra.recv(65536):  # ConnectionResetError here would be the reset
            pass
        extra.close()
        assert get(held, "/v2/health/live")[0] == 200
        held.close()


def test_shedding_is_summarised_in_the_log_and_counted(backends):
    good, _ = good_request(backends)
    raw = json.dumps(good).encode()
    many = 2000
    # Only the in-flight cap sheds (the held request's slow body inflates the estimate).
    with Router(backends, max_in_flight=1, body_grace_ms=30000, shed=False) as router:
        assert router.metric("cleave_router_max_in_flight") == 1
        held = Held(router, raw)
        assert router.metric("cleave_router_admitted_total") == 1
        sock = router.connect()
        start, cpu = time.monotonic(), cpu_s(router.child.proc.pid)
        for _ in range(many):
            shed(sock, raw)
        spent, elapsed = cpu_s(router.child.proc.pid) - cpu, time.monotonic() - start
        print(
            f"\nrouter CPU per refusal ({len(raw)}-byte body, keep-alive): "
            f"{spent / many * 1e6:.0f} us over {many} refusals"
        )
        sock.close()
        assert held.release() == 200
        assert router.metric('cleave_router_shed_total{reason="in_flight"}') == many
        assert router.metric('cleave_router_errors_total{kind="overloaded"}') == many

        def summaries():
            return [int(m.group(1)) for line in router.child.lines if (m := SUMMARY.search(line))]

        wait_for(lambda: sum(summaries()) == many, "summaries that add up to the shed requests")
        lines = summaries()
        print("\n".join(line for line in router.child.lines if SUMMARY.search(line)))
        # One line per second of shedding at most (and one for the last part second).
        assert 1 <= len(lines) <= int(elapsed) + 2, lines
        assert not any("request shed" in line for line in router.child.lines)

        # A request admitted that then runs out of its budget (its body never comes).
        expired = router.connect()
        expired.sendall(post_head(INFER, len(raw), "cleave-budget-ms: 200\r\n") + raw[:10])
        status, _, body = read_response(expired)
        expired.close()
        assert status == 504, body
        assert router.metric("cleave_router_expired_after_admission_total") == 1
        assert router.metric("cleave_router_admitted_total") == 2


def grpc_statuses_on_one_connection(target: str, message: bytes, calls: int) -> list[str]:
    """`calls` ModelInfer calls one after the other over one plain HTTP/2 connection; the
    grpc-status of each. Fails if the router ends the connection."""
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    framed = b"\0" + len(message).to_bytes(4, "big") + message
    head = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", GRPC_INFER),
        (":authority", target),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    statuses = []
    host, port = target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=BOUND_S) as sock:
        sock.sendall(conn.data_to_send())
        for _ in range(calls):
            stream = conn.get_next_available_stream_id()
            conn.send_headers(stream, head)
            step = conn.max_outbound_frame_size
            for at in range(0, len(framed), step):
                end = at + step >= len(framed)
                conn.send_data(stream, framed[at : at + step], end_stream=end)
            sock.sendall(conn.data_to_send())
            answer: dict[str, str] = {}
            ended = False
            while not ended:
                data = sock.recv(65536)
                assert data, f"the router closed the connection after {statuses}"
                for event in conn.receive_data(data):
                    assert not isinstance(event, h2.events.ConnectionTerminated), event
                    if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                        answer.update((k.decode(), v.decode()) for k, v in event.headers)
                    ended |= isinstance(event, h2.events.StreamEnded)
                sock.sendall(conn.data_to_send())
            statuses.append(answer.get("grpc-status", "none"))
    return statuses


def test_a_shed_grpc_call_leaves_its_connection_open(backends):
    good, _ = good_request(backends)
    raw = json.dumps(good).encode()
    with Router(backends, max_in_flight=1, body_grace_ms=30000, grpc_port=0) as router:
        held = Held(router, raw)
        # Refused before it is parsed: any message will do.
        message = pb.ModelInferRequest(model_name=MODEL).SerializeToString()
        statuses = grpc_statuses_on_one_connection(router.grpc_address, message, 3)
        assert statuses == ["14"] * 3  # UNAVAILABLE
        assert held.release() == 200
