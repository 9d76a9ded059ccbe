"""What every benchmark records about where it ran, and its `--realtime` switch."""

from __future__ import annotations

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
