"""What a `cleave bench` command does around its measurement: a work directory (--workdir, else
a temporary one), and the report (JSON on stdout and in --json, then the table)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from cleave.bench.harness.summary import write_json


def in_workdir(args, name: str, measure: Callable[[Path], dict]) -> dict:
    """`measure(workdir)` in --workdir (created) or in a temporary directory removed after."""
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        return measure(Path(args.workdir))
    with tempfile.TemporaryDirectory(prefix=f"cleave-bench-{name}-") as tmp:
        return measure(Path(tmp))


def report(result: dict, args, print_table: Callable[[dict], None]) -> None:
    print(json.dumps(result))
    print_table(result)
    if args.json:
        write_json(result, args.json)
