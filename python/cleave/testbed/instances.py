"""Every instance on this machine, for `cleave testbed list` and `down`: by name, or all that
nobody (alive) owns."""

from __future__ import annotations

from dataclasses import dataclass

from cleave.errors import UsageError
from cleave.testbed import naming, resources, state
from cleave.testbed.commands import require_privileges
from cleave.testbed.owner import CLI


@dataclass(frozen=True)
class Listed:
    slot: int
    name: str  # "-" when there is no readable state file
    subnet: str
    hosts: str
    link_gbit: str
    owner: str
    status: str  # live | dead owner | no state file | unreadable state


def list_all() -> list[Listed]:
    states, broken = state.read_all()
    present = resources.slots_present()
    rows = []
    for slot in sorted(set(states) | set(broken) | present):
        subnet = str(naming.Names(slot).subnet)
        if slot in states:
            s = states[slot]
            status = "live" if s.owner.alive() else "dead owner"
            rows.append(
                Listed(
                    slot,
                    s.name,
                    subnet,
                    f"{s.hosts} ({s.racks} racks, {s.rack_mode})" if s.racks else str(s.hosts),
                    f"{s.link_gbit:g}",
                    s.owner.describe(),
                    status,
                )
            )
        else:
            status = broken.get(slot, "no state file")
            rows.append(Listed(slot, "-", subnet, "-", "-", "-", status))
    return rows


def remove_by_name(name: str) -> int:
    """Remove the instance called ``name`` unless a live process owns it; returns its slot."""
    require_privileges()
    with state.locked():
        states, _ = state.read_all()
        match = [s for s in states.values() if s.name == name]
        if not match:
            known = ", ".join(sorted(s.name for s in states.values())) or "none"
            raise UsageError(f"no testbed named {name!r} (testbeds: {known})")
        inst = match[0]
        if inst.owner.kind != CLI and inst.owner.alive():
            raise UsageError(
                f"testbed {name!r} is owned by running pid {inst.owner.pid}, which removes it "
                f"when it exits; stop that process instead"
            )
        resources.remove_slot(inst.slot)
        state.remove(inst.slot)
        return inst.slot


def remove_all() -> tuple[list[int], list[str]]:
    """Remove every CLI-made instance, every leftover of a dead owner and every orphan.
    Returns (slots removed, names left because a live process owns them)."""
    require_privileges()
    with state.locked():
        removed = resources.reclaim_dead()
        states, broken = state.read_all()
        kept = []
        for slot, inst in states.items():
            if inst.owner.kind == CLI:
                resources.remove_slot(slot)
                state.remove(slot)
                removed.append(slot)
            else:
                kept.append(f"{inst.name} (pid {inst.owner.pid})")
        # Explicitly asked for all: orphans whose bridge alias names a CLI owner go too, and
        # slots with unreadable state files.
        for slot in sorted((resources.slots_present() | set(broken)) - set(states)):
            if slot in removed:
                continue
            owner = resources.bridge_owner(slot)
            if owner is not None and owner.kind != CLI and owner.alive():
                kept.append(f"slot {slot} (pid {owner.pid})")
                continue
            resources.remove_slot(slot)
            state.remove(slot)
            removed.append(slot)
        return sorted(removed), kept
