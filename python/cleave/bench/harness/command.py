"""What a `cleave bench` command does around its measurement: a work directory (--workdir, else
a temporary one), the report (JSON on stdout and in --json, then the table), and its flags'
comma-separated lists."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from cleave.bench.harness.summary import write_json
from cleave.errors import UsageError


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


def counts(text: str, flag: str, least: int = 1) -> list[int]:
    """A flag's comma-separated integers, each at least `least`."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise UsageError(f"{flag}: expected integers >= {least} separated by commas, got {text!r}")
    return values


def positives(text: str, flag: str) -> list[float]:
    """A flag's comma-separated numbers, each above zero."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(v > 0 for v in values):
        raise UsageError(f"{flag}: expected numbers > 0 separated by commas, got {text!r}")
    return values
