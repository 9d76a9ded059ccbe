"""`cleave bench json-parse --quick`: the router's JSON request parsing, the scanner against
serde_json in one run, with the same-run ratios. No timing is asserted."""

from __future__ import annotations

from support.bench import run_bench
from support.cli import refused


def test_quick_run_times_both_parsers_with_ratios(tmp_path):
    result, report = run_bench(
        tmp_path, "json-parse", "--quick",
        "--models", "shared", "--scale", "0.01", "--candidates", "4,16",
    )  # fmt: skip
    assert report["benchmark"] == "json-parse"
    assert [(c["model"], c["candidates"]) for c in report["cases"]] == [
        ("shared", 4),
        ("shared", 16),
    ]
    for case in report["cases"]:
        for parser in ("serde", "scan"):
            for part in ("request", "data"):
                row = case["parsers"][parser][part]
                assert row["mb_per_s"] > 0 and row["us_per_request"] > 0, row
        assert case["bytes_per_request"]["request"] > case["bytes_per_request"]["data"] > 0
    assert set(report["ratios"]) == {
        f"shared_{n}_{part}" for n in (4, 16) for part in ("request", "data")
    }
    assert all(r > 0 for r in report["ratios"].values())
    assert "scan/serde" in result.stdout


def test_bad_candidates_are_a_usage_error():
    assert "--candidates" in refused("bench", "json-parse", "--candidates", "0")
