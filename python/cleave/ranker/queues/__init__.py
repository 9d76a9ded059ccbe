"""The order in which requests waiting in the ranker start: one policy per file behind
`RequestQueue` (docs/serving.md, "Queue policies"). Adding a policy is adding a file and an
entry in `POLICIES`.

* `fifo`: arrival order (the default, and the ranker's behaviour before policies existed);
* `edf`: earliest absolute deadline first; requests without a deadline go last, in arrival order.

Items need three attributes: `deadline_us` (Unix µs, 0 = none), `arrived_ns` and
`conn_id`/`request_id` (for `remove`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any


class RequestQueue(ABC):
    """Requests waiting to start. `peek` and `pop` give the one the policy starts next."""

    name: str

    @abstractmethod
    def push(self, item: Any) -> None: ...

    @abstractmethod
    def peek(self) -> Any:
        """The next request to start, left in the queue (IndexError when empty)."""

    @abstractmethod
    def pop(self) -> Any:
        """Removes and returns the next request to start (IndexError when empty)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Any]:
        """Every waiting request, in no particular order."""

    @abstractmethod
    def remove_if(self, gone: Callable[[Any], bool]) -> list[Any]:
        """Removes the requests for which `gone` is true; returns them."""

    def oldest_arrival_ns(self) -> int:
        """When the longest-waiting request arrived (for the batcher's max_wait)."""
        return min(item.arrived_ns for item in self)


def make_queue(policy: str) -> RequestQueue:
    """An empty queue of the named policy (one of `POLICIES`)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown queue policy {policy!r}: expected one of {sorted(POLICIES)}")
    return POLICIES[policy]()


from cleave.ranker.queues.edf import EdfQueue  # noqa: E402 (the modules import RequestQueue)
from cleave.ranker.queues.fifo import FifoQueue  # noqa: E402

POLICIES: dict[str, type[RequestQueue]] = {"fifo": FifoQueue, "edf": EdfQueue}
DEFAULT_POLICY = "fifo"

__all__ = ["DEFAULT_POLICY", "POLICIES", "EdfQueue", "FifoQueue", "RequestQueue", "make_queue"]
