"""Alibaba's DLRM serving trace (cluster-trace-gpu-v2025 format, docs/simulate.md): one row per
CN or HN instance with its requests and lifetime, read into column arrays. Every malformed row
is a UsageError naming the file, the row (1-based line number) and the field."""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cleave.errors import UsageError

# Columns the simulator reads; the others of the format (limits, disk) are allowed and ignored.
REQUIRED = (
    "instance_sn",
    "role",
    "app_name",
    "cpu_request",
    "gpu_request",
    "memory_request",
    "max_instance_per_node",
    "creation_time",
    "deletion_time",
)
ROLES = ("CN", "HN")


@dataclass
class Trace:
    """Column arrays, one entry per instance, in file order. Times are seconds from the trace
    start; an instance alive at the start has `start` 0, one alive at the end `end` = `horizon`."""

    names: list[str]
    role: np.ndarray  # 0 CN, 1 HN
    app: np.ndarray  # index into `apps`
    apps: list[str]
    cpu: np.ndarray  # cores
    mem: np.ndarray  # GiB
    gpu: np.ndarray  # GPUs
    density: np.ndarray  # max instances of its app and role per host; 0: no limit
    start: np.ndarray
    end: np.ndarray
    horizon: float

    def __len__(self) -> int:
        return len(self.names)

    def subset(self, keep: np.ndarray) -> Trace:
        idx = np.flatnonzero(keep)
        cols = {k: getattr(self, k)[idx] for k in ("role", "app", "cpu", "mem", "gpu")}
        return Trace(
            names=[self.names[i] for i in idx],
            apps=self.apps,
            density=self.density[idx],
            start=self.start[idx],
            end=self.end[idx],
            horizon=self.horizon,
            **cols,
        )


def _number(row: dict, field: str, where: str, *, empty: float | None = None) -> float:
    text = (row.get(field) or "").strip()
    if not text and empty is not None:
        return empty
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{where}: {field}: expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise UsageError(f"{where}: {field}: expected a finite number, got {text!r}")
    return value


def load_trace(path: str | os.PathLike) -> Trace:
    path = Path(path)
    try:
        f = path.open(newline="")
    except OSError as err:
        raise UsageError(f"{path}: trace cannot be read: {err}") from None
    with f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise UsageError(
                f"{path}: header: expected the columns {', '.join(REQUIRED)}; missing "
                f"{', '.join(missing)} (got {', '.join(reader.fieldnames or []) or 'no header'})"
            )
        names, rows, apps = [], [], {}
        nan = math.nan
        for row in reader:
            where = f"{path}: row {reader.line_num}"
            if None in row:
                raise UsageError(f"{where}: expected {len(reader.fieldnames)} fields, got more")
            role = (row["role"] or "").strip()
            if role not in ROLES:
                raise UsageError(f"{where}: role: expected CN or HN, got {role!r}")
            app = (row["app_name"] or "").strip()
            if not app:
                raise UsageError(f"{where}: app_name: expected a name, got an empty field")
            cpu = _number(row, "cpu_request", where)
            mem = _number(row, "memory_request", where)
            gpu = _number(row, "gpu_request", where)
            for field, value in (
                ("cpu_request", cpu),
                ("memory_request", mem),
                ("gpu_request", gpu),
            ):
                if value < 0:
                    raise UsageError(f"{where}: {field}: expected >= 0, got {value:g}")
            if cpu == 0 and gpu == 0:
                raise UsageError(f"{where}: cpu_request: expected > 0 (or a GPU), got 0")
            density = _number(row, "max_instance_per_node", where)
            if density != -1 and (density < 1 or density != int(density)):
                raise UsageError(
                    f"{where}: max_instance_per_node: expected -1 (no limit) or a whole "
                    f"number >= 1, got {row['max_instance_per_node']!r}"
                )
            start = _number(row, "creation_time", where, empty=0.0)
            end = _number(row, "deletion_time", where, empty=nan)
            if start < 0:
                raise UsageError(f"{where}: creation_time: expected >= 0, got {start:g}")
            if end < start:  # False for nan (alive at the end)
                raise UsageError(
                    f"{where}: deletion_time: expected >= creation_time ({start:g}), got {end:g}"
                )
            names.append((row["instance_sn"] or "").strip() or f"row-{reader.line_num}")
            a = apps.setdefault(app, len(apps))
            rows.append((role == "HN", a, cpu, mem, gpu, max(density, 0), start, end))
    if not rows:
        raise UsageError(f"{path}: expected at least one instance row, got none")
    cols = np.array(rows, dtype=np.float64)
    times = cols[:, 6:8]
    horizon = float(np.nanmax(times)) if np.isfinite(times).any() else 1.0
    horizon = max(horizon, 1.0)
    end = np.where(np.isnan(cols[:, 7]), horizon, cols[:, 7])
    return Trace(
        names=names,
        role=cols[:, 0].astype(np.int8),
        app=cols[:, 1].astype(np.int32),
        apps=list(apps),
        cpu=cols[:, 2],
        mem=cols[:, 3],
        gpu=cols[:, 4],
        density=cols[:, 5].astype(np.int32),
        start=cols[:, 6],
        end=end,
        horizon=horizon,
    )
