"""Who owns an instance: a process, identified by pid plus its start time (so a reused pid is
not mistaken for the owner), or the CLI (owned by nobody, kept until removed by name)."""

from __future__ import annotations

import os
from dataclasses import dataclass

PROCESS = "process"
CLI = "cli"


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot), or None when there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after its closing one.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 counted from field 3
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Owner:
    kind: str  # PROCESS or CLI
    pid: int
    start_time: int

    @classmethod
    def current(cls, kind: str = PROCESS) -> Owner:
        pid = os.getpid()
        return cls(kind=kind, pid=pid, start_time=start_time(pid) or 0)

    def alive(self) -> bool:
        """A CLI-owned instance is alive until removed; a process owner while its pid runs
        with the same start time."""
        if self.kind == CLI:
            return True
        return start_time(self.pid) == self.start_time

    def describe(self) -> str:
        if self.kind == CLI:
            return f"cli (made by pid {self.pid})"
        return f"pid {self.pid}" + ("" if self.alive() else " (gone)")

    def to_json(self) -> dict:
        return {"kind": self.kind, "pid": self.pid, "start_time": self.start_time}

    @classmethod
    def from_json(cls, data: dict) -> Owner:
        kind = data["kind"]
        if kind not in (PROCESS, CLI):
            raise ValueError(f"owner kind must be {PROCESS!r} or {CLI!r}, got {kind!r}")
        return cls(kind=kind, pid=int(data["pid"]), start_time=int(data["start_time"]))

    def alias(self) -> str:
        """The owner as written into the bridge's interface alias (`ip -d link` shows it)."""
        return f"cleave-testbed owner={self.kind}:{self.pid}:{self.start_time}"

    @classmethod
    def from_alias(cls, alias: str) -> Owner | None:
        for word in alias.split():
            if word.startswith("owner="):
                try:
                    kind, pid, start = word[len("owner=") :].split(":")
                    return cls.from_json({"kind": kind, "pid": pid, "start_time": start})
                except (ValueError, KeyError):
                    return None
        return None
