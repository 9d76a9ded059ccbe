"""`cleave._native.FrameServer` / `FrameClient`: the generic data plane a Python ranker serves
frames with, over real loopback and Unix sockets."""

from __future__ import annotations

import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from cleave import _native
from support.waiting import wait_for

KIND = 0x0200


def serve(server: _native.FrameServer, stop: threading.Event) -> None:
    """A toy ranker: replies each request's float32 payload doubled; kind 0x0201 errors."""
    while not stop.is_set():
        for conn, rid, kind, payload, *_ in server.recv(max_items=16, timeout_s=0.05):
            if kind == KIND + 1:
                server.reply_error(conn, rid, 7, f"kind {kind:#x} is refused here")
            else:
                server.reply(conn, rid, kind, np.frombuffer(payload, np.float32) * 2)


@pytest.fixture(params=["tcp", "unix"])
def ranker(request, tmp_path):
    address = "127.0.0.1:0" if request.param == "tcp" else f"unix:{tmp_path}/ranker.sock"
    server = _native.FrameServer(address, io_threads=2)
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(server, stop), daemon=True)
    thread.start()
    yield server
    stop.set()
    thread.join()
    server.close()


def test_pipelined_calls_from_many_threads_get_their_own_replies(ranker):
    client = _native.FrameClient(ranker.address, timeout_s=10, connections=3)

    def call(i: int) -> None:
        x = np.arange(i, i + 1000, dtype=np.float32)
        got = np.frombuffer(client.call(KIND, x.tobytes()), np.float32)
        np.testing.assert_array_equal(got, 2 * x)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(call, range(200)))
    client.ping()
    assert client.ready()
    assert ranker.pending() == 0


def test_errors_name_the_peer(ranker):
    client = _native.FrameClient(ranker.address, timeout_s=10)
    with pytest.raises(_native.WireError, match=r"error 7 \(bad_request\): kind 0x201 is refused"):
        client.call(KIND + 1, b"")
    with pytest.raises(_native.WireError, match=r"control kind 0x0005 is not defined"):
        client.call(5, b"")
    assert np.frombuffer(client.call(KIND, b"\x00\x00\x80\x3f"), np.float32)[0] == 2.0


def test_recv_says_how_long_each_request_waited_for_it():
    """The pickup: the ranker reports it as queueing (its `queue_us`), not as transfer."""
    with _native.FrameServer("127.0.0.1:0") as server:
        client = _native.FrameClient(server.address, timeout_s=10)
        caller = threading.Thread(target=lambda: client.call(KIND, b"abc"))
        caller.start()
        wait_for(lambda: server.pending() == 1, "the request queued for recv")
        time.sleep(0.02)  # not a wait for a signal: the time the request must be seen to wait
        (conn, rid, _, _, _, _, waited_ns) = server.recv(timeout_s=10)[0]
        assert 20e6 <= waited_ns < 10e9
        server.reply(conn, rid, KIND, b"")
        caller.join()


def test_reply_checks_its_arguments():
    with _native.FrameServer("127.0.0.1:0") as server:
        client = _native.FrameClient(server.address, timeout_s=10)
        result = {}
        call = lambda: result.update(r=client.call(KIND, b"abc", trace_id=31))  # noqa: E731
        caller = threading.Thread(target=call)
        caller.start()
        before_us = time.time() * 1e6
        (conn, rid, kind, payload, deadline_us, trace_id, _) = server.recv(timeout_s=10)[0]
        assert (kind, payload, trace_id) == (KIND, b"abc", 31)
        # The header carries now + the client's timeout (10 s) as the deadline.
        assert before_us < deadline_us <= time.time() * 1e6 + 10e6
        with pytest.raises(ValueError, match="reply kind 0x0300 for request .* of kind 0x0200"):
            server.reply(conn, rid, 0x0300, b"")
        for bad in (3.5, 3, "text"):
            with pytest.raises(TypeError, match="payload must be bytes"):
                server.reply(conn, rid, kind, bad)
        with pytest.raises(ValueError, match="C-contiguous"):
            server.reply(conn, rid, kind, np.zeros((4, 4), np.float32)[:, 1])
        with pytest.raises(ValueError, match="no request 999 of connection"):
            server.reply(conn, 999, kind, b"")
        server.reply(conn, rid, kind, memoryview(b"xyz"))
        caller.join()
        assert result["r"] == b"xyz"
        with pytest.raises(ValueError, match="already answered, or never received"):
            server.reply(conn, rid, kind, b"again")
        assert server.recv(timeout_s=0.01) == []


