"""Repository plans (docs/plan.md, "Repository plans"): a plan whose `bundle` is a model
repository (docs/repository.md) carries several model versions. Every shard and ranker names
the version it serves (`model`, `version`); a version's shards hold only the tables it brings
first, by content key (bundle.repository.TableKey): a table an earlier version has is served
where that one's is, as `cleave serve REPO` shares them. Versions are taken in order of model
name, then version, at plan time, at check time and when served, so all compute the same
sharing.

`place_version` is the one place that says where a version's roles go on a plan's hosts: for
`cleave plan REPO`, and for a version loaded later through the API."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cleave.bundle import manifest as manifest_io
from cleave.bundle.repository import TableKey, is_repository, model_policy, scan, table_keys
from cleave.errors import CleaveError, UsageError
from cleave.plan.check import GIB, SHARD_MARGIN_BYTES, _roles, check_plan
from cleave.plan.planner import METRICS_OFFSET, RANKER_PORT, SHARD_PORT, _Ports, make_plan
from cleave.plan.schema import Host, Plan, Shard
from cleave.plan.topology import Topology
from cleave.settings import ServeConfig
from cleave.settings.addresses import LOCAL_TRANSPORTS

ROUTERS_REFUSED = (
    "a repository plan has one router: loads, unloads and the rollout state of every model "
    "live in one router (docs/repository.md)"
)


def is_repository_plan(plan: Plan) -> bool:
    return is_repository(plan.bundle_path())


def name_roles(plan: Plan, model: str, version: int) -> Plan:
    """The plan's shards and rankers named `MODEL-VERSION-ROLE` and marked as that version's."""
    prefix = f"{model}-{version}-"
    mark = {"model": model, "version": version}
    plan.shards = [dataclasses.replace(s, name=prefix + s.name, **mark) for s in plan.shards]
    plan.rankers = [dataclasses.replace(r, name=prefix + r.name, **mark) for r in plan.rankers]
    return plan


def cut(plan: Plan, tables: set[str]) -> Plan:
    """The plan's shards cut down to `tables` (a version's new ones); a shard left holding
    nothing is dropped."""
    shards = []
    for shard in plan.shards:
        ranges = {t: r for t, r in shard.ranges.items() if t in tables}
        if ranges:
            ssd = [t for t in shard.ssd_tables if t in ranges]
            shards.append(dataclasses.replace(shard, ranges=ranges, ssd_tables=ssd))
    plan.shards = shards
    return plan


def place_version(
    bundle: Path,
    model: str,
    version: int,
    hosts: list[Host],
    shards: int,
    replicas: int,
    rankers: int,
    config: ServeConfig,
    topology: Topology | None = None,
    limits: dict[str, int] | None = None,
) -> Plan:
    """A version's roles on `hosts`: `make_plan` of its bundle (`shards` range groups of
    `replicas`, `rankers` rankers), named after the version; not yet cut to its new tables."""
    plan = make_plan(bundle, hosts, shards, replicas, rankers, 1, config, topology, limits)
    return name_roles(plan, model, version)


def make_repository_plan(
    repo: Path,
    hosts: list[Host],
    shards: int,
    replicas: int,
    rankers: int,
    routers: int,
    config: ServeConfig,
    topology: Topology | None = None,
    limits: dict[str, int] | None = None,
) -> Plan:
    """Every version the models' policies select, each placed by `place_version` and cut down
    to the tables it brings first, concatenated; one router; logical ports renumbered so that
    they stay unique on each host across versions."""
    if routers != 1:
        raise UsageError(f"routers: expected 1, got {routers}: {ROUTERS_REFUSED}")
    repo = Path(repo).resolve()
    models = scan(repo)
    if not models:
        raise UsageError(
            f"{repo}: not a model repository (no MODEL/VERSION/ directory in it, VERSION a "
            "positive integer) and not a bundle (no manifest.json)"
        )
    held: set[TableKey] = set()
    parts: list[Plan] = []
    for model, versions in models.items():
        for version in model_policy(repo, model).select(list(versions)):
            bundle = versions[version]
            keys = table_keys(bundle, manifest_io.read(bundle, whole=False))
            new = {t for t, key in keys.items() if key not in held}
            held |= set(keys.values())
            part = place_version(
                bundle, model, version, hosts, shards, replicas, rankers, config, topology, limits
            )
            parts.append(cut(part, new))
    if not parts:
        raise UsageError(f"{repo}: the models' version policies select no version present")
    plan_shards, plan_rankers = [], []
    for part in parts:  # range groups numbered across the plan: a group is one version's
        first = 1 + max((s.group for s in plan_shards), default=-1)
        plan_shards += [dataclasses.replace(s, group=first + s.group) for s in part.shards]
        plan_rankers += part.rankers
    ports = _Ports()  # make_plan numbered each version's from the same base
    for kind, roles, base in (
        ("shards", plan_shards, SHARD_PORT),
        ("rankers", plan_rankers, RANKER_PORT),
    ):
        for role in roles:
            role.port = ports.next(kind, role.host, base)
            role.metrics_port = role.port + METRICS_OFFSET
    used = {r.host for r in [*plan_shards, *plan_rankers, *parts[0].routers]}
    transport = config.transport
    if transport in LOCAL_TRANSPORTS and len(used) > 1:  # as make_plan decides it
        transport = "tcp"
    return dataclasses.replace(
        parts[0],
        name=config.name or repo.name,
        bundle=str(repo),
        transport=transport,
        shards=plan_shards,
        rankers=plan_rankers,
        placement=[],
    )


def carried(plan: Plan) -> list[tuple[str, int]]:
    """The versions a repository plan's roles serve, in the order they are staged."""
    return sorted({(r.model, r.version) for r in [*plan.shards, *plan.rankers]})


