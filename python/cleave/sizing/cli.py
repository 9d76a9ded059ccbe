"""`cleave size BUNDLE --rate R --p99-ms L --catalog MACHINES.yaml [--profile PROFILE.json]
-o PLAN.yaml`: the cheapest hosts for the rate at the p99, with one host to spare per pool,
explained (the binding constraint per pool, the cost, the runners-up, monolithic serving
sized the same way) and written as a plan the runners execute (docs/sizing.md)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from cleave.errors import UsageError


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
    from cleave.sizing.catalog import is_testbed, load_catalog, testbed_room
    from cleave.sizing.plan import write_plan
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
    testbed = is_testbed(read_yaml(args.catalog, "catalog"))
    room = testbed_room() if testbed else None
    result = Sizer(manifest, profile, kinds, target, cap_room=room).size()
    mix = result.pop("chosen_mix")
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


def print_explanation(result: dict) -> None:
    t, chosen = result["target"], result["chosen"]
    print(
        f"target: {t['rate']:g} requests/s of {t['candidates']} candidates, p99 <= "
        f"{t['p99_ms']:g} ms, utilization <= {t['headroom']:g}; router CPU per request "
        f"{result['router_cpu_us']['value']:.0f} us ({result['router_cpu_us']['source']})"
    )
    if result.get("capped_kinds"):
        print(
            f"CPU per request on {', '.join(result['capped_kinds'])} hosts as measured there "
            f"(the profile's capped runs), at low load and saturated"
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
