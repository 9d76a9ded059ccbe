"""`cleave bench serve --quick`: the serving benchmark runs end to end (both deployments, checks
every score, writes JSON and a plot), so it cannot rot unnoticed. No timing is asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from support.bench import run_bench, serve_bench


def test_bench_serve_quick_compare(tmp_path):
    result, report = run_bench(
        tmp_path, "serve", "--quick", "--compare", "--check",
        "--model", "shared", "--scale", "0.01", "--candidates", "16",
    )  # fmt: skip
    assert set(report["deployments"]) == {"monolithic", "disaggregated", "router-held"}
    for deployment in report["deployments"].values():
        assert [p["rate"] for p in deployment["rates"]] == [20.0, 40.0]
        for point in [deployment["single"], *deployment["rates"]]:
            assert point["ok"] > 0 and point["p99_ms"] > 0
        assert "compute_us" in deployment["rates"][0]["stages_us"]
    assert report["deployments"]["disaggregated"]["rates"][0]["stages_us"]["lookup_us"] > 0
    codec = report["deployments"]["disaggregated"]["rates"][0]["metrics"]["codec_cpu_us"]
    assert codec["parse_json"] > 0 and codec["encode_json"] > 0  # the router's CPU per request
    assert "router CPU per request in parsing and encoding" in result.stdout
    assert report["max_abs_diff"] is not None and report["max_abs_diff"] <= 1e-5
    assert {"single_p50_disagg_over_mono", "max_rate_held_over_disagg"} <= set(report["ratios"])
    held = report["deployments"]["router-held"]["rates"][0]
    assert held["stages_us"]["lookup_us"] > 0  # looked up in the router, no shard process
    assert (tmp_path / "serve.png").stat().st_size > 10_000
    assert "max rate with p99 <= 25 ms" in result.stdout


def test_bench_serve_measures_joined_against_per_request_batches_of_a_shared_input_model(
    tmp_path,
):
    _, report = run_bench(
        tmp_path, "serve", "--quick", "--check",
        "--model", "din", "--scale", "0.002", "--candidates", "16",
    )  # fmt: skip
    assert set(report["deployments"]) == {"disaggregated", "disaggregated-per-request"}
    assert report["max_abs_diff"] is not None and report["max_abs_diff"] <= 1e-5
    assert {"max_rate_joined_over_per_request", "max_goodput_joined_over_per_request"} <= set(
        report["ratios"]
    )


def test_bench_serve_overload_and_soak_report_what_they_measured(tmp_path):
    # The capacity measured closed loop, two bursts over it, the generator on a core of its own.
    flags = ["--duration", "1", "--bursts", "1.5,3", "--idle-connections", "20"]
    result, report = serve_bench(tmp_path, "--overload", *flags, "--idle-wait-s", "1")
    (dep,) = report["deployments"].values()
    capacity = dep["capacity_rps"]
    assert capacity > 0 and dep["capacity_clients"] == 8 and dep["budget_ms"] == 1000.0
    assert list(dep["bursts"]) == ["1.5", "3"]
    for factor, burst in zip((1.5, 3.0), dep["bursts"].values(), strict=True):
        assert list(burst["phases"]) == ["before", "burst", "after"]
        rates = [p["rate"] for p in burst["phases"].values()]
        assert rates == pytest.approx([0.4 * capacity, factor * capacity, 0.4 * capacity])
        sent = sum(p["sent"] for p in burst["phases"].values())
        assert sum(s["sent"] for s in burst["timeline"]) == sent
        # The router's counters saw the run: each request sent was admitted or refused (one
        # refused after its body was read counts as both).
        assert burst["admitted"] <= sent <= burst["admitted"] + burst["shed"], burst
        assert burst["phases"]["before"]["router_cpu_s"] > 0
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        assert report["layout"] == {"server_cpus": cores[:-1], "client_cpus": cores[-1:]}
    assert dep["idle_connections"]["opened"] == 20
    assert "expired after admission" in result.stdout and (tmp_path / "serve.png").exists()

    result, report = serve_bench(tmp_path, "--soak", "0.1", "--capacity", "40")
    (dep,) = report["deployments"].values()
    roles = {name.split()[0] for name in dep["processes"]}
    assert {"router", "shard-0", "ranker-0"} <= roles
    for proc in dep["processes"].values():
        assert proc["rss_median_mib"] > 0 and proc["fds_max"] >= proc["fds_min"] > 0
    assert dep["windows"] and "max dev %" in result.stdout


def test_bench_serve_reports_a_budget_no_request_meets_instead_of_crashing(tmp_path):
    # Every request gets 504 (the budget is 1 µs): the report says so, with "-" latencies.
    # One deployment: each probe that misses its budget restarts it.
    result, report = serve_bench(tmp_path, "--quick", "--budget-ms", "0.001")
    for dep in report["deployments"].values():
        assert dep["single"]["p50_ms"] is None and dep["single"]["errors"]["http_504"] > 0
        assert dep["max_rate_within_budget"] == 0.0
    assert "max rate with p99 <= 0.001 ms: 0/s" in result.stdout


def test_bench_serve_measures_a_plan_with_a_stage_breakdown_from_metrics(tmp_path):
    """A 4-host plan under the local runner: the roles' /metrics give every stage, the
    lookup's network part included."""
    from cleave.plan import emulated_hosts, make_plan, save_plan
    from cleave.settings import RankerConfig, ServeConfig
    from support.served import Served

    served = Served("shared", tmp_path)
    config = ServeConfig(ranker=RankerConfig(threads=1, device="cpu"))
    plan = make_plan(served.dir, emulated_hosts(4), 2, 1, 1, 1, serve_config=config)
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


