"""Incast control on the real router → ranker path (docs/traffic.md, "Wiring it into the
router → ranker path"): a local plan with `incast_control` on answers with the model's exact
scores, every fused payload asking the ranker's control port first; with the window held full
by another sender, a request is answered 504 naming the stage `ranker incast queue` and the
deployment keeps serving; malformed control frames get an error frame and a closed
connection, never a crash; and the scheduler binding (`cleave._native.IncastScheduler`)
never grants past its window."""

from __future__ import annotations

import json
import random
import socket
import struct
import urllib.request

import pytest
from cleave._native import IncastScheduler, decode_control, encode_control
from cleave.bench.stages import metrics_endpoints, printed_all_metrics
from cleave.launch.process import ServeProcess
from cleave.plan import emulated_hosts, make_plan, save_plan
from cleave.settings import RankerConfig, ServeConfig
from support.client import post
from support.served import Served, check_scores, infer_url
from support.waiting import wait_for

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

IO_TIMEOUT_S = 30.0
MAGIC = b"FC"  # 0x4346 little-endian


def frame(kind: int, body: bytes, length: int | None = None, magic: bytes = MAGIC) -> bytes:
    n = len(body) if length is None else length
    return magic + bytes([1, kind]) + struct.pack("<I", n) + body


def read_message(sock: socket.socket) -> dict | None:
    """The next control message, or None when the peer closed the connection."""
    buf = b""
    for _ in range(1000):  # a frame is at most 250 bytes
        decoded = decode_control(buf)
        if decoded is not None:
            return decoded[0]
        chunk = sock.recv(512)
        if not chunk:
            return None
        buf += chunk
    raise AssertionError(f"no whole frame in {len(buf)} bytes")


def control_socket(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)
    sock.settimeout(IO_TIMEOUT_S)
    return sock


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    return Served("shared", tmp_path_factory.mktemp("incast"))


@pytest.fixture(scope="module")
def deployment(served, tmp_path_factory):
    """One host: a shard, a ranker whose window holds one payload at a time (1 byte: one
    message alone always goes; adaptive, from there up in steps of 1 byte), a router asking
    before every payload (threshold 1 byte)."""
    config = ServeConfig(ranker=RankerConfig(threads=1, device="cpu"))
    plan = make_plan(served.dir, emulated_hosts(1), 1, 1, 1, 1, serve_config=config)
    plan.incast_control = True
    plan.incast_threshold_bytes = 1
    # Every port 0: each role binds one and says which (the plan's logical ports, 7000 and
    # 9000, would clash with another worker's deployment).
    for role in [*plan.shards, *plan.rankers]:
        role.port = role.metrics_port = 0
    plan.rankers[0].control_port = 0
    plan.rankers[0].incast_window_bytes = 1
    plan.rankers[0].incast_adaptive = True
    path = save_plan(plan, tmp_path_factory.mktemp("plan") / "incast.yaml")
    with ServeProcess(None, "--plan", str(path), "--http-port", "0") as server:
        (ready,) = [line for line in server.log if line.startswith("[ranker-0] ready ")]
        control = ready.split(" control=", 1)[1].split()[0]
        yield server, int(control.rsplit(":", 1)[1])


def test_scores_are_exact_with_incast_control_on(served, deployment):
    server, _ = deployment
    check_scores(server, served)


def test_the_rankers_metrics_show_its_incast_window(served, deployment):
    server, _ = deployment
    check_scores(server, served, batches=(3,))
    wait_for(lambda: printed_all_metrics(list(server.log)), "cleave serve's metrics lines")
    endpoints = metrics_endpoints(server.log, server.url)
    (url,) = [u for role, u in endpoints.items() if "ranker" in role]
    with urllib.request.urlopen(url, timeout=IO_TIMEOUT_S) as reply:
        text = reply.read().decode()
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("cleave_ranker_incast_")
    }
    assert values["cleave_ranker_incast_window_bytes"] >= 1, text
    assert values["cleave_ranker_incast_malformed_total"] >= 0, text
    assert "cleave_ranker_incast_queued" in values, text
    # B of the start-by deadline: learnt from the payloads that went, or the link rate.
    assert values["cleave_ranker_incast_rate_bytes_per_second"] > 0, text


def test_a_full_window_is_a_504_in_the_incast_queue_and_serving_goes_on(served, deployment):
    server, port = deployment
    # Another sender takes the whole window (1 byte, at most 64 when adapted) and never sends
    # its bytes. 1 KiB, not more: its start-by deadline subtracts bytes / B, and B is learnt
    # from the small payloads before it, so a 1 GiB ask expired on a slow machine.
    hog = control_socket(port)
    try:
        hog.sendall(
            encode_control(
                {"kind": "request-to-send", "id": 1, "bytes": 1 << 10, "slo_left_us": 600_000_000}
            )
        )
        assert read_message(hog) == {"kind": "grant", "id": 1}
        body, _ = served.request(1)
        request = json.loads(body)
        request["parameters"] = {"budget_ms": 500}
        status, reply = post(infer_url(server, served), json.dumps(request).encode())
        assert status == 504, reply
        assert reply.get("stage") == "ranker incast queue", reply
        assert "incast queue" in reply["error"], reply
    finally:
        hog.close()  # its window space goes with its connection
    check_scores(server, served, batches=(1, 7))


