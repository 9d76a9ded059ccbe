"""The cluster the simulator places on: host types and their counts, read from a node list
(Alibaba's openb format: `sn, cpu_milli, memory_mib, gpu, model`), scaled by a factor."""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cleave.errors import UsageError

REQUIRED = ("cpu_milli", "memory_mib", "gpu")


@dataclass(frozen=True)
class HostType:
    cpus: float  # cores
    mem: float  # GiB
    gpus: int
    model: str  # GPU model; "" without GPUs
    count: int  # hosts of this type in the node list


@dataclass
class Hosts:
    """A concrete cluster: one entry per host, hosts of a type contiguous."""

    cpu: np.ndarray
    mem: np.ndarray
    gpu: np.ndarray
    kind: np.ndarray  # index into `types`
    types: list[HostType]

    def __len__(self) -> int:
        return len(self.cpu)

    def types_present(self) -> list[HostType]:
        return [self.types[k] for k in np.unique(self.kind)]


def number_field(row: dict, key: str, where: str) -> float:
    """`row[key]` as a finite number >= 0, or a UsageError naming `where` and the key."""
    text = (row.get(key) or "").strip()
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{where}: {key}: expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{where}: {key}: expected a number >= 0, got {text!r}")
    return value


def load_nodes(path: str | os.PathLike) -> list[HostType]:
    """The node list's host types, most numerous first."""
    path = Path(path)
    try:
        f = path.open(newline="")
    except OSError as err:
        raise UsageError(f"{path}: node list cannot be read: {err}") from None
    counts: dict[tuple, int] = {}
    with f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        # The shipped list's names, or those of the openb original (num_gpu, gpu_type).
        gpu_key = "gpu" if "gpu" in fields else "num_gpu"
        model_key = "model" if "model" in fields else "gpu_type"
        missing = [c for c in ("cpu_milli", "memory_mib") if c not in fields]
        if gpu_key not in fields:
            missing.append("gpu")
        if missing:
            raise UsageError(
                f"{path}: header: expected the columns sn, cpu_milli, memory_mib, gpu, model; "
                f"missing {', '.join(missing)}"
            )
        for row in reader:
            where = f"{path}: row {reader.line_num}"
            if None in row:
                raise UsageError(f"{where}: expected {len(fields)} fields, got more")
            cpu = number_field(row, "cpu_milli", where) / 1000
            mem = number_field(row, "memory_mib", where) / 1024
            gpus = number_field(row, gpu_key, where)
            if gpus != int(gpus):
                raise UsageError(f"{where}: {gpu_key}: expected a whole number, got {gpus:g}")
            if cpu <= 0:
                raise UsageError(f"{where}: cpu_milli: expected > 0, got {row['cpu_milli']!r}")
            model = (row.get(model_key) or "").strip() if gpus else ""
            key = (cpu, mem, int(gpus), model)
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        raise UsageError(f"{path}: expected at least one node row, got none")
    types = [HostType(c, m, g, model, n) for (c, m, g, model), n in counts.items()]
    return sorted(types, key=lambda t: (-t.count, -t.gpus, -t.cpus))


def scaled_count(t: HostType, scale: float) -> int:
    # Every type keeps at least one host, so a scaled cluster still offers the list's mix.
    return max(1, round(t.count * scale))


def build_hosts(types: list[HostType], scale: float, only_gpu: bool = False) -> Hosts:
    chosen = [(i, t) for i, t in enumerate(types) if t.gpus > 0 or not only_gpu]
    counts = [scaled_count(t, scale) for _, t in chosen]
    kind = np.repeat([i for i, _ in chosen], counts).astype(np.int32)
    return Hosts(
        cpu=np.array([types[k].cpus for k in kind], dtype=np.float64),
        mem=np.array([types[k].mem for k in kind], dtype=np.float64),
        gpu=np.array([types[k].gpus for k in kind], dtype=np.float64),
        kind=kind,
        types=types,
    )
