"""`cleave bench serve --quick`: the serving benchmark runs end to end (both deployments, checks
every score, writes JSON and a plot), so it cannot rot unnoticed. No timing is asserted."""

from __future__ import annotations

import argparse

import pytest
from cleave.bench.harness.target import serve_flags
from support.bench import FLOAT32, run_bench, serve_bench
from support.cli import refused
from support.served import SCALES, reference_bundle


def test_bench_serve_quick_compare(tmp_path):
    """The three ways of serving, at a reduced dense dtype (bfloat16) with its float32 twin:
    every score checked against its own bundle's reference, the distance to float32 and each
    dtype's roofline reported apart."""
    result, report = run_bench(
        tmp_path, "serve", "--quick", "--compare", "--check",
        "--model", "shared", "--scale", "0.01", "--candidates", "16",
        "--dense-dtype", "bfloat16",
    )  # fmt: skip
    assert set(report["deployments"]) == {
        "monolithic", "disaggregated", "router-held", "disaggregated-float32"
    }  # fmt: skip
    for deployment in report["deployments"].values():
        assert [p["rate"] for p in deployment["rates"]] == [20.0, 40.0]
        # A rate, or the single requests, may be refused whole (503: admission) where the
        # machine (other test workers) cannot meet the 25 ms budget: seen in full runs, the
        # monolith's 65 requests at 40/s, and the router-held deployment's 20 single requests.
        for point in [deployment["single"], *deployment["rates"]]:
            assert point["ok"] > 0 and point["p99_ms"] > 0 or set(point["errors"]) == {"http_503"}
        assert any(point["ok"] > 0 for point in deployment["rates"])
        assert "compute_us" in deployment["rates"][0]["stages_us"]
    assert report["deployments"]["disaggregated"]["rates"][0]["stages_us"]["lookup_us"] > 0
    codec = report["deployments"]["disaggregated"]["rates"][0]["metrics"]["codec_cpu_us"]
    assert codec["parse_json"] > 0 and codec["encode_json"] > 0  # the router's CPU per request
    for name, roles in [("monolithic", {"ranker-0"}), ("disaggregated", {"shard-0", "router"})]:
        point = report["deployments"][name]["rates"][0]  # every process's CPU per request
        assert roles <= set(point["cpu_ms_by_role"]), point["cpu_ms_by_role"]
        assert point["cpu_ms_per_request"] == pytest.approx(sum(point["cpu_ms_by_role"].values()))
    assert "cpu_per_request_disagg_over_mono" in report["ratios"]
    assert "CPU per request answered" in result.stdout
    assert "router CPU per request in parsing and encoding" in result.stdout
    assert report["max_abs_diff"] is not None and report["max_abs_diff"] <= 1e-5
    assert {"single_p50_disagg_over_mono", "max_rate_held_over_disagg"} <= set(report["ratios"])
    held = report["deployments"]["router-held"]["rates"][0]
    assert held["stages_us"]["lookup_us"] > 0  # looked up in the router, no shard process
    assert (tmp_path / "serve.png").stat().st_size > 10_000
    assert "max rate with p99 <= 25 ms" in result.stdout
    assert report["bundle"]["dense_dtype"] == "bfloat16" and report["budget_ms"] >= 25.0
    roof = report["roofline"]
    assert roof["served"]["dtype"] == "bfloat16" and roof["float32"]["dtype"] == "float32"
    for r in (roof["served"], roof["float32"]):
        assert r["achieved_gflops"] > 0 and r["peak_gflops"] > 0
    assert 0 < report["float32_distance"] <= 0.02
    assert "max_rate_dtype_over_float32" in report["ratios"]
    assert "GFLOP/s peak" in result.stdout


