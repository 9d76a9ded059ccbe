"""The adaptive incast window on the real ranker's control port (docs/traffic.md, "The
adaptive window on the ranker"): the data server lists its TCP connections' kernel counters
(`FrameServer.receiver_stats`), `CongestionMeter` turns them into one interval's congestion
and link use, and the control thread sets the window `AdaptiveWindow` decides — growing it
lets a waiting request through, congestion halves it, never below where it started."""

from __future__ import annotations

import gc
import socket
import threading

import pytest
from cleave._native import (
    AdaptiveWindow,
    FrameClient,
    FrameServer,
    IncastScheduler,
    decode_control,
    encode_control,
)
from cleave.ranker.control import CongestionMeter, ControlServer
from support.waiting import wait_for

IO_TIMEOUT_S = 30.0
KIND = 0x0200


def test_the_data_server_lists_its_tcp_connections_counters():
    with FrameServer("127.0.0.1:0") as server:
        client = FrameClient(server.address, timeout_s=10)
        payload = b"x" * 100_000
        caller = threading.Thread(target=client.call, args=(KIND, payload))
        caller.start()
        (conn, rid, kind, got, *_) = server.recv(timeout_s=10)[0]
        server.reply(conn, rid, kind, b"")
        caller.join()
        (stats,) = server.receiver_stats()
        assert stats[0] == conn
        assert stats[1] == 0, "loopback drops nothing: no out-of-order segments"
        assert stats[2] >= len(payload), f"the kernel counted what arrived: {stats}"
        del client, caller
        gc.collect()
        wait_for(lambda: server.receiver_stats() == [], "the closed connection to leave")
    assert server.receiver_stats() == [], "a closed server lists nothing"


def test_the_meter_takes_deltas_per_connection():
    counters = [[(1, 0, 0)]]
    meter = CongestionMeter(lambda: counters[0], link_bytes_per_s=1 << 20)
    assert meter.sample(1.0) == (0.0, 0.0)
    counters[0] = [(1, 4, 2 << 20), (2, 0, 1 << 20)]  # conn 2 is new: counts from its opening
    congestion, utilization = meter.sample(1.0)
    assert congestion == pytest.approx(4 / 3) and utilization == pytest.approx(3.0)
    counters[0] = [(2, 0, 1 << 20)]  # conn 1 gone, conn 2 idle
    assert meter.sample(0.5) == (0.0, 0.0)
    counters[0] = [(2, 1, (1 << 20) + 1000)]  # one stray segment in an idle interval
    congestion, _ = meter.sample(1.0)
    assert congestion == pytest.approx(1 / 0.25), "an idle interval counts as a quarter MiB"


class Scripted:
    """A congestion meter whose readings the test sets."""

    def __init__(self):
        self.reading = (0.0, 0.0)
        self.samples = 0  # intervals the control loop has measured

    def sample(self, interval_s: float) -> tuple[float, float]:
        self.samples += 1
        return self.reading


def read_message(sock: socket.socket) -> dict:
    buf = b""
    for _ in range(100):
        decoded = decode_control(buf)
        if decoded is not None:
            return decoded[0]
        chunk = sock.recv(512)
        assert chunk, "the control port closed the connection"
        buf += chunk
    raise AssertionError(f"no whole frame in {len(buf)} bytes")


def test_the_control_port_grows_the_window_for_a_backlog_and_halves_it_on_congestion():
    step = 1000
    scheduler = IncastScheduler(step, "edf", 125e6, False)
    adaptive = AdaptiveWindow(step, 4 * step, step, grow_after=2)
    meter = Scripted()
    control = ControlServer("127.0.0.1", 0, scheduler, adaptive, meter, interval_s=0.01)
    try:
        port = int(control.address.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)
        for message_id in (1, 2):
            rts = {"kind": "request-to-send", "id": message_id, "bytes": step}
            sock.sendall(encode_control({**rts, "slo_left_us": 60_000_000}))
        assert read_message(sock) == {"kind": "grant", "id": 1}
        # The second waits: one step is the window. An idle link with a backlog grows it.
        assert read_message(sock) == {"kind": "grant", "id": 2}
        assert scheduler.limit == 2 * step and control.window_changes >= 1
        # With nothing waiting, an idle link is no reason to grow: over several intervals
        # (the loop samples first, so all but the last are decided when it has sampled 5).
        seen = meter.samples
        wait_for(lambda: meter.samples >= seen + 5, "five more intervals of the control loop")
        assert scheduler.limit == 2 * step
        meter.reading = (10.0, 1.0)  # 10 segments lost per MiB: halve, down to the start
        wait_for(lambda: scheduler.limit == step, "the window to halve")
        sock.close()
    finally:
        control.close()


def test_the_adaptive_window_refuses_bad_settings():
    with pytest.raises(ValueError, match="0 < min_bytes <= max_bytes and step_bytes > 0"):
        AdaptiveWindow(0, 10, 1)
    with pytest.raises(ValueError, match="got min 10, max 5"):
        AdaptiveWindow(10, 5, 1)
    with pytest.raises(ValueError, match="0 <= low < high"):
        AdaptiveWindow(1, 10, 1, low=3.0, high=2.0)
