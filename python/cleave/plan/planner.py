"""The planner: a bundle, hosts and counts -> a Plan (placement rules in docs/plan.md), and
`local_plan`, today's `cleave serve` layout as a plan."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from cleave.bundle import manifest as manifest_io
from cleave.errors import UsageError
from cleave.plan.check import GIB, SHARD_MARGIN_BYTES, host_problems
from cleave.plan.cluster import this_machine
from cleave.plan.placement import Request, place
from cleave.plan.schema import Host, Plan, Ranker, Router, Shard, Supervision
from cleave.plan.topology import Topology
from cleave.settings import ServeConfig
from cleave.settings.addresses import LOCAL_TRANSPORTS
from cleave.settings.router_json import deployment_mode

# Logical ports, per host: role i of its kind on a host gets BASE + i; its metrics port is
# that + METRICS_OFFSET. PER_HOST keeps the kinds' ranges apart.
SHARD_PORT, RANKER_PORT, ROUTER_PORT = 7000, 7100, 8000
METRICS_OFFSET = 2000
PER_HOST = 100
# Topology-aware requests the config does not give: a ranker's cores when its threads are
# "auto", and the memory of a ranker and a router (their own, beside no table rows).
RANKER_CORES, RANKER_MEMORY_GIB, ROUTER_MEMORY_GIB = 4, 1.0, 0.5
# Host labels `pool: <one of these>` on every host put each role kind on its own hosts.
POOLS = ("routers", "shards", "rankers")


def layout(hosts: list[Host]) -> tuple[list[Host], list[Host], list[Host]]:
    """(router hosts, shard hosts, ranker hosts): as their `pool` labels say when every host
    has one (`cleave size` writes them), else by the rules in docs/plan.md."""
    pools = [h.labels.get("pool") for h in hosts]
    if any(pools):
        by_pool = {p: [h for h in hosts if h.labels.get("pool") == p] for p in POOLS}
        wrong = [f"{h.name}: {p!r}" for h, p in zip(hosts, pools, strict=True) if p not in POOLS]
        empty = [p for p in POOLS if not by_pool[p]]
        if wrong or empty:
            raise UsageError(
                f"hosts: labels.pool: expected one of {list(POOLS)} on every host and each on "
                f"some host, got {', '.join(wrong) or 'no bad label'}; none for {empty or '-'}"
            )
        return by_pool["routers"], by_pool["shards"], by_pool["rankers"]
    gpu = [h for h in hosts if h.gpus > 0]
    if gpu and len(gpu) < len(hosts):  # some hosts have GPUs: they are the rankers'
        rest = [h for h in hosts if h.gpus == 0]
        return rest[:1], (rest if len(rest) == 1 else rest[1:]), gpu
    if len(hosts) == 1:
        return hosts, hosts, hosts
    if len(hosts) == 2:
        return hosts[:1], hosts[1:], hosts[:1]
    return hosts[:1], hosts[1:-1], hosts[-1:]


class _Ports:
    """The next logical port of each kind on each host."""

    def __init__(self):
        self.used: Counter[tuple[str, str]] = Counter()

    def next(self, kind: str, host: str, base: int) -> int:
        i = self.used[(kind, host)]
        if i >= PER_HOST:
            raise UsageError(f"host {host}: more than {PER_HOST} {kind} on it; add hosts")
        self.used[(kind, host)] += 1
        return base + i


def _ranker_settings(config: ServeConfig) -> dict:
    c = config.ranker
    return {
        "device": c.device,
        "dense_dtype": c.dense_dtype,
        "max_batch": c.max_batch,
        "max_wait_ms": c.max_wait_ms,
        "max_queue": c.max_queue,
        "cuda_graphs": c.cuda_graphs,
        "compile": c.compile,
        "compile_cache": c.compile_cache,
        "shared_batching": c.shared_batching,
        "eager_model": c.eager_model,
        "queue": c.queue,
    }


def _common(bundle: Path, config: ServeConfig) -> dict:
    return {
        "name": config.name or bundle.name,
        "bundle": str(bundle),
        "router": dataclasses.replace(config.router),
        "supervision": Supervision(config.fail_stop, config.ready_timeout_s, config.stop_timeout_s),
    }


def make_plan(
    bundle_dir: str | Path,
    hosts: list[Host],
    shards: int,
    replicas: int,
    rankers: int,
    routers: int,
    serve_config: ServeConfig,
    topology: Topology | None = None,
    limits: dict[str, int] | None = None,
) -> Plan:
    """A disaggregated deployment of the bundle on `hosts`: `shards` range groups with
    `replicas` replicas each on distinct hosts, `rankers` rankers, `routers` routers. Not yet
    checked against resources: call `plan.check(manifest)`. With a `topology`, roles are placed
    by `placement.place` (Prism's Algorithm 1) within `limits` per host."""
    config = serve_config.check()
    for key, value in (("shards", shards), ("replicas", replicas), ("rankers", rankers)):
        if value < 1:
            raise UsageError(f"{key}: expected at least 1, got {value}")
    if routers < 1:
        raise UsageError(f"routers: expected at least 1, got {routers}")
    problems = host_problems(hosts)
    if problems:
        raise UsageError("; ".join(problems))
    if config.monolithic:
        raise UsageError(
            "monolithic: expected false: the planner plans disaggregated deployments; the "
            "monolithic baseline is one process (cleave serve --monolithic, local_plan)"
        )
    bundle = Path(bundle_dir).resolve()
    manifest = manifest_io.read(bundle, whole=False)
    router_hosts, shard_hosts, ranker_hosts = layout(hosts)
    # More shards than rows in every table leaves some empty: they are left out.
    held = table_ranges(manifest, shards, config.table_layout)
    groups = [] if config.router_held else [r for r in held if r]
    placement = None
    if topology is not None:
        requests = _requests(manifest, groups, replicas, rankers, routers, config, hosts)
        placement = place(requests, topology, limits)
    elif replicas > len(shard_hosts):
        names = ", ".join(h.name for h in shard_hosts)
        raise UsageError(
            f"replicas: expected at most {len(shard_hosts)}, the hosts that may hold shards "
            f"({names}), got {replicas}: a range's replicas go on distinct hosts"
        )
    ports = _Ports()
    plan_shards = []
    for g, ranges in enumerate(groups):
        for r in range(replicas):
            name = f"shard-{g}" if replicas == 1 else f"shard-{g}-{r}"
            # Consecutive slots over the shard hosts: a group's K replicas land on K distinct
            # hosts (K <= hosts) and every host gets the same number of shards, +- 1.
            host = shard_hosts[(g * replicas + r) % len(shard_hosts)].name
            host = placement.host_of(name) if placement else host
            port = ports.next("shards", host, SHARD_PORT)
            plan_shards.append(
                Shard(
                    name,
                    g,
                    host,
                    port,
                    port + METRICS_OFFSET,
                    config.shard.threads,
                    ranges,
                    config.shard.queue,
                    dram_budget=config.shard.dram_budget,
                )
            )
    plan_routers = []
    for i in range(routers):
        host = router_hosts[i % len(router_hosts)].name
        host = placement.host_of(f"router-{i}") if placement else host
        n = ports.next("routers", host, 0)
        http_port = (config.http_port or ROUTER_PORT) + n
        grpc_port = config.grpc_port + n if config.grpc_port else config.grpc_port
        plan_routers.append(Router(f"router-{i}", host, http_port, grpc_port))
    placed = [ranker_hosts[i % len(ranker_hosts)] for i in range(rankers)]
    if placement:
        by_name = {h.name: h for h in hosts}
        placed = [by_name[placement.host_of(f"ranker-{i}")] for i in range(rankers)]
    per_host = Counter(h.name for h in placed)
    busy = {s.host for s in plan_shards} | {r.host for r in plan_routers}
    plan_rankers = []
    for i, host in enumerate(placed):
        port = ports.next("rankers", host.name, RANKER_PORT)
        threads = config.ranker.threads
        if placement:  # the cores it was given
            threads = sum(placement.choice(f"ranker-{i}").cores.values())
        elif not threads:  # cleave serve's rule, per host: one core left when it is shared
            spare = host.cpus - (1 if host.name in busy else 0)
            threads = max(1, spare // per_host[host.name])
        plan_rankers.append(
            Ranker(
                f"ranker-{i}",
                host.name,
                port,
                port + METRICS_OFFSET,
                threads=threads,
                **_ranker_settings(config),
            )
        )
    used = {s.host for s in plan_shards} | busy | set(per_host)
    return Plan(
        **_common(bundle, config),
        mode=deployment_mode(config),
        # Socket paths need every role on one host; over several, the roles talk TCP.
        transport="tcp"
        if config.transport in LOCAL_TRANSPORTS and len(used) > 1
        else config.transport,
        hosts=list(hosts),
        shards=plan_shards,
        rankers=plan_rankers,
        routers=plan_routers,
        placement=placement.report if placement else [],
    )


def _requests(manifest, groups, replicas, rankers, routers, config, hosts) -> list[Request]:
    """What each role asks of a host: a shard its threads and the rows it maps, a ranker its
    threads (RANKER_CORES when auto) and a GPU when the cluster has any and its device allows,
    a router its threads."""
    row_bytes = {t["name"]: int(t["row_bytes"]) for t in manifest["tables"]}
    out = []
    for g, ranges in enumerate(groups):
        rows = sum((b - a) * row_bytes[t] for t, (a, b) in ranges.items())
        memory = (rows + SHARD_MARGIN_BYTES) / GIB
        for r in range(replicas):
            name = f"shard-{g}" if replicas == 1 else f"shard-{g}-{r}"
            out.append(Request(name, "shards", config.shard.threads, memory, 0, g))
    gpu = int(config.ranker.device != "cpu" and any(h.gpus for h in hosts))
    cores = config.ranker.threads or RANKER_CORES
    out += [
        Request(f"ranker-{i}", "rankers", cores, RANKER_MEMORY_GIB, gpu) for i in range(rankers)
    ]
    out += [
        Request(f"router-{i}", "routers", config.router.threads, ROUTER_MEMORY_GIB)
        for i in range(routers)
    ]
    return out


def local_plan(bundle_dir: str | Path, serve_config: ServeConfig) -> Plan:
    """Exactly today's `cleave serve` layout: one host h0 (this machine), `shards` shards
    without replicas, `rankers` rankers, one router, the config's transport. Ports are 0: the
    local runner binds Unix sockets, or picks free TCP ports before it starts each role."""
    config = serve_config
    bundle = Path(bundle_dir).resolve()
    manifest = manifest_io.read(bundle, whole=False)
    held = config.monolithic or config.router_held  # no shard processes
    ranges = table_ranges(manifest, config.shards, config.table_layout)
    ranges = [] if held else [r for r in ranges if r]
    shards = [
        Shard(
            f"shard-{i}",
            i,
            "h0",
            0,
            0,
            config.shard.threads,
            r,
            config.shard.queue,
            dram_budget=config.shard.dram_budget,
        )
        for i, r in enumerate(ranges)
    ]
    rankers = [
        Ranker(
            f"ranker-{i}",
            "h0",
            0,
            0,
            threads=config.ranker_threads(manifest.get("dense", {}).get("demand")),
            **_ranker_settings(config),
        )
        for i in range(config.rankers)
    ]
    return Plan(
        **_common(bundle, config),
        mode=deployment_mode(config),
        transport=config.transport,
        hosts=[this_machine("h0")],
        shards=shards,
        rankers=rankers,
        routers=[Router("router", "h0", config.http_port, config.grpc_port)],
    )


def table_ranges(
    manifest: dict, shards: int, layout: str = "rows"
) -> list[dict[str, tuple[int, int]]]:
    """The rows of each table shard i holds (`table_layout`). "rows": every table cut into
    `shards` contiguous ranges, shard i holding rows [rows * i // S, rows * (i + 1) // S);
    "tables": whole tables (`whole_tables`). Empty ranges are left out."""
    plan: list[dict[str, tuple[int, int]]] = [{} for _ in range(shards)]
    if layout == "tables":
        rows = {t["name"]: int(t["rows"]) for t in manifest["tables"]}
        for name, shard in whole_tables(manifest, shards).items():
            plan[shard][name] = (0, rows[name])
        return plan
    for table in manifest["tables"]:
        rows = int(table["rows"])
        for i in range(shards):
            start, end = rows * i // shards, rows * (i + 1) // shards
            if end > start:
                plan[i][table["name"]] = (start, end)
    return plan


def whole_tables(manifest: dict, parts: int) -> dict[str, int]:
    """Each table whole on one of `parts` (shards, or `cleave score`'s ranks): largest table
    first, each onto the part with the fewest lookups so far (the features reading its
    tables: the pooling work per sample), then the fewest bytes, then the lowest index; the
    same split wherever it is computed."""
    lookups = {t["name"]: 0 for t in manifest["tables"]}
    for f in manifest["features"]:
        lookups[f["table"]] += 1
    work = [(0, 0)] * parts  # (lookups, bytes) per part
    owners = {}
    for table in sorted(manifest["tables"], key=lambda t: (-t["rows"] * t["row_bytes"], t["name"])):
        part = min(range(parts), key=lambda r: (work[r], r))
        owners[table["name"]] = part
        size = table["rows"] * table["row_bytes"]
        work[part] = (work[part][0] + lookups[table["name"]], work[part][1] + size)
    return owners
