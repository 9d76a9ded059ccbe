"""`cleave bench admission --quick`: both admission rules measured in interleaved rounds at
each load, their medians and the adaptive / estimate ratios in the JSON."""

from __future__ import annotations

import pytest
from support.bench import run_bench
from support.cli import refused


def test_quick_run_measures_both_rules_at_each_load_with_ratios(tmp_path):
    _, report = run_bench(tmp_path, "admission", "--quick", "--pin", "off", "--loads", "0.3")
    assert report["capacity_rps"] > 0
    assert set(report["rules"]) == {"adaptive", "estimate"}
    for rows in report["rules"].values():
        (row,) = rows
        assert row["load_share"] == 0.3 and len(row["rounds"]) == 1
        assert row["ok_per_s"] > 0 and row["p50_ms"] > 0 and row["p99_ms"] >= row["p50_ms"]
    assert {
        "throughput_adaptive_over_estimate_at_30",
        "p50_adaptive_over_estimate_at_30",
        "p99_adaptive_over_estimate_at_30",
    } == set(report["ratios"])


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--loads", "half"], "--loads: expected numbers > 0"),
        (["--loads", "0.5,-1"], "--loads: expected numbers > 0"),
        (["--rounds", "0"], "must be at least 1"),
    ],
)
def test_bad_flags_are_refused(flags, expected):
    assert expected in refused("bench", "admission", *flags)
