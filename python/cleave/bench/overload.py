"""`cleave bench serve --overload`: how a deployment behaves past its capacity.

Capacity C is what it answers closed loop: 8 clients, each sending its next request when its
last one answered, no budget (unless --capacity gives it). Then, for each burst factor X
(--bursts, default 1.5, 3 and 10): Poisson load at 0.4 C, X·C, then 0.4 C again, --duration
seconds each, with a 2 s client timeout. Reported per burst: the 200s within the budget per
second against C (goodput / C), work admitted that then expired (the router's counters),
refusals, connection resets and client timeouts, how long after the burst every request was
answered 200 again, and the router's CPU per refusal.

The server and the load generator are pinned to separate cores (--pin, default all but the
last core for the server, the last for the client) so that sending the excess does not come
out of the server's cores. Optionally many idle connections are held open during the run
(they must not slow valid requests), and afterwards the bench waits for the router's idle
timeout to close them.
"""

from __future__ import annotations

import asyncio
import resource
import threading
import time
from collections import Counter

import numpy as np

from cleave.bench.harness.processes import Sampler, cpu_seconds, process_tree

# Relative to the burst: 0.4 C before and after it.
QUIET = 0.4
CLIENT_TIMEOUT_S = 2.0
CAPACITY_CLIENTS = 8


def capacity_of(target, workload, args, log) -> float:
    """Requests/s answered 200 by `CAPACITY_CLIENTS` closed-loop clients for --duration
    seconds (after as long a warm-up), with no budget, unless --capacity gives it."""
    if args.capacity:
        return float(args.capacity)
    from cleave.bench.loadgen import closed_loop_spread

    urls = target.infer_urls(workload)  # a plan's routers share the clients
    log(f"  capacity: {CAPACITY_CLIENTS} closed-loop clients, {args.duration:g} s")
    bodies = workload.unbudgeted
    closed_loop_spread(urls, bodies, CAPACITY_CLIENTS, args.duration, CLIENT_TIMEOUT_S)
    samples = closed_loop_spread(urls, bodies, CAPACITY_CLIENTS, args.duration, CLIENT_TIMEOUT_S)
    ok = sum(1 for s in samples if not s.error)
    log(f"  capacity C = {ok / args.duration:.1f}/s ({len(samples) - ok} errors)")
    return ok / args.duration


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
    capacity = capacity_of(target, workload, args, log)
    if capacity <= 0:
        raise RuntimeError("capacity measured as 0 requests/s: nothing to overload")
    budget_ms = workload.sent_budget_ms or router_budget_ms()
    idle = IdleConnections(target.url, args.idle_connections) if args.idle_connections else None
    result: dict = {
        "capacity_rps": capacity,
        "capacity_clients": None if args.capacity else CAPACITY_CLIENTS,
        "budget_ms": budget_ms,
        "client_timeout_s": CLIENT_TIMEOUT_S,
        "generator": args.generator,
        "bursts": {},
    }
    try:
        if idle:
            idle.open()
        for factor in args.burst_list:
            result["bursts"][f"{factor:g}"] = burst(
                target, workload, args, log, capacity, factor, budget_ms
            )
        if idle:
            result["idle_connections"] = idle.wait_closed(args.idle_wait_s)
    finally:
        if idle:
            idle.close()
    return result


def router_budget_ms() -> float:
    """The budget of a request that names none: the router's default."""
    from cleave.settings import RouterConfig

    return RouterConfig().budget_ms


def burst(target, workload, args, log, capacity: float, factor: float, budget_ms: float) -> dict:
    """0.4 C, `factor`·C, 0.4 C for --duration seconds each, in one open-loop run."""
    from cleave.bench import vegeta
    from cleave.bench.harness.summary import summarize
    from cleave.bench.loadgen import open_loop_phases_spread
    from cleave.bench.stages import admission_counts, scrape, shed_reasons

    d = args.duration
    phases = [("before", QUIET), ("burst", factor), ("after", QUIET)]
    log(f"  {factor:g}x burst: " + ", ".join(f"{n} {f * capacity:.0f}/s" for n, f in phases))
    before = scrape(target.endpoints)
    urls, rates = target.infer_urls(workload), [(f * capacity, d) for _, f in phases]
    with RouterCpu(target) as cpu, Boundaries(target.endpoints, [d, 2 * d]) as marks:
        if args.generator == "vegeta":
            samples = vegeta.open_loop_phases(urls, workload.bodies, rates, CLIENT_TIMEOUT_S)
        else:  # the rate split evenly over a plan's routers
            samples = open_loop_phases_spread(
                urls, workload.bodies, rates, timeout_s=CLIENT_TIMEOUT_S, replies=False
            )
    after = scrape(target.endpoints)
    counts = admission_counts(before, after)
    report: dict = {"factor": factor, "phases": {}, **counts}
    ends = [before, *marks.taken, after]
    for i, (name, f) in enumerate(phases):
        inside = [s for s in samples if i * d <= s.scheduled_s < (i + 1) * d]
        summary = summarize(inside, d, budget_ms)
        summary["rate"] = f * capacity
        summary["goodput_over_capacity"] = summary["goodput_rps"] / capacity
        summary["router_cpu_s"] = cpu.between(i * d, (i + 1) * d)
        # By the routers' clocks: a request sent just before a boundary and refused just
        # after it counts in the next phase. None: a boundary's scrape was missed.
        whole = len(ends) == len(phases) + 1
        summary["shed_by_reason"] = shed_reasons(ends[i], ends[i + 1]) if whole else None
        report["phases"][name] = summary
    admitted = counts.get("admitted")
    report["expired_after_admission_pct"] = (
        100 * counts["expired_after_admission"] / admitted if admitted else None
    )
    late = [s for s in samples if s.scheduled_s >= 2 * d and s.error]
    report["every_200_after_burst_s"] = max(s.scheduled_s for s in late) - 2 * d if late else 0.0
    report["connection_errors"] = sum(1 for s in samples if s.error == "connection")
    # What the client saw (a reset, a refused connect, a closed socket): the count alone
    # cannot tell a server's fault from the client's.
    why = Counter(s.detail for s in samples if s.error == "connection")
    report["connection_error_details"] = dict(why.most_common(5))
    report["client_timeouts"] = sum(1 for s in samples if s.error == "timeout")
    report["router_cpu_us_per_refusal"] = cpu_per_refusal(report["phases"])
    report["timeline"] = timeline(samples, 3 * d)
    p = report["phases"]["burst"]
    log(
        f"    burst: {p['goodput_over_capacity']:.2f} C within {budget_ms:g} ms, errors "
        f"{p['errors'] or 0}; every 200 from {report['every_200_after_burst_s']:.1f} s after"
    )
    return report


