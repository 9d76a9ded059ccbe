"""What exists in the kernel for each slot, and removing it: namespaces (with any process
left inside), veths, the bridge. qdiscs go with the devices they sit on."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import signal
import time

from cleave.testbed import cpu, naming, state
from cleave.testbed.commands import TestbedError, ip
from cleave.testbed.owner import Owner

log = logging.getLogger(__name__)
KILL_WAIT_S = 2.0  # per signal, for processes left in a namespace being removed


def netns_names() -> list[str]:
    # Lines look like "cleave-3-h0 (id: 5)" or "cleave-3-h0".
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def links() -> list[dict]:
    return json.loads(ip("-j", "link", "show") or "[]")


def slots_present() -> set[int]:
    """Slots that have at least one namespace or root-namespace interface."""
    found = {naming.slot_of_netns(n) for n in netns_names()}
    found |= {naming.slot_of_link(link.get("ifname", "")) for link in links()}
    found |= cpu.slots_present()
    found.discard(None)
    return found  # type: ignore[return-value]


def bridge_owner(slot: int) -> Owner | None:
    """The owner written into the bridge's alias, when the bridge exists and has one."""
    bridge = naming.Names(slot).bridge
    for link in links():
        if link.get("ifname") == bridge:
            return Owner.from_alias(link.get("ifalias", ""))
    return None


def routed_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 destination routed or local in the root namespace (defaults aside): a slot
    whose subnet overlaps one of these is not used, so the testbed never shadows a real route."""
    found = []
    for route in json.loads(ip("-j", "-4", "route", "show", "table", "all") or "[]"):
        dst = route.get("dst", "default")
        with contextlib.suppress(ValueError):
            if dst != "default":
                found.append(ipaddress.ip_network(dst, strict=False))
    return found


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def kill_netns_processes(netns: str) -> None:
    """Stop every process still inside ``netns`` (SIGTERM, then SIGKILL), bounded in time."""
    pids = [int(p) for p in ip("netns", "pids", netns, check=False).split() if p.isdigit()]
    pids = [p for p in pids if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.02)
        pids = [p for p in pids if _alive(p)]
        if not pids:
            return
    log.warning("processes %s in %s survived SIGKILL for %.0f s", pids, netns, KILL_WAIT_S)


def remove_slot(slot: int) -> None:
    """Remove everything of ``slot`` that exists; raise TestbedError naming what could not be
    removed. Idempotent: nothing present is not an error."""
    failures: list[str] = []
    for ns in netns_names():
        if naming.slot_of_netns(ns) != slot:
            continue
        kill_netns_processes(ns)
        try:
            ip("netns", "delete", ns)
        except TestbedError as err:
            if ns in netns_names():
                failures.append(str(err))
    # Deleting a bridge-side veth also deletes its peer, wherever that peer lives.
    ours = [link["ifname"] for link in links() if naming.slot_of_link(link["ifname"]) == slot]
    bridge = naming.Names(slot).bridge
    for name in sorted(ours, key=lambda n: n == bridge):  # ports first, the bridge last
        try:
            ip("link", "delete", name)
        except TestbedError as err:
            if any(link["ifname"] == name for link in links()):
                failures.append(str(err))
    failures += cpu.remove_slot(slot)  # after the namespaces: their processes are gone
    if failures:
        raise TestbedError(f"could not remove all of testbed slot {slot}: " + "; ".join(failures))


def reclaim_dead() -> list[int]:
    """Remove instances whose owning process is gone, and resources nobody has on record.
    The caller holds state.locked(). Returns the slots removed. An instance whose owner is
    alive (or that the CLI made) is never touched."""
    states, broken = state.read_all()
    removed = []
    for slot, inst in states.items():
        if not inst.owner.alive():
            log.info("removing testbed %r (slot %d) left by %s", inst.name, slot, inst.owner)
            if _try_remove(slot):
                state.remove(slot)
                removed.append(slot)
    # Resources without a state file: their creator writes the file before making anything and
    # removes it after removing everything, so these are orphans unless the bridge's alias
    # names a live owner (someone deleted the file under a running instance).
    for slot in sorted(slots_present() - set(states) - set(broken)):
        owner = bridge_owner(slot)
        if owner is not None and owner.alive():
            continue
        log.info("removing testbed slot %d: its resources have no state file", slot)
        if _try_remove(slot):
            removed.append(slot)
    return removed


def _try_remove(slot: int) -> bool:
    """Remove a leftover; one that resists is reported and skipped (its slot stays busy), so
    it does not stop the caller's own testbed from coming up."""
    try:
        remove_slot(slot)
        return True
    except TestbedError as err:
        log.warning("leaving testbed slot %d in place: %s", slot, err)
        return False