def version_plan(plan: Plan, model: str, version: int) -> Plan:
    """One carried version's roles as a plan of its own bundle (no router)."""
    mine = (model, version)
    return dataclasses.replace(
        plan,
        bundle=str((plan.bundle_path() / model / str(version)).resolve()),
        shards=[s for s in plan.shards if (s.model, s.version) == mine],
        rankers=[r for r in plan.rankers if (r.model, r.version) == mine],
        routers=[],
        placement=[],
    )


def plan_shape(plan: Plan) -> tuple[int, int, int]:
    """(range groups, replicas, rankers) a version gets in this plan: the most any carried
    version has; what a version loaded later is placed with."""
    groups = replicas = rankers = 1
    for model, version in carried(plan):
        mine = version_plan(plan, model, version)
        sizes = [sum(s.group == g for s in mine.shards) for g in {s.group for s in mine.shards}]
        groups = max(groups, len(sizes))
        replicas = max(replicas, *sizes, 1)
        rankers = max(rankers, len(mine.rankers))
    return groups, replicas, rankers


def check_repository_plan(plan: Plan) -> list[str]:
    """Every carried version against its own bundle's manifest (check_plan on its roles and
    the shards that hold the tables it shares), names and ports across the plan, each host's
    memory for every version's rows: the warnings, or UsageError listing every problem."""
    errors: list[str] = []
    warnings: list[str] = []
    repo = plan.bundle_path()
    if len(plan.routers) != 1:
        errors.append(f"routers: expected 1, got {len(plan.routers)}: {ROUTERS_REFUSED}")
    if plan.mode != "disaggregated":
        errors.append(f"mode: expected 'disaggregated' in a repository plan, got {plan.mode!r}")
    if plan.incast_control:
        errors.append("incast_control: expected false: not yet with a repository plan")
    _roles(plan, errors)
    for f, role in plan.roles():
        if not f.startswith("routers") and (not role.model or role.version < 1):
            errors.append(
                f"{f}: expected the model and version it serves in a repository plan, got "
                f"model {role.model!r}, version {role.version}"
            )
    models = scan(repo)
    homes: dict[TableKey, list[Shard]] = {}  # the shards holding each table, so far
    row_bytes: dict[str, dict[str, int]] = {}  # each shard's tables' row sizes
    for model, version in carried(plan):
        if not model or version < 1:
            continue  # reported above
        if version not in models.get(model, {}):
            have = sorted(models.get(model, {}))
            errors.append(
                f"model {model!r} version {version} (roles {_names(plan, model, version)}): not "
                f"in the repository {repo}; "
                + (f"{model} has versions {have}" if have else f"it has no model {model!r}")
            )
            continue
        bundle = models[model][version]
        try:
            manifest = manifest_io.read(bundle, whole=False)
        except CleaveError as err:  # a corrupt bundle: BundleError, naming the file
            errors.append(f"model {model!r} version {version}: {err}")
            continue
        keys = table_keys(bundle, manifest)
        mine = version_plan(plan, model, version)
        for shard in mine.shards:
            row_bytes[shard.name] = {t["name"]: int(t["row_bytes"]) for t in manifest["tables"]}
            i = next(i for i, s in enumerate(plan.shards) if s is shard)
            for t in shard.ranges:
                if t in keys and keys[t] in homes:
                    errors.append(
                        f"shards[{i}].ranges.{t}: model {model!r} version {version}'s table "
                        f"{t} is held by {homes[keys[t]][0].name} already (the same content "
                        "key); expected only the tables the version brings first"
                    )
        # The shards of earlier versions, each cut down to the tables this one shares with it
        # (by key: two versions' tables of one name may differ).
        lent: dict[str, Shard] = {}
        for t, key in keys.items():
            for s in homes.get(key, []):
                lent.setdefault(s.name, dataclasses.replace(s, ranges={}, ssd_tables=[]))
                lent[s.name].ranges[t] = s.ranges[t]
        sub = dataclasses.replace(
            mine, shards=[*lent.values(), *mine.shards], routers=plan.routers, source=None
        )
        try:
            warnings += check_plan(sub, manifest)
        except UsageError as err:
            errors.append(f"model {model!r} version {version}: " + str(err).removeprefix("plan: "))
        for shard in mine.shards:
            for t in shard.ranges:
                if t in keys:
                    homes.setdefault(keys[t], []).append(shard)
    _memory(plan, row_bytes, errors)
    where = plan.where()
    if len(errors) == 1:
        raise UsageError(f"{where}: {errors[0]}")
    if errors:
        raise UsageError(f"{where}: {len(errors)} problems:\n  " + "\n  ".join(errors))
    return [
        f"{where}: warning: {w.removeprefix('plan: warning: ')}" for w in dict.fromkeys(warnings)
    ]


def _names(plan: Plan, model: str, version: int) -> str:
    mine = version_plan(plan, model, version)
    return ", ".join(r.name for r in [*mine.shards, *mine.rankers])


def _memory(plan: Plan, row_bytes: dict[str, dict[str, int]], errors: list[str]) -> None:
    """Each host holds the rows of every version's shards on it (check_plan sees one version
    at a time)."""
    for h in plan.hosts:
        shards = [s for s in plan.shards if s.host == h.name and s.name in row_bytes]
        rows = sum(
            (b - a) * row_bytes[s.name].get(t, 0) for s in shards for t, (a, b) in s.ranges.items()
        )
        need = rows + SHARD_MARGIN_BYTES * len(shards)
        if shards and need > h.memory_gib * GIB:
            errors.append(
                f"host {h.name}: memory_gib: expected at least {need / GIB:.3f} GiB for the "
                f"tables of every version's {len(shards)} shard(s) on it: {rows / GIB:.3f} GiB "
                f"of rows plus {SHARD_MARGIN_BYTES >> 20} MiB each; got {h.memory_gib}"
            )
