"""An in-process request source with the FrameServer interface (`recv` / `reply` /
`reply_error` / `cancelled`), for callers in the same process as the batching loop: tests and
tools."""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future


def take(
    cond: threading.Condition,
    items: deque,
    max_items: int,
    timeout_s: float,
    clock=time.monotonic_ns,
) -> list:
    """Up to `max_items` from the front of `items`, waiting on `cond` (which guards them) up
    to `timeout_s` for the first: what a ranker's request source's `recv` does. Items are
    queued as `(conn_id, request_id, kind, payload, deadline_us, trace_id, queued_ns)` (a
    `clock()` stamp) and returned in `recv`'s shape, the stamp turned into the wait here, ns."""
    deadline = time.monotonic() + timeout_s
    with cond:
        while not items:
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            cond.wait(left)
        taken = [items.popleft() for _ in range(min(max_items, len(items)))]
    now = clock()
    return [(*item[:6], now - item[6]) for item in taken]


class RankerError(Exception):
    """An error frame from a ranker: `code` and `message`."""

    def __init__(self, code: int, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class LocalQueue:
    def __init__(self):
        self._items: deque = deque()
        self._waiting: dict[int, Future] = {}
        self._cond = threading.Condition()
        self._next_id = 0
        self._cancelled: list[tuple[int, int]] = []
        self.clock = time.monotonic_ns  # stamps what waits here (`take`)

    def submit(self, kind: int, payload: bytes, deadline_us: int = 0, trace_id: int = 0) -> Future:
        """Queues one request; the future resolves to the response payload or RankerError.
        `future.request_id` is its id (for `cancel`)."""
        future: Future = Future()
        with self._cond:
            self._next_id += 1
            future.request_id = self._next_id
            self._waiting[self._next_id] = future
            self._items.append(
                (0, self._next_id, kind, payload, deadline_us, trace_id, self.clock())
            )
            self._cond.notify()
        return future

    def cancel(self, request_id: int) -> None:
        """The caller gives up (as a CANCEL frame): dropped if still queued here, otherwise
        reported by `cancelled()`; its future is cancelled and any reply is dropped."""
        with self._cond:
            future = self._waiting.pop(request_id, None)
            queued = [item for item in self._items if item[1] == request_id]
            if queued:
                self._items.remove(queued[0])
            elif future is not None:
                self._cancelled.append((0, request_id))
        if future is not None:
            future.cancel()

    def cancelled(self) -> list[tuple[int, int]]:
        with self._cond:
            out, self._cancelled = self._cancelled, []
        return out

    def recv(self, max_items: int, timeout_s: float) -> list:
        return take(self._cond, self._items, max_items, timeout_s, self.clock)

    # A reply to a cancelled request is dropped, as the FrameServer does.
    def reply(self, conn_id: int, request_id: int, kind: int, payload) -> None:
        with self._cond:
            future = self._waiting.pop(request_id, None)
        if future is not None:
            future.set_result(bytes(payload))

    def reply_error(self, conn_id: int, request_id: int, code: int, message: str) -> None:
        with self._cond:
            future = self._waiting.pop(request_id, None)
        if future is not None:
            future.set_exception(RankerError(code, message))
