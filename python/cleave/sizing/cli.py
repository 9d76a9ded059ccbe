"""`cleave size BUNDLE --rate R --p99-ms L --catalog MACHINES.yaml [--profile PROFILE.json]
-o PLAN.yaml`: the cheapest hosts for the rate at the p99, with one host to spare per pool,
explained (the binding constraint per pool, the cost, the runners-up, monolithic serving
sized the same way) and written as a plan the runners execute (docs/sizing.md)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from cleave.errors import UsageError

SHARD_PROCESSES_PER_HOST = 2  # two range groups' replicas per shard host (search.py)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", nargs="?", help="bundle directory")
    parser.add_argument("--rate", type=float, help="requests per second")
    parser.add_argument("--p99-ms", type=float, help="p99 latency target, ms")
    parser.add_argument("--catalog", help="machine kinds with prices (YAML)")
    parser.add_argument(
        "--profile", help="`cleave profile`'s JSON for this bundle; default: measure now, quick"
    )
    parser.add_argument("-o", "--output", help="plan YAML to write")
    parser.add_argument(
        "--headroom", type=float, default=0.7, help="most CPU or NIC utilization; default 0.7"
    )
    parser.add_argument("--json", help="write the sizing and its explanation here")
    parser.add_argument(
        "--validate",
        metavar="PLAN",
        help="serve PLAN (written by cleave size with a testbed catalog) on the testbed and "
        "compare its measured max rate and p99 with the predicted ones (docs/sizing.md)",
    )
    parser.add_argument("--quick", action="store_true", help="with --validate: short steps (tests)")


def run(args: argparse.Namespace) -> int:
    from cleave.bundle import manifest as manifest_io
    from cleave.plan.files import read_yaml
    from cleave.sizing.catalog import is_testbed, load_catalog
    from cleave.sizing.profile import load_profile
    from cleave.sizing.search import Sizer, Target

    if args.validate:
        from cleave.sizing.validate import run_validate

        return run_validate(Path(args.validate), args.json, quick=args.quick)
    missing = [
        flag
        for flag, value in (
            ("BUNDLE", args.bundle),
            ("--rate", args.rate),
            ("--p99-ms", args.p99_ms),
            ("--catalog", args.catalog),
            ("-o", args.output),
        )
        if value is None
    ]
    if missing:
        raise UsageError(
            f"cleave size: missing {', '.join(missing)} (or --validate PLAN to check a plan)"
        )
    bundle = Path(args.bundle)
    output = Path(args.output)
    if output.is_dir():
        raise UsageError(f"-o {output}: is a directory; expected a file name")
    manifest = manifest_io.read(bundle, whole=False)
    kinds = load_catalog(args.catalog)
    target = Target(args.rate, args.p99_ms, args.headroom)
    if args.profile:
        profile = load_profile(args.profile, bundle)
    else:
        profile = _measure_now(bundle)
    result = Sizer(manifest, profile, kinds, target).size()
    mix = result.pop("chosen_mix")
    testbed = is_testbed(read_yaml(args.catalog, "catalog"))
    result["traffic"] = dict(profile["traffic"])
    result["catalog"] = {"path": str(args.catalog), "testbed": testbed}
    plan = write_plan(bundle, mix, result, output)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print_explanation(result)
    groups = len({s.group for s in plan.shards})
    print(
        f"cleave size: wrote {output}: {len(plan.hosts)} hosts: {len(plan.routers)} routers, "
        f"{len(plan.shards)} shards in {groups} range groups, {len(plan.rankers)} rankers "
        f"(`cleave plan --check {output}` lists where each runs)"
    )
    return 0


def _measure_now(bundle: Path) -> dict:
    from cleave.sizing.profile import measure

    print(f"cleave size: no --profile: measuring {bundle} on this machine (quick)", flush=True)
    cores = len(os.sched_getaffinity(0))
    return measure(bundle, 100, 1.0, 1.05, sorted({1, cores}), quick=True)


def write_plan(bundle: Path, mix, result: dict, output: Path):
    """The chosen mix as a plan: hosts labelled with their pool and kind, placed by the
    planner (roles round-robin over their pool's hosts), checked, written atomically."""
    from cleave.bundle import manifest as manifest_io
    from cleave.plan.files import save_plan
    from cleave.plan.planner import make_plan
    from cleave.plan.schema import Host
    from cleave.runners.testbed import CPU_LABEL, LINK_LABEL
    from cleave.settings import ServeConfig
    from cleave.sizing.catalog import testbed_cores

    pools = {p.name: p for p in mix.pools}
    testbed = result.get("catalog", {}).get("testbed", False)
    hosts = []
    for name in ("routers", "shards", "rankers"):
        p = pools[name]
        labels = {"pool": name, "kind": p.kind.kind}
        if testbed:  # the testbed runner gives each host its kind's cap and link rate
            labels[CPU_LABEL] = f"{testbed_cores(p.kind):g}"
            labels[LINK_LABEL] = f"{p.kind.nic_gbit:g}"
        for i in range(p.hosts):
            hosts.append(
                Host(f"{name[:-1]}-{i}", p.kind.cpus, p.kind.memory_gib, p.kind.gpus, dict(labels))
            )
    chosen = result["chosen"]
    config = ServeConfig()
    config.transport = "tcp"
    config.ranker.dense_dtype = chosen["dtype"]
    config.ranker.threads = chosen["threads"]
    config.ranker.device = chosen["device"]
    config.shard.threads = max(1, pools["shards"].kind.cpus // SHARD_PROCESSES_PER_HOST)
    config.router.threads = pools["routers"].kind.cpus
    if chosen["router_cache_bytes"]:  # the size the hit rate was predicted for: fixed
        config.router.cache = "fixed"
        config.router.cache_bytes = chosen["router_cache_bytes"]
    rankers = pools["rankers"].hosts * pools["rankers"].servers_per_host
    plan = make_plan(
        bundle, hosts, pools["shards"].hosts, 2, rankers, pools["routers"].hosts, config
    )
    plan.bundle = os.path.relpath(bundle.resolve(), output.parent.resolve())
    plan.source = output
    try:
        plan.check(manifest_io.read(bundle, whole=False))
    except UsageError as err:
        raise UsageError(f"{err}\n(nothing was written to {output})") from None
    command = shlex.join(["cleave", "size", *sys.argv[2:]]) if sys.argv[1:2] == ["size"] else ""
    lines = [f"command: {command}"] if command else []
    lines.append(
        f"sized for {result['target']['rate']:g}/s at p99 <= {result['target']['p99_ms']:g} ms: "
        f"predicted p99 {chosen['p99_ms']:.2f} ms, max rate {chosen['max_rate']:.0f}/s, "
        f"{chosen['cost_per_hour']:.2f} per hour"
    )
    lines += [
        f"{p['pool']}: {p['hosts']} x {p['kind']} ({p['binding']}, one spare)"
        for p in chosen["pools"]
    ]
    # What `cleave size --validate` compares the system with, and the traffic it was sized
    # for (the profile's request shape), on one line.
    sizing = {
        "rate": result["target"]["rate"],
        "p99_ms": result["target"]["p99_ms"],
        "predicted_p99_ms": chosen["p99_ms"],
        "predicted_max_rate": chosen["max_rate"],
        "candidates": result["target"]["candidates"],
        **{k: result.get("traffic", {}).get(k) for k in ("ids_per_candidate", "alpha")},
        "catalog": result.get("catalog", {}).get("path"),
        "testbed": result.get("catalog", {}).get("testbed", False),
        "pools": {
            p["pool"]: {k: p[k] for k in ("kind", "hosts", "service_ms", "p99_ms")}
            for p in chosen["pools"]
        },
    }
    from cleave.sizing.validate import SIZING_PREFIX

    lines.append(SIZING_PREFIX + json.dumps(sizing, separators=(",", ":")))
    output.parent.mkdir(parents=True, exist_ok=True)
    save_plan(plan, output, header="\n".join(lines))
    return plan


def print_explanation(result: dict) -> None:
    t, chosen = result["target"], result["chosen"]
    print(
        f"target: {t['rate']:g} requests/s of {t['candidates']} candidates, p99 <= "
        f"{t['p99_ms']:g} ms, utilization <= {t['headroom']:g}; router CPU per request "
        f"{result['router_cpu_us']['value']:.0f} us ({result['router_cpu_us']['source']})"
    )
    print(f"{'pool':<9} {'kind':<14} {'hosts':>5} {'cpu':>5} {'nic':>5} {'p99 ms':>8}  binding")
    for p in chosen["pools"]:
        print(
            f"{p['pool']:<9} {p['kind']:<14} {p['hosts']:>5} {p['cpu_utilization']:>5.2f} "
            f"{p['nic_utilization']:>5.2f} {p['p99_ms']:>8.2f}  {p['binding']} (+1 spare)"
        )
    router = next(p for p in chosen["pools"] if p["pool"] == "routers")
    if router["cache_bytes"]:
        print(
            f"router cache: {router['cache_bytes'] / 2**20:.1f} MiB in each router (fixed), "
            f"predicted to answer {router['cache_hit_rate']:.0%} of the lookups"
        )
    print(
        f"chosen: {_rankers(chosen)}; predicted p99 "
        f"{chosen['p99_ms']:.2f} ms, max rate {chosen['max_rate']:.0f}/s; cost "
        f"{chosen['cost_per_hour']:.2f} per hour"
    )
    for i, r in enumerate(result["runners_up"], 1):
        kinds = ", ".join(f"{k} {v}" for k, v in r["kinds"].items())
        print(
            f"runner-up {i}: {r['cost_per_hour']:.2f} per hour ({kinds}; {_rankers(r)}; "
            f"hosts {'/'.join(str(p['hosts']) for p in r['pools'])})"
        )
    mono = result["monolithic"]
    if "problem" in mono:
        print(f"monolithic: cannot: {mono['problem']}")
    else:
        ratio = mono["cost_per_hour"] / chosen["cost_per_hour"]
        host = mono["pools"][0]
        print(
            f"monolithic, sized the same way: {host['hosts']} x {host['kind']}, "
            f"{mono['cost_per_hour']:.2f} per hour ({ratio:.2f}x the disaggregated cost)"
        )


def _rankers(mix: dict) -> str:
    if mix["device"] == "cuda":
        return f"{mix['dtype']} rankers on GPUs (one per GPU)"
    return f"{mix['dtype']} rankers of {mix['threads']} thread(s)"
