"""Last in, first out: the newest request starts first. Under overload the oldest requests are
the likeliest to be late already; serving the newest keeps some requests in time instead of
making every one of them late ("adaptive LIFO", Facebook's "Fail at Scale"). Not for a ranker
that is not overloaded: an old request waits as long as newer ones keep coming."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from cleave.ranker.queues import RequestQueue


class LifoQueue(RequestQueue):
    name = "lifo"

    def __init__(self) -> None:
        self._items: list[Any] = []  # oldest first; the newest is at the end

    def push(self, item: Any) -> None:
        self._items.append(item)

    def peek(self) -> Any:
        return self._items[-1]

    def pop(self) -> Any:
        return self._items.pop()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def remove_if(self, gone: Callable[[Any], bool]) -> list[Any]:
        removed = [p for p in self._items if gone(p)]
        if removed:
            self._items = [p for p in self._items if not gone(p)]
        return removed

    def oldest_arrival_ns(self) -> int:
        return self._items[0].arrived_ns  # arrival order kept: the first waited longest