def test_bench_serve_refuses_flags_that_disagree(tmp_path):
    for flags, message in [
        (["--runner", "testbed"], "--runner testbed: only with --plan or --shard-hosts"),
        (["--shard-hosts", "1,x"], "--shard-hosts: expected shard host counts"),
        (["--shard-hosts", "1", "--compare"], "got --shard-hosts, --compare"),
        (["--plan", "p.yaml", "--link-gbit", "2"], "--link-gbit: only with --runner testbed"),
        (["--plan", str(tmp_path / "none.yaml")], "none.yaml: plan not found"),
        (["--shard-hosts", "1", "--link-gbit", "0"], "--link-gbit: expected a rate > 0"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "cleave.cli", "bench", "serve", *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2 and message in result.stderr, (flags, result.stderr)


def test_pin_layouts_parse_and_refuse_bad_specs(monkeypatch):
    from cleave.bench import machine
    from cleave.errors import UsageError

    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert machine.parse_pin("auto") == ([0, 1, 2], [3])
    assert machine.parse_pin("off") == (None, None)
    assert machine.parse_pin("0-1,3:2") == ([0, 1, 3], [2])
    for spec, message in [
        ("0-1", "expected SERVER:CLIENT"),
        ("a:1", "expected SERVER:CLIENT"),
        ("0:1:2", "expected SERVER:CLIENT"),
        ("0-4:5", "may use CPUs [0, 1, 2, 3] only"),
        ("0-1:1", "share CPUs"),
    ]:
        with pytest.raises(UsageError, match=re.escape(message)):
            machine.parse_pin(spec)
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda _pid: {5})
    assert machine.parse_pin("auto") == (None, None)  # one core: nothing to separate


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--overload", "--bursts", "3,x"], "--bursts: expected factors > 0"),
        (["--overload", "--bursts", "0"], "--bursts: expected factors > 0"),
        (["--overload", "--pin", "0-1"], "--pin: expected SERVER:CLIENT"),
        (["--soak", "0"], "--soak takes minutes > 0"),
    ],
)
def test_bench_serve_refuses_bad_stress_flags(flags, message):
    argv = [sys.executable, "-m", "cleave.cli", "bench", "serve", *flags]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_bench_serve_overload_with_vegeta_as_the_generator(tmp_path):
    """The independent generator (vegeta, built by `make tools`) sends the bursts; its
    results are read back into the same report."""
    flags = ["--capacity", "40", "--duration", "1", "--bursts", "3", "--generator", "vegeta"]
    result, report = serve_bench(tmp_path, "--overload", *flags)
    (dep,) = report["deployments"].values()
    assert dep["generator"] == "vegeta" and list(dep["bursts"]) == ["3"]
    burst = dep["bursts"]["3"]
    # vegeta sends at a constant rate: each phase's rate times its second.
    assert [p["sent"] for p in burst["phases"].values()] == [16, 120, 16]
    assert burst["admitted"] <= 152 <= burst["admitted"] + burst["shed"], burst
    assert burst["phases"]["before"]["goodput_rps"] > 0
    assert "bursts sent by vegeta" in result.stdout


def test_vegeta_results_say_what_failed():
    import socket

    from cleave.bench import vegeta

    with socket.socket() as held:  # bound, never listening: every connection is refused
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}/x"
        samples = vegeta.open_loop_phases(url, [b"{}"], [(20, 0.5)], 1.0)
    assert len(samples) == 10 and {s.error for s in samples} == {"connection"}
