"""The ranker's batching loop: take requests, join them into a batch, run it, reply.

The loop only needs a *source* with two calls, so it does not care where requests come from
(a `cleave._native.FrameServer` on a socket, or an in-process queue):

* `recv(max_items, timeout_s) -> list[(conn_id, request_id, kind, payload, deadline_us,
  trace_id)]`: waits at most `timeout_s` for at least one request (`deadline_us`: Unix µs from
  the frame header, 0 = none);
* `cancelled() -> list[(conn_id, request_id)]`: requests already received whose callers gave
  up since the last call;
* `reply(conn_id, request_id, kind, payload)` and
  `reply_error(conn_id, request_id, code: int, message)`.

Policy: requests start in the order of the queue policy (`queue`: "fifo", arrival order, the
default; or "edf", earliest deadline first; cleave/ranker/queues/). A batch starts when the
queued rows reach `max_batch` (or the lower cap the router's latest request carried: what its
memory budget leaves beside its cache, docs/cache.md), or when the longest-waiting request has
waited `max_wait_s`; with `max_wait_s = 0` the loop is work-conserving (it runs whatever
arrived while the previous batch computed). A batch is one call of the dense program: requests
are never interleaved. A batch stops growing before a request whose joining would make the
batch's compute (cleave/ranker/compute.py: learnt from the batches run) outlast the time any of
its requests has left, or take more than `BATCH_SHARE` of the time any of them had left when
it arrived: large batches amortise the program's fixed cost under loose budgets, and tight
budgets keep small ones. A request that cannot make its deadline when its batch is formed
(less time left than it would take alone) is answered with error `deadline` and not computed;
one whose caller cancelled it is dropped from the queue. The queue holds at
most `max_queue` requests: one more is answered `overloaded` at once (not executed, so the
router retries it on another ranker).

Logs (`logging`, logger "cleave.ranker") carry the router's trace id as `trace=%016x`, the
form of the router's `x-request-id`: failures at WARNING, one record per batch at DEBUG.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

import torch

from cleave._native import (
    ERR_BAD_REQUEST,
    ERR_CANCELLED,
    ERR_DEADLINE,
    ERR_INTERNAL,
    ERR_OVERLOADED,
)
from cleave.ranker import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE
from cleave.ranker.compute import ComputeModel
from cleave.ranker.executor import DenseExecutor
from cleave.ranker.payload import PayloadError, decode_request, encode_response
from cleave.ranker.queues import DEFAULT_POLICY, make_queue
from cleave.ranker.signature import Signature

log = logging.getLogger("cleave.ranker")

# The error codes a ranker answers with come from the wire crate (docs/protocol.md, "Error
# frames"): re-exported here for the ranker's callers and tests.
__all__ = [
    "ERR_BAD_REQUEST",
    "ERR_CANCELLED",
    "ERR_DEADLINE",
    "ERR_INTERNAL",
    "ERR_OVERLOADED",
    "Batcher",
    "BatchStats",
]

_IDLE_POLL_S = 0.05  # how often an idle loop looks at its stop flag
# A batch's compute takes at most this share of the time each of its requests had left on
# arrival: a request waits for the batch running when it comes, then runs in its own, so
# among requests of like budgets batching costs one at most about a fifth of its budget, the
# least latency the router's admission tolerates (gradient.rs, TARGET_FLOOR). Chosen so, not
# measured against other shares (docs/benchmarks.md, "Batches of 1,024 rows").
BATCH_SHARE = 0.1


@dataclass
class Pending:
    conn_id: int
    request_id: int
    arrived_ns: int  # Batcher.clock() when the loop received it
    deadline_us: int  # Unix microseconds; 0: none
    tensors: list[torch.Tensor]
    rows: int
    trace_id: int = 0  # the router's request id, for logs (docs/protocol.md); 0: none
    batch_us: float = math.inf  # the most compute its batch may take (BATCH_SHARE)
    # How long it waited in the source (the frame server's inbox) for the loop, busy with a
    # batch: queueing at the ranker, reported in `queue_us` (else the router would count it
    # as transfer).
    waited_us: int = 0


@dataclass
class BatchStats:
    requests: int = 0
    batches: int = 0
    dropped_deadline: int = 0  # already late when their batch was formed
    dropped_late: int = 0  # less time left than a batch's compute takes
    cancelled: int = 0
    overloaded: int = 0
    bad_requests: int = 0
    failed: int = 0


class Batcher:
    def __init__(
        self,
        source,
        executor: DenseExecutor,
        signature: Signature,
        kind: int,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_wait_s: float = 0.0,
        max_queue: int = DEFAULT_MAX_QUEUE,
        wall_clock=time.time,
        clock=time.monotonic_ns,
        queue: str = DEFAULT_POLICY,
    ):
        self.source = source
        self.executor = executor
        self.signature = signature
        self.kind = kind
        self.max_batch = max(1, max_batch)
        # The router's cap (docs/cache.md): the memory its cache leaves for batches, from the
        # latest request that carried one; never above max_batch.
        self.router_cap = 0
        # Waiting for company is pointless when requests cannot share a batch.
        self.max_wait_ns = int(max_wait_s * 1e9) if signature.batchable else 0
        self.max_queue = max(1, max_queue)
        self.wall_clock = wall_clock  # for deadlines (Unix time, seconds)
        self.clock = clock  # for queueing time and max_wait (nanoseconds)
        self.queue = make_queue(queue)
        self.queued_rows = 0
        self.stats = BatchStats()
        # A batch's compute by its rows: 0 until the first batch (nothing is dropped as late).
        self.compute = ComputeModel()
        self.dense_choice = None  # load_ranker's: the dense precision served, and why
        self.activation_bytes = None  # load_ranker's: memory per batch row, when measured

    def serve_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.step()

    def step(self) -> int:
        """Receives what is there (waiting as the policy says), runs at most one batch; returns
        the number of requests the batch computed."""
        self._receive(self._wait_s())
        if not self.queue:
            return 0
        # (Under EDF finding the oldest is a scan: only when waiting for company is on.)
        if self.max_wait_ns and self.queued_rows < self.batch_limit():
            if self.clock() - self.queue.oldest_arrival_ns() < self.max_wait_ns:
                return 0
        return self._run(self._take())

    def batch_limit(self) -> int:
        """Rows per batch at most: max_batch, lowered by the router's cap when it sends one."""
        return min(self.max_batch, self.router_cap) if self.router_cap else self.max_batch

    def _wait_s(self) -> float:
        if not self.queue:
            return _IDLE_POLL_S
        if self.queued_rows >= self.batch_limit():
            return 0.0
        if not self.max_wait_ns:
            return 0.0
        left_ns = self.queue.oldest_arrival_ns() + self.max_wait_ns - self.clock()
        return max(0.0, left_ns / 1e9)

    def _receive(self, timeout_s: float) -> None:
        received = self.source.recv(1024, timeout_s)
        now_us = self.wall_clock() * 1e6
        for conn_id, request_id, kind, payload, deadline_us, trace_id, waited_ns in received:
            now = self.clock()
            if len(self.queue) >= self.max_queue:
                self.stats.overloaded += 1
                message = f"ranker queue full ({len(self.queue)} requests); not executed"
                log.warning("trace=%016x refused: %s", trace_id, message)
                self._error(conn_id, request_id, ERR_OVERLOADED, message)
                continue
            try:
                if kind != self.kind:
                    raise PayloadError(f"this ranker serves frame kind {self.kind}, got {kind}")
                request = decode_request(payload)
                rows = self.signature.check(request)
                if request.max_batch:
                    self.router_cap = request.max_batch
            except PayloadError as err:
                self.stats.bad_requests += 1
                log.warning("trace=%016x bad request: %s", trace_id, err)
                self._error(conn_id, request_id, ERR_BAD_REQUEST, str(err))
                continue
            batch_us = max(0.0, BATCH_SHARE * (deadline_us - now_us)) if deadline_us else math.inf
            self.queue.push(
                Pending(
                    conn_id,
                    request_id,
                    now,
                    deadline_us,
                    request.tensors,
                    rows,
                    trace_id,
                    batch_us,
                    waited_ns // 1000,
                )
            )
            self.queued_rows += rows
        self._drop_cancelled()

    def _drop_cancelled(self) -> None:
        """Requests whose callers gave up leave the queue unanswered (the server would not send
        a reply anyway); the `cancelled` reply only settles the source's books."""
        gone = set(self.source.cancelled())
        if not gone:
            return
        for p in self.queue.remove_if(lambda p: (p.conn_id, p.request_id) in gone):
            self.stats.cancelled += 1
            self.queued_rows -= p.rows
            self._error(p.conn_id, p.request_id, ERR_CANCELLED, "cancelled by the caller")

    def _take(self) -> list[Pending]:
        """In the queue policy's order, up to max_batch rows (at least one request) and no
        more than its requests' deadlines leave time to compute (module doc); drops those
        that cannot make their deadline."""
        batch: list[Pending] = []
        rows = 0
        now_us = int(self.wall_clock() * 1e6)
        bound_us = math.inf  # the most compute the batch may take
        while self.queue:
            head = self.queue.peek()
            if batch and (not self.signature.batchable or rows + head.rows > self.batch_limit()):
                break
            left_us = head.deadline_us - now_us if head.deadline_us else None
            head_bound = head.batch_us if left_us is None else min(left_us, head.batch_us)
            if batch and self.compute.estimate_us(rows + head.rows) > min(bound_us, head_bound):
                break  # the head heads the next batch
            self.queue.pop()
            self.queued_rows -= head.rows
            needs_us = int(self.compute.least_us(head.rows))
            if left_us is not None and left_us < needs_us:
                self._drop_late(head, now_us, needs_us)
                if left_us >= 0:
                    # Only batches run teach the model: each drop pulls it towards half the
                    # time that was left, so one slow batch cannot make the ranker drop every
                    # later request.
                    target = needs_us + self.compute.weight * (left_us / 2 - needs_us)
                    self.compute.scale(target / needs_us)
                continue
            batch.append(head)
            rows += head.rows
            bound_us = min(bound_us, head_bound)
        return batch

    def _drop_late(self, p: Pending, now_us: int, needs_us: int) -> None:
        """Answers `deadline` for a request that would finish after its caller stops waiting."""
        if p.deadline_us < now_us:
            self.stats.dropped_deadline += 1
            late_us = now_us - p.deadline_us
            log.warning("trace=%016x past its deadline by %d us", p.trace_id, late_us)
            message = f"deadline passed {late_us} us before the ranker could start it"
        else:
            self.stats.dropped_late += 1
            left_us = p.deadline_us - now_us
            log.warning("trace=%016x cannot make its deadline (%d us left)", p.trace_id, left_us)
            message = (
                f"deadline cannot be met: {left_us} us left when its batch formed, and it "
                f"computes in {needs_us} us alone; dropped before starting"
            )
        self._error(p.conn_id, p.request_id, ERR_DEADLINE, message)

    def _run(self, batch: list[Pending]) -> int:
        if not batch:
            return 0
        start = self.clock()
        try:
            outputs = self.executor.run(self.signature.join([p.tensors for p in batch]))
            pieces = self.signature.split(outputs, [p.rows for p in batch])
        except Exception as err:  # a model error fails its requests, never the ranker
            if len(batch) > 1:  # find the request that fails instead of failing all of them
                return sum(self._run([p]) for p in batch)
            self.stats.failed += 1
            p = batch[0]
            log.warning("trace=%016x dense program failed: %s", p.trace_id, err)
            self._error(p.conn_id, p.request_id, ERR_INTERNAL, f"dense program failed: {err}")
            return 0
        compute_us = (self.clock() - start) // 1000
        self.compute.record(sum(p.rows for p in batch), compute_us)
        depth = len(self.queue)
        if log.isEnabledFor(logging.DEBUG):  # the hot path: format nothing unless asked
            traces = ",".join(f"{p.trace_id:016x}" for p in batch)
            log.debug("batch of %d requests in %d us: trace=%s", len(batch), compute_us, traces)
        for p, outs in zip(batch, pieces, strict=True):
            queue_us = (start - p.arrived_ns) // 1000 + p.waited_us
            payload = encode_response(queue_us, compute_us, len(batch), depth, outs)
            self._reply(p.conn_id, p.request_id, payload)
        self.stats.requests += len(batch)
        self.stats.batches += 1
        return len(batch)

    # A reply that cannot be delivered (the source forgot the request, e.g. while closing) is
    # logged: it must never stop the loop that serves everyone else.
    def _reply(self, conn_id: int, request_id: int, payload: bytes) -> None:
        try:
            self.source.reply(conn_id, request_id, self.kind, payload)
        except Exception as err:
            log.warning("reply to request %d of connection %d lost: %s", request_id, conn_id, err)

    def _error(self, conn_id: int, request_id: int, code: int, message: str) -> None:
        try:
            self.source.reply_error(conn_id, request_id, code, message)
        except Exception as err:
            log.warning("error reply to request %d lost: %s (%s)", request_id, err, message)
