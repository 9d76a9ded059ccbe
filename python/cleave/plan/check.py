"""`Plan.check(manifest)`: every rule a plan must keep against its bundle (docs/plan.md,
"Validation"). All problems are collected and raised as one UsageError, each naming the field
(`shards[2].ranges.t0`) or the host, what was expected and what arrived; what is legal but
probably slow (cores oversubscribed) comes back as warnings."""

from __future__ import annotations

import dataclasses
import re

from cleave.errors import UsageError
from cleave.plan.schema import Host, Plan
from cleave.settings import ServeConfig, choice_problems
from cleave.settings.addresses import LOCAL_TRANSPORTS

# A shard's own memory beside the rows it maps (process, runtime, lookup buffers).
SHARD_MARGIN_BYTES = 64 << 20
# A DNS label: role and host names become process, pod and namespace names.
NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
GIB = float(1 << 30)


def host_problems(hosts: list[Host], where: str = "hosts") -> list[str]:
    problems, seen = [], set()
    if not hosts:
        problems.append(f"{where}: expected at least one host, got none")
    for i, h in enumerate(hosts):
        f = f"{where}[{i}]"
        if not NAME.match(h.name):
            problems.append(
                f"{f}.name: expected a DNS label (a-z, 0-9, '-', at most 63), got {h.name!r}"
            )
        elif h.name in seen:
            problems.append(f"{f}.name: host {h.name!r} is named twice")
        seen.add(h.name)
        if h.cpus < 1:
            problems.append(f"{f}.cpus: expected at least 1, got {h.cpus}")
        if not h.memory_gib > 0:
            problems.append(f"{f}.memory_gib: expected > 0, got {h.memory_gib}")
        if h.gpus < 0:
            problems.append(f"{f}.gpus: expected >= 0, got {h.gpus}")
    return problems


def check_plan(plan: Plan, manifest: dict) -> list[str]:
    errors: list[str] = []
    warnings: list[str] = []
    errors += choice_problems(plan, "")  # mode, transport
    if not plan.name:
        errors.append("name: expected the model name, got an empty string")
    errors += host_problems(plan.hosts)
    _roles(plan, errors)
    _settings(plan, errors)
    if plan.mode == "monolithic":
        _monolithic(plan, errors)
    elif plan.mode == "router-held":
        _router_held(plan, errors)
    else:
        tables = {t["name"]: t for t in manifest["tables"]}
        _ranges(plan, tables, errors, warnings)
    _resources(plan, manifest, errors, warnings)
    hosts_used = sorted({role.host for _, role in plan.roles()})
    if plan.transport in LOCAL_TRANSPORTS and len(hosts_used) > 1:
        errors.append(
            f"transport: {plan.transport!r} needs every role on one host, got roles on "
            f"{', '.join(hosts_used)}; use 'tcp'"
        )
    where = plan.where()
    if len(errors) == 1:
        raise UsageError(f"{where}: {errors[0]}")
    if errors:
        raise UsageError(f"{where}: {len(errors)} problems:\n  " + "\n  ".join(errors))
    return [f"{where}: warning: {w}" for w in warnings]


def _roles(plan: Plan, errors: list[str]) -> None:
    """Names, hosts and ports of every role."""
    names: dict[str, str] = {}
    ports: dict[tuple[str, int], str] = {}
    known = [h.name for h in plan.hosts]
    for f, role in plan.roles():
        if not NAME.match(role.name):
            errors.append(f"{f}.name: expected a DNS label (a-z, 0-9, '-'), got {role.name!r}")
        elif role.name in names:
            errors.append(f"{f}.name: {role.name!r} is already the name of {names[role.name]}")
        names.setdefault(role.name, f)
        if role.host not in known:
            errors.append(
                f"{f}.host: expected one of the plan's hosts ({', '.join(known)}), "
                f"got {role.host!r}"
            )
        keys = ("http_port",) if f.startswith("routers") else ("port", "metrics_port")
        if f.startswith("rankers"):
            keys = (*keys, "control_port")
        for key in keys:
            port = getattr(role, key)
            if not 0 <= port <= 65535:
                errors.append(f"{f}.{key}: expected a port in 0..65535, got {port}")
            elif port:  # 0: the runner picks a free one, which cannot clash
                other = ports.setdefault((role.host, port), f"{f}.{key}")
                if other != f"{f}.{key}":
                    errors.append(
                        f"{f}.{key}: port {port} on host {role.host} is already {other}; "
                        "expected ports unique per host"
                    )


