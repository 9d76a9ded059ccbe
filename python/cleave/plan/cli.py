"""`cleave plan BUNDLE (--cluster CLUSTER.yaml | --hosts N) ... -o PLAN.yaml` writes a
deployment plan (of a model repository too: a repository plan); `cleave plan --check PLAN.yaml`
validates one against its bundle, or each version against its own (docs/plan.md)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from cleave.bundle import manifest as manifest_io
from cleave.bundle.repository import is_repository
from cleave.errors import UsageError
from cleave.plan.cluster import emulated_hosts, load_cluster_file
from cleave.plan.files import load_plan, save_plan
from cleave.plan.planner import make_plan
from cleave.plan.repository import carried, make_repository_plan
from cleave.plan.schema import Plan
from cleave.plan.tiers import load_profile, parse_bytes, place_plan
from cleave.settings import TABLE_LAYOUTS, config_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "bundle",
        nargs="?",
        help="bundle directory (cleave partition's output), or a model repository of "
        "MODEL/VERSION/ bundles: a repository plan (docs/plan.md)",
    )
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument(
        "--cluster",
        help="YAML file: hosts: [{name, cpus, memory_gib, gpus}], optional topology (docs/plan.md)",
    )
    hosts.add_argument("--hosts", type=int, help="N identical emulated hosts h0..h{N-1}")
    parser.add_argument("--shards", type=int, help="range groups (default: the config's shards)")
    parser.add_argument(
        "--table-layout",
        choices=TABLE_LAYOUTS.names,
        help="range groups hold row ranges of every table or whole tables "
        "(default: the config's table_layout)",
    )
    parser.add_argument("--replicas", type=int, default=1, help="replicas per range group")
    parser.add_argument("--rankers", type=int, help="rankers (default: the config's rankers)")
    parser.add_argument("--routers", type=int, default=1, help="routers (default 1)")
    parser.add_argument("--config", help="cleave serve's TOML file: the roles' settings")
    parser.add_argument("-o", "--output", help="the plan file to write")
    parser.add_argument("--check", metavar="PLAN", help="validate PLAN against its bundle")
    parser.add_argument(
        "--dram-budget",
        metavar="BYTES",
        help="DRAM per shard for rows and caches (suffix K, M, G); tables over it go to SSD",
    )
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        default="state",
        help="each shard keeps `cleave update`'s table versions in DIR/SHARD_NAME, relative to "
        "the plan file (default state; '' for none: updates are then refused)",
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="access profile (JSON, docs/tiers.md): places tables by bandwidth need per byte",
    )


def _count(items, noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def describe(plan: Plan) -> str:
    """One paragraph: what runs where."""
    where = []
    for h in plan.hosts:
        names = [role.name for _, role in plan.roles() if role.host == h.name]
        where.append(f"{h.name}: {', '.join(names) if names else 'nothing'}")
    groups = len({s.group for s in plan.shards})
    what = f"model {plan.name!r}"
    versions = carried(plan)
    if any(model for model, _ in versions):
        what = f"repository {plan.name!r} ({', '.join(f'{m}/{v}' for m, v in versions)})"
    roles = [
        f"{_count(plan.shards, 'shard')} in {_count(range(groups), 'range group')}",
        _count(plan.rankers, "ranker"),
        _count(plan.routers, "router"),
    ]
    return (
        f"{what} ({plan.mode}, transport {plan.transport}) on "
        f"{_count(plan.hosts, 'host')}: {', '.join(roles)}. {'; '.join(where)}."
    )


def _check(path: str) -> int:
    plan = load_plan(path)
    warnings = plan.validate()
    for warning in warnings:
        print(warning, file=sys.stderr)
    print(f"{path}: OK: {describe(plan)}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.check:
        fields = ("bundle", "cluster", "hosts", "output", "dram_budget", "profile")
        extra = [f for f in fields if getattr(args, f)]
        if extra:
            raise UsageError(f"--check takes only the plan file, got also {', '.join(extra)}")
        return _check(args.check)
    if not args.bundle:
        raise UsageError("expected BUNDLE (or --check PLAN.yaml)")
    if not args.output:
        raise UsageError("expected -o PLAN.yaml: where to write the plan")
    if args.cluster is None and args.hosts is None:
        raise UsageError("expected --cluster CLUSTER.yaml or --hosts N")
    bundle = Path(args.bundle)
    if not bundle.is_dir():
        raise UsageError(f"bundle {bundle} is not a directory")
    output = Path(args.output)
    if output.is_dir():
        raise UsageError(f"-o {output}: is a directory; expected a file name")
    if args.profile and not args.dram_budget:
        raise UsageError("--profile needs --dram-budget BYTES: the DRAM each shard may use")
    budget = parse_bytes(args.dram_budget, "--dram-budget") if args.dram_budget else None
    profile = load_profile(args.profile) if args.profile else None
    config = config_file.load(args.config)
    if args.table_layout is not None:
        config.table_layout = args.table_layout
    cluster = load_cluster_file(args.cluster) if args.cluster else None
    hosts = cluster.hosts if cluster else emulated_hosts(args.hosts)
    topology = cluster.topology if cluster else None
    limits = cluster.limits if cluster else None
    shards = config.shards if args.shards is None else args.shards
    rankers = config.rankers if args.rankers is None else args.rankers
    repository = is_repository(bundle)
    if repository and budget is not None:
        raise UsageError("--dram-budget, --profile: not yet with a model repository")
    plan = (make_repository_plan if repository else make_plan)(
        bundle, hosts, shards, args.replicas, rankers, args.routers, config, topology, limits
    )
    # The bundle is named relative to the plan, so the two move together.
    plan.bundle = os.path.relpath(bundle.resolve(), output.parent.resolve())
    # A repository's shards keep their table versions under the deployment's runtime
    # directory (docs/repository.md, "Row updates"), so no state_dir is written for them.
    if args.state_dir and not repository:  # docs/tiers.md, "Updates": one per shard process
        for shard in plan.shards:
            shard.state_dir = str(Path(args.state_dir) / shard.name)
    plan.source = output
    if budget is not None:
        manifest = manifest_io.read(bundle, whole=False)
        ref = ""
        if args.profile:  # named relative to the plan, as the bundle is
            ref = os.path.relpath(Path(args.profile).resolve(), output.parent.resolve())
        plan.placement += place_plan(plan, manifest, budget, profile, ref)
    try:
        warnings = plan.validate()
    except UsageError as err:
        raise UsageError(f"{err}\n(nothing was written to {output})") from None
    command = shlex.join(["cleave", "plan", *sys.argv[2:]]) if sys.argv[1:2] == ["plan"] else ""
    header = "\n".join([*([f"command: {command}"] if command else []), *plan.placement])
    save_plan(plan, output, header=header)
    for warning in warnings:
        print(warning, file=sys.stderr)
    if plan.placement:  # the placement's cost; each choice is explained in the plan file
        print(f"cleave plan: {plan.placement[-1]}")
    print(f"cleave plan: wrote {output}: {describe(plan)}")
    return 0
