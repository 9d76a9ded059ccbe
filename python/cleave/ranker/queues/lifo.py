"""Last in, first out: the newest request starts first. Under overload the oldest requests are
the likeliest to be late already; serving the newest keeps some requests in time instead of
making every one of them late ("adaptive LIFO", Facebook's "Fail at Scale"). Not for a ranker
that is not overloaded: an old request waits as long as newer ones keep coming."""

from __future__ import annotations

from typing import Any

from cleave.ranker.queues.fifo import FifoQueue


class LifoQueue(FifoQueue):
    """FIFO's arrival-ordered store, taken from the other end."""

    name = "lifo"

    def peek(self) -> Any:
        return self._items[-1]

    def pop(self) -> Any:
        return self._items.pop()
