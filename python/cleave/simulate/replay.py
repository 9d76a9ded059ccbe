"""Replaying a trace on a cluster (docs/simulate.md): the two deployments' workloads, the
event loop, GPUs needed, and capacity loaning."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cleave.simulate.fragmentation import fragments, instance_types
from cleave.simulate.nodes import Hosts, HostType, build_hosts
from cleave.simulate.pool import Pool
from cleave.simulate.trace import Trace

MONOLITHIC, DISAGGREGATED = "monolithic", "disaggregated"
MAX_SCALE = 20.0  # fewest_hosts' search: at most 20 times the node list's GPU hosts
RESOLUTION = 1.01  # ... stopped when the bounds are within 1% of each other


@dataclass
class Workload:
    """What one deployment asks the cluster for: one entry per instance."""

    cpu: np.ndarray
    mem: np.ndarray
    gpu: np.ndarray
    density: np.ndarray  # 0: no limit
    key: np.ndarray  # (n, 2): app, role; density counts per key and host
    start: np.ndarray
    end: np.ndarray
    horizon: float
    source: np.ndarray  # the trace row each instance stands for

    def __len__(self) -> int:
        return len(self.cpu)

    def subset(self, keep: np.ndarray) -> Workload:
        kw = {k: getattr(self, k)[keep] for k in self.__dataclass_fields__ if k != "horizon"}
        return Workload(horizon=self.horizon, **kw)


def disaggregated(trace: Trace) -> Workload:
    """CN and HN instances as the trace has them, each placed on its own."""
    return Workload(
        cpu=trace.cpu.copy(),
        mem=trace.mem.copy(),
        gpu=trace.gpu.copy(),
        density=trace.density.copy(),
        key=np.stack([trace.app, trace.role.astype(np.int32)], axis=1),
        start=trace.start.copy(),
        end=trace.end.copy(),
        horizon=trace.horizon,
        source=np.arange(len(trace)),
    )


def monolithic(trace: Trace) -> Workload:
    """One instance per HN: its own request plus an equal share of its app's CN requests alive
    when it arrives (after every event at that time), fixed for its life. CN instances of an
    app that has no HN in the trace stay CPU-only instances."""
    n_apps = len(trace.apps)
    hn = trace.role == 1
    has_hn = np.bincount(trace.app[hn], minlength=n_apps) > 0
    cn_cpu, cn_mem = np.zeros(n_apps), np.zeros(n_apps)
    hn_alive = np.zeros(n_apps)
    # Sweep events by time; at a time, departures and arrivals all apply before HNs are sized.
    times = np.concatenate([trace.start, trace.end])
    sign = np.concatenate([np.ones(len(trace)), -np.ones(len(trace))])
    rows = np.concatenate([np.arange(len(trace))] * 2)
    order = np.lexsort((sign, times))
    cpu, mem = trace.cpu.copy(), trace.mem.copy()
    i = 0
    while i < len(order):
        j = i
        t = times[order[i]]
        while j < len(order) and times[order[j]] == t:
            j += 1
        batch = order[i:j]
        arriving_hn = []
        for e in batch:
            r, s = rows[e], sign[e]
            a = trace.app[r]
            if hn[r]:
                hn_alive[a] += s
                if s > 0:
                    arriving_hn.append(r)
            else:
                cn_cpu[a] += s * trace.cpu[r]
                cn_mem[a] += s * trace.mem[r]
        for r in arriving_hn:
            a = trace.app[r]
            alive = max(hn_alive[a], 1.0)  # 0 only when it also leaves now (a zero-length life)
            cpu[r] += max(cn_cpu[a], 0.0) / alive
            mem[r] += max(cn_mem[a], 0.0) / alive
        i = j
    keep = hn | ~has_hn[trace.app]
    whole = Workload(
        cpu=cpu,
        mem=mem,
        gpu=trace.gpu.copy(),
        density=trace.density.copy(),
        key=np.stack([trace.app, np.zeros(len(trace), dtype=np.int32)], axis=1),
        start=trace.start.copy(),
        end=trace.end.copy(),
        horizon=trace.horizon,
        source=np.arange(len(trace)),
    )
    return whole.subset(keep)


def fits_some_type(work: Workload, types: list[HostType], only_gpu: bool = False) -> np.ndarray:
    """Per instance: whether some host type could hold it alone (density aside)."""
    ok = np.zeros(len(work), dtype=bool)
    for t in types:
        if only_gpu and not t.gpus:
            continue
        ok |= (work.cpu <= t.cpus) & (work.mem <= t.mem) & (work.gpu <= t.gpus)
    return ok


@dataclass
class Replay:
    """One deployment's run: per-sample series and totals."""

    times: np.ndarray
    cpu_fragments: np.ndarray  # fragmented CPUs
    gpu_fragments: np.ndarray
    gpu_fragments_weng: np.ndarray  # CPU-only types count every free GPU (Weng et al.)
    cpu_allocation: np.ndarray  # allocated fraction
    gpu_allocation: np.ndarray
    unplaced_alive: np.ndarray  # alive instances without a host (failed or unplaceable)
    alive: np.ndarray
    instances: int
    failed: int  # no host had room when it arrived
    unplaceable: int  # larger than every host type
    capacity_cpu: float
    capacity_gpu: float
    extra: dict = field(default_factory=dict)


