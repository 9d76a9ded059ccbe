"""`python -m cleave.settings --check | --write`: are the files generated from the settings
schema current (exit 1 naming each stale one), or rewrite them."""

from __future__ import annotations

import argparse
import sys

from cleave.settings import artifacts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cleave.settings", description=__doc__)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    what.add_argument("--write", action="store_true", help="regenerate the stale files")
    args = parser.parse_args(argv)
    if args.write:
        for path in artifacts.write():
            print(f"wrote {path}")
        return 0
    stale = artifacts.stale()
    for path in stale:
        print(f"{path} is stale: run `python -m cleave.settings --write`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
