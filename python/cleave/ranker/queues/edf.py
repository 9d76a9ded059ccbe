"""Earliest deadline first (Prism §4.3): the request whose caller stops waiting soonest starts
first. Equal deadlines keep arrival order; requests without a deadline (0) wait behind every
request that has one (they can never be late), in arrival order."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from cleave.ranker.queues import RequestQueue

_NO_DEADLINE = float("inf")


class EdfQueue(RequestQueue):
    name = "edf"

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()  # arrival order breaks ties; items are never compared

    def push(self, item: Any) -> None:
        key = item.deadline_us or _NO_DEADLINE
        heapq.heappush(self._heap, (key, next(self._seq), item))

    def peek(self) -> Any:
        return self._heap[0][2]

    def pop(self) -> Any:
        return heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Any]:
        return (entry[2] for entry in self._heap)

    def remove_if(self, gone: Callable[[Any], bool]) -> list[Any]:
        removed = [e[2] for e in self._heap if gone(e[2])]
        if removed:
            self._heap = [e for e in self._heap if not gone(e[2])]
            heapq.heapify(self._heap)
        return removed
