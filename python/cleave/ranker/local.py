"""An in-process request source with the FrameServer interface (`recv` / `reply` /
`reply_error`), for callers in the same process as the batching loop: tests and tools."""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future


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

    def submit(self, kind: int, payload: bytes) -> Future:
        """Queues one request; the future resolves to the response payload or RankerError."""
        future: Future = Future()
        with self._cond:
            self._next_id += 1
            self._waiting[self._next_id] = future
            self._items.append((0, self._next_id, kind, payload))
            self._cond.notify()
        return future

    def recv(self, max_items: int, timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            count = min(max_items, len(self._items))
            return [self._items.popleft() for _ in range(count)]

    def reply(self, conn_id: int, request_id: int, kind: int, payload) -> None:
        with self._cond:
            future = self._waiting.pop(request_id)
        future.set_result(bytes(payload))

    def reply_error(self, conn_id: int, request_id: int, code: int, message: str) -> None:
        with self._cond:
            future = self._waiting.pop(request_id)
        future.set_exception(RankerError(code, message))
