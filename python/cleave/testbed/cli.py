"""`cleave testbed up|down|list`. An instance made here outlives the command: it is recorded
as CLI-owned and stays until `cleave testbed down --name NAME` (or `--all`) removes it."""

from __future__ import annotations

import argparse
import sys

from cleave.testbed import instances, racks, shaping, tcp
from cleave.testbed.testbed import Testbed

DEFAULT_NAME = "default"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="create N hosts; prints HOSTNAME NETNS ADDRESS per host")
    count = up.add_mutually_exclusive_group(required=True)
    count.add_argument("--hosts", type=int, metavar="N", help="hosts, 1..200")
    count.add_argument(
        "--racks",
        type=int,
        metavar="R",
        help="racks of --hosts-per-rack hosts each (docs/testbed.md, 'Racks')",
    )
    up.add_argument(
        "--hosts-per-rack", type=int, default=4, metavar="H", help="with --racks (default 4)"
    )
    up.add_argument(
        "--mode",
        choices=racks.MODES,
        default="tor",
        help="with --racks: each host's own NIC (tor) or every NIC of its rack (pool)",
    )
    up.add_argument(
        "--link-gbit",
        type=float,
        default=1.0,
        metavar="G",
        help="rate of every host link, each direction (default 1)",
    )
    up.add_argument(
        "--burst-kb",
        type=float,
        default=shaping.DEFAULT_BURST_KB,
        help=f"htb burst (default {shaping.DEFAULT_BURST_KB:g})",
    )
    up.add_argument(
        "--queue-kb",
        type=float,
        default=shaping.DEFAULT_QUEUE_KB,
        help=f"bfifo queue limit (default {shaping.DEFAULT_QUEUE_KB:g})",
    )
    up.add_argument(
        "--rto-min-ms",
        type=float,
        default=tcp.DEFAULT_RTO_MIN_MS,
        help=f"hosts' TCP retransmission floor (default {tcp.DEFAULT_RTO_MIN_MS:g}; 0: the "
        "kernel's 200)",
    )
    up.add_argument("--name", default=DEFAULT_NAME, help=f"(default {DEFAULT_NAME!r})")
    down = sub.add_parser("down", help="remove a CLI-made testbed, or all leftovers")
    which = down.add_mutually_exclusive_group()
    which.add_argument("--name", default=DEFAULT_NAME, help=f"(default {DEFAULT_NAME!r})")
    which.add_argument(
        "--all",
        action="store_true",
        help="every CLI-made testbed and every leftover of a dead owner",
    )
    sub.add_parser("list", help="every testbed on this machine")


def run(args: argparse.Namespace) -> int:
    if args.action == "up":
        return _up(args)
    if args.action == "down":
        return _down(args)
    return _list()


def _up(args: argparse.Namespace) -> int:
    racked = args.racks is not None
    if racked:
        racks.check(args.racks, args.hosts_per_rack, args.mode, 200)
    tb = Testbed(
        args.racks * args.hosts_per_rack if racked else args.hosts,
        args.link_gbit,
        burst_kb=args.burst_kb,
        queue_kb=args.queue_kb,
        rto_min_ms=args.rto_min_ms,
        name=args.name,
        detached=True,
        racks=args.racks,
        mode=args.mode,
    ).up()
    for h in tb.hosts:
        print(f"{h.name} {h.netns} {h.address}" + (f" rack{h.rack}" if racked else ""))
    print(f"root - {tb.root_address}", flush=True)
    print(
        f"testbed {tb.name!r} is up: slot {tb.slot}, {tb.subnet}, {tb.shape.gbit:g} Gbit/s "
        f"links; remove it with `cleave testbed down --name {tb.name}`",
        file=sys.stderr,
    )
    return 0


def _down(args: argparse.Namespace) -> int:
    if args.all:
        removed, kept = instances.remove_all()
        print(f"removed {len(removed)} testbed(s)" + (f": slots {removed}" if removed else ""))
        if kept:
            print(f"left (owned by running processes): {', '.join(kept)}")
        return 0
    slot = instances.remove_by_name(args.name)
    print(f"removed testbed {args.name!r} (slot {slot})")
    return 0


def _list() -> int:
    rows = instances.list_all()
    header = ("NAME", "SLOT", "SUBNET", "HOSTS", "GBIT", "OWNER", "STATUS")
    table = [header] + [
        (r.name, str(r.slot), r.subnet, r.hosts, r.link_gbit, r.owner, r.status) for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1])
    return 0
