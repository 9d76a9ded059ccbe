"""A testbed host's CPU cap (docs/testbed.md, "CPU caps"): a cgroup per capped host,
`cleave-S-hI`, with a CFS bandwidth limit of `cores` cores, and every process the testbed
starts on that host placed in it before it execs. cgroup v1's cpu controller
(`cpu.cfs_quota_us` / `cpu.cfs_period_us`) or v2's `cpu.max`, whichever is mounted."""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

from cleave.errors import UsageError
from cleave.testbed.commands import TestbedError

V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")
# The bandwidth period. CFS lets a group run `quota` per period, then throttles it until
# the next: a short period keeps a capped host's stalls short (a request's service time is
# then slowed evenly, as on a slower core, not paused for most of 100 ms, the kernel's
# default). The kernel's least quota is 1 ms, so the least cap is 0.1 core.
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000
MIN_CORES = MIN_QUOTA_US / PERIOD_US
GROUP_RE = re.compile(r"^cleave-(\d{1,3})-h(\d{1,3})$")
REMOVE_WAIT_S = 2.0  # for a group's last processes to leave after they were killed


def root() -> tuple[str, Path] | None:
    """("v1", its cpu hierarchy) or ("v2", the unified one) where this machine can cap CPU."""
    if (V1_ROOT / "cpu.cfs_quota_us").exists():
        return "v1", V1_ROOT
    if (V2_ROOT / "cgroup.controllers").exists() and "cpu" in (
        V2_ROOT / "cgroup.controllers"
    ).read_text().split():
        return "v2", V2_ROOT
    return None


def check_cores(cores: float, what: str) -> float:
    if isinstance(cores, bool) or not isinstance(cores, int | float):
        raise UsageError(f"{what}: expected a number of cores, got {cores!r}")
    if not MIN_CORES <= cores <= os.cpu_count():
        raise UsageError(
            f"{what}: a CPU cap must be {MIN_CORES:g} to {os.cpu_count()} cores (the "
            f"kernel's least quota is {MIN_QUOTA_US} us per {PERIOD_US} us period), got {cores!r}"
        )
    return float(cores)


def group_name(slot: int, index: int) -> str:
    return f"cleave-{slot}-h{index}"


def create(slot: int, index: int, cores: float) -> Path:
    """The host's cgroup, capped at `cores`; returns the file a process joins it by."""
    found = root()
    if found is None:
        raise TestbedError(
            "cannot cap a host's CPU: no cgroup cpu controller (neither v1's "
            f"{V1_ROOT}/cpu.cfs_quota_us nor 'cpu' in {V2_ROOT}/cgroup.controllers)"
        )
    version, base = found
    path = base / group_name(slot, index)
    quota = max(MIN_QUOTA_US, round(cores * PERIOD_US))
    try:
        path.mkdir(exist_ok=True)
        if version == "v1":
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    except OSError as err:
        raise TestbedError(f"cannot cap host h{index}'s CPU at {cores:g} cores: {err}") from None
    return path / "cgroup.procs"


def procs_file(slot: int, index: int) -> Path | None:
    """The host's cgroup.procs when it is capped."""
    found = root()
    if found is None:
        return None
    path = found[1] / group_name(slot, index) / "cgroup.procs"
    return path if path.exists() else None


def joined(procs: Path, argv: list[str]) -> list[str]:
    """`argv` run by a shell that first moves itself into the cgroup, then execs: the
    process and all it starts are capped from their first instruction."""
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *argv]


def groups(slot: int | None = None) -> list[Path]:
    """Every testbed cgroup (of `slot`, when given)."""
    found = root()
    if found is None:
        return []
    out = []
    for path in found[1].iterdir():
        m = GROUP_RE.match(path.name)
        if m and path.is_dir() and (slot is None or int(m.group(1)) == slot):
            out.append(path)
    return sorted(out)


def slots_present() -> set[int]:
    return {int(GROUP_RE.match(p.name).group(1)) for p in groups()}  # type: ignore[union-attr]


def remove_slot(slot: int) -> list[str]:
    """Remove the slot's cgroups (their processes were stopped with their namespaces; any
    left are moved to the root group first). Returns what could not be removed."""
    failures = []
    for path in groups(slot):
        deadline = time.monotonic() + REMOVE_WAIT_S
        while True:
            try:
                path.rmdir()
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    failures.append(f"cgroup {path}: {err}")
                    break
                _evict(path)
                time.sleep(0.02)
    return failures


def _evict(path: Path) -> None:
    with contextlib.suppress(OSError):
        parent = path.parent / "cgroup.procs"
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                parent.write_text(pid)