def _events(work: Workload) -> np.ndarray:
    """Row indices, departures coded as -1 - row, in time order (departures first at a tie)."""
    n = len(work)
    times = np.concatenate([work.end, work.start])
    codes = np.concatenate([-1 - np.arange(n), np.arange(n)])
    kinds = np.concatenate([np.zeros(n), np.ones(n)])
    return codes[np.lexsort((kinds, times))], np.sort(times)


def replay(work: Workload, hosts: Hosts, samples: int = 0, stop_on_failure: bool = False):
    """Place and release the workload's instances in time order on `hosts`. With `samples`,
    measure the cluster at that many evenly spaced times. Returns a Replay."""
    live = work.end > work.start  # a zero-length life never holds a host
    work = work.subset(live)
    pool = Pool(hosts)
    placeable = fits_some_type(work, hosts.types_present())
    where = np.full(len(work), -1, dtype=np.int64)
    codes, times = _events(work)
    sample_t = np.linspace(0, work.horizon, samples, endpoint=False) if samples else np.zeros(0)
    series = {k: np.zeros(len(sample_t)) for k in ("cf", "gf", "gw", "ca", "ga", "un", "al")}
    failed = 0
    s = 0
    cpu, mem, gpu, dens = work.cpu, work.mem, work.gpu, work.density
    keys = [tuple(k) for k in work.key.tolist()]

    def measure(k: int, t: float) -> None:
        alive = (work.start <= t) & (work.end > t)
        types, counts = instance_types(cpu[alive], mem[alive], gpu[alive])
        cf, gf, gw = fragments(pool.free_cpu, pool.free_mem, pool.free_gpu, types, counts)
        ca, ga = pool.allocation()
        series["cf"][k], series["gf"][k], series["gw"][k] = cf, gf, gw
        series["ca"][k], series["ga"][k] = ca, ga
        series["al"][k] = alive.sum()
        series["un"][k] = (alive & (where < 0)).sum()

    for code, t in zip(codes.tolist(), times.tolist(), strict=True):
        while s < len(sample_t) and sample_t[s] < t:
            measure(s, sample_t[s])
            s += 1
        if code < 0:
            r = -1 - code
            if where[r] >= 0:
                pool.release(int(where[r]), cpu[r], mem[r], gpu[r], keys[r])
            continue
        if not placeable[code]:
            continue
        host = pool.place(cpu[code], mem[code], gpu[code], keys[code], int(dens[code]))
        if host < 0:
            failed += 1
            if stop_on_failure:
                break
        where[code] = host
    while s < len(sample_t):
        measure(s, sample_t[s])
        s += 1
    return Replay(
        times=sample_t,
        cpu_fragments=series["cf"],
        gpu_fragments=series["gf"],
        gpu_fragments_weng=series["gw"],
        cpu_allocation=series["ca"],
        gpu_allocation=series["ga"],
        unplaced_alive=series["un"],
        alive=series["al"],
        instances=len(work),
        failed=failed,
        unplaceable=int((~placeable).sum()),
        capacity_cpu=float(hosts.cpu.sum()),
        capacity_gpu=float(hosts.gpu.sum()),
    )


def gpu_holding(work: Workload) -> Workload:
    return work.subset(work.gpu > 0)