def test_close_answers_what_is_pending_and_raw_garbage_is_refused():
    server = _native.FrameServer("127.0.0.1:0", frame_timeout_s=0.3)
    host, port = server.address.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=10)
    raw.sendall(b"\x00" * 40)
    head = raw.recv(40)
    magic, _, flags, _, _, n, _, _, _ = struct.unpack("<4sBBHQIIQQ", head)
    body = raw.recv(n)
    assert (magic, flags, struct.unpack("<H", body[:2])[0]) == (b"CLVW", 3, 1)
    assert b"bad frame magic" in body

    client = _native.FrameClient(server.address, timeout_s=10)
    errors = []

    def call() -> None:
        try:
            client.call(KIND, b"never answered")
        except _native.WireError as err:
            errors.append(str(err))

    caller = threading.Thread(target=call)
    caller.start()
    assert len(server.recv(timeout_s=10)) == 1
    server.close()
    caller.join()
    assert errors and "internal" in errors[0] and server.address in errors[0], errors
    server.close()  # idempotent
    with pytest.raises(_native.WireError, match="cannot connect"):
        _native.FrameClient(server.address, timeout_s=2).call(KIND, b"")


def test_bad_addresses_and_timeouts_are_value_errors():
    expected = "expected host:port, mptcp:host:port, unix:/path or shm:/path"
    with pytest.raises(ValueError, match=expected):
        _native.FrameServer("localhost")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        _native.FrameClient("127.0.0.1:1", timeout_s=0)


def test_a_caller_that_gives_up_cancels_its_request():
    with _native.FrameServer("127.0.0.1:0") as server:
        client = _native.FrameClient(server.address, timeout_s=10)
        # One exchange first, so that the data connection is open before the short timeouts.
        warm = threading.Thread(target=lambda: client.call(KIND, b"warm"))
        warm.start()
        (conn, rid, *_) = server.recv(timeout_s=10)[0]
        server.reply(conn, rid, KIND, b"")
        warm.join()
        # Queued, never received: the cancel removes it before Python sees it.
        with pytest.raises(_native.WireError, match="no response within"):
            client.call(KIND, b"queued", timeout_s=0.2)
        wait_for(lambda: server.stats()["cancelled"] == 1, "the CANCEL to arrive")
        assert server.recv(timeout_s=0.05) == [] and server.pending() == 0
        # Received, then cancelled: reported once by cancelled(); its reply is not sent.
        result = {}
        caller = threading.Thread(
            target=lambda: result.update(r=_call_or_error(client, b"taken", 1.0))
        )
        caller.start()
        (conn, rid, _, payload, *_) = server.recv(timeout_s=10)[0]
        assert payload == b"taken"
        caller.join()
        assert "no response within" in result["r"]
        wait_for(lambda: server.stats()["cancelled"] == 2, "the second CANCEL to arrive")
        assert server.cancelled() == [(conn, rid)]
        assert server.cancelled() == []
        server.reply(conn, rid, KIND, b"late")  # accepted, dropped
        assert server.pending() == 0
        assert client.stats() == {"orphan_responses": 0, "cancels_sent": 2}


def _call_or_error(client, payload: bytes, timeout_s: float) -> str:
    try:
        return client.call(KIND, payload, timeout_s=timeout_s).decode()
    except _native.WireError as err:
        return str(err)
