"""`cleave bench serve --plan PLAN` and `--shard-hosts 1,2,4`: deployments a plan describes,
started through `cleave serve --plan` (the one code path of every runner), and the summary of
the shard-host sweep (docs/benchmarks.md, "Across hosts: the testbed"); `--plan PLAN
--incast-control off,on`: the plan with incast control off, then on (docs/benchmarks.md,
"Incast control end to end")."""

from __future__ import annotations

import sys
from pathlib import Path

from cleave.bench.harness.command import counts
from cleave.bench.harness.summary import Ratio, ms, ratio
from cleave.bench.harness.target import Target
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
INCAST_VALUES = ("off", "on")
CONTROL_PORT = 7200  # a ranker's control port where the plan leaves it 0 (on a testbed host)


def deployment_settings(args) -> dict:
    """Flags that pick the deployment, checked (UsageError, exit 2, before anything starts),
    and what they imply, for `cleave bench serve` to set: the runner, the error allowance,
    `--shard-hosts` as `shard_host_list`, `--incast-control` as `incast_list`, and with
    `--plan` its name and bundle."""
    picks = [f for f, on in (("--url", args.url), ("--plan", args.plan)) if on]
    picks += ["--shard-hosts"] if args.shard_hosts else []
    picks += [f for f, on in (("--compare", args.compare), ("--monolithic", args.monolithic)) if on]
    if len(picks) > 1:
        raise UsageError(
            f"expected at most one of --url, --plan, --shard-hosts, --compare, "
            f"--monolithic; got {', '.join(picks)}"
        )
    planned = bool(args.plan or args.shard_hosts)
    runner = args.runner
    if runner and not planned:
        raise UsageError(f"--runner {runner}: only with --plan or --shard-hosts")
    if planned and not runner:
        runner = "testbed" if args.shard_hosts else "local"
    if args.link_gbit is not None and runner != "testbed":
        raise UsageError("--link-gbit: only with --runner testbed (--shard-hosts uses it)")
    if args.link_gbit is not None and not 0 < args.link_gbit <= 100:
        raise UsageError(f"--link-gbit: expected a rate > 0 and <= 100, got {args.link_gbit}")
    if args.shard_hosts and (args.overload or args.soak):
        raise UsageError(
            "--overload and --soak measure one deployment (a bundle or --plan): drop --shard-hosts"
        )
    max_error_pct = args.max_error_pct
    if max_error_pct is None:  # the sweep's goodput allows 1 % errors (docs/benchmarks.md)
        max_error_pct = 1.0 if args.shard_hosts else 0.0
    if not 0 <= max_error_pct <= 100:
        raise UsageError(f"--max-error-pct: expected 0..100, got {max_error_pct}")
    settings = {
        "runner": runner,
        "max_error_pct": max_error_pct,
        "shard_host_list": [],
        "incast_list": _incast_values(args),
    }
    if settings["incast_list"] and (args.overload or args.soak):
        raise UsageError("--overload and --soak measure one deployment: drop --incast-control")
    if args.shard_hosts:
        hosts = counts(args.shard_hosts, "--shard-hosts")
        if max(hosts) > MAX_SHARD_HOSTS:
            raise UsageError(
                f"--shard-hosts: expected shard host counts 1..{MAX_SHARD_HOSTS} separated by "
                f"commas, got {args.shard_hosts!r}"
            )
        settings["shard_host_list"] = hosts
    if args.plan:
        from cleave.plan import load_plan

        plan = load_plan(args.plan)  # a clear error naming the file and field when bad
        settings["plan_name"] = plan.name
        settings["bundle"] = args.bundle or str(plan.bundle_path())
    return settings


def _incast_values(args) -> list[str]:
    """--incast-control's comma-separated list, checked; [] when not given."""
    if args.incast_control is None:
        return []
    values = [v.strip() for v in args.incast_control.split(",")]
    if any(v not in INCAST_VALUES for v in values) or len(set(values)) != len(values):
        raise UsageError(
            f"--incast-control: expected distinct values of off, on separated by commas, "
            f"got {args.incast_control!r}"
        )
    if not args.plan:
        raise UsageError(
            "--incast-control: only with --plan (it sets the plan's incast_control), "
            f"got {'--shard-hosts' if args.shard_hosts else 'no plan'}"
        )
    return values


def _runner_flags(args) -> list[str]:
    flags = ["--runner", args.runner]
    if args.link_gbit is not None:
        flags += ["--link-gbit", str(args.link_gbit)]
    if args.runner == "local":  # a plan's logical port 8000 may be taken on this machine
        flags += ["--http-port", "0"]
    return flags


def _hosts_name(count: int) -> str:
    return f"{count} shard host" + ("s" if count > 1 else "")


