"""A batch's compute time as a function of its rows, learnt from the batches the ranker ran.

The batcher asks it two things: whether a request can still make its deadline (the time it
would take alone), and how many rows a batch may take before its tightest deadline cannot be
met. Both need the time of a batch of a size not yet seen, and a batch's time is not
proportional to its rows: a batch cost the ranker about 2 ms of CPU beyond its requests' 1.8 ms
each on a 2-core KVM guest (100-candidate DLRM requests), so 10 requests in one batch cost 2.1
ms each and 2 cost 2.8 (docs/benchmarks.md, "Batches of 1,024 rows"); the dense program's own
share of that fixed cost is about 0.3 ms ("The ranker's batch, taken apart").

So the time is fitted as `fixed + per_row × rows` by least squares over the recent batches,
newest weighted most (each batch's weight shrinks by `1 - WEIGHT` per newer batch). While the
batches seen are all about one size, they say nothing about the split, and the time is taken
as proportional to rows (through the mean): too high above the mean size (a batch capped
early: some throughput lost) and too low below it. Whether a request is dropped as unable to
make its deadline asks what it surely needs instead (`least_us`): not more than the mean
batch's time above the mean size, and nothing before SURE_AFTER batches ran: a starved or cold
ranker's first batch (1 row in 1.03 s, a full suite's Ray test) is no evidence of the next.
"""

from __future__ import annotations

# Samples before a request is dropped on an estimate (one may be an outlier): the router's and
# the shards' estimates wait as long (cleave_wire::Ewma::settled).
from cleave._native import SURE_AFTER

WEIGHT = 0.1  # the newest batch's share: about the last 10-20 batches count
SPREAD = 0.1  # rows' standard deviation, over their mean, below which sizes are "one size"


class ComputeModel:
    def __init__(self, weight: float = WEIGHT):
        self.weight = weight
        # Weighted sums: weights, rows, µs, rows², rows × µs.
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.batches = 0

    def record(self, rows: int, us: float) -> None:
        keep = 1.0 - self.weight if self.w else 0.0
        self.batches += 1
        self.w = keep * self.w + 1.0
        self.x = keep * self.x + rows
        self.y = keep * self.y + us
        self.xx = keep * self.xx + rows * rows
        self.xy = keep * self.xy + rows * us

    def estimate_us(self, rows: int) -> float:
        """A batch of `rows`' compute time (0: no batch seen yet)."""
        return self._fit(rows, grow=True)

    def least_us(self, rows: int) -> float:
        """What a batch of `rows` surely takes, by what was seen: the fit, or, while the
        batches seen are all about one size, their time scaled down to fewer rows but not up
        to more (a larger batch takes at least as long, not proportionally longer). A request
        is dropped only when even this exceeds its time left: one slow batch of one row (a
        starved ranker's first, 468 ms) made 8-row requests look like 3.7 s. Nothing is sure
        before SURE_AFTER batches ran."""
        return self._fit(rows, grow=False) if self.batches >= SURE_AFTER else 0.0

    def _fit(self, rows: int, grow: bool) -> float:
        if not self.w or self.x <= 0:
            return 0.0
        mean_x, mean_y = self.x / self.w, self.y / self.w
        variance = self.xx / self.w - mean_x * mean_x
        if variance > (SPREAD * mean_x) ** 2:
            per_row = (self.xy / self.w - mean_x * mean_y) / variance
            fixed = mean_y - per_row * mean_x
            if per_row > 0 and fixed >= 0:
                return fixed + per_row * rows
        share = rows / mean_x
        return mean_y * (share if grow else min(share, 1.0))

    def scale(self, factor: float) -> None:
        """Every estimate times `factor` (the batcher's correction when it drops a request)."""
        self.y *= factor
        self.xy *= factor
