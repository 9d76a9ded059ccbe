"""One small JSON file per instance under /run/cleave-testbed (tmpfs: gone after a reboot, as
are the namespaces it describes), written atomically, plus a lock file that serialises claiming
a slot and removing leftovers between processes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cleave.testbed.commands import TestbedError
from cleave.testbed.naming import SLOTS
from cleave.testbed.owner import Owner

STATE_DIR = Path("/run/cleave-testbed")
LOCK_WAIT_S = 120.0  # a holder runs at most a reclaim: bounded ip/tc calls
VERSION = 1


@dataclass(frozen=True)
class InstanceState:
    slot: int
    name: str
    hosts: int
    link_gbit: float
    burst_kb: float
    queue_kb: float
    owner: Owner
    created: float
    racks: int = 0  # 0: no racks (racks.py)
    rack_mode: str = ""  # with racks: "tor" or "pool"

    def to_json(self) -> dict:
        return {
            "version": VERSION,
            "slot": self.slot,
            "name": self.name,
            "hosts": self.hosts,
            "link_gbit": self.link_gbit,
            "burst_kb": self.burst_kb,
            "queue_kb": self.queue_kb,
            "owner": self.owner.to_json(),
            "created": self.created,
            "racks": self.racks,
            "rack_mode": self.rack_mode,
        }

    @classmethod
    def from_json(cls, data: dict) -> InstanceState:
        if data.get("version") != VERSION:
            raise ValueError(f"version must be {VERSION}, got {data.get('version')!r}")
        return cls(
            slot=int(data["slot"]),
            name=str(data["name"]),
            hosts=int(data["hosts"]),
            link_gbit=float(data["link_gbit"]),
            burst_kb=float(data["burst_kb"]),
            queue_kb=float(data["queue_kb"]),
            owner=Owner.from_json(data["owner"]),
            created=float(data["created"]),
            # Absent from files written before racks: none.
            racks=int(data.get("racks", 0)),
            rack_mode=str(data.get("rack_mode", "")),
        )


def path_of(slot: int) -> Path:
    return STATE_DIR / f"{slot}.json"


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """Hold the testbed lock (waiting at most LOCK_WAIT_S)."""
    STATE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    lock_path = STATE_DIR / ".lock"
    with open(lock_path, "a") as lock:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TestbedError(
                        f"{lock_path} stayed locked by another cleave testbed for "
                        f"{LOCK_WAIT_S:.0f} s; is one stuck?"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write(state: InstanceState) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    STATE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    final = path_of(state.slot)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)


def remove(slot: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        path_of(slot).unlink()


def read_all() -> tuple[dict[int, InstanceState], dict[int, str]]:
    """Every instance on record, and the slots whose file could not be read (slot -> why)."""
    states: dict[int, InstanceState] = {}
    broken: dict[int, str] = {}
    if not STATE_DIR.is_dir():
        return states, broken
    for path in sorted(STATE_DIR.glob("*.json")):
        if not path.stem.isdigit() or not 0 <= int(path.stem) < SLOTS:
            continue
        slot = int(path.stem)
        try:
            state = InstanceState.from_json(json.loads(path.read_text(encoding="utf-8")))
            if state.slot != slot:
                raise ValueError(f"it names slot {state.slot}")
            states[slot] = state
        except FileNotFoundError:
            continue  # removed while listing
        except (OSError, ValueError, KeyError, TypeError) as err:
            broken[slot] = f"{path}: unreadable state ({err})"
    return states, broken