def _settings(plan: Plan, errors: list[str]) -> None:
    for i, s in enumerate(plan.shards):
        if s.threads < 1:
            errors.append(f"shards[{i}].threads: expected at least 1, got {s.threads}")
    for f, role in plan.roles():  # queue, device, incast_order: each off its list of names
        errors += choice_problems(role, f"{f}.")
    for i, r in enumerate(plan.rankers):
        f = f"rankers[{i}]"
        for key, low in (("threads", 1), ("max_batch", 1), ("max_queue", 1), ("max_wait_ms", 0)):
            if getattr(r, key) < low:
                errors.append(f"{f}.{key}: expected at least {low}, got {getattr(r, key)}")
        if r.incast_window_bytes < 1:
            errors.append(
                f"{f}.incast_window_bytes: expected at least 1, got {r.incast_window_bytes}"
            )
        if not r.link_gbit > 0:
            errors.append(f"{f}.link_gbit: expected > 0, got {r.link_gbit}")
    dtypes = sorted({r.dense_dtype for r in plan.rankers})
    if len(dtypes) > 1:  # a request's scores must not depend on the ranker that answers
        errors.append(
            f"rankers[*].dense_dtype: expected one for every ranker, got {', '.join(dtypes)}"
        )
    if plan.incast_threshold_bytes < 0:
        errors.append(f"incast_threshold_bytes: expected >= 0, got {plan.incast_threshold_bytes}")
    # The router's rules live with its config; a ServeConfig around the plan's section
    # reuses them (its messages say `config router.KEY`).
    config = ServeConfig(
        router=dataclasses.replace(plan.router),
        ready_timeout_s=plan.supervision.ready_timeout_s,
        stop_timeout_s=plan.supervision.stop_timeout_s,
    )
    try:
        config.check()
    except UsageError as err:
        message = str(err).removeprefix("config ")
        top = message.startswith(("ready_timeout_s", "stop_timeout_s"))
        errors.append(f"supervision.{message}" if top else message)
    if plan.supervision.stop_timeout_s < 0:
        errors.append(
            f"supervision.stop_timeout_s: expected >= 0, got {plan.supervision.stop_timeout_s}"
        )


def _monolithic(plan: Plan, errors: list[str]) -> None:
    """The baseline is one process: the router and one ranker running the whole model."""
    if plan.shards:
        errors.append(f"shards: expected none in mode 'monolithic', got {len(plan.shards)}")
    if len(plan.rankers) != 1 or len(plan.routers) != 1:
        errors.append(
            "mode: 'monolithic' expects 1 ranker and 1 router (one process), got "
            f"{len(plan.rankers)} rankers and {len(plan.routers)} routers"
        )
    elif plan.rankers[0].host != plan.routers[0].host:
        errors.append(
            f"rankers[0].host: expected the router's host {plan.routers[0].host!r} in mode "
            f"'monolithic' (one process), got {plan.rankers[0].host!r}"
        )
    for i, r in enumerate(plan.rankers):
        if r.device == "cuda":
            errors.append(f"rankers[{i}].device: 'cuda' is not supported in mode 'monolithic'")


def _span(r: tuple[int, int]) -> str:
    return f"[{r[0]}, {r[1]})"


def _router_held(plan: Plan, errors: list[str]) -> None:
    """Every router holds every table: no shard processes, rankers and routers as usual."""
    if plan.shards:
        errors.append(
            f"shards: expected none in mode 'router-held' (each router holds every table), "
            f"got {len(plan.shards)}"
        )
    for kind, items in (("rankers", plan.rankers), ("routers", plan.routers)):
        if not items:
            errors.append(f"{kind}: expected at least one in mode 'router-held', got none")