def targets(args, workload, result: dict) -> dict:
    """--plan: that plan. --shard-hosts: one plan per count, written under --workdir."""
    flags = _runner_flags(args)
    result["runner"] = args.runner
    result["link_gbit"] = args.link_gbit if args.link_gbit is not None else 1.0
    if args.plan:
        result["plan"] = str(args.plan)
        if args.incast_list:
            return _incast_targets(args, flags, result)
        return {"plan": Target(plan=args.plan, flags=flags, model=args.plan_name)}
    from cleave.plan import emulated_hosts, make_plan, save_plan
    from cleave.settings import RankerConfig, ServeConfig
    from cleave.settings.config_file import load as load_config

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
        found[name] = Target(plan=path, flags=flags, model=plan.name)
    return found


def _incast_targets(args, flags: list[str], result: dict) -> dict:
    """One copy of --plan per --incast-control value, written under --workdir/plans:
    `incast-off`, `incast-on`."""
    from cleave.plan import load_plan, save_plan

    plans = Path(args.workdir) / "plans"
    plans.mkdir(parents=True, exist_ok=True)
    result["incast_control"] = args.incast_list
    result["plans"] = {}
    found = {}
    for value in args.incast_list:
        plan = load_plan(args.plan)
        plan.bundle = str(plan.bundle_path().resolve())  # the copy lives elsewhere
        plan.incast_control = value == "on"
        if args.runner == "local":
            # Both deployments are up at once for the single-request rounds: on one machine
            # the plan's ports would clash, so every port is one the runner picks.
            for role in [*plan.shards, *plan.rankers]:
                role.port = role.metrics_port = 0
            for ranker in plan.rankers:
                ranker.control_port = 0
        elif plan.incast_control:
            for i, ranker in enumerate(plan.rankers):
                if not ranker.control_port:  # a known port: the testbed gives it priority
                    ranker.control_port = _free_port_on(plan, ranker.host, CONTROL_PORT)
                    print(
                        f"cleave bench serve: rankers[{i}] ({ranker.name}) has no control_port: "
                        f"incast-on uses {ranker.control_port}",
                        file=sys.stderr,
                        flush=True,
                    )
        name = f"incast-{value}"
        path = save_plan(plan, plans / f"{Path(args.plan).stem}-{name}.yaml")
        result["plans"][name] = str(path)
        found[name] = Target(plan=path, flags=flags, model=plan.name)
    return found


def _free_port_on(plan, host: str, port: int) -> int:
    """`port`, or the next one no role of `plan` on `host` uses."""
    taken = {
        p
        for _, role in plan.roles()
        if role.host == host
        for p in (
            getattr(role, "port", 0),
            getattr(role, "metrics_port", 0),
            getattr(role, "control_port", 0),
            getattr(role, "http_port", 0),
        )
    }
    while port in taken:
        port += 1
    return port


def _best_goodput(dep: dict) -> float:
    return max((p["goodput_rps"] for p in dep["rates"]), default=0.0)


def _goodput_by_rate(on: dict, off: dict) -> dict[str, float | None]:
    """On over off at each rate both measured."""
    off_by_rate = {p["rate"]: p["goodput_rps"] for p in off["rates"]}
    return {
        str(p["rate"]): _share(p["goodput_rps"], off_by_rate[p["rate"]])
        for p in sorted(on["rates"], key=lambda p: p["rate"])
        if p["rate"] in off_by_rate
    }


# Incast control on over off: best goodput, highest rate within budget, goodput per rate (a
# rate both measured). None where off had none: strict JSON has no infinity.
INCAST_RATIOS = (
    Ratio(
        "max_goodput_incast_on_over_off",
        "incast-on",
        "incast-off",
        lambda on, off: _share(_best_goodput(on), _best_goodput(off)),
    ),
    Ratio(
        "max_rate_incast_on_over_off",
        "incast-on",
        "incast-off",
        lambda on, off: _share(on["max_rate_within_budget"], off["max_rate_within_budget"]),
    ),
    Ratio("goodput_incast_on_over_off_by_rate", "incast-on", "incast-off", _goodput_by_rate),
)


def _share(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


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
        ratios[f"max_rate_{key}_over_first"] = ratio(
            dep["max_rate_within_budget"], base["max_rate_within_budget"]
        )
        ratios[f"single_p50_{key}_over_first"] = ratio(
            dep["single"]["p50_ms"], base["single"]["p50_ms"]
        )
        ratios[f"reference_p99_{key}_over_first"] = ratio(
            point.get("p99_ms"), base_point.get("p99_ms")
        )
    return ratios


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
            + " ".join(ms(means.get(s), 8) for s in STAGES)
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
    used = [(name, p) for name, p in rows if "cpu_ms_per_request" in p]
    if used:
        print("\nCPU per request answered, ms: every process of the deployment, then by role:")
        for name, p in used:
            roles = "  ".join(f"{r} {ms:.2f}" for r, ms in p["cpu_ms_by_role"].items())
            print(f"{name:<16} {p['rate']:8.1f}  {p['cpu_ms_per_request']:6.2f}  {roles}")


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
        share = ratio(dep["max_rate_within_budget"], base)
        print(
            f"{name:<16} {dep['max_rate_within_budget']:9.1f} {ms(point.get('p50_ms'), 8)} "
            f"{ms(point.get('p99_ms'), 8)} {kib} {share:8.2f}"
        )
