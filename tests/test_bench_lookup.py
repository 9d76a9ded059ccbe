"""Smoke test of `cleave bench lookup --quick`: it runs, compares like with like, and writes the
JSON the benchmark docs promise. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

CASES = {"fp32-uniform", "fp32-zipf", "int8-cached"}
KEYS = {
    "case",
    "threads",
    "cleave_rows_per_s",
    "torch_rows_per_s",
    "limit_rows_per_s",
    "cleave_vs_torch",
    "cleave_vs_limit",
    "torch_path",
    "kernel",
    "max_rel_diff_vs_torch",
}


def _bench(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cleave.cli", "bench", "lookup", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_quick_run_writes_every_case(tmp_path):
    out = tmp_path / "lookup.json"
    done = _bench("--quick", "--json", str(out), "--threads", "1,2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["benchmark"] == "lookup" and report["config"]["quick"] is True
    assert {"cpu", "cores", "llc"} <= report["machine"].keys()
    results = report["cases"]
    assert {(r["case"], r["threads"]) for r in results} == {(c, t) for c in CASES for t in (1, 2)}
    for r in results:
        assert KEYS <= r.keys(), KEYS - r.keys()
        for key in ("cleave_rows_per_s", "torch_rows_per_s", "limit_rows_per_s"):
            assert r[key] > 0, (r["case"], key)
        # One round: the ratio of medians is the median of ratios.
        assert abs(r["cleave_vs_torch"] - r["cleave_rows_per_s"] / r["torch_rows_per_s"]) < 1e-9
        # Cleave and torch computed the same pooled bags.
        assert r["max_rel_diff_vs_torch"] < 1e-5, r
        assert ("cpu_time" in r) == (r["threads"] == 1)
    int8 = next(r for r in results if r["case"] == "int8-cached")
    assert "embedding_bag_byte_rowwise_offsets" in int8["torch_path"]
    assert "targets_met" in int8
    # The printed table names every case.
    for case in CASES:
        assert case in done.stdout


def test_bad_arguments_are_usage_errors(tmp_path):
    for args, message in (
        (["--threads", "0"], "--threads: expected integers >= 1"),
        (["--threads", "x"], "separated by commas"),
        (["--rounds", "0"], "--rounds must be >= 1"),
    ):
        done = _bench("--quick", *args, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr
