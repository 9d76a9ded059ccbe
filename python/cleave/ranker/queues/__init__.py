"""The order in which requests waiting in the ranker start: one policy per file behind
`RequestQueue` (docs/serving.md, "Queue policies"). Adding a policy is adding a file named
after it and its name to the settings' QUEUE_POLICIES (cleave/settings/choices.py).

Each file says what its policy does: `fifo.py` (arrival order, the default and the ranker's
behaviour before policies existed), `edf.py` (earliest absolute deadline first), ...

Items need three attributes: `deadline_us` (Unix µs, 0 = none), `arrived_ns` and
`conn_id`/`request_id` (for `remove`).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

from cleave.settings import QUEUE_POLICIES, RankerConfig, default


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


def _policy(name: str) -> type[RequestQueue]:
    """The queue class of policy `name`: the one in cleave/ranker/queues/NAME.py."""
    module = importlib.import_module(f"{__name__}.{name}")
    (cls,) = [c for c in vars(module).values() if getattr(c, "name", None) == name]
    return cls


# One file per name of the settings' QUEUE_POLICIES (cleave/settings/choices.py).
POLICIES: dict[str, type[RequestQueue]] = {name: _policy(name) for name in QUEUE_POLICIES.names}
DEFAULT_POLICY = default(RankerConfig, "queue")

from cleave.ranker.queues.edf import EdfQueue  # noqa: E402 (the modules import RequestQueue)
from cleave.ranker.queues.fifo import FifoQueue  # noqa: E402

__all__ = ["DEFAULT_POLICY", "POLICIES", "EdfQueue", "FifoQueue", "RequestQueue", "make_queue"]
