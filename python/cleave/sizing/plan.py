"""A sizing's chosen mix written as a plan (docs/sizing.md, "The plan"): hosts labelled with
their pool and kind (and on a testbed catalog their CPU cap and link rate), roles placed by the
planner, the header saying what it was sized for, checked and written atomically."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from cleave.errors import UsageError

SHARD_PROCESSES_PER_HOST = 2  # two range groups' replicas per shard host (search.py)


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
    # A request the target lets be slow is not refused for it: the default budget (for
    # requests that name none) is at least twice the p99 target.
    twice = min(2 * result["target"]["p99_ms"], config.router.max_budget_ms)
    config.router.budget_ms = max(config.router.budget_ms, twice)
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
