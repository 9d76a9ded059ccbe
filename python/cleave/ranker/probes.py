"""A ranker's HTTP probes, the same as every role's: `/live`, `/ready` (the health schema of
docs/protocol.md, "Health") and `/metrics` (Prometheus text from prometheus-client), served on a
thread of their own so that probes never wait behind a batch."""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _BatcherCollector:
    """Reads the batching loop's counters when scraped: the loop itself stays free of metrics
    calls on its hot path."""

    def __init__(self, batcher):
        self.batcher = batcher

    def collect(self):
        s = self.batcher.stats
        requests = CounterMetricFamily(
            "cleave_ranker_requests", "requests answered, by outcome", labels=["outcome"]
        )
        for outcome, value in (
            ("ok", s.requests),
            ("deadline", s.dropped_deadline),
            ("late", s.dropped_late),
            ("cancelled", s.cancelled),
            ("overloaded", s.overloaded),
            ("bad_request", s.bad_requests),
            ("failed", s.failed),
        ):
            requests.add_metric([outcome], value)
        yield requests
        yield CounterMetricFamily("cleave_ranker_batches", "batches run", value=s.batches)
        yield from _pickup(getattr(self.batcher, "source", None))
        yield GaugeMetricFamily(
            "cleave_ranker_queue_depth", "requests waiting", value=len(self.batcher.queue)
        )
        if self.batcher.dense_choice is not None:
            yield from _dense_choice(self.batcher.dense_choice)
        if self.batcher.activation_bytes:
            yield GaugeMetricFamily(
                "cleave_ranker_activation_bytes_per_row",
                "the dense program's memory per batch row, measured at start",
                value=self.batcher.activation_bytes,
            )


def _pickup(source):
    """How long requests waited in the frame server for the batching loop to take them
    (`FrameServer.stats`; none for other sources): the part of the ranker's queue (`queue_us`)
    spent there, its Python thread busy with a batch, whatever the transport
    (docs/benchmarks.md, "Pass-by-reference between co-located roles")."""
    stats = getattr(source, "stats", None)
    counts = stats() if callable(stats) else {}
    if "picked_up" not in counts:
        return
    yield CounterMetricFamily(
        "cleave_ranker_picked_up", "requests the batching loop took", value=counts["picked_up"]
    )
    yield CounterMetricFamily(
        "cleave_ranker_pickup_seconds",
        "time requests waited in the frame server for the batching loop to take them",
        value=counts["pickup_seconds"],
    )


def served_dtype(metrics_text: str) -> str | None:
    """The dense dtype a ranker's /metrics text says it serves, if it says."""
    found = re.search(r'^cleave_ranker_dense_dtype\{[^}]*\bdtype="(\w+)"', metrics_text, re.M)
    return found.group(1) if found else None


def measured_activation(metrics_text: str) -> int:
    """The memory per batch row a ranker's /metrics text says it measured (0: none)."""
    found = re.search(r"^cleave_ranker_activation_bytes_per_row ([0-9.e+]+)", metrics_text, re.M)
    return int(float(found.group(1))) if found else 0


def _dense_choice(choice):
    """The dense precision served (cleave.ranker.dense_dtype): an info-style gauge, and the
    start-up probe's time per batch of each dtype it measured."""
    served = GaugeMetricFamily(
        "cleave_ranker_dense_dtype",
        "1 for the dense precision served, labelled with how it was chosen",
        labels=["dtype", "chosen_by"],
    )
    served.add_metric([choice.dtype, choice.chosen_by], 1)
    yield served
    probed = GaugeMetricFamily(
        "cleave_ranker_dense_probe_seconds",
        "the start-up probe's time per batch of the bundle's typical size, per dense dtype",
        labels=["dtype", "rows"],
    )
    for dtype, seconds in choice.seconds.items():
        probed.add_metric([dtype, str(choice.rows)], seconds)
    yield probed
    if choice.compiled is not None:  # --compile: served compiled only where it pays
        compiled = GaugeMetricFamily(
            "cleave_ranker_dense_compiled",
            "1 when the dense program is served compiled (--compile), 0 when it is served "
            "uncompiled because compiled measured slower at start",
        )
        compiled.add_metric([], 1 if choice.compiled else 0)
        yield compiled
        timed = GaugeMetricFamily(
            "cleave_ranker_dense_compile_probe_seconds",
            "the start-up probe's time per batch of the dense program, eager and compiled",
            labels=["program"],
        )
        for program, seconds in choice.compile_seconds.items():
            timed.add_metric([program], seconds)
        yield timed


class _IncastCollector:
    """The incast control port's window and queue (docs/traffic.md), read when scraped."""

    def __init__(self, control):
        self.control = control

    def collect(self):
        c, s = self.control, self.control.scheduler
        yield GaugeMetricFamily(
            "cleave_ranker_incast_window_bytes",
            "incast window: bytes that may be in flight",
            value=s.limit,
        )
        yield GaugeMetricFamily(
            "cleave_ranker_incast_in_flight_bytes",
            "bytes granted and not yet received",
            value=s.in_flight,
        )
        yield GaugeMetricFamily(
            "cleave_ranker_incast_queued",
            "requests-to-send waiting for the window",
            value=s.queued,
        )
        yield GaugeMetricFamily(
            "cleave_ranker_incast_rate_bytes_per_second",
            "B in the start-by deadline: measured from transfers, else the link rate",
            value=s.rate_bytes_per_s,
        )
        yield CounterMetricFamily(
            "cleave_ranker_incast_window_changes",
            "adaptive window changes",
            value=c.window_changes,
        )
        yield CounterMetricFamily(
            "cleave_ranker_incast_malformed",
            "malformed control frames answered with an error",
            value=c.malformed,
        )


class Probes:
    """`/live`, `/ready`, `/metrics` on `host:port` (port 0 picks one) until `close()`;
    with `control` (the incast ControlServer), its window and queue too."""

    def __init__(self, batcher, host: str = "127.0.0.1", port: int = 0, control=None):
        self.registry = CollectorRegistry()
        self.registry.register(_BatcherCollector(batcher))
        if control is not None:
            self.registry.register(_IncastCollector(control))
        self.problems: list[str] = []  # why the ranker cannot serve (stopping, for one)
        probes = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the standard library's name)
                path = self.path.split("?", 1)[0]
                if path == "/live":
                    probes._send(self, 200, "application/json", b'{"live":true}')
                elif path == "/ready":
                    from cleave._native import health

                    status, body = health("ranker", [], list(probes.problems))
                    probes._send(self, status, "application/json", body.encode())
                elif path == "/metrics":
                    text = generate_latest(probes.registry)
                    probes._send(self, 200, "text/plain; version=0.0.4", text)
                else:
                    probes._send(self, 404, "application/json", b'{"error":"no such endpoint"}')

            def log_message(self, *args):  # no line per probe on stderr
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="probes")
        self.thread.daemon = True
        self.thread.start()

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    @staticmethod
    def _send(handler, status: int, content_type: str, body: bytes) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
