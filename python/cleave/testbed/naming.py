"""Names and addresses of one testbed instance, all derived from its slot (the instance id).

Slot S (0..511) owns the /24 number S inside the RFC 2544 benchmarking range 198.18.0.0/15,
so instances never share a subnet. Everything it creates carries the id:

* namespaces  ``cleave-S-hI``           (host I), or ``cleave-S-rR`` (rack R: its hosts share it)
* bridge      ``clvSbr``                (root namespace)
* veth pair   ``clvShI`` (inside host I) and ``clvSbI`` (bridge port, root namespace)

Linux interface names hold at most 15 characters, hence ``clv`` rather than ``cleave-``:
``clv511h199`` is the longest. The root namespace is ``.1`` on the bridge, host I is ``.(11+I)``.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

RANGE = ipaddress.ip_network("198.18.0.0/15")
SLOTS = 512  # /24s in the /15
MAX_HOSTS = 200  # host I gets .(11+I): .11 .. .210
HOST_OFFSET = 11
ROOT_OFFSET = 1
NETNS_PREFIX = "cleave-"
LINK_PREFIX = "clv"

NETNS_RE = re.compile(r"^cleave-(\d{1,3})-[hr](\d{1,3})$")
LINK_RE = re.compile(r"^clv(\d{1,3})(br|[hb]\d{1,3})$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")


@dataclass(frozen=True)
class Names:
    """Every name and address of instance ``slot``."""

    slot: int

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        base = int(RANGE.network_address) + self.slot * 256
        return ipaddress.ip_network(f"{ipaddress.IPv4Address(base)}/24")

    @property
    def bridge(self) -> str:
        return f"{LINK_PREFIX}{self.slot}br"

    @property
    def root_address(self) -> str:
        return str(self.subnet.network_address + ROOT_OFFSET)

    def netns(self, index: int) -> str:
        return f"{NETNS_PREFIX}{self.slot}-h{index}"

    def rack_netns(self, rack: int) -> str:
        return f"{NETNS_PREFIX}{self.slot}-r{rack}"

    def host_veth(self, index: int) -> str:
        return f"{LINK_PREFIX}{self.slot}h{index}"

    def bridge_veth(self, index: int) -> str:
        return f"{LINK_PREFIX}{self.slot}b{index}"

    def host_address(self, index: int) -> str:
        return str(self.subnet.network_address + HOST_OFFSET + index)


def slot_of_netns(name: str) -> int | None:
    """The slot a namespace name belongs to, or None when it is not a testbed namespace."""
    match = NETNS_RE.match(name)
    return int(match.group(1)) if match else None


def slot_of_link(name: str) -> int | None:
    """The slot an interface name belongs to, or None when it is not a testbed interface."""
    match = LINK_RE.match(name)
    return int(match.group(1)) if match else None


def slot_of_address(address: str) -> int | None:
    """The slot whose subnet holds ``address`` (a host's or the root's), or None."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if ip not in RANGE:
        return None
    return (int(ip) - int(RANGE.network_address)) // 256
