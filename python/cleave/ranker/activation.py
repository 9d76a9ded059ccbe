"""The memory a ranker's batch takes per row, measured at start (docs/cache.md, "Budget").

The router's adaptive cache shares one memory budget with the rankers' batches: the largest
batch is what the budget leaves after the cache, divided by this figure. It is measured, not
guessed, on the ranker's own device: the peak memory of one run of the dense program at two
batch sizes (inputs included: they live in the same memory), the difference per row. On a GPU
the allocator's peak counter gives it; on the CPU, PyTorch's profiler records each allocation
and free in order, and the peak is the largest running sum."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("cleave.ranker")

Inputs = list[torch.Tensor]


def bytes_per_row(batch: Callable[[int], tuple[Inputs, int] | None], run, device: str, rows: int):
    """Activation bytes per row of a batch: the peak of `run(inputs)` on `batch(rows)` less
    its peak on `batch(1)`, per row between them (one batch alone when both have as many
    rows: a model whose requests are not joined). None when there is no batch to run."""
    small, large = batch(1), batch(rows)
    if small is None or large is None:
        return None
    peak_small, peak_large = peak_bytes(run, small[0], device), peak_bytes(run, large[0], device)
    if large[1] > small[1]:
        return max(1, round((peak_large - peak_small) / (large[1] - small[1])))
    return max(1, round(peak_large / large[1]))


def peak_bytes(run, inputs: Inputs, device: str) -> int:
    """The most memory one run of `run` on `inputs` held at once on `device`, inputs included
    (they are copied to the device inside the measured span)."""
    if device == "cpu":
        return _cpu_peak(run, inputs)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        run([t.to(device) for t in inputs])
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _cpu_peak(run, inputs: Inputs) -> int:
    from torch.profiler import ProfilerActivity, profile

    with (
        torch.inference_mode(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p,
    ):
        run([t.clone() for t in inputs])
    # Each allocation is its op's own (self) memory; each free a "[memory]" event of its own.
    changes = sorted(
        (
            (e.time_range.start, e.self_cpu_memory_usage)
            for e in p.events()
            if e.self_cpu_memory_usage
        ),
    )
    held = peak = 0
    for _, change in changes:
        held += change
        peak = max(peak, held)
    return peak
