"""`cleave bench serve --quick`: the serving benchmark runs end to end (both deployments, checks
every score, writes JSON and a plot), so it cannot rot unnoticed. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_serve_quick_compare(tmp_path):
    out = tmp_path / "serve.json"
    result = subprocess.run(
        [sys.executable, "-m", "cleave.cli", "bench", "serve", "--quick", "--compare", "--check"]
        + ["--model", "shared", "--scale", "0.01", "--candidates", "16"]
        + ["--workdir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["deployments"]) == {"monolithic", "disaggregated"}
    for deployment in report["deployments"].values():
        assert [p["rate"] for p in deployment["rates"]] == [20.0, 40.0]
        for point in [deployment["single"], *deployment["rates"]]:
            assert point["ok"] > 0 and point["p99_ms"] > 0
        assert "compute_us" in deployment["rates"][0]["stages_us"]
    assert report["deployments"]["disaggregated"]["rates"][0]["stages_us"]["lookup_us"] > 0
    assert report["max_abs_diff"] is not None and report["max_abs_diff"] <= 1e-5
    assert "single_p50_disagg_over_mono" in report["ratios"]
    assert (tmp_path / "serve.png").stat().st_size > 10_000
    assert "max rate with p99 <= 25 ms" in result.stdout


def bench(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "stress.json"
    result = subprocess.run(
        [sys.executable, "-m", "cleave.cli", "bench", "serve", *flags]
        + ["--model", "shared", "--scale", "0.01", "--candidates", "16", "--requests", "8"]
        + ["--workdir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result, json.loads(out.read_text())


def test_bench_serve_overload_and_soak_report_what_they_measured(tmp_path):
    flags = ["--capacity", "40", "--duration", "1", "--idle-connections", "20"]
    result, report = bench(tmp_path, "--overload", *flags, "--idle-wait-s", "1")
    (dep,) = report["deployments"].values()
    assert list(dep["phases"]) == ["before", "burst", "after"]
    assert [p["rate"] for p in dep["phases"].values()] == [16.0, 120.0, 16.0]
    assert sum(s["sent"] for s in dep["timeline"]) == sum(p["sent"] for p in dep["phases"].values())
    assert dep["idle_connections"]["opened"] == 20
    assert "5xx other than 503" in result.stdout and (tmp_path / "stress.png").exists()

    result, report = bench(tmp_path, "--soak", "0.1", "--capacity", "40")
    (dep,) = report["deployments"].values()
    roles = {name.split()[0] for name in dep["processes"]}
    assert {"router", "shard-0", "ranker-0"} <= roles
    for proc in dep["processes"].values():
        assert proc["rss_median_mib"] > 0 and proc["fds_max"] >= proc["fds_min"] > 0
    assert dep["windows"] and "max dev %" in result.stdout


def test_bench_serve_reports_a_budget_no_request_meets_instead_of_crashing(tmp_path):
    # Every request gets 504 (the budget is 1 µs): the report says so, with "-" latencies.
    result, report = bench(tmp_path, "--quick", "--compare", "--budget-ms", "0.001")
    for dep in report["deployments"].values():
        assert dep["single"]["p50_ms"] is None and dep["single"]["errors"]["http_504"] > 0
        assert dep["max_rate_within_budget"] == 0.0
    assert "max rate with p99 <= 0.001 ms: 0/s" in result.stdout
