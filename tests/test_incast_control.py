"""The incast control channel of a real `cleave-incast ranker` process on loopback
(crates/cleave-flow, docs/traffic.md): a request-to-send is granted and, once its data has
arrived, done; malformed and oversized control frames are answered with an error frame and
the connection closed, and the ranker goes on serving other senders; with --drop-expired a
request that can no longer make its SLO is answered "expired" instead of granted."""

from __future__ import annotations

import json
import socket
import struct
import subprocess

import pytest
from cleave.bench.incast import find_incast_binary

IO_TIMEOUT_S = 10.0
MAGIC = b"CF"[::-1]  # 0x4346 little-endian: 'F', 'C'


def frame(kind: int, body: bytes, length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return MAGIC + bytes([1, kind]) + struct.pack("<I", n) + body


def rts(msg_id: int, nbytes: int, slo_us: int = 10_000_000) -> bytes:
    return frame(1, struct.pack("<QQQQ", msg_id, nbytes, slo_us, 0))


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    head = recv_exact(sock, 8)
    assert head[:3] == MAGIC + b"\x01", head
    (n,) = struct.unpack("<I", head[4:])
    return head[3], recv_exact(sock, n)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def start_ranker(*extra: str):
    argv = [find_incast_binary(), "ranker", "--listen", "127.0.0.1"]
    # The ranker reports once 6 control connections have closed: the first test opens 6.
    argv += ["--control-port", "0", "--data-port", "0", "--senders", "6"]
    argv += ["--window", "1000", "--order", "edf", "--message-bytes", "1000", "--max-s", "60"]
    proc = subprocess.Popen(
        [*argv, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        bound = proc.stdout.readline().split()  # the ports it bound for the 0s
        assert bound[0] == "listening" and proc.stdout.readline().strip() == "ready", bound
        control, data = (int(word.rsplit(":", 1)[1]) for word in bound[1:])
        yield proc, control, data
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def ranker():
    yield from start_ranker()


@pytest.fixture
def expiring_ranker():
    yield from start_ranker("--drop-expired")


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)
    s.settimeout(IO_TIMEOUT_S)
    return s


def assert_error_then_closed(sock: socket.socket, code: int, words: str) -> None:
    kind, body = read_frame(sock)
    assert kind == 5, f"expected an error frame (kind 5), got kind {kind}"
    (got,) = struct.unpack("<H", body[:2])
    assert got == code, body
    assert words in body[2:].decode(), body
    assert sock.recv(1) == b"", "the connection should be closed after the error frame"


def test_grant_done_and_bad_frames(ranker):
    proc, control, data = ranker
    with connect(control) as c, connect(data) as d:
        c.sendall(rts(7, 1000))
        assert read_frame(c) == (2, struct.pack("<Q", 7))  # granted: the window is 1000
        c.sendall(rts(8, 1000))  # waits: the window is full
        d.sendall(struct.pack("<QQQ", 1, 7, 1000) + bytes(1000))
        got = {read_frame(c), read_frame(c)}
        assert got == {(3, struct.pack("<Q", 7)), (2, struct.pack("<Q", 8))}

        bad = [
            (frame(2, b"\x00" * 4), 1, "grant needs a body of 8 bytes, got 4"),
            (frame(1, b"", length=1 << 30), 2, "exceeds the limit"),
            (b"XY" + bytes(6), 1, "expected magic"),
            (frame(9, b""), 1, "unknown message kind 9"),
            (frame(2, struct.pack("<Q", 1)), 3, "expects request-to-send or credit"),
        ]
        for data_bytes, code, words in bad:
            with connect(control) as s:
                s.sendall(data_bytes)
                assert_error_then_closed(s, code, words)
        # The first sender is still served after all that.
        c.sendall(frame(4, struct.pack("<IQQ", 0, 4096, 0)))
        d.sendall(struct.pack("<QQQ", 1, 8, 1000) + bytes(1000))
        assert read_frame(c) == (3, struct.pack("<Q", 8))
    out, _ = proc.communicate(timeout=IO_TIMEOUT_S * 3)
    report = json.loads(out.strip().splitlines()[-1])
    assert sorted(m[0] for m in report["messages"]) == [1000, 1000]
    assert all(m[2] is not None for m in report["messages"])
    assert len(report["credits_priority_us"]) == 1


def test_data_for_an_unknown_message_closes_that_connection(ranker):
    proc, control, data = ranker
    with connect(data) as d:
        d.sendall(struct.pack("<QQQ", 1, 99, 10) + bytes(10))
        assert d.recv(1) == b""
    with connect(data) as d:
        d.sendall(struct.pack("<QQQ", 7, 0, 0))  # no such kind
        assert d.recv(1) == b""
    with connect(control) as c:
        c.sendall(rts(1, 10))
        assert read_frame(c) == (2, struct.pack("<Q", 1))
    assert proc.poll() is None


def test_a_request_that_cannot_make_its_slo_expires(expiring_ranker):
    proc, control, _ = expiring_ranker
    with connect(control) as c:
        # 1 MB at 1 Gbit/s takes 8 ms: with 1 ms of SLO left it cannot arrive in time.
        c.sendall(rts(1, 1_000_000, slo_us=1_000))
        assert read_frame(c) == (6, struct.pack("<Q", 1))
        c.sendall(rts(2, 1000, slo_us=10_000_000))  # this one can: granted
        assert read_frame(c) == (2, struct.pack("<Q", 2))
    assert proc.poll() is None