def cpu_per_refusal(phases: dict) -> float | None:
    """The router's CPU µs per refused request: the quiet phase gives its CPU per answered
    request; what the burst spent beyond that many answers, over the burst's refusals."""
    quiet, peak = phases["before"], phases["burst"]
    answered = quiet["sent"] - quiet["errors"].get("http_503", 0)
    refused = peak["errors"].get("http_503", 0)
    if not answered or not refused or quiet["router_cpu_s"] is None or peak["router_cpu_s"] is None:
        return None
    per_answer = quiet["router_cpu_s"] / answered
    admitted = peak["sent"] - refused
    return max(0.0, peak["router_cpu_s"] - per_answer * admitted) / refused * 1e6


class Boundaries:
    """The routers' metrics scraped at each of `at` (seconds into a run: the phases'
    boundaries), on a thread of its own while the run goes on; `taken` has one scrape per
    boundary reached."""

    def __init__(self, endpoints: dict[str, str], at: list[float]):
        self.endpoints, self.at = endpoints, at
        self.taken: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Boundaries:
        self.start = time.monotonic() + 0.05  # the load generator starts 50 ms after its call
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)

    def _run(self) -> None:
        from cleave.bench.stages import scrape

        for t in self.at:
            if self.stop.wait(max(0.0, self.start + t - time.monotonic())):
                return  # the run ended first
            self.taken.append(scrape(self.endpoints))


def router_pids(root: int) -> list[int]:
    """The router processes under `root`: `router`, or a plan's `router-0`, `router-1`, ..."""
    return [
        pid
        for pid, role in process_tree(root).items()
        if role == "router" or role.startswith("router-")
    ]


class RouterCpu(Sampler):
    """The routers' CPU time (a plan's routers together), sampled every 0.1 s while a run
    goes on; `between(a, b)` is the CPU seconds spent between a and b seconds into it."""

    def __init__(self, target):
        root = target.server.proc.pid if target.server else None
        self.pids = router_pids(root) if root else []
        super().__init__(self.pids[0] if self.pids else None, every_s=0.1)
        self.points: list[tuple[float, float]] = []

    def __enter__(self) -> RouterCpu:
        self.start = time.monotonic() + 0.05  # the load generator starts 50 ms after its call
        return super().__enter__()

    def sample(self, now: float) -> bool:
        used = [cpu_seconds(pid) for pid in self.pids]
        if None in used:  # a router gone: the sum would drop
            return False
        self.points.append((now, sum(used)))
        return True

    def between(self, a: float, b: float) -> float | None:
        if len(self.points) < 2:
            return None
        t, used = zip(*self.points, strict=True)
        return float(np.interp(b, t, used) - np.interp(a, t, used))


def print_overload(result: dict) -> None:
    clients = result["capacity_clients"]
    how = f"{clients} closed-loop clients" if clients else "given"
    print(
        f"capacity C {result['capacity_rps']:.1f}/s ({how}); goodput within "
        f"{result['budget_ms']:g} ms; client timeout {result['client_timeout_s']} s; "
        f"bursts sent by {result['generator']}; dense dtype served "
        f"{result.get('dense_dtype_served') or 'unknown'}"
    )
    print(
        f"{'burst':>5} {'phase':<7} {'rate/s':>8} {'good/s':>8} {'/C':>5} {'p50 ms':>8} "
        f"{'p99 ms':>8}  errors"
    )
    for factor, b in result["bursts"].items():
        for name, p in b["phases"].items():
            p50 = f"{p['p50_ms']:8.1f}" if p["p50_ms"] is not None else f"{'-':>8}"
            p99 = f"{p['p99_ms']:8.1f}" if p["p99_ms"] is not None else f"{'-':>8}"
            why = ", ".join(f"{r} {n}" for r, n in (p.get("shed_by_reason") or {}).items())
            print(
                f"{factor + 'x':>5} {name:<7} {p['rate']:8.1f} {p['goodput_rps']:8.1f} "
                f"{p['goodput_over_capacity']:5.2f} {p50} {p99}  {p['errors'] or ''}"
                + (f" (shed: {why})" if why else "")
            )
        wasted = b["expired_after_admission_pct"]
        cpu = b["router_cpu_us_per_refusal"]
        print(
            f"{factor + 'x':>5} expired after admission: "
            f"{'-' if wasted is None else f'{wasted:.2f}%'}, connection errors: "
            f"{b['connection_errors']}, client timeouts: {b['client_timeouts']}, every answer "
            f"200 from {b['every_200_after_burst_s']:.1f} s after the burst, router CPU per "
            f"refusal: {'-' if cpu is None else f'{cpu:.0f} µs'}"
        )
        for detail, count in b.get("connection_error_details", {}).items():
            print(f"{'':>5} {count} x connection error: {detail}")
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
