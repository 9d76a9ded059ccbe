"""`cleave shard FLAGS...`: one embedding shard process. The shard is the standalone
executable `cleave-shard` (crates/cleave-shard, no Python in it); this subcommand replaces
itself with it (`os.execv`), so there is one code path and the same flags
(`cleave-shard --help`; docs/serving.md, "Executables and images")."""

from __future__ import annotations

import argparse
import os

from cleave.launch.supervisor import find_executable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="cleave-shard's flags")


def exec_shard(flags: list[str]) -> int:
    """Never returns: becomes `cleave-shard FLAGS`. Raises CleaveError when it is missing."""
    path = find_executable("cleave-shard")
    os.execv(path, [path, *flags])
    return 1  # not reached


def run(args: argparse.Namespace) -> int:
    return exec_shard(args.flags)
