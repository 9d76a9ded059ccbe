"""The testbed hosts' TCP retransmission timeout floor, set as datacenter hosts set it.

Linux waits at least 200 ms (`tcp_rto_min`) before it resends a segment whose ACK did not
come. On the testbed's shallow switch queues (shaping.py: 256 KiB, 2 ms at 1 Gbit/s) the
shard responses and request bodies converging on a router host overflow its queue (measured:
3,169 drops on the link into the routers' host in one 3x overload run), and each loss that
fast retransmit cannot repair stalls its connection for 200 ms or more: lookup stages of
100-500 ms on an idle core, read by the routers' admission as overload. This is TCP incast
(Vasudevan et al., SIGCOMM 2009), and datacenter operators lower the floor to a few
milliseconds for it; so does the testbed, in every namespace it creates
(`net.ipv4.tcp_rto_min_us`, Linux >= 6.11) and on the root namespace's route to the testbed
(`rto_min`, for the load generator's connections). docs/testbed.md, "TCP".
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from cleave.errors import UsageError
from cleave.testbed.commands import ip

DEFAULT_RTO_MIN_MS = 5.0
KERNEL_RTO_MIN_MS = 200.0  # Linux's TCP_RTO_MIN: lowering to more than this changes nothing
SYSCTL_KEY = "net.ipv4.tcp_rto_min_us"
SYSCTL = Path("/proc/sys", *SYSCTL_KEY.split("."))


def check(rto_min_ms: float) -> float:
    """0 (the kernel's) or a floor in (0, 200] ms."""
    if isinstance(rto_min_ms, bool) or not isinstance(rto_min_ms, int | float):
        raise UsageError(f"rto_min_ms must be a number, got {rto_min_ms!r}")
    if not (math.isfinite(rto_min_ms) and 0 <= rto_min_ms <= KERNEL_RTO_MIN_MS):
        raise UsageError(
            f"rto_min_ms must be 0 (the kernel's) to {KERNEL_RTO_MIN_MS:g}, got {rto_min_ms!r}"
        )
    return float(rto_min_ms)


def netns_floor(rto_min_ms: float) -> float:
    """The floor the testbed's namespaces can take: `rto_min_ms`, or 0 (said once, on stderr)
    where this kernel has no per-namespace floor."""
    if rto_min_ms and not SYSCTL.exists():
        print(
            f"testbed: this kernel has no {SYSCTL} (Linux < 6.11): the hosts keep its "
            f"{KERNEL_RTO_MIN_MS:g} ms retransmission floor",
            file=sys.stderr,
        )
        return 0.0
    return rto_min_ms


def apply_netns(netns: str, rto_min_ms: float) -> None:
    """Every TCP connection made in `netns` from now on waits at least `rto_min_ms` (a
    `netns_floor`; 0: the kernel's)."""
    if rto_min_ms:
        ip("netns", "exec", netns, "sysctl", "-qw", f"{SYSCTL_KEY}={round(rto_min_ms * 1000)}")


def apply_route(subnet: str, dev: str, src: str, rto_min_ms: float) -> None:
    """The root namespace's connected route to the testbed, with the floor as its metric."""
    if rto_min_ms:
        floor = f"{rto_min_ms:g}ms"
        route = ["proto", "kernel", "scope", "link", "src", src, "rto_min", floor]
        ip("route", "replace", subnet, "dev", dev, *route)
