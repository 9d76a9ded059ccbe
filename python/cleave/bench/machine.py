"""What every benchmark records about where it ran, and its `--realtime` switch."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess

from cleave.errors import UsageError


def describe() -> dict:
    """CPU model, usable cores, last-level cache, memory, and the software that was measured."""
    info = {"cpu": platform.processor(), "cores": len(os.sched_getaffinity(0)), "llc": None}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                info["cpu"] = value.strip()
            elif key.strip() == "L3 cache":
                info["llc"] = value.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(memory / 2**30, 1)
    except (ValueError, OSError):
        info["memory_gib"] = None
    import torch

    info.update(
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    )
    return info


def go_realtime() -> None:
    """SCHED_FIFO for this thread and every thread and process started from it, so that other
    processes on a shared machine do not add their scheduling delays to what is measured."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (AttributeError, OSError) as err:
        raise UsageError(f"--realtime needs SCHED_FIFO (root or CAP_SYS_NICE): {err}") from None


def parse_pin(spec: str) -> tuple[list[int] | None, list[int] | None]:
    """`--pin SERVER:CLIENT` as two CPU lists ("0-2,5:3"); "auto": every allowed core but
    the last for the server, the last for the client (no pinning on one core); "off": none."""
    allowed = sorted(os.sched_getaffinity(0))
    if spec == "off" or (spec == "auto" and len(allowed) < 2):
        return None, None
    if spec == "auto":
        return allowed[:-1], allowed[-1:]
    try:
        server, client = (_cpu_list(part) for part in spec.split(":"))
    except ValueError:
        raise UsageError(
            f"--pin: expected SERVER:CLIENT CPU lists such as 0-2:3, auto or off, got {spec!r}"
        ) from None
    if not set(server) <= set(allowed) or not set(client) <= set(allowed):
        raise UsageError(f"--pin {spec}: this process may use CPUs {allowed} only")
    if set(server) & set(client):
        raise UsageError(f"--pin {spec}: the server and the client share CPUs")
    return server, client


def _cpu_list(text: str) -> list[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus:
        raise ValueError(text)
    return sorted(cpus)


@contextlib.contextmanager
def pinned(cpus: list[int] | None):
    """This thread on `cpus` (None: as it is) for the block; threads and processes it starts
    meanwhile keep them (a deployment started inside stays on its cores)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
