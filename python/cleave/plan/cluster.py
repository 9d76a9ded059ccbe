"""The hosts a plan may use: a cluster file (`hosts: [{name, cpus, memory_gib, gpus, labels}]`)
or N identical emulated hosts with this machine's cores and memory (`--hosts N`, the testbed:
docs/testbed.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from cleave.errors import UsageError
from cleave.plan import codec
from cleave.plan.check import host_problems
from cleave.plan.files import read_yaml
from cleave.plan.schema import Host
from cleave.plan.topology import Node, Topology, build_topology

MAX_EMULATED = 200  # the testbed's limit per instance


@dataclass
class Cluster:
    hosts: list[Host]
    # Optional (docs/plan.md, "Topology-aware placement"): pods, switches, hosts, NUMA nodes
    # and PCIe switches; with it `cleave plan` places by Prism's Algorithm 1.
    topology: list[Node] = field(default_factory=list)
    # Role kind (shards, rankers, routers) -> at most this many of it per host.
    max_instance_per_node: dict[str, int] = field(default_factory=dict)


@dataclass
class ClusterFile:
    hosts: list[Host]
    topology: Topology | None
    limits: dict[str, int]


def load_cluster_file(path: str | os.PathLike) -> ClusterFile:
    """The cluster file's hosts, its resolved topology (None without one) and density limits."""
    path = Path(path)
    cluster = codec.from_dict(Cluster, read_yaml(path, "cluster file"), "", str(path))
    problems = host_problems(cluster.hosts)
    for role, limit in cluster.max_instance_per_node.items():
        if role not in ("shards", "rankers", "routers"):
            problems.append(
                f"max_instance_per_node.{role}: expected shards, rankers or routers, got {role!r}"
            )
        elif limit < 1:
            problems.append(f"max_instance_per_node.{role}: expected at least 1, got {limit}")
    if problems:
        raise UsageError(f"{path}: " + "; ".join(problems))
    topology = None
    if cluster.topology:
        try:
            topology = build_topology(cluster.topology, cluster.hosts)
        except UsageError as err:
            raise UsageError(f"{path}: {err}") from None
    return ClusterFile(cluster.hosts, topology, dict(cluster.max_instance_per_node))


def load_cluster(path: str | os.PathLike) -> list[Host]:
    return load_cluster_file(path).hosts


def machine_gpus() -> int:
    """NVIDIA GPUs the driver lists; read from /proc so planning never imports torch."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def this_machine(name: str) -> Host:
    """This machine as one host: the cores this process may use, as `cleave serve` counts."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Host(name, len(os.sched_getaffinity(0)), round(memory / (1 << 30), 3), machine_gpus())


def emulated_hosts(count: int) -> list[Host]:
    """`count` identical hosts h0..h{count-1}, each with this machine's cores and memory: on the
    testbed they share both, which `Plan.check`'s cores warning cannot see."""
    if not 1 <= count <= MAX_EMULATED:
        raise UsageError(f"--hosts: expected 1..{MAX_EMULATED} emulated hosts, got {count}")
    return [this_machine(f"h{i}") for i in range(count)]
