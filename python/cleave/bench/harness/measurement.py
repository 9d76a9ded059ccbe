"""How a deployment is measured: single requests (one at a time), open-loop probes at each
offered rate, and the search for the highest rate within the latency budget. Every request
goes through the one client, cleave.bench.loadgen."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cleave.bench.harness.summary import ms, summarize, within_budget

if TYPE_CHECKING:
    from cleave.bench.harness.target import Target
    from cleave.bench.harness.workload import Workload


def paired_single(targets: dict[str, Target], workload: Workload, args, log) -> dict:
    """Single-request latency of several running deployments, measured in alternating rounds
    (one request at a time, never overlapping), so drifting load on a shared machine hits
    them alike. Returns each deployment's summary plus the per-round p50s."""
    import numpy as np

    from cleave.bench.loadgen import sequential

    rounds = 10
    per_round = max(1, args.single // rounds)
    samples: dict[str, list] = {name: [] for name in targets}
    p50s: dict[str, list] = {name: [] for name in targets}
    for target in targets.values():  # warm-up
        sequential(target.infer_url(workload), target.bodies(workload), min(20, args.single))
    for _ in range(rounds):
        for name, target in targets.items():
            check = target.checker(workload) if args.check else None
            bodies = target.bodies(workload)
            got = sequential(target.infer_url(workload), bodies, per_round, check=check)
            samples[name].extend(got)
            ok = [s.latency_s * 1e3 for s in got if not s.error]
            p50s[name].append(float(np.median(ok)) if ok else None)
    result = {}
    for name in targets:
        result[name] = {**summarize(samples[name], 1.0, args.budget_ms), "round_p50_ms": p50s[name]}
        s = result[name]
        log(f"  {name} single request: p50 {ms(s['p50_ms'])} ms  p99 {ms(s['p99_ms'])} ms")
    return result


def measure(
    target: Target, workload: Workload, args, log, single: bool = True, find_max: bool | None = None
) -> dict:
    """Single-request latency (unless measured elsewhere), then each rate of the sweep, and the
    search for the highest rate within budget (--search, unless `find_max` says). A deployment
    that missed its budget is restarted before the next probe, so no probe inherits another's
    backlog (or a wedged connection: see docs/benchmarks.md, "Serving"); after the last one it
    is not (its caller stops it)."""
    from cleave.bench.loadgen import open_loop_spread, sequential
    from cleave.bench.stages import breakdown, scrape

    def infer() -> str:
        return target.infer_url(workload)

    def warm_up() -> None:  # every router: each has its own connections to open
        for url in target.infer_urls(workload):
            sequential(url, bodies, min(20, args.single), check=None)

    bodies = target.bodies(workload)
    check = target.checker(workload) if args.check else None
    warm_up()
    result: dict = {"rates": []}
    if single:
        samples = sequential(infer(), bodies, args.single, check=check)
        result["single"] = summarize(samples, 1.0, args.budget_ms)
        s = result["single"]
        log(f"  single request: p50 {ms(s['p50_ms'])} ms  p99 {ms(s['p99_ms'])} ms")

    missed = False  # the last probe missed its budget: restart before the next

    def probe(rate: float) -> dict:
        nonlocal missed
        for point in result["rates"]:  # the search may come back to a rate of the sweep
            if point["rate"] == rate:
                return point
        if missed:
            target.restart()
            warm_up()
        before, cpu = scrape(target.endpoints, target.links), target.cpu_seconds()
        urls = target.infer_urls(workload)
        samples = open_loop_spread(urls, bodies, rate, args.duration, seed=int(rate), check=check)
        cpu_after, after = target.cpu_seconds(), scrape(target.endpoints, target.links)
        metrics = breakdown(before, after)
        point = {"rate": rate, **summarize(samples, args.duration, args.budget_ms)}
        if cpu_after and point["ok"]:  # every process of the deployment, per request answered
            used = {role: cpu_after[role] - cpu.get(role, 0.0) for role in cpu_after}
            point["cpu_ms_per_request"] = 1e3 * sum(used.values()) / point["ok"]
            point["cpu_ms_by_role"] = {r: 1e3 * u / point["ok"] for r, u in sorted(used.items())}
        if len(urls) > 1:  # what the client sent each router, and what each one counted
            point["sent_by_router"] = [
                sum(s.router == i for s in samples) for i in range(len(urls))
            ]
            metrics["requests_by_router"] = router_requests(before, after)
        point["metrics"] = metrics
        point["within_budget"] = within_budget(point, args.budget_ms, args.max_error_pct)
        result["rates"].append(point)
        log(
            f"  {rate:8.1f}/s: {point['throughput_rps']:8.1f}/s ok, p50 "
            f"{ms(point['p50_ms'])} ms, p99 {ms(point['p99_ms'])} ms, errors {point['errors']}"
        )
        missed = not point["within_budget"] and target.restartable
        return point

    for rate in args.rate_list:
        probe(rate)
    if args.search if find_max is None else find_max:
        result["max_rate_within_budget"] = search_max_rate(probe, args)
    else:
        good = [p["rate"] for p in result["rates"] if p["within_budget"]]
        result["max_rate_within_budget"] = max(good) if good else 0.0
    # Bad gateway: a role failed the router. Past capacity only 503s and 504s should come.
    result["http_502"] = sum(
        p["errors"].get("http_502", 0) for p in [result.get("single", {}), *result["rates"]] if p
    )
    return result


def router_requests(before: dict, after: dict) -> dict[str, float]:
    """Requests each router counted between two scrapes (its `total` stage histogram)."""
    key = "router.total.count"
    return {
        role: values[key] - before.get(role, {}).get(key, 0.0)
        for role, values in after.items()
        if key in values
    }


def search_max_rate(probe, args) -> float:
    """Doubles the rate until a probe misses the budget, then bisects three times."""
    lo, hi = 0.0, None
    rate = min(args.rate_list) if args.rate_list else 25.0
    while hi is None and rate <= 100_000:
        if probe(rate)["within_budget"]:
            lo, rate = rate, rate * 2
        else:
            hi = rate
    for _ in range(3):
        if hi is None:
            break
        mid = round((lo + hi) / 2, 1)
        if probe(mid)["within_budget"]:
            lo = mid
        else:
            hi = mid
    return lo
