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
    kinds = parse_catalog(data, str(path))
    if is_testbed(data, str(path)):
        check_testbed(kinds, str(path))
    return kinds


def is_testbed(data, source: str = "catalog") -> bool:
    """`testbed: true`: the kinds are hosts of this machine's testbed (docs/sizing.md,
    "Validation"), and the plans sized from it carry each host's CPU cap and link rate."""
    flag = data.get("testbed", False) if isinstance(data, dict) else False
    if not isinstance(flag, bool):
        raise UsageError(f"{source}: testbed: expected true or false, got {flag!r}")
    return flag


def testbed_cores(kind: MachineKind) -> float:
    """A testbed kind's CPU cap: its cores at its speed relative to this machine's."""
    return kind.cpus * kind.cpu_speed


def testbed_room() -> float:
    """The most cores a testbed plan's caps may add up to: this machine's, less the load
    generator's (runners/testbed.py refuses a plan over it)."""
    import os

    from cleave.runners.testbed import SPARE_CORES

    return float((os.cpu_count() or 1) - SPARE_CORES)


def check_testbed(kinds: list[MachineKind], source: str) -> None:
    """Refuse a testbed kind the testbed cannot emulate: GPUs, a CPU cap outside what one
    cgroup gives (testbed/cpu.py) with a core left for the load generator, a link htb
    cannot shape."""
    from cleave.testbed.cpu import MIN_CORES

    room = testbed_room()
    problems = []
    for k in kinds:
        cores = testbed_cores(k)
        if k.gpus:
            problems.append(f"kind {k.kind!r}: gpus {k.gpus}: the testbed has no GPUs to give")
        if not MIN_CORES <= cores <= room:
            problems.append(
                f"kind {k.kind!r}: cpus x cpu_speed = {cores:g} cores; a testbed host's cap "
                f"must be {MIN_CORES:g} to {room:g} cores here (one core is the load generator's)"
            )
        if k.nic_gbit > 100:
            problems.append(f"kind {k.kind!r}: nic_gbit {k.nic_gbit:g}: htb shapes at most 100")
    if problems:
        raise UsageError(
            f"{source}: testbed: true, but the testbed cannot emulate: " + "; ".join(problems)
        )


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
