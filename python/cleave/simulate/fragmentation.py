"""Fragmentation after Weng et al., "Beware of fragmentation" (USENIX ATC'23), as Prism §5.4
uses it: the unallocated CPUs and GPUs of each host that an instance drawn from the current
workload cannot use, in expectation over the workload's instance types, summed over hosts.

For resource r and host n, with p_m the share of alive instances of type m (a type is one
(cpus, memory, gpus) request) among the types that request r:

    fragments_r(n) = free_r(n) * sum_m p_m * [m does not fit on n]

A type that does not request r is left out: CPU-only instances cannot use a free GPU however
it is placed. Weng et al. count every free GPU as a fragment for such a type; that variant is
returned too (docs/simulate.md)."""

from __future__ import annotations

import numpy as np


def instance_types(
    cpu: np.ndarray, mem: np.ndarray, gpu: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (cpu, mem, gpu) rows and how many instances have each."""
    rows = np.stack([cpu, mem, gpu], axis=1)
    if not len(rows):
        return np.zeros((0, 3)), np.zeros(0)
    types, counts = np.unique(rows, axis=0, return_counts=True)
    return types, counts.astype(np.float64)


def fragments(
    free_cpu: np.ndarray,
    free_mem: np.ndarray,
    free_gpu: np.ndarray,
    types: np.ndarray,
    counts: np.ndarray,
) -> tuple[float, float, float]:
    """(fragmented CPUs, fragmented GPUs, fragmented GPUs as Weng et al. count them) of the
    cluster against the workload `types` (rows of cpu, mem, gpu) weighted by `counts`. The
    third counts every free GPU as a fragment for a type that requests none (their "x-axis"
    case): over a mostly CPU-only workload it is high whatever the placement."""
    if not len(types):
        return 0.0, 0.0, 0.0
    fits = (
        (free_cpu[:, None] >= types[None, :, 0])
        & (free_mem[:, None] >= types[None, :, 1])
        & (free_gpu[:, None] >= types[None, :, 2])
    )
    misfit = ~fits
    out = []
    for free, col in ((free_cpu, 0), (free_gpu, 2)):
        weights = counts * (types[:, col] > 0)
        total = weights.sum()
        if not total:
            out.append(0.0)
            continue
        unusable = misfit @ (weights / total)  # per host: probability the instance misfits
        out.append(float(free @ unusable))
    no_gpu = types[:, 2] == 0
    weng = float(free_gpu @ ((misfit | no_gpu[None, :]) @ (counts / counts.sum())))
    return out[0], out[1], weng
