"""The planner: a bundle, hosts and counts -> a Plan (placement rules in docs/plan.md), and
`local_plan`, today's `cleave serve` layout as a plan."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from cleave.errors import UsageError
from cleave.launch.config import ServeConfig
from cleave.launch.serve import read_manifest, table_ranges
from cleave.plan.check import host_problems
from cleave.plan.cluster import this_machine
from cleave.plan.schema import Host, Plan, Ranker, Router, Shard, Supervision

# Logical ports, per host: role i of its kind on a host gets BASE + i; its metrics port is
# that + METRICS_OFFSET. PER_HOST keeps the kinds' ranges apart.
SHARD_PORT, RANKER_PORT, ROUTER_PORT = 7000, 7100, 8000
METRICS_OFFSET = 2000
PER_HOST = 100


def layout(hosts: list[Host]) -> tuple[list[Host], list[Host], list[Host]]:
    """(router hosts, shard hosts, ranker hosts)."""
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
        "max_batch": c.max_batch,
        "max_wait_ms": c.max_wait_ms,
        "max_queue": c.max_queue,
        "cuda_graphs": c.cuda_graphs,
        "compile": c.compile,
        "compile_cache": c.compile_cache,
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
) -> Plan:
    """A disaggregated deployment of the bundle on `hosts`: `shards` range groups with
    `replicas` replicas each on distinct hosts, `rankers` rankers, `routers` routers. Not yet
    checked against resources: call `plan.check(manifest)`."""
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
    manifest = read_manifest(bundle)
    router_hosts, shard_hosts, ranker_hosts = layout(hosts)
    if replicas > len(shard_hosts):
        names = ", ".join(h.name for h in shard_hosts)
        raise UsageError(
            f"replicas: expected at most {len(shard_hosts)}, the hosts that may hold shards "
            f"({names}), got {replicas}: a range's replicas go on distinct hosts"
        )
    ports = _Ports()
    plan_shards = []
    # More shards than rows in every table leaves some empty: they are left out.
    groups = [r for r in table_ranges(manifest, shards) if r]
    for g, ranges in enumerate(groups):
        for r in range(replicas):
            # Consecutive slots over the shard hosts: a group's K replicas land on K distinct
            # hosts (K <= hosts) and every host gets the same number of shards, +- 1.
            host = shard_hosts[(g * replicas + r) % len(shard_hosts)].name
            port = ports.next("shards", host, SHARD_PORT)
            name = f"shard-{g}" if replicas == 1 else f"shard-{g}-{r}"
            plan_shards.append(
                Shard(name, g, host, port, port + METRICS_OFFSET, config.shard.threads, ranges)
            )
    plan_routers = []
    for i in range(routers):
        host = router_hosts[i % len(router_hosts)].name
        n = ports.next("routers", host, 0)
        http_port = (config.http_port or ROUTER_PORT) + n
        plan_routers.append(Router(f"router-{i}", host, http_port))
    placed = [ranker_hosts[i % len(ranker_hosts)] for i in range(rankers)]
    per_host = Counter(h.name for h in placed)
    busy = {s.host for s in plan_shards} | {r.host for r in plan_routers}
    plan_rankers = []
    for i, host in enumerate(placed):
        port = ports.next("rankers", host.name, RANKER_PORT)
        threads = config.ranker.threads
        if not threads:  # cleave serve's rule, per host: one core left when it is shared
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
        mode="disaggregated",
        transport=config.transport if len(used) == 1 else "tcp",
        hosts=list(hosts),
        shards=plan_shards,
        rankers=plan_rankers,
        routers=plan_routers,
    )


def local_plan(bundle_dir: str | Path, serve_config: ServeConfig) -> Plan:
    """Exactly today's `cleave serve` layout: one host h0 (this machine), `shards` shards
    without replicas, `rankers` rankers, one router, the config's transport. Ports are 0: the
    local runner binds Unix sockets, or picks free TCP ports before it starts each role."""
    config = serve_config
    bundle = Path(bundle_dir).resolve()
    manifest = read_manifest(bundle)
    ranges = [] if config.monolithic else [r for r in table_ranges(manifest, config.shards) if r]
    shards = [
        Shard(f"shard-{i}", i, "h0", 0, 0, config.shard.threads, r) for i, r in enumerate(ranges)
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
        mode="monolithic" if config.monolithic else "disaggregated",
        transport=config.transport,
        hosts=[this_machine("h0")],
        shards=shards,
        rankers=rankers,
        routers=[Router("router", "h0", config.http_port)],
    )
