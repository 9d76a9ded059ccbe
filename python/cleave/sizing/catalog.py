"""The machine kinds `cleave size` may buy (docs/sizing.md, "The catalog"): a YAML file

    machines:
    - {kind: c-16, cpus: 16, memory_gib: 64, nic_gbit: 25, price_per_hour: 0.68}
    - {kind: c-64, cpus: 64, memory_gib: 256, nic_gbit: 50, price_per_hour: 2.72,
       cpu_speed: 1.1, max_count: 40}

`cpu_speed` is a core's speed relative to the machine the profile was measured on (default
1); `gpus` and `ssd_iops` are recorded (GPU rankers need a profile measured on a GPU);
`max_count` caps how many of the kind may be bought."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cleave.errors import UsageError
from cleave.plan.check import NAME

# key -> (type, required, default, what it is)
FIELDS = {
    "kind": (str, True, None, "the kind's name, a DNS label"),
    "cpus": (int, True, None, "cores"),
    "memory_gib": (float, True, None, "memory, GiB"),
    "nic_gbit": (float, True, None, "the NIC's rate, Gbit/s"),
    "price_per_hour": (float, True, None, "price of one machine-hour"),
    "cpu_speed": (float, False, 1.0, "a core's speed relative to the profiled machine"),
    "gpus": (int, False, 0, "GPUs"),
    "ssd_iops": (int, False, 0, "4 KiB random reads per second of its SSD"),
    "max_count": (int, False, 1000, "the most machines of this kind"),
}


@dataclass(frozen=True)
class MachineKind:
    kind: str
    cpus: int
    memory_gib: float
    nic_gbit: float
    price_per_hour: float
    cpu_speed: float = 1.0
    gpus: int = 0
    ssd_iops: int = 0
    max_count: int = 1000

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gbit * 1e9 / 8


def load_catalog(path) -> list[MachineKind]:
    from cleave.plan.files import read_yaml

    data = read_yaml(path, "catalog")
    return parse_catalog(data, str(path))


def parse_catalog(data, source: str = "catalog") -> list[MachineKind]:
    if not isinstance(data, dict) or not isinstance(data.get("machines"), list):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise UsageError(f"{source}: expected a mapping with a list `machines`, got {got}")
    if not data["machines"]:
        raise UsageError(f"{source}: machines: expected at least one machine kind, got none")
    kinds, problems = [], []
    for i, entry in enumerate(data["machines"]):
        where = f"{source}: machines[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where}: expected a mapping, got {entry!r}")
            continue
        unknown = sorted(set(entry) - set(FIELDS))
        if unknown:
            problems.append(f"{where}: unknown keys {unknown}; expected some of {list(FIELDS)}")
        values = {}
        for key, (kind, required, default, what) in FIELDS.items():
            if key not in entry:
                if required:
                    problems.append(f"{where}.{key}: missing ({what})")
                values[key] = default
                continue
            values[key] = _value(entry[key], kind, f"{where}.{key}", what, problems)
        if not problems:
            kinds.append(MachineKind(**values))
    seen = set()
    for k in kinds:
        if k.kind in seen:
            problems.append(f"{source}: kind {k.kind!r} is listed twice")
        seen.add(k.kind)
    if problems:
        raise UsageError("; ".join(problems))
    return kinds


def _value(raw, kind, where: str, what: str, problems: list[str]):
    if kind is str:
        if not isinstance(raw, str) or not NAME.match(raw):
            problems.append(f"{where}: expected a DNS label (a-z, 0-9, '-'), got {raw!r}")
        return raw
    ok = isinstance(raw, int | float) and not isinstance(raw, bool) and math.isfinite(raw)
    if kind is int and ok and float(raw) != int(raw):
        ok = False
    if not ok:
        problems.append(f"{where}: expected a {kind.__name__} ({what}), got {raw!r}")
        return kind(0)
    value = kind(raw)
    # Only a GPU count, SSD IOPS may be 0; everything else a machine has is positive.
    if value < 0 or (value == 0 and where.rsplit(".", 1)[-1] not in ("gpus", "ssd_iops")):
        problems.append(f"{where}: expected a positive {kind.__name__} ({what}), got {raw!r}")
    return value
