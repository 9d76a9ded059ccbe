"""The load generator over a deployment's several routers (cleave.bench.loadgen): an
open-loop schedule's phases and a closed loop's clients split over the URLs, every sample
marked with the URL it went to. Two stdlib HTTP servers on loopback stand in for routers."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cleave.bench.loadgen import closed_loop_spread, open_loop_phases_spread

REPLY = b'{"outputs": []}'


class Counting(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (the stdlib's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            self.server.posts += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(REPLY)))
        self.end_headers()
        self.wfile.write(REPLY)

    def log_message(self, *args):  # quiet
        pass


def servers(count: int):
    started = []
    for _ in range(count):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Counting)
        server.posts, server.lock = 0, threading.Lock()
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
    return started


def test_phases_and_clients_are_split_over_the_urls():
    pair = servers(2)
    try:
        urls = [f"http://127.0.0.1:{s.server_address[1]}/v2/models/m/infer" for s in pair]
        samples = open_loop_phases_spread(urls, [b"{}"], [(40, 0.5), (80, 0.5)], 5.0)
        assert samples and all(not s.error for s in samples)
        by_url = [sum(1 for s in samples if s.router == i) for i in (0, 1)]
        assert all(n > 0 for n in by_url) and [s.posts for s in pair] == by_url
        # The second phase (twice the rate) is sent after the first.
        assert max(s.scheduled_s for s in samples) >= 0.5
        before = [s.posts for s in pair]
        done = closed_loop_spread(urls, [b"{}"], 4, 0.3, 5.0)
        assert {s.router for s in done} == {0, 1} and all(not s.error for s in done)
        assert all(s.posts > b for s, b in zip(pair, before, strict=True))
    finally:
        for s in pair:
            s.shutdown()
            s.server_close()
