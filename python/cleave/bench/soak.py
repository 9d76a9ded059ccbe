"""`cleave bench serve --soak MINUTES`: a constant load at 40% of the capacity for MINUTES
while the resident memory and open files of every process of the deployment are sampled;
after a warm-up, each process's RSS must stay flat. Its private (anonymous) memory is
sampled too: on `transport = "shm"` RSS also grows as a process first touches pages of the
fixed-size shared regions, which is not a leak."""

from __future__ import annotations

import time

import numpy as np

from cleave.bench.harness.processes import Sampler, process_tree, sample_process
from cleave.bench.overload import CLIENT_TIMEOUT_S, capacity_of


class MemorySampler(Sampler):
    """Samples RSS and open files of a process tree every `every_s`."""

    def __init__(self, pid: int | None, every_s: float = 5.0):
        super().__init__(pid, every_s)
        self.series: dict[str, dict] = {}

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
    with MemorySampler(pid) as sampler:
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
    }


def flatness(entry: dict, warmup: float = 0.2) -> dict:
    """After the first `warmup` share of the samples: the median of RSS and of private
    memory and their largest deviation from it, in percent, and the range of open files."""
    start = int(len(entry["rss"]) * warmup)
    fds = entry["fds"][start:] or entry["fds"]
    out = {**entry, "fds_min": min(fds), "fds_max": max(fds)}
    for key in ("rss", "private"):
        rest = entry[key][start:] or entry[key]
        median = float(np.median(rest))
        out[f"{key}_median_mib"] = median / 2**20
        out[f"{key}_max_dev_pct"] = (
            100 * max(abs(r - median) for r in rest) / median if median else None
        )
    return out


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
