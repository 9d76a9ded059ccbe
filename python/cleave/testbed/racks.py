"""Racks on the testbed (docs/testbed.md, "Racks"): the hosts of a rack share one network
namespace, the rack's fabric (local delivery between their addresses: unshaped, as DRack's
CXL interconnect), and each host's NIC is its own htb-shaped veth from the rack to the core
bridge. Two wirings of the same NICs:

* ``tor``: a packet leaves by the NIC of the address it is sent from (policy routing, one
  table per NIC): each host has its own NIC only, today's one-link-per-host shape.
* ``pool``: every NIC is an MPTCP ``subflow`` endpoint, so an MPTCP connection opens one
  subflow per NIC of the connecting rack, subflow k (bound to NIC k) goes to the far rack's
  NIC k (policy routing on the outgoing interface), and the far end's replies to the address
  of NIC k leave by its own NIC k (a /32 route per peer address): subflow k crosses the two
  racks' NICs k, both ways, whatever hosts the ends are on. The connection's first subflow
  goes straight to the host's own NIC.

Both: ARP answered only by the NIC that holds the address (arp_ignore 1, arp_announce 2), and
reverse-path filtering off (a reply may come in by another NIC than the one it left by).
"""

from __future__ import annotations

from cleave.errors import UsageError
from cleave.testbed.commands import ip

MODES = ("tor", "pool")
TABLE_BASE = 100  # routing table of NIC k in ToR mode: 100 + k
OIF_TABLE_BASE = 200  # pool mode: routes of the sockets bound to NIC k: 200 + k
MAX_SUBFLOWS = 8  # the kernel's ceiling for `ip mptcp limits`


def check(racks: int, hosts_per_rack: int, mode: str, max_hosts: int) -> None:
    for what, value in (("racks", racks), ("hosts_per_rack", hosts_per_rack)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{what} must be an integer >= 1, got {value!r}")
    if racks * hosts_per_rack > max_hosts:
        raise UsageError(
            f"racks x hosts_per_rack must be <= {max_hosts} hosts, got "
            f"{racks} x {hosts_per_rack} = {racks * hosts_per_rack}"
        )
    if hosts_per_rack > MAX_SUBFLOWS:
        raise UsageError(
            f"hosts_per_rack must be <= {MAX_SUBFLOWS} (MPTCP subflows per connection), "
            f"got {hosts_per_rack}"
        )
    if mode not in MODES:
        raise UsageError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


def sysctls(netns: str) -> None:
    """ARP and reverse-path settings of a namespace holding several NICs on one subnet."""
    for key, value in (
        ("net.ipv4.conf.all.arp_ignore", "1"),
        ("net.ipv4.conf.all.arp_announce", "2"),
        ("net.ipv4.conf.all.rp_filter", "0"),
        ("net.ipv4.conf.default.rp_filter", "0"),
    ):
        ip("netns", "exec", netns, "sysctl", "-qw", f"{key}={value}")


def wire_tor(netns: str, nics: list[tuple[str, str]], prefix: int, subnet: str) -> None:
    """``nics``: (device, address) of each NIC of the rack, in rack order."""
    for k, (dev, address) in enumerate(nics):
        table = str(TABLE_BASE + k)
        tor_routes(netns, k, dev, address, subnet)
        ip("-n", netns, "rule", "add", "from", address, "table", table, "pref", table)
    ip("-n", netns, "mptcp", "limits", "set", "subflows", "0", "add_addr_accepted", "0")


def wire_pool(netns: str, nics: list[tuple[str, str]], peers: list[tuple[str, list[str]]]) -> None:
    """``peers``: every NIC address of the other racks, with the addresses of the NICs of its
    rack in rack order (the gateways a subflow bound to this rack's NIC k goes through)."""
    for k, (dev, src) in enumerate(nics):
        table = str(OIF_TABLE_BASE + k)
        ip("-n", netns, "rule", "add", "oif", dev, "table", table, "pref", table)
        pool_routes(netns, k, dev, src, peers)
    n = str(min(len(nics), MAX_SUBFLOWS))
    ip("-n", netns, "mptcp", "limits", "set", "subflows", n, "add_addr_accepted", n)
    for k, (dev, address) in enumerate(nics):
        ip(
            "-n",
            netns,
            "mptcp",
            "endpoint",
            "add",
            address,
            "dev",
            dev,
            "id",
            str(k + 1),
            "subflow",
        )


# The routes through a NIC go when its link goes down; Testbed.set_link puts them back
# ("replace": idempotent) when it comes up.


def tor_routes(netns: str, k: int, dev: str, address: str, subnet: str) -> None:
    table = str(TABLE_BASE + k)
    ip("-n", netns, "route", "replace", subnet, "dev", dev, "src", address, "table", table)


def pool_routes(netns: str, k: int, dev: str, src: str, peers: list[tuple[str, list[str]]]) -> None:
    """NIC k's routes in pool mode. Main table: a peer NIC of index k is reached straight
    through this rack's NIC k (so the bulk a host sends back to a subflow's address leaves
    by the NIC of that subflow). Table OIF_TABLE_BASE + k, for sockets bound to NIC k (the
    subflows the path manager opens from its endpoint): any peer address through the NIC
    of index k of the peer's rack, which delivers it to the peer's rack namespace (the
    address is local there), so subflows arrive over every NIC of the far rack too."""
    table = str(OIF_TABLE_BASE + k)
    for address, gateways in peers:
        if gateways.index(address) % len(gateways) == k:
            ip("-n", netns, "route", "replace", f"{address}/32", "dev", dev, "src", src)
        if k < len(gateways):
            via = gateways[k]
            ip(
                "-n",
                netns,
                "route",
                "replace",
                f"{address}/32",
                "via",
                via,
                "dev",
                dev,
                "src",
                src,
                "onlink",
                "table",
                table,
            )
