"""Load-aware I/O threads (docs/serving.md, "I/O threads") through the Python binding a
ranker serves with: a `cleave._native.FrameServer` with two data I/O threads, four raw socket
connections accepted alternately onto them, and a skewed load (all requests on the two
connections of thread 0, held unanswered so the work they owe piles up). A connection moves
(the server counts it), and every request is answered with its own payload."""

from __future__ import annotations

from cleave._native import FrameServer
from support.shards import connect, frame, read_frame
from support.waiting import wait_for

WORK = 0x0100  # an application kind: handed to recv()
PER_CONN = 64  # the default threshold: a thread sheds a connection from 64 owed requests


def test_a_skewed_load_moves_a_connection_and_answers_every_request():
    with FrameServer("127.0.0.1:0", io_threads=2) as server:
        conns = [connect(server.address) for _ in range(4)]  # threads 0, 1, 0, 1
        try:
            for i in (0, 2):
                burst = b"".join(
                    frame(WORK, rid, bytes([i, rid])) for rid in range(1, PER_CONN + 1)
                )
                conns[i].sendall(burst)
            held = []
            for _ in range(200):  # bounded: 2 x 64 requests arrive well within it
                held += server.recv(max_items=256, timeout_s=0.1)
                if len(held) == 2 * PER_CONN:
                    break
            assert len(held) == 2 * PER_CONN
            # the I/O thread moves the connection as it next balances, not necessarily yet
            wait_for(lambda: server.stats()["migrations"] >= 1, "a connection to move")
            for conn_id, rid, kind, payload, *_ in held:
                server.reply(conn_id, rid, kind, payload)
            for i in (0, 2):
                got = {}
                for _ in range(PER_CONN):
                    flags, kind, rid, payload = read_frame(conns[i])
                    assert (flags, kind) == (1, WORK)
                    got[rid] = payload
                assert got == {rid: bytes([i, rid]) for rid in range(1, PER_CONN + 1)}
        finally:
            for c in conns:
                c.close()
