"""`cleave bench idle-gap --quick`: the dense program of every dtype the bundle approves, back to
back and after each idle gap, slept or spun, with the ratios to back to back. No timing is
asserted."""

from __future__ import annotations

from support.bench import run_bench
from support.cli import refused
from support.served import SCALES


def test_quick_run_times_every_approved_dtype_after_each_gap(tmp_path):
    result, report = run_bench(
        tmp_path, "idle-gap", "--quick", "--model", "shared", "--scale", f"{SCALES['shared']:g}",
        "--candidates", "8", "--gaps", "0.5,2",
    )  # fmt: skip
    assert report["benchmark"] == "idle-gap" and report["candidates"] == 8
    assert sorted(report["dtypes"]) == ["bfloat16", "float32", "int8"]
    for rows in report["dtypes"].values():
        cases = [(r["gap_ms"], r["mode"]) for r in rows]
        assert cases == [(0, "sleep"), (0.5, "sleep"), (0.5, "spin"), (2, "sleep"), (2, "spin")]
        assert rows[0]["ratio"] == 1.0
        for r in rows:
            assert r["call_ms"] > 0 and r["cpu_ms"] > 0 and r["ratio"] > 0, r
    assert "vs gap 0" in result.stdout


def test_bad_gaps_are_a_usage_error():
    assert "--gaps" in refused("bench", "idle-gap", "--gaps", "-1")
    assert "--calls" in refused("bench", "idle-gap", "--calls", "0")
