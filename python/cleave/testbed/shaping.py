"""Bandwidth shaping of one link direction with htb.

Layout on every shaped veth (egress)::

    1:    htb root qdisc, unclassified traffic goes to 1:10
    1:1   class at the link rate (ceil = rate): the link itself
    1:10  default leaf under 1:1 at the link rate; its queue is a bfifo of queue_kb
    10:   bfifo, limit queue_kb (tail drop when full)

Later priority classes for control traffic go beside 1:10 under 1:1 (e.g. 1:5 with a lower
``prio``) plus a filter, without touching the link class. There is no netem on this kernel, so
delay and loss cannot be added: only rate, burst and queueing are emulated.
"""

from __future__ import annotations

from dataclasses import dataclass

from cleave.testbed.commands import tc

DEFAULT_BURST_KB = 64.0  # one full GSO segment (64 KiB): veths hand htb packets that large
DEFAULT_QUEUE_KB = 256.0  # about 2 ms at 1 Gbit/s, 20 ms at 100 Mbit/s


@dataclass(frozen=True)
class Shape:
    gbit: float
    burst_kb: float = DEFAULT_BURST_KB
    queue_kb: float = DEFAULT_QUEUE_KB

    @property
    def rate(self) -> str:
        return f"{round(self.gbit * 1e9)}bit"

    @property
    def burst(self) -> str:
        return f"{round(self.burst_kb * 1024)}b"

    @property
    def limit(self) -> str:
        return f"{round(self.queue_kb * 1024)}b"


def apply(dev: str, shape: Shape, netns: str | None = None) -> None:
    """Shape egress of ``dev`` (in ``netns``, or the root namespace) as the module describes."""
    where = ["-n", netns] if netns else []
    link = ["rate", shape.rate, "ceil", shape.rate, "burst", shape.burst, "cburst", shape.burst]
    tc(*where, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
    tc(*where, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", *link)
    tc(*where, "class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", *link)
    tc(
        *where,
        "qdisc",
        "add",
        "dev",
        dev,
        "parent",
        "1:10",
        "handle",
        "10:",
        "bfifo",
        "limit",
        shape.limit,
    )


PRIORITY_CLASS = "1:5"
PRIORITY_SHARE = 0.01  # of the link rate, guaranteed to control traffic (at least 1 Mbit/s)


def _priority_class(dev: str, shape: Shape, where: list[str]) -> None:
    """Class 1:5 (prio 0, a small guaranteed rate, ceil the link) with its own short pfifo,
    so control packets never wait in the data queue; the default leaf 1:10 moves to prio 1.
    Once per device."""
    if f"htb {PRIORITY_CLASS} " in tc(*where, "class", "show", "dev", dev):
        return
    guaranteed = f"{max(round(shape.gbit * 1e9 * PRIORITY_SHARE), 1_000_000)}bit"
    link = ["ceil", shape.rate, "burst", shape.burst, "cburst", shape.burst]
    parent = ["dev", dev, "parent", "1:1"]
    tc(
        *where,
        "class",
        "add",
        *parent,
        "classid",
        PRIORITY_CLASS,
        "htb",
        "rate",
        guaranteed,
        *link,
        "prio",
        "0",
    )
    tc(
        *where,
        "qdisc",
        "add",
        "dev",
        dev,
        "parent",
        PRIORITY_CLASS,
        "handle",
        "5:",
        "pfifo",
        "limit",
        "1000",
    )
    tc(
        *where,
        "class",
        "change",
        *parent,
        "classid",
        "1:10",
        "htb",
        "rate",
        shape.rate,
        *link,
        "prio",
        "1",
    )


def _priority_filter(dev: str, where: list[str], *match: str) -> None:
    tc(
        *where,
        "filter",
        "add",
        "dev",
        dev,
        "parent",
        "1:",
        "protocol",
        "ip",
        "prio",
        "1",
        "u32",
        "match",
        "ip",
        *match,
        "flowid",
        PRIORITY_CLASS,
    )


def add_priority_port(dev: str, shape: Shape, port: int, netns: str | None = None) -> None:
    """Put TCP/UDP traffic to or from ``port`` on ``dev`` in the priority class beside the
    default leaf, as RDMA QoS gives control traffic its own service level. Adding a second
    port adds only its filters."""
    if not (isinstance(port, int) and 0 < port < 65536):
        raise ValueError(f"port must be 1..65535, got {port!r}")
    where = ["-n", netns] if netns else []
    _priority_class(dev, shape, where)
    for field in ("dport", "sport"):
        _priority_filter(dev, where, field, str(port), "0xffff")


def add_priority_dscp(dev: str, shape: Shape, dscp: int, netns: str | None = None) -> None:
    """Put IPv4 packets marked with ``dscp`` (the six high bits of the TOS byte) on ``dev``
    in the priority class: how a switch honours the marks of control connections."""
    if not (isinstance(dscp, int) and 0 <= dscp < 64):
        raise ValueError(f"dscp must be 0..63, got {dscp!r}")
    where = ["-n", netns] if netns else []
    _priority_class(dev, shape, where)
    _priority_filter(dev, where, "tos", hex(dscp << 2), "0xfc")
