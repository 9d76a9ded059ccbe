"""`cleave bench front-door --quick`: one rate on a JSON and a binary deployment, in one run,
with the same-run ratios. No timing is asserted."""

from __future__ import annotations

from support.bench import run_bench
from support.cli import refused


def test_quick_run_measures_both_protocols_with_ratios(tmp_path):
    result, report = run_bench(
        tmp_path, "front-door", "--quick",
        "--model", "shared", "--scale", "0.01", "--candidates", "16",
    )  # fmt: skip
    assert report["benchmark"] == "front-door"
    assert list(report["deployments"]) == ["json", "binary"]
    for protocol, deployment in report["deployments"].items():
        (point,) = deployment["rates"]
        assert point["rate"] == 20.0 and point["ok"] > 0, point
        assert point["metrics"]["codec_cpu_us"][f"parse_{protocol}"] > 0
    assert set(report["ratios"]) == {
        "p50_binary_over_json",
        "p99_binary_over_json",
        "codec_cpu_binary_over_json",
    }
    assert report["ratios"]["codec_cpu_binary_over_json"] > 0
    assert "p50_binary_over_json:" in result.stdout


def test_bad_rate_is_a_usage_error():
    assert "--rate" in refused("bench", "front-door", "--rate", "0")
