"""`cleave bench serve --soak MINUTES`: a constant load at 40% of the capacity for MINUTES
while the resident memory and open files of every process of the deployment are sampled;
after a warm-up, each process's RSS must stay flat. Its private (anonymous) memory is
sampled too: on `transport = "shm"` RSS also grows as a process first touches pages of the
fixed-size shared regions, which is not a leak. Neither tells a leak from pages an allocator
keeps for reuse: the (first) router's live heap bytes, from its `/metrics`, do."""

from __future__ import annotations

import time

import numpy as np

from cleave.bench.harness.processes import Sampler, process_tree, sample_process
from cleave.bench.overload import CLIENT_TIMEOUT_S, capacity_of
from cleave.bench.stages import gauge


class MemorySampler(Sampler):
    """Samples RSS and open files of a process tree every `every_s`, and the live heap bytes
    of the router at `router_url` when given."""

    def __init__(self, pid: int | None, router_url: str = "", every_s: float = 5.0):
        super().__init__(pid, every_s)
        self.series: dict[str, dict] = {}
        self.router_url = router_url
        self.heap: dict[str, list] = {"t": [], "live": []}

    def sample(self, now: float) -> bool:
        for p, name in process_tree(self.pid).items():
            got = sample_process(p)
            if got:
                entry = self.series.setdefault(
                    f"{name} ({p})", {"t": [], "rss": [], "private": [], "fds": []}
                )
                entry["t"].append(round(now, 1))
                entry["rss"].append(got.rss)
                entry["private"].append(got.private)
                entry["fds"].append(got.fds)
        if self.router_url:
            try:
                live = gauge(f"{self.router_url}/metrics", "cleave_router_heap_live_bytes")
            except OSError:  # a soak is not stopped by its own probe
                live = None
            if live is not None:
                self.heap["t"].append(round(now, 1))
                self.heap["live"].append(int(live))
        return True


def soak(target, workload, args, log) -> dict:
    from cleave.bench.harness.summary import summarize
    from cleave.bench.loadgen import open_loop

    capacity = capacity_of(target, workload, args, log)
    rate = 0.4 * capacity
    minutes = args.soak
    window_s = 60.0 if minutes >= 2 else 15.0
    windows = []
    log(f"  soak: {rate:.1f}/s (40% of {capacity:.1f}/s) for {minutes:g} min")
    pid = target.server.proc.pid if target.server else None  # none for --url
    end = time.monotonic() + minutes * 60
    with MemorySampler(pid, target.url) as sampler:
        while (duration := min(window_s, end - time.monotonic())) >= 1.0:
            samples = open_loop(
                target.infer_url(workload),
                workload.bodies,
                rate,
                duration,
                timeout_s=CLIENT_TIMEOUT_S,
                seed=len(windows),
            )
            point = summarize(samples, duration, args.budget_ms)
            windows.append(point)
            log(
                f"    {len(windows):3d}: {point['throughput_rps']:.1f}/s ok, p99 "
                f"{point['p99_ms'] or 0:.1f} ms, errors {point['errors'] or 0}"
            )
    return {
        "capacity_rps": capacity,
        "rate": rate,
        "minutes": minutes,
        "windows": windows,
        "errors": sum(sum(w["errors"].values()) for w in windows),
        "processes": {name: flatness(entry) for name, entry in sampler.series.items()},
        "router_heap": heap_flatness(sampler.heap),
    }


def flatness(entry: dict, warmup: float = 0.2) -> dict:
    """After the first `warmup` share of the samples: the median of RSS and of private
    memory and their largest deviation from it, in percent, and the range of open files."""
    start = int(len(entry["rss"]) * warmup)
    fds = entry["fds"][start:] or entry["fds"]
    out = {**entry, "fds_min": min(fds), "fds_max": max(fds)}
    for key in ("rss", "private"):
        out[f"{key}_median_mib"], out[f"{key}_max_dev_pct"] = _flat(entry[key], start)
    return out


def heap_flatness(heap: dict, warmup: float = 0.2) -> dict | None:
    """The router's live heap as `flatness` reads memory, and its median per tenth of the run
    (None: the router does not report it)."""
    live = heap["live"]
    if not live:
        return None
    median_mib, max_dev_pct = _flat(live, int(len(live) * warmup))
    tenths = [live[i * len(live) // 10 : (i + 1) * len(live) // 10] for i in range(10)]
    return {
        **heap,
        "median_mib": median_mib,
        "max_dev_pct": max_dev_pct,
        "tenths_mib": [float(np.median(t)) / 2**20 for t in tenths if t],
    }


def _flat(values: list, start: int) -> tuple[float, float | None]:
    """The median (MiB) of `values[start:]` and its largest deviation from it, in percent."""
    rest = values[start:] or values
    median = float(np.median(rest))
    return median / 2**20, 100 * max(abs(r - median) for r in rest) / median if median else None


def print_soak(result: dict) -> None:
    print(f"soak: {result['rate']:.1f}/s for {result['minutes']:g} min, {result['errors']} errors")
    print(
        f"{'process':<24} {'RSS MiB':>8} {'max dev %':>10} {'private MiB':>12} {'max dev %':>10}"
        f" {'files':>9}"
    )
    for name, p in result["processes"].items():
        dev = {
            k: f"{p[k]:10.2f}" if p[k] is not None else f"{'-':>10}"
            for k in ("rss_max_dev_pct", "private_max_dev_pct")
        }
        print(
            f"{name:<24} {p['rss_median_mib']:8.1f} {dev['rss_max_dev_pct']} "
            f"{p['private_median_mib']:12.1f} {dev['private_max_dev_pct']} "
            f"{p['fds_min']:4d}-{p['fds_max']:<4d}"
        )
    heap = result.get("router_heap")
    if heap:
        tenths = " ".join(f"{m:.2f}" for m in heap["tenths_mib"])
        print(
            f"router live heap: median {heap['median_mib']:.2f} MiB, max dev "
            f"{heap['max_dev_pct']:.2f}% (per tenth of the run: {tenths} MiB)"
        )
