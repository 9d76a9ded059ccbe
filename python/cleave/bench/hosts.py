"""`cleave bench serve --plan PLAN` and `--shard-hosts 1,2,4`: deployments a plan describes,
started through `cleave serve --plan` (the one code path of every runner), and the summary of
the shard-host sweep (docs/benchmarks.md, "Across hosts: the testbed")."""

from __future__ import annotations

import math
from pathlib import Path

from cleave.errors import UsageError

# Stages of the breakdown from /metrics, in pipeline order (cleave.bench.stages); "lookup" only
# when no shard metrics split it (--url).
STAGES = [
    "parse",
    "lookup",
    "lookup_service",
    "lookup_network",
    "transfer",
    "queue",
    "compute",
    "rest",
]
MAX_SHARD_HOSTS = 16


def check_deployment_flags(args) -> None:
    """Flags that pick the deployment agree (UsageError, exit 2, before anything starts);
    `--shard-hosts` parsed into `args.shard_host_list`; `--plan` names the bundle."""
    picks = [f for f, on in (("--url", args.url), ("--plan", args.plan)) if on]
    picks += ["--shard-hosts"] if args.shard_hosts else []
    picks += [f for f, on in (("--compare", args.compare), ("--monolithic", args.monolithic)) if on]
    if len(picks) > 1:
        raise UsageError(
            f"expected at most one of --url, --plan, --shard-hosts, --compare, "
            f"--monolithic; got {', '.join(picks)}"
        )
    planned = bool(args.plan or args.shard_hosts)
    if args.runner and not planned:
        raise UsageError(f"--runner {args.runner}: only with --plan or --shard-hosts")
    if planned and not args.runner:
        args.runner = "testbed" if args.shard_hosts else "local"
    if args.link_gbit is not None and args.runner != "testbed":
        raise UsageError("--link-gbit: only with --runner testbed (--shard-hosts uses it)")
    if args.link_gbit is not None and not 0 < args.link_gbit <= 100:
        raise UsageError(f"--link-gbit: expected a rate > 0 and <= 100, got {args.link_gbit}")
    if planned and (args.overload or args.soak):
        raise UsageError(
            "--overload and --soak measure `cleave serve BUNDLE`: drop --plan and --shard-hosts"
        )
    if args.max_error_pct is None:  # the sweep's goodput allows 1 % errors (docs/benchmarks.md)
        args.max_error_pct = 1.0 if args.shard_hosts else 0.0
    if not 0 <= args.max_error_pct <= 100:
        raise UsageError(f"--max-error-pct: expected 0..100, got {args.max_error_pct}")
    args.shard_host_list = []
    if args.shard_hosts:
        try:
            counts = [int(s) for s in args.shard_hosts.split(",") if s.strip()]
        except ValueError:
            counts = []
        if not counts or any(not 1 <= s <= MAX_SHARD_HOSTS for s in counts):
            raise UsageError(
                f"--shard-hosts: expected shard host counts 1..{MAX_SHARD_HOSTS} separated by "
                f"commas, got {args.shard_hosts!r}"
            )
        args.shard_host_list = counts
    if args.plan:
        from cleave.plan import load_plan

        plan = load_plan(args.plan)  # a clear error naming the file and field when bad
        args.plan_name = plan.name
        if not args.bundle:
            args.bundle = str(plan.bundle_path())


def _runner_flags(args) -> list[str]:
    flags = ["--runner", args.runner]
    if args.link_gbit is not None:
        flags += ["--link-gbit", str(args.link_gbit)]
    if args.runner == "local":  # a plan's logical port 8000 may be taken on this machine
        flags += ["--http-port", "0"]
    return flags


def _hosts_name(count: int) -> str:
    return f"{count} shard host" + ("s" if count > 1 else "")


def targets(args, workload, result: dict, target_class) -> dict:
    """--plan: that plan. --shard-hosts: one plan per count, written under --workdir."""
    flags = _runner_flags(args)
    result["runner"] = args.runner
    result["link_gbit"] = args.link_gbit if args.link_gbit is not None else 1.0
    if args.plan:
        result["plan"] = str(args.plan)
        return {"plan": target_class(plan=args.plan, flags=flags, model=args.plan_name)}
    from cleave.launch.config import RankerConfig, ServeConfig
    from cleave.launch.config import load as load_config
    from cleave.plan import emulated_hosts, make_plan, save_plan

    config = load_config(args.config) if args.config else ServeConfig()
    if not args.config:  # the single-host bench's ranker: one torch thread
        config = ServeConfig(ranker=RankerConfig(threads=1, device="cpu"))
    found = {}
    plans = Path(args.workdir) / "plans"
    plans.mkdir(parents=True, exist_ok=True)
    result["plans"] = {}
    for count in args.shard_host_list:
        # Router host, `count` shard hosts, ranker host: the planner's layout for count + 2.
        plan = make_plan(
            workload.bundle_dir,
            emulated_hosts(count + 2),
            shards=count,
            replicas=1,
            rankers=args.rankers,
            routers=1,
            serve_config=config,
        )
        path = save_plan(plan, plans / f"{workload.name}-{count}-shard-hosts.yaml")
        name = _hosts_name(count)
        result["plans"][name] = str(path)
        found[name] = target_class(plan=path, flags=flags, model=plan.name)
    return found


