"""The bounded-lag alltoallv (BLS §III): an alltoallv whose ranks may be up to `lag`
iterations apart, usable by itself (docs/score.md, "The collective").

Each rank `start`s iteration i with one tensor per peer and later `wait`s for it, in
iteration order, with at most `lag + 1` iterations unfinished (BLS Listing 2: start, and
wait for the oldest once more than `lag` are unfinished). K = `lag` + 1 buffer sets per peer,
indexed by iteration mod K, receive what is in flight. Starting iteration i posts the
receives of i into its buffer set before sending, so a peer's message lands without this
rank's help (gloo's I/O threads move it, as BLS's one-sided puts do): a rank blocks only in
`wait`, and only when a peer it needs has not yet started that iteration — more than `lag`
iterations behind in the Listing 2 pattern. lag = 0 is the ordinary synchronous alltoallv.

Underneath are torch.distributed's non-blocking isend/irecv (gloo). gloo refuses (aborts on)
a message larger than the receive posted for it, so every message fits a capacity both sides
compute alike: the largest count either side saw in the iterations that have left the
window (i - lag - 1 and before), and at least `capacity`. A message is a 16-byte header
(iteration, element count) and the first `capacity` elements; a longer one sends the rest
as a second message, received in `wait` (one rendezvous, only when messages grow). The
header's iteration checks the order. A peer that dies closes its connections and the wait
fails at once, naming it; a peer that hangs fails the wait after `timeout_s`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from cleave.errors import CleaveError

__all__ = ["BoundedLagAlltoallv", "CollectiveError", "PeerError"]

HEADER = 16  # bytes: int64 iteration, int64 element count


class CollectiveError(CleaveError):
    """The collective was used out of order, or a peer sent what was not expected."""


class PeerError(CollectiveError):
    """A peer died or stopped answering: `peer` and `iteration` say which and when."""

    def __init__(self, message: str, peer: int, iteration: int):
        super().__init__(message)
        self.peer = peer
        self.iteration = iteration


class _Slot:
    """One buffer set: the receives and sends of one in-flight iteration, per peer."""

    def __init__(self, world: int):
        self.iteration = -1
        self.recv = [torch.empty(0, dtype=torch.uint8) for _ in range(world)]
        self.recv_works: list = [None] * world
        self.caps = [0] * world  # elements the first message carries at most, per peer
        self.sent = [0] * world  # element counts sent (this rank's) ...
        self.received = [0] * world  # ... and received, per peer: retired at reuse
        self.sends: list = []  # (peer, what, work, tensor): kept alive until complete
        self.local: torch.Tensor | None = None


class BoundedLagAlltoallv:
    """An alltoallv over `group` (torch.distributed's default group if None; a world of one
    when torch.distributed is not initialized) whose ranks may be up to `lag` iterations
    apart. `dtype`: of every payload. `tag`: two collectives used side by side need
    different tags (each takes two point-to-point tags). `capacity`: elements per peer that
    travel without a rendezvous before any message was seen."""

    def __init__(
        self,
        lag: int,
        dtype: torch.dtype = torch.uint8,
        tag: int = 0,
        timeout_s: float = 30.0,
        capacity: int = 4096,
        group=None,
    ):
        if lag < 0:
            raise CollectiveError(f"lag must be at least 0, got {lag}")
        self.lag = lag
        self.dtype = dtype
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._head_tag, self._rest_tag = 2 * tag, 2 * tag + 1
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._itemsize = torch.empty(0, dtype=dtype).element_size()
        self._largest = [capacity] * self.world  # per peer: over the iterations retired
        self._slots = [_Slot(self.world) for _ in range(lag + 1)]
        self._started = 0  # the next iteration to start
        self._waited = 0  # the next iteration to wait for

    def slot(self, iteration: int) -> int:
        """The buffer set an iteration uses."""
        return iteration % (self.lag + 1)

    @property
    def unfinished(self) -> int:
        """Iterations started and not yet waited for."""
        return self._started - self._waited

    def start(self, iteration: int, sends: Sequence[torch.Tensor]) -> None:
        """Sends `sends[p]` (of this collective's dtype; flattened) to each peer p for
        `iteration`, without blocking. Iterations start in order, at most `lag + 1`
        unfinished."""
        if iteration != self._started:
            raise CollectiveError(
                f"rank {self.rank}: started iteration {iteration}, expected {self._started} "
                "(iterations start in order)"
            )
        if self.unfinished > self.lag:
            raise CollectiveError(
                f"rank {self.rank}: iteration {iteration} started with {self.unfinished} "
                f"unfinished; lag {self.lag} allows {self.lag + 1}: wait for iteration "
                f"{self._waited} first"
            )
        if len(sends) != self.world:
            raise CollectiveError(
                f"rank {self.rank}: {len(sends)} tensors to send, {self.world} expected "
                "(one per rank)"
            )
        for t in sends:
            if t.dtype != self.dtype:
                raise CollectiveError(
                    f"rank {self.rank}: iteration {iteration}: a {t.dtype} tensor to send, "
                    f"this collective sends {self.dtype}"
                )
        slot = self._slots[self.slot(iteration)]
        self._retire(slot)
        slot.iteration = iteration
        for peer in self._peers():  # receive before sending: the peer's message lands here
            cap = slot.caps[peer] = self._largest[peer]
            size = HEADER + cap * self._itemsize
            if slot.recv[peer].numel() < size:
                slot.recv[peer] = torch.empty(size, dtype=torch.uint8)
            slot.recv_works[peer] = self._irecv(slot.recv[peer][:size], peer, self._head_tag)
        for peer in self._peers():
            data = sends[peer].reshape(-1).contiguous()
            slot.sent[peer] = n = data.numel()
            first = min(n, slot.caps[peer])
            header = torch.tensor([iteration, n], dtype=torch.int64).view(torch.uint8)
            # (an empty tensor may have any stride, which a byte view refuses)
            body = data[:first].view(torch.uint8) if first else torch.empty(0, dtype=torch.uint8)
            message = torch.cat([header, body])
            slot.sends.append((peer, "header", self._isend(message, peer, self._head_tag), message))
            if n > first:
                rest = data[first:]
                slot.sends.append((peer, "data", self._isend(rest, peer, self._rest_tag), rest))
        slot.local = sends[self.rank].reshape(-1)
        self._started += 1

    def wait(self, iteration: int, expect: Sequence[int] | None = None) -> list[torch.Tensor]:
        """What each peer sent for `iteration` (the oldest unfinished one), blocking until all
        of it arrived. `expect[p]`: the element count peer p must have sent, where known. The
        tensors may be this slot's buffers: valid until iteration + lag + 1 starts."""
        if iteration != self._waited or iteration >= self._started:
            want = self._waited if self._waited < self._started else "a start first"
            raise CollectiveError(
                f"rank {self.rank}: waited for iteration {iteration}, expected {want} "
                "(iterations are waited for in order, after they start)"
            )
        slot = self._slots[self.slot(iteration)]
        got: list[torch.Tensor] = [slot.local] * self.world
        rests = []
        for peer in self._peers():
            self._complete(slot.recv_works[peer], peer, iteration, "header")
            slot.recv_works[peer] = None
            buf = slot.recv[peer]
            sent_iteration, n = (int(v) for v in buf[:HEADER].view(torch.int64))
            if sent_iteration != iteration:
                raise CollectiveError(
                    f"rank {self.rank}: rank {peer} sent iteration {sent_iteration} where "
                    f"iteration {iteration} was expected (out of order)"
                )
            slot.received[peer] = n
            first = min(n, slot.caps[peer])
            head = buf[HEADER : HEADER + first * self._itemsize].view(self.dtype)
            if n > first:
                rest = torch.empty(n - first, dtype=self.dtype)
                rests.append((peer, head, rest, self._irecv(rest, peer, self._rest_tag)))
            else:
                got[peer] = head
        for peer, head, rest, work in rests:
            self._complete(work, peer, iteration, "data")
            got[peer] = torch.cat([head, rest])
        if expect is not None:
            for peer, (want, t) in enumerate(zip(expect, got, strict=True)):
                if t.numel() != want:
                    raise CollectiveError(
                        f"rank {self.rank}: iteration {iteration}: rank {peer} sent "
                        f"{t.numel()} elements, {want} expected"
                    )
        self._waited += 1
        return got

    def close(self) -> None:
        """Completes the sends still in flight (each peer received them, or died: then a
        PeerError)."""
        for slot in self._slots:
            self._finish_sends(slot)

    def _peers(self) -> list[int]:
        return [p for p in range(self.world) if p != self.rank]

    def _retire(self, slot: _Slot) -> None:
        """Before a slot is reused: its sends are complete (the peers posted their receives
        when they started that iteration), and its counts join the capacity."""
        self._finish_sends(slot)
        if slot.iteration >= 0:
            for peer in self._peers():
                self._largest[peer] = max(self._largest[peer], slot.sent[peer], slot.received[peer])

    def _finish_sends(self, slot: _Slot) -> None:
        for peer, what, work, _ in slot.sends:
            self._complete(work, peer, slot.iteration, what)
        slot.sends = []

    def _isend(self, tensor: torch.Tensor, peer: int, tag: int):
        try:
            return dist.isend(tensor, peer, group=self.group, tag=tag)
        except RuntimeError as err:
            raise self._peer_error(peer, self._started, "send", err) from None

    def _irecv(self, tensor: torch.Tensor, peer: int, tag: int):
        try:
            return dist.irecv(tensor, peer, group=self.group, tag=tag)
        except RuntimeError as err:
            raise self._peer_error(peer, self._started, "receive", err) from None

    def _complete(self, work, peer: int, iteration: int, what: str) -> None:
        try:
            work.wait(self._timeout)
        except RuntimeError as err:
            raise self._peer_error(peer, iteration, what, err) from None

    def _peer_error(self, peer: int, iteration: int, what: str, err: Exception) -> PeerError:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        first = first.split(". This is typically")[0]  # gloo's advice to read the peer's logs
        return PeerError(
            f"rank {self.rank}: rank {peer} failed during iteration {iteration} (its {what} "
            f"did not complete: {first})",
            peer,
            iteration,
        )
