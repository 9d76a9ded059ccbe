"""`cleave bench serve --overload` and `--soak MINUTES`: how a deployment behaves past its
capacity and over time.

Overload: Poisson load at 40% of the capacity, a burst at 3× it, then 40% again, with a 2 s
client timeout. Reported per second and per phase: answers by status, client timeouts, and
the latency of the 200s; the burst's 200s per second against the capacity; and how long after
the burst the deployment answered every request 200 again. Optionally many idle connections
are held open during the run (they must not slow valid requests), and afterwards the bench
waits for the router's idle timeout to close them.

Soak: a constant load for MINUTES while the resident memory and open files of every process
of the deployment are sampled; after a warm-up, each process's RSS must stay flat.
"""

from __future__ import annotations

import asyncio
import os
import resource
import threading
import time
from pathlib import Path

import numpy as np

PHASES = (("before", 0.4), ("burst", 3.0), ("after", 0.4))
CLIENT_TIMEOUT_S = 2.0


def run(targets: dict, workload, result: dict, args, log) -> int:
    """`cleave bench serve --overload` or `--soak` on its one deployment: measure, print, write."""
    from cleave.bench.harness.summary import write_outputs
    from cleave.bench.plot import plot_stress

    ((name, target),) = targets.items()
    log(f"{name}:")
    with target:
        report = (overload if args.overload else soak)(target, workload, args, log)
    result["benchmark"] = "serve-overload" if args.overload else "serve-soak"
    result["deployments"][name] = report
    (print_overload if args.overload else print_soak)(report)
    write_outputs(result, args, plot_stress, log)
    return 0


def capacity_of(target, workload, args, log) -> float:
    """The highest rate whose p99 stays within --budget-ms (the serving search), unless given."""
    if args.capacity:
        return float(args.capacity)
    from cleave.bench.harness.measurement import measure

    log("  measuring capacity (the highest rate within the budget):")
    deployment = measure(target, workload, args, log, single=False, find_max=True)
    return deployment["max_rate_within_budget"]


def timeline(samples, duration_s: float) -> list[dict]:
    """Answers per second of scheduled send time: counts by outcome, p99 of the 200s."""
    seconds = []
    for second in range(int(np.ceil(duration_s))):
        inside = [s for s in samples if second <= s.scheduled_s < second + 1]
        counts: dict[str, int] = {}
        for s in inside:
            key = "200" if not s.error else s.error.removeprefix("http_")
            counts[key] = counts.get(key, 0) + 1
        ok = [s.latency_s * 1e3 for s in inside if not s.error]
        seconds.append(
            {
                "t": second,
                "sent": len(inside),
                "counts": counts,
                "p99_ms": float(np.percentile(ok, 99)) if ok else None,
            }
        )
    return seconds


def overload(target, workload, args, log) -> dict:
    from cleave.bench.harness.summary import summarize
    from cleave.bench.loadgen import open_loop_phases

    capacity = capacity_of(target, workload, args, log)
    if capacity <= 0:
        raise RuntimeError("capacity measured as 0 requests/s: nothing to overload")
    phases = [(name, factor * capacity, args.duration) for name, factor in PHASES]
    idle = IdleConnections(target.url, args.idle_connections) if args.idle_connections else None
    log(
        f"  overload: {', '.join(f'{n} {r:.0f}/s for {d:g} s' for n, r, d in phases)}"
        + (f", {args.idle_connections} idle connections open" if idle else "")
    )
    try:
        if idle:
            idle.open()
        samples = open_loop_phases(
            target.infer_url(workload),
            workload.bodies,
            [(rate, duration) for _, rate, duration in phases],
            timeout_s=CLIENT_TIMEOUT_S,
            replies=False,
        )
        idle_report = idle.wait_closed(args.idle_wait_s) if idle else None
    finally:
        if idle:
            idle.close()
    result: dict = {"capacity_rps": capacity, "client_timeout_s": CLIENT_TIMEOUT_S, "phases": {}}
    start = 0.0
    for name, rate, duration in phases:
        inside = [s for s in samples if start <= s.scheduled_s < start + duration]
        summary = summarize(inside, duration, args.budget_ms)
        summary["rate"] = rate
        summary["ok_over_capacity"] = summary["throughput_rps"] / capacity
        result["phases"][name] = summary
        start += duration
    burst_end = 2 * args.duration
    late = [s for s in samples if s.scheduled_s >= burst_end and s.error]
    result["every_200_after_burst_s"] = (
        max(s.scheduled_s for s in late) - burst_end if late else 0.0
    )
    result["errors_5xx_other"] = sum(
        1 for s in samples if s.error.startswith("http_5") and s.error not in ("http_503",)
    )
    result["client_timeouts"] = sum(1 for s in samples if s.error == "timeout")
    result["timeline"] = timeline(samples, 3 * args.duration)
    if idle_report:
        result["idle_connections"] = idle_report
    return result