def reference_point(dep: dict) -> dict | None:
    """The point a deployment is summarised by: its highest rate within budget, else its
    lowest rate (what it did when it could not keep up at all)."""
    points = sorted(dep["rates"], key=lambda p: p["rate"])
    good = [p for p in points if p["within_budget"]]
    return good[-1] if good else (points[0] if points else None)


def stage_means(point: dict) -> dict[str, float]:
    """Milliseconds per request by stage, from the /metrics breakdown; `rest` is the router's
    total less its stages (HTTP encode of the reply, scheduling)."""
    us = point.get("metrics", {}).get("stages_us", {})
    out = {s: us[f"{s}_us"] / 1e3 for s in STAGES if s != "lookup" and f"{s}_us" in us}
    if "lookup_service" not in out and "lookup_us" in us:
        out["lookup"] = us["lookup_us"] / 1e3  # no shard metrics: the lookup as one stage
    # Each histogram counts the requests that reached its stage: with errors they differ, and
    # total less the stages would mix populations, so `rest` is left out then.
    if "total_us" in us and not point.get("errors"):
        parts = ("parse", "lookup", "transfer", "queue", "compute")
        out["rest"] = (us["total_us"] - sum(us.get(f"{p}_us", 0.0) for p in parts)) / 1e3
    if "total_us" in us:
        out["total"] = us["total_us"] / 1e3
    return out


def link_drops(point: dict) -> float | None:
    """Packets every testbed link's queue dropped during the point (None off the testbed)."""
    links = point.get("metrics", {}).get("link_drops")
    if not links:
        return None
    return sum(sum(d.values()) for d in links.values())


def hosts_ratios(result: dict) -> dict[str, float]:
    """Each sweep point's goodput and p99 against the first (S = 1 when it is swept)."""
    deps = list(result["deployments"].items())
    if not deps:
        return {}
    _, base = deps[0]
    base_point = reference_point(base) or {}
    ratios = {}
    for name, dep in deps[1:]:
        point = reference_point(dep) or {}
        key = name.replace(" ", "_")
        ratios[f"max_rate_{key}_over_first"] = _ratio(
            dep["max_rate_within_budget"], base["max_rate_within_budget"]
        )
        ratios[f"single_p50_{key}_over_first"] = _ratio(
            dep["single"]["p50_ms"], base["single"]["p50_ms"]
        )
        ratios[f"reference_p99_{key}_over_first"] = _ratio(
            point.get("p99_ms"), base_point.get("p99_ms")
        )
    return ratios


def _ratio(a, b) -> float:
    return a / b if a is not None and b else math.nan


def _ms(value: float | None) -> str:
    return f"{value:8.2f}" if value is not None else f"{'-':>8}"


def print_stages(result: dict) -> None:
    """Every rate's breakdown from /metrics (ms per request), where one was scraped."""
    rows = [
        (name, p)
        for name, dep in result["deployments"].items()
        for p in sorted(dep["rates"], key=lambda p: p["rate"])
        if p.get("metrics", {}).get("stages_us")
    ]
    if not rows:
        return
    print(
        "\nstages, ms per request from /metrics (lookup_network = router lookup - slowest "
        "shard's service; transfer = ranker round trip - its queue and compute; drops = "
        "packets the testbed's link queues dropped):"
    )
    print(
        f"{'deployment':<16} {'rate/s':>8} "
        + " ".join(f"{s[:8]:>8}" for s in STAGES)
        + f" {'drops':>7}"
    )
    for name, p in rows:
        means = stage_means(p)
        drops = link_drops(p)
        print(
            f"{name:<16} {p['rate']:8.1f} "
            + " ".join(_ms(means.get(s)) for s in STAGES)
            + (f" {drops:7.0f}" if drops is not None else f" {'-':>7}")
        )
    codec = [
        (name, p, p["metrics"]["codec_cpu_us"])
        for name, p in rows
        if "codec_cpu_us" in p["metrics"]
    ]
    if codec:
        print("\nrouter CPU per request in parsing and encoding, µs (from /metrics):")
        for name, p, cpu in codec:
            steps = "  ".join(f"{step} {us:.0f}" for step, us in cpu.items())
            print(f"{name:<16} {p['rate']:8.1f}  {steps}")


def print_hosts(result: dict) -> None:
    """The sweep's summary: per S, goodput within the budget, p50/p99 there, and ratios."""
    deps = list(result["deployments"].items())
    print(
        f"\nshard-host sweep, {result.get('link_gbit', 1.0):g} Gbit/s links, p99 budget "
        f"{result['budget_ms']:g} ms ({result['candidates']} candidates per request):"
    )
    print(
        f"{'deployment':<16} {'goodput/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'KiB/req':>8} "
        f"{'vs first':>8}"
    )
    base = deps[0][1]["max_rate_within_budget"] if deps else 0
    for name, dep in deps:
        point = reference_point(dep) or {}
        sent = point.get("metrics", {}).get("lookup_reply_bytes")
        kib = f"{sent / 1024:8.1f}" if sent else f"{'-':>8}"
        ratio = _ratio(dep["max_rate_within_budget"], base)
        print(
            f"{name:<16} {dep['max_rate_within_budget']:9.1f} {_ms(point.get('p50_ms'))} "
            f"{_ms(point.get('p99_ms'))} {kib} {ratio:8.2f}"
        )
