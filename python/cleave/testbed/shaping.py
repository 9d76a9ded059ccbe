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