def fewest_hosts(
    work: Workload, types: list[HostType], max_scale: float = MAX_SCALE
) -> tuple[float, Hosts | None]:
    """The smallest scale of `types` (those with GPUs, counts in proportion) on which every
    instance of `work` that fits one of them is placed at all times: (scale, hosts); (0, None)
    when nothing needs placing; (inf, None) when even `max_scale` times the list is not enough
    (instances that fit only a rare type make a proportional pool huge). Bisection to
    RESOLUTION; placement is a heuristic, so this is the smallest scale found feasible."""
    gpu_types = [t for t in types if t.gpus > 0]
    work = work.subset(fits_some_type(work, gpu_types) & (work.end > work.start))
    if not len(work):
        return 0.0, None

    def ok(scale: float) -> Hosts | None:
        hosts = build_hosts(gpu_types, scale)
        return hosts if replay(work, hosts, stop_on_failure=True).failed == 0 else None

    # No scale below the one whose capacity just covers the peak demand can work.
    peak = peak_demand(work)
    per_scale = [sum(t.count * getattr(t, a) for t in gpu_types) for a in ("cpus", "mem", "gpus")]
    lo = max(p / c for p, c in zip(peak, per_scale, strict=True) if c > 0) * 0.999
    hi = min(lo * 1.25, max_scale)
    found = ok(hi)
    while found is None:
        if hi >= max_scale:
            return float("inf"), None
        lo, hi = hi, min(hi * 2, max_scale)
        found = ok(hi)
    while hi / lo > RESOLUTION:
        mid = (lo + hi) / 2
        hosts = ok(mid)
        if hosts is None:
            lo = mid
        else:
            hi, found = mid, hosts
        if len(found) == len(gpu_types):
            break  # one host of each type: smaller scales give the same cluster
    return hi, found


def fewest_gpus_any_mix(work: Workload, types: list[HostType]) -> int:
    """GPUs of a pool that grows as the trace needs, each new host of the GPU type with the
    fewest GPUs (then cores, then memory) that holds the instance that did not fit: the GPU
    need when the mix is free, not the list's proportions. Hosts are never given back."""
    gpu_types = [t for t in types if t.gpus > 0]
    work = work.subset(fits_some_type(work, gpu_types) & (work.end > work.start))
    empty = np.zeros(0)
    pool = Pool(Hosts(empty, empty, empty, np.zeros(0, dtype=np.int32), gpu_types))
    cheapest = sorted(
        range(len(gpu_types)),
        key=lambda i: (gpu_types[i].gpus, gpu_types[i].cpus, gpu_types[i].mem),
    )
    codes, _ = _events(work)
    where = np.full(len(work), -1, dtype=np.int64)
    keys = [tuple(k) for k in work.key.tolist()]
    for code in codes.tolist():
        if code < 0:
            r = -1 - code
            if where[r] >= 0:
                pool.release(int(where[r]), work.cpu[r], work.mem[r], work.gpu[r], keys[r])
            continue
        args = (work.cpu[code], work.mem[code], work.gpu[code], keys[code], int(work.density[code]))
        host = pool.place(*args)
        if host < 0:  # fits_some_type kept only instances some type holds
            cpu, mem, gpu = args[:3]
            t = next(
                i
                for i in cheapest
                if cpu <= gpu_types[i].cpus and mem <= gpu_types[i].mem and gpu <= gpu_types[i].gpus
            )
            pool.add_host(t)
            host = pool.place(*args)
        where[code] = host
    return int(pool.hosts.gpu.sum())


def peak_demand(work: Workload) -> np.ndarray:
    """The peak over time of the alive instances' total (CPUs, memory, GPUs)."""
    live = work.subset(work.end > work.start)
    codes, _ = _events(live)
    rows = np.where(codes < 0, -1 - codes, codes)
    sign = np.where(codes < 0, -1.0, 1.0)[:, None]
    demand = np.stack([live.cpu, live.mem, live.gpu], axis=1)[rows] * sign
    return np.cumsum(demand, axis=0).max(axis=0) if len(rows) else np.zeros(3)


def percentile_alive(work: Workload, percentile: float) -> float:
    """The `percentile` of the count of alive instances, weighted by time."""
    codes, times = _events(work.subset(work.end > work.start))
    steps = np.cumsum(np.where(codes < 0, -1, 1))
    durations = np.diff(np.append(times, work.horizon))
    order = np.argsort(steps, kind="stable")
    weight = np.cumsum(durations[order])
    if not len(weight) or weight[-1] <= 0:
        return 0.0
    k = np.searchsorted(weight, percentile / 100 * weight[-1])
    return float(steps[order][min(k, len(order) - 1)])


def split_for_loaning(work: Workload, limit: float) -> np.ndarray:
    """Per instance: True if it runs on the dedicated pool, False if on borrowed hosts. In
    arrival order, an instance is dedicated while fewer than `limit` dedicated ones are alive."""
    work_live = work.end > work.start
    codes, _ = _events(work)
    dedicated = np.zeros(len(work), dtype=bool)
    alive = 0
    for code in codes.tolist():
        if code < 0:
            r = -1 - code
            if dedicated[r]:
                alive -= 1
        elif work_live[code] and alive < limit:
            dedicated[code] = True
            alive += 1
    return dedicated