def print_overload(result: dict) -> None:
    print(f"capacity {result['capacity_rps']:.1f}/s, client timeout {result['client_timeout_s']} s")
    print(
        f"{'phase':<8} {'rate/s':>8} {'200/s':>8} {'/cap':>6} {'p50 ms':>8} {'p99 ms':>8}  errors"
    )
    for name, p in result["phases"].items():
        p50 = f"{p['p50_ms']:8.1f}" if p["p50_ms"] is not None else f"{'-':>8}"
        p99 = f"{p['p99_ms']:8.1f}" if p["p99_ms"] is not None else f"{'-':>8}"
        print(
            f"{name:<8} {p['rate']:8.1f} {p['throughput_rps']:8.1f} "
            f"{p['ok_over_capacity']:6.2f} {p50} {p99}  {p['errors'] or ''}"
        )
    print(
        f"5xx other than 503: {result['errors_5xx_other']}, client timeouts: "
        f"{result['client_timeouts']}, every answer 200 from "
        f"{result['every_200_after_burst_s']:.1f} s after the burst"
    )
    if "idle_connections" in result:
        i = result["idle_connections"]
        print(
            f"idle connections: {i['opened']} opened, {i['closed_by_server']} closed by the "
            f"server within {i['waited_s']:.0f} s"
        )


class IdleConnections:
    """Many TCP connections to the router that never send a byte, held on a thread of their
    own while the load runs."""

    def __init__(self, url: str, count: int):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port, self.count = host, int(port), count
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.streams: list = []
        self.opened_at = 0.0

    def open(self) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < self.count + 1024:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, self.count + 1024), hard))
        self.thread.start()
        self.streams = self._run(self._open(), timeout=120)
        self.opened_at = time.monotonic()

    async def _open(self):
        streams = []
        for _ in range(self.count):
            streams.append(await asyncio.open_connection(self.host, self.port))
        return streams

    def wait_closed(self, wait_s: float) -> dict:
        """Waits until the server closed every idle connection, or `wait_s` after opening."""
        closed = self._run(self._count_closed(self.opened_at + wait_s), timeout=wait_s + 60)
        return {
            "opened": len(self.streams),
            "closed_by_server": closed,
            "waited_s": time.monotonic() - self.opened_at,
        }

    async def _count_closed(self, until: float) -> int:
        async def eof(reader) -> bool:
            try:
                left = max(0.0, until - time.monotonic())
                return await asyncio.wait_for(reader.read(1), left) == b""
            except (asyncio.TimeoutError, ConnectionError):
                return False

        results = await asyncio.gather(*(eof(r) for r, _ in self.streams))
        return sum(results)

    def close(self) -> None:
        async def close_all():
            for _, writer in self.streams:
                writer.close()

        if self.thread.is_alive():
            self._run(close_all(), timeout=60)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


# -- soak ----------------------------------------------------------------------------------


def process_tree(pid: int) -> dict[int, str]:
    """`pid` and its descendants, each with a short name from its command line."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        names[int(entry.name)] = _role(argv)
    tree, frontier = {pid: names.get(pid, "serve")}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, p in parents.items():
            if p == parent and child not in tree:
                tree[child] = names[child]
                frontier.append(child)
    return tree


def _role(argv: list[str]) -> str:
    line = " ".join(argv)
    if argv and Path(argv[0]).name == "cleave-router":
        return "router"
    for arg in argv:
        stem = Path(arg).stem
        if stem.startswith(("shard-", "ranker-")):
            return stem
    if " serve " in f" {line} ":
        return "serve"
    return Path(argv[0]).name if argv and argv[0] else "?"


def sample_process(pid: int) -> tuple[int, int] | None:
    """(RSS bytes, open files) of a process, None once it is gone."""
    try:
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError, IndexError):
        return None
    return rss_pages * os.sysconf("SC_PAGE_SIZE"), fds


class MemorySampler:
    """Samples RSS and open files of a process tree every `every_s` on a thread of its own."""

    def __init__(self, pid: int | None, every_s: float = 5.0):
        self.pid, self.every_s = pid, every_s
        self.series: dict[str, dict] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.start = time.monotonic()

    def __enter__(self) -> MemorySampler:
        if self.pid:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(30)

    def _run(self) -> None:
        while True:
            now = time.monotonic() - self.start
            for p, name in process_tree(self.pid).items():
                got = sample_process(p)
                if got:
                    entry = self.series.setdefault(f"{name} ({p})", {"t": [], "rss": [], "fds": []})
                    entry["t"].append(round(now, 1))
                    entry["rss"].append(got[0])
                    entry["fds"].append(got[1])
            if self.stop.wait(self.every_s):
                return


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
    """After the first `warmup` share of the samples: the largest RSS deviation from their
    median, in percent, and the range of open files."""
    n = len(entry["rss"])
    rest = entry["rss"][int(n * warmup) :] or entry["rss"]
    median = float(np.median(rest))
    fds = entry["fds"][int(n * warmup) :] or entry["fds"]
    return {
        **entry,
        "rss_median_mib": median / 2**20,
        "rss_max_dev_pct": 100 * max(abs(r - median) for r in rest) / median if median else None,
        "fds_min": min(fds),
        "fds_max": max(fds),
    }


def print_soak(result: dict) -> None:
    print(f"soak: {result['rate']:.1f}/s for {result['minutes']:g} min, {result['errors']} errors")
    print(f"{'process':<24} {'RSS MiB':>8} {'max dev %':>10} {'files':>9}")
    for name, p in result["processes"].items():
        dev = f"{p['rss_max_dev_pct']:10.2f}" if p["rss_max_dev_pct"] is not None else "-"
        print(f"{name:<24} {p['rss_median_mib']:8.1f} {dev} {p['fds_min']:4d}-{p['fds_max']:<4d}")
