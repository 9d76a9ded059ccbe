"""Scaling signals (docs/simulate.md, "Scaling signals"): from a load trace (CSV `time_s,
requests_per_s`), the CN and HN instances each pool needs per time window, what the Ray
runner's `cleave scale` acts on. Each pool scales on its own: a CN serves `cn_rps` requests/s
and an HN `hn_rps`, both planned to run at `headroom` of that at the window's peak."""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path

from cleave.errors import UsageError
from cleave.simulate.nodes import number_field

COLUMNS = ("time_s", "requests_per_s")


@dataclass
class Window:
    start_s: float
    peak_rps: float
    cn: int
    hn: int


def load_load(path: str | os.PathLike) -> list[tuple[float, float]]:
    """(time_s, requests_per_s) rows, times increasing; errors name the row and field."""
    path = Path(path)
    try:
        f = path.open(newline="")
    except OSError as err:
        raise UsageError(f"{path}: load trace cannot be read: {err}") from None
    rows: list[tuple[float, float]] = []
    with f:
        reader = csv.DictReader(f)
        if [c for c in COLUMNS if c not in (reader.fieldnames or [])]:
            raise UsageError(
                f"{path}: header: expected the columns {', '.join(COLUMNS)}, got "
                f"{', '.join(reader.fieldnames or []) or 'no header'}"
            )
        for row in reader:
            where = f"{path}: row {reader.line_num}"
            values = []
            for key in COLUMNS:
                values.append(number_field(row, key, where))
            if rows and values[0] < rows[-1][0]:
                raise UsageError(
                    f"{where}: time_s: expected times in increasing order, got {values[0]:g} "
                    f"after {rows[-1][0]:g}"
                )
            rows.append((values[0], values[1]))
    if not rows:
        raise UsageError(f"{path}: expected at least one row, got none")
    return rows


def scaling_signals(
    load: list[tuple[float, float]],
    window_s: float,
    cn_rps: float,
    hn_rps: float,
    headroom: float = 0.8,
) -> list[Window]:
    """Per window of `window_s` from the first sample: its peak load and the CN and HN
    instances that carry it at `headroom` of their capacity (at least one of each)."""
    for name, value in (("window", window_s), ("cn-rps", cn_rps), ("hn-rps", hn_rps)):
        if not value > 0:
            raise UsageError(f"--{name}: expected > 0, got {value:g}")
    if not 0 < headroom <= 1:
        raise UsageError(f"--headroom: expected 0 < H <= 1, got {headroom:g}")
    first = load[0][0]
    peaks: dict[int, float] = {}
    for t, rps in load:
        k = int((t - first) // window_s)
        peaks[k] = max(peaks.get(k, 0.0), rps)
    return [
        Window(
            start_s=first + k * window_s,
            peak_rps=peak,
            cn=max(1, math.ceil(peak / (cn_rps * headroom))),
            hn=max(1, math.ceil(peak / (hn_rps * headroom))),
        )
        for k, peak in sorted(peaks.items())
    ]