def test_bench_serve_measures_joined_against_per_request_batches_of_a_shared_input_model(
    tmp_path,
):
    _, report = run_bench(
        tmp_path, "serve", "--quick", "--check",
        "--model", "din", "--scale", f"{SCALES['din']:g}", "--candidates", "16", *FLOAT32,
        "--bundle", str(reference_bundle("din", tmp_path / "bundle")),
    )  # fmt: skip
    assert set(report["deployments"]) == {"disaggregated", "disaggregated-per-request"}
    assert report["max_abs_diff"] is not None and report["max_abs_diff"] <= 1e-5
    assert {"max_rate_joined_over_per_request", "max_goodput_joined_over_per_request"} <= set(
        report["ratios"]
    )


def test_bench_serve_reports_a_budget_no_request_meets_instead_of_crashing(tmp_path):
    # Every request gets 504 (the budget is 1 µs): the report says so, with "-" latencies.
    # One deployment: the probe that misses its budget restarts it before the next one.
    flags = ["--rates", "20,40", "--duration", "1", "--single", "10", "--budget-ms", "0.001"]
    result, report = serve_bench(tmp_path, *flags)
    for dep in report["deployments"].values():
        assert dep["single"]["p50_ms"] is None and dep["single"]["errors"]["http_504"] > 0
        assert dep["max_rate_within_budget"] == 0.0
    assert "max rate with p99 <= 0.001 ms: 0/s" in result.stdout


def test_bench_serve_measures_a_plan_with_a_stage_breakdown_from_metrics(tmp_path):
    """A 4-host plan under the local runner: the roles' /metrics give every stage, the
    lookup's network part included."""
    from cleave.plan import emulated_hosts, make_plan, save_plan
    from cleave.settings import RankerConfig, ServeConfig

    bundle = reference_bundle("shared", tmp_path)
    config = ServeConfig(ranker=RankerConfig(threads=1, device="cpu"))
    plan = make_plan(bundle, emulated_hosts(4), 2, 1, 1, 1, serve_config=config)
    path = save_plan(plan, tmp_path / "plan.yaml")
    result, report = serve_bench(tmp_path, "--quick", "--check", "--plan", str(path))
    (dep,) = report["deployments"].values()
    assert report["runner"] == "local" and report["max_abs_diff"] <= 1e-5
    metrics = dep["rates"][0]["metrics"]
    assert metrics["shards_served"] == 2
    stages = metrics["stages_us"]
    for stage in ("parse", "lookup", "lookup_service", "transfer", "compute", "total"):
        assert stages[f"{stage}_us"] > 0, stages
    assert stages["lookup_network_us"] == stages["lookup_us"] - stages["lookup_service_us"]
    assert metrics["lookup_reply_bytes"] > 0
    assert "lookup_n" in result.stdout  # the stage table


def test_more_rankers_leave_the_monolith_one_process():
    """`--rankers 2 --compare` compares against the monolith as it is (one process): before,
    the monolith got `--rankers 2` as well, which `cleave serve --monolithic` refuses."""
    args = argparse.Namespace(
        shards=1, rankers=2, config=None, threads=1, compile=False, device=None
    )
    flags = {mode: serve_flags(args, mode) for mode in ("monolithic", "disaggregated")}
    assert flags["monolithic"][:4] == ["--shards", "1", "--rankers", "1"]
    assert flags["monolithic"][-1] == "--monolithic"
    assert flags["disaggregated"][:4] == ["--shards", "1", "--rankers", "2"]


def test_bench_serve_refuses_flags_that_disagree(tmp_path):
    for flags, message in [
        (["--runner", "testbed"], "--runner testbed: only with --plan or --shard-hosts"),
        (["--shard-hosts", "1,x"], "--shard-hosts: expected integers >= 1"),
        (["--shard-hosts", "1", "--compare"], "got --shard-hosts, --compare"),
        (["--plan", "p.yaml", "--link-gbit", "2"], "--link-gbit: only with --runner testbed"),
        (["--plan", str(tmp_path / "none.yaml")], "none.yaml: plan not found"),
        (["--shard-hosts", "1", "--link-gbit", "0"], "--link-gbit: expected a rate > 0"),
    ]:
        assert message in refused("bench", "serve", *flags), flags
