"""First in, first out: requests start in the order they arrived."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from cleave.ranker.queues import RequestQueue


class FifoQueue(RequestQueue):
    name = "fifo"

    def __init__(self) -> None:
        self._items: deque[Any] = deque()

    def push(self, item: Any) -> None:
        self._items.append(item)

    def peek(self) -> Any:
        return self._items[0]

    def pop(self) -> Any:
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def remove_if(self, gone: Callable[[Any], bool]) -> list[Any]:
        removed = [p for p in self._items if gone(p)]
        if removed:
            self._items = deque(p for p in self._items if not gone(p))
        return removed

    def oldest_arrival_ns(self) -> int:
        return self._items[0].arrived_ns  # arrival order: the head waited longest
