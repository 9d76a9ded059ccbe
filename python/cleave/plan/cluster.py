"""The hosts a plan may use: a cluster file (`hosts: [{name, cpus, memory_gib, gpus, labels}]`)
or N identical emulated hosts with this machine's cores and memory (`--hosts N`, the testbed:
docs/testbed.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cleave.errors import UsageError
from cleave.plan import codec
from cleave.plan.check import host_problems
from cleave.plan.files import read_yaml
from cleave.plan.schema import Host

MAX_EMULATED = 200  # the testbed's limit per instance


@dataclass
class Cluster:
    hosts: list[Host]


def load_cluster(path: str | os.PathLike) -> list[Host]:
    path = Path(path)
    cluster = codec.from_dict(Cluster, read_yaml(path, "cluster file"), "", str(path))
    problems = host_problems(cluster.hosts)
    if problems:
        raise UsageError(f"{path}: " + "; ".join(problems))
    return cluster.hosts


def machine_gpus() -> int:
    """NVIDIA GPUs the driver lists; read from /proc so planning never imports torch."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def this_machine(name: str) -> Host:
    """This machine as one host (os.cpu_count(), as `cleave serve` counts cores)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Host(name, os.cpu_count() or 1, round(memory / (1 << 30), 3), machine_gpus())


def emulated_hosts(count: int) -> list[Host]:
    """`count` identical hosts h0..h{count-1}, each with this machine's cores and memory: on the
    testbed they share both, which `Plan.check`'s cores warning cannot see."""
    if not 1 <= count <= MAX_EMULATED:
        raise UsageError(f"--hosts: expected 1..{MAX_EMULATED} emulated hosts, got {count}")
    return [this_machine(f"h{i}") for i in range(count)]