def _ranges(plan: Plan, tables: dict, errors: list[str], warnings: list[str]) -> None:
    """Every range inside its table; replicas of a group identical; groups disjoint; every row
    of every table held by some shard."""
    for kind, items in (("shards", plan.shards), ("rankers", plan.rankers)):
        if not items:
            errors.append(f"{kind}: expected at least one in mode 'disaggregated', got none")
    if not plan.routers:
        errors.append("routers: expected at least one, got none")
    valid: dict[int, dict[str, tuple[int, int]]] = {}
    for i, s in enumerate(plan.shards):
        valid[i] = {}
        if not s.ranges:
            errors.append(f"shards[{i}].ranges: expected at least one table range, got none")
        for t in s.ssd_tables:  # placement across tiers (docs/tiers.md)
            if t not in s.ranges:
                errors.append(
                    f"shards[{i}].ssd_tables: expected tables the shard holds "
                    f"({', '.join(s.ranges)}), got {t!r}"
                )
        if (s.ssd_tables or s.profile) and not s.dram_budget:
            errors.append(f"shards[{i}]: ssd_tables and profile need a dram_budget, got 0")
        for t, (a, b) in s.ranges.items():
            f = f"shards[{i}].ranges.{t}"
            if t not in tables:
                errors.append(
                    f"{f}: expected a table of the bundle ({', '.join(tables)}), got {t!r}"
                )
                continue
            rows = int(tables[t]["rows"])
            if not 0 <= a < b <= rows:
                errors.append(
                    f"{f}: expected [row_start, row_end] with 0 <= row_start < row_end <= {rows} "
                    f"(table {t} has {rows} rows), got [{a}, {b}]"
                )
                continue
            valid[i][t] = (a, b)
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(plan.shards):
        groups.setdefault(s.group, []).append(i)
    for g, members in groups.items():
        first = plan.shards[members[0]]
        hosts: dict[str, str] = {}
        for j in members:
            s = plan.shards[j]
            if j != members[0] and s.ranges != first.ranges:
                errors.append(
                    f"shards[{j}].ranges: expected the ranges of shards[{members[0]}] "
                    f"({first.name}), its replica in group {g}: {_fmt(first.ranges)}; "
                    f"got {_fmt(s.ranges)}"
                )
            if s.host in hosts:
                warnings.append(
                    f"shards[{j}].host: {s.name} and {hosts[s.host]} (group {g}) are both on "
                    f"host {s.host}: losing it loses both replicas"
                )
            hosts.setdefault(s.host, s.name)
    for t, table in tables.items():
        # One replica speaks for its group: differing replicas were reported above.
        spans = sorted((valid[m[0]][t], m[0]) for m in groups.values() if t in valid[m[0]])
        covered, last, gaps = 0, None, []
        for (a, b), i in spans:
            if a < covered and last is not None:
                s, p = plan.shards[i], plan.shards[last[1]]
                errors.append(
                    f"shards[{i}].ranges.{t}: rows {_span((a, b))} overlap rows "
                    f"{_span(last[0])} of shards[{last[1]}] ({p.name}, group {p.group}); "
                    f"expected the groups' ranges disjoint (group {s.group} vs {p.group})"
                )
            elif a > covered:
                gaps.append((covered, a))
            if b > covered:
                covered, last = b, ((a, b), i)
        rows = int(table["rows"])
        if covered < rows:
            gaps.append((covered, rows))
        if gaps:
            errors.append(
                f"coverage: table {t}: rows {', '.join(map(_span, gaps))} are held by no "
                f"shard; expected every row of its {rows} held by one group"
            )


def _fmt(ranges: dict[str, tuple[int, int]]) -> str:
    return "{" + ", ".join(f"{t}: [{a}, {b}]" for t, (a, b) in ranges.items()) + "}"


def _resources(plan: Plan, manifest: dict, errors: list[str], warnings: list[str]) -> None:
    """Memory for the rows a host's shards map, GPUs for cuda rankers, cores (a warning)."""
    row_bytes = {t["name"]: int(t["row_bytes"]) for t in manifest["tables"]}
    for h in plan.hosts:
        shards = [s for s in plan.shards if s.host == h.name]
        rankers = [(i, r) for i, r in enumerate(plan.rankers) if r.host == h.name]
        routers = [r for r in plan.routers if r.host == h.name]
        rows = sum(
            max(0, b - a) * row_bytes[t]
            for s in shards
            for t, (a, b) in s.ranges.items()
            if t in row_bytes
        )
        holders = len(shards)
        if plan.mode == "router-held":  # every router holds every row
            rows += len(routers) * sum(
                int(t["rows"]) * row_bytes[t["name"]] for t in manifest["tables"]
            )
            holders += len(routers)
        need = rows + SHARD_MARGIN_BYTES * holders
        if holders and need > h.memory_gib * GIB:
            errors.append(
                f"host {h.name}: memory_gib: expected at least {need / GIB:.3f} GiB for the "
                f"tables of its {holders} shard(s) or router-held routers: {rows / GIB:.3f} GiB "
                f"of rows plus {SHARD_MARGIN_BYTES >> 20} MiB each; got {h.memory_gib}"
            )
        cuda = [i for i, r in rankers if r.device == "cuda"]
        for i in cuda:
            if h.gpus == 0:
                errors.append(
                    f"rankers[{i}].device: 'cuda' needs a GPU, but host {h.name} has gpus: 0; "
                    "expected a GPU host, or device 'cpu' or 'auto'"
                )
        if 0 < h.gpus < len(cuda):
            warnings.append(f"host {h.name}: {len(cuda)} cuda rankers share {h.gpus} GPUs")
        threads = (
            sum(s.threads for s in shards)
            + sum(r.threads for _, r in rankers)
            + plan.router.threads * len(routers)
        )
        if threads > h.cpus:
            warnings.append(
                f"host {h.name}: its roles run {threads} threads on {h.cpus} cpus; they will "
                "compete for cores (latency suffers)"
            )
