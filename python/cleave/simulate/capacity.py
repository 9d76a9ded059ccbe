"""The whole study `cleave simulate` runs (docs/simulate.md): the cluster's scale, both
deployments replayed, GPUs needed by each, and capacity loaning."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from cleave.errors import UsageError
from cleave.simulate import replay as rp
from cleave.simulate.nodes import HostType, build_hosts
from cleave.simulate.trace import Trace

TARGET_ALLOCATION = 0.9  # --cluster-scale auto: the trace's peak at about 90%, as Prism's cluster
SAMPLES = 240  # measurement times over the trace
# Prism §5.4's training host: 8 GPUs, 96 CPUs; memory as its A100 hosts (§5.1).
TRAINING_HOST = HostType(cpus=96.0, mem=1024.0, gpus=8, model="training", count=1)


@dataclass
class Study:
    scale: float
    hosts: int
    replays: dict[str, rp.Replay]
    gpus_needed: dict[str, int | None]
    gpus_needed_any_mix: dict[str, int]  # and how many HN instances it counts
    loaning: dict
    seconds: float
    search_bound: int  # the most GPUs fewest_hosts tries (MAX_SCALE times the list's)


def auto_scale(work: rp.Workload, types: list[HostType]) -> float:
    """The smallest scale at which the peak CPU, memory and GPU demand of the instances some
    host could hold is at most TARGET_ALLOCATION of the cluster's."""
    peak = rp.peak_demand(work.subset(rp.fits_some_type(work, types)))
    capacity = np.array(
        [
            sum(t.count * t.cpus for t in types),
            sum(t.count * t.mem for t in types),
            sum(t.count * t.gpus for t in types),
        ]
    )
    need = [p / (TARGET_ALLOCATION * c) for p, c in zip(peak, capacity, strict=True) if c > 0]
    return max([*need, 1e-3])


def gpus_of(found: tuple[float, object]) -> int | None:
    """GPUs of fewest_hosts' answer; None when no scale up to its bound was enough."""
    scale, hosts = found
    if hosts is None:
        return None if scale == float("inf") else 0
    return int(hosts.gpu.sum())


def like_for_like(trace: Trace, types: list[HostType]) -> Trace:
    """Only the apps whose every monolithic instance fits some host type: both deployments
    then place the same work, and neither is credited for what the other cannot place."""
    mono = rp.monolithic(trace)
    too_big = mono.source[~rp.fits_some_type(mono, types)]
    return trace.subset(~np.isin(trace.app, np.unique(trace.app[too_big])))


def run_study(
    trace: Trace,
    types: list[HostType],
    scale: float | None,
    percentile: float,
    same_work: bool = False,
) -> Study:
    """`scale` None: auto. `percentile`: the load the dedicated pool is sized for (loaning).
    `same_work`: keep only the apps `like_for_like` keeps."""
    if not 0 < percentile <= 100:
        raise UsageError(f"--loan-percentile: expected 0 < P <= 100, got {percentile:g}")
    began = time.process_time()
    if same_work:
        trace = like_for_like(trace, types)
        if not len(trace):
            raise UsageError("--like-for-like: no app's monolithic instances all fit a host")
    works = {rp.MONOLITHIC: rp.monolithic(trace), rp.DISAGGREGATED: rp.disaggregated(trace)}
    if scale is None:
        scale = auto_scale(works[rp.DISAGGREGATED], types)
    hosts = build_hosts(types, scale)
    replays = {m: rp.replay(w, hosts, samples=SAMPLES) for m, w in works.items()}
    needed = {m: gpus_of(rp.fewest_hosts(rp.gpu_holding(w), types)) for m, w in works.items()}
    # Any mix, like for like: only the HNs whose monolithic instance some GPU host can hold,
    # so neither deployment is credited for instances the other could not place at all.
    mono_gpu = rp.gpu_holding(works[rp.MONOLITHIC])
    mono_gpu = mono_gpu.subset(rp.fits_some_type(mono_gpu, types, only_gpu=True))
    dis_gpu = rp.gpu_holding(works[rp.DISAGGREGATED])
    dis_gpu = dis_gpu.subset(np.isin(dis_gpu.source, mono_gpu.source))
    any_mix = {
        rp.MONOLITHIC: rp.fewest_gpus_any_mix(mono_gpu, types),
        rp.DISAGGREGATED: rp.fewest_gpus_any_mix(dis_gpu, types),
        "instances": len(dis_gpu),
    }
    # Loaning: HN instances beyond the percentile's load borrow training hosts.
    gpu_work = rp.gpu_holding(works[rp.DISAGGREGATED])
    limit = rp.percentile_alive(gpu_work, percentile)
    dedicated = rp.split_for_loaning(gpu_work, limit)
    dedicated_gpus = gpus_of(rp.fewest_hosts(gpu_work.subset(dedicated), types))
    borrowed = gpu_work.subset(~dedicated)
    borrowed_gpus = gpus_of(rp.fewest_hosts(borrowed, [TRAINING_HOST], len(borrowed) + 1.0))
    # The same borrowed instances as monolithic ones (HN plus its CN share), for Prism's
    # comparison: how many training GPUs monolithic serving would have borrowed.
    mono = works[rp.MONOLITHIC]
    mono_borrowed = mono.subset(np.isin(mono.source, borrowed.source))
    fits = rp.fits_some_type(mono_borrowed, [TRAINING_HOST])
    mono_gpus = gpus_of(
        rp.fewest_hosts(mono_borrowed.subset(fits), [TRAINING_HOST], len(mono_borrowed) + 1.0)
    )
    needed["disaggregated_with_loaning"] = dedicated_gpus
    loaning = {
        "percentile": percentile,
        "dedicated_instances_limit": limit,
        "dedicated_gpus": dedicated_gpus,
        "borrowed_gpus": borrowed_gpus,
        "borrowed_instances": int(len(borrowed)),
        "monolithic_borrowed_gpus": mono_gpus,
        "monolithic_borrowed_unplaceable": int((~fits).sum()),
    }
    seconds = time.process_time() - began
    bound = int(rp.MAX_SCALE * sum(t.count * t.gpus for t in types))
    return Study(scale, len(hosts), replays, needed, any_mix, loaning, seconds, bound)