@pytest.mark.parametrize(
    "bad, says",
    [
        (frame(2, b"\0" * 4), "grant needs a body of 8 bytes, got 4"),
        (frame(2, b"\0" * 8, magic=b"XX"), "expected magic 0x4346"),
        (frame(9, b""), "unknown message kind 9"),
        (frame(1, b"", length=1 << 20), "exceeds the limit"),
        (encode_control({"kind": "grant", "id": 3}), "got grant"),
    ],
)
def test_malformed_control_frames_get_an_error_frame_and_the_ranker_goes_on(
    served, deployment, bad, says
):
    server, port = deployment
    sock = control_socket(port)
    try:
        sock.sendall(bad)
        reply = read_message(sock)
        assert reply is not None and reply["kind"] == "error", reply
        assert says in reply["message"], reply
        assert read_message(sock) is None  # then closed
    finally:
        sock.close()
    # Another sender is still served: granted at once (the window is free).
    other = control_socket(port)
    try:
        other.sendall(
            encode_control(
                {"kind": "request-to-send", "id": 7, "bytes": 10, "slo_left_us": 60_000_000}
            )
        )
        assert read_message(other) == {"kind": "grant", "id": 7}
    finally:
        other.close()
    check_scores(server, served, batches=(1,))


def test_the_binding_never_grants_past_the_window():
    """Random requests, completions, withdrawals and departures against a model of what is
    in flight: the binding's count matches it, and exceeds the window only with one message
    alone."""
    rng = random.Random(5)
    for trial in range(30):
        window = rng.choice([1, 100, 1000, 5000])
        s = IncastScheduler(window, rng.choice(["fcfs", "edf"]), 1e9, False)
        sizes: dict[tuple[int, int], int] = {}
        flying: dict[tuple[int, int], int] = {}
        for step in range(300):
            op = rng.random()
            if op < 0.5 or not sizes:
                key = (rng.randrange(4), step + 1)
                sizes[key] = rng.randrange(1, 2000)
                out = s.request(*key, sizes[key], rng.randrange(1, 10**7))
            elif op < 0.8:
                key = rng.choice(sorted(flying or sizes))
                flying.pop(key, None)
                out = s.complete(*key)
            elif op < 0.9:
                key = rng.choice(sorted(sizes))
                flying.pop(key, None)
                out = s.withdraw(*key)
            else:
                gone = rng.randrange(4)
                flying = {k: b for k, b in flying.items() if k[0] != gone}
                out = s.sender_gone(gone)
            for what, sender, mid in out:
                assert what == "grant" and (sender, mid) not in flying, (trial, step)
                flying[(sender, mid)] = sizes[(sender, mid)]
            assert s.in_flight == sum(flying.values()), (trial, step)
            assert s.in_flight <= window or len(flying) == 1, (trial, step, flying)
        assert s.limit == window


def test_the_codec_binding_round_trips():
    for m in [
        {"kind": "request-to-send", "id": 9, "bytes": 1 << 40, "slo_left_us": 5, "stamp_ns": 1},
        {"kind": "grant", "id": 2**64 - 1},
        {"kind": "done", "id": 0},
        {"kind": "expired", "id": 4},
        {"kind": "error", "code": 2, "message": "too big"},
    ]:
        data = encode_control(m)
        assert decode_control(data) == (m, len(data))
        assert decode_control(data[:-1]) is None
    with pytest.raises(ValueError, match="grant needs a body of 8 bytes, got 4"):
        decode_control(frame(2, b"\0" * 4))


@pytest.mark.parametrize(
    "body, says",
    [
        ({"addr": "127.0.0.1:9"}, 'needs "control"'),
        ({"addr": "127.0.0.1:9", "control": "nonsense"}, 'expected HOST:PORT, got "nonsense"'),
        ({"addr": "127.0.0.1:9", "control": 7200}, "control"),
    ],
)
def test_a_ranker_added_without_a_valid_control_port_is_refused(served, deployment, body, says):
    server, _ = deployment
    status, reply = post(f"{server.url}/admin/v1/rankers", json.dumps(body).encode())
    assert status == 400 and says in reply["error"], (status, reply)
    with urllib.request.urlopen(f"{server.url}/admin/v1/members", timeout=IO_TIMEOUT_S) as r:
        members = json.loads(r.read())
    assert len(members["rankers"]) == 1, members
