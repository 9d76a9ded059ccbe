"""The processes of a deployment a benchmark started, read from /proc: which role each is,
their memory, open files and CPU time."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import NamedTuple


def process_table() -> dict[int, tuple[int, list[str]]]:
    """Every process on the machine: pid -> (parent pid, argv), from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        table[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), argv)
    return table


def processes_below(pid: int, table: dict | None = None) -> dict[int, list[str]]:
    """Every process below `pid` (children, theirs, ...: a launcher's rankers are its fork
    server's children): pid -> argv, from `table` (default: /proc now)."""
    table = process_table() if table is None else table
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (p, argv) in table.items():
            if p == parent and child not in found:
                found[child] = argv
                frontier.append(child)
    return found


def process_tree(pid: int) -> dict[int, str]:
    """`pid` and its descendants, each with a short name from its command line."""
    table = process_table()
    below = processes_below(pid, table)
    root = {pid: _role(table[pid][1]) if pid in table else "serve"}
    return root | {child: _role(argv) for child, argv in below.items()}


def _role(argv: list[str]) -> str:
    line = " ".join(argv)
    if argv and Path(argv[0]).name == "cleave-router":
        return "router"
    for arg in argv:
        stem = Path(arg).stem
        if stem.startswith(("shard-", "ranker-")):
            return stem
    # Over TCP their arguments name no socket file.
    if argv and Path(argv[0]).name == "cleave-shard":
        return "shard"
    if "cleave.cli" in argv[:3] and "ranker" in argv[:4]:
        return "ranker"
    if " serve " in f" {line} ":
        return "serve"
    if "cleave.launch.forkserver" in argv:
        return "fork-server"
    return Path(argv[0]).name if argv and argv[0] else "?"


def pss_bytes(pid: int) -> int:
    """Its proportional set size: pages shared with other processes (a fork server's with
    the rankers it forked) counted once over all of them; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class ProcessSample(NamedTuple):
    """A process's memory and open files at one instant. Private: `statm`'s resident less
    shared (its anonymous memory). A shm region's pages count in RSS as the process first
    touches them, up to the region's size, so a leak shows in private memory, not in RSS."""

    rss: int  # bytes
    private: int  # bytes
    fds: int


def sample_process(pid: int) -> ProcessSample | None:
    """The process's sample, None once it is gone (one read of `statm`)."""
    try:
        resident, shared = map(int, Path(f"/proc/{pid}/statm").read_text().split()[1:3])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    return ProcessSample(resident * page, (resident - shared) * page, fds)


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of a process so far, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of a process, ns (schedstat: finer than /proc/PID/stat's
    clock ticks, which are 10 ms: a few hundred requests' worth of router time)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total


def role_pid(root: int, role: str) -> int | None:
    """The first process of `role` ("router", "shard-0", ...) under `root`."""
    return next((pid for pid, name in process_tree(root).items() if name == role), None)


class Sampler:
    """Calls `sample(seconds since start)` every `every_s` on a thread of its own while in
    its `with` block (not at all without a `pid`); `sample` returns False to stop early."""

    def __init__(self, pid: int | None, every_s: float):
        self.pid, self.every_s = pid, every_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.start = time.monotonic()

    def __enter__(self):
        if self.pid:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(30)

    def _run(self) -> None:
        while self.sample(time.monotonic() - self.start) and not self.stop.wait(self.every_s):
            pass

    def sample(self, now: float) -> bool:
        raise NotImplementedError
