"""`cleave bench serve --plan` with several routers (local runner, real processes): each probe's
load is split over every router, and `--incast-control off,on` measures a copy of the plan
each way. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

from cleave.plan import emulated_hosts, load_plan, make_plan, save_plan
from cleave.settings import RankerConfig, ServeConfig
from support.bench import FLOAT32
from support.cli import refused


def bench(*flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "cleave.cli", "bench", "serve", *flags, *FLOAT32]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def test_two_routers_share_the_load_with_incast_control_off_then_on(tmp_path):
    from support.served import Served

    served = Served("shared", tmp_path)
    config = ServeConfig(ranker=RankerConfig(threads=1, device="cpu"))
    plan = make_plan(served.dir, emulated_hosts(4), 2, 1, 1, 2, serve_config=config)
    plan.incast_threshold_bytes = 1  # with control on, every payload asks the ranker first
    path = save_plan(plan, tmp_path / "two-routers.yaml")
    out = tmp_path / "bench.json"
    result = bench(
        *("--quick", "--check", "--plan", str(path), "--incast-control", "off,on"),
        *("--model", "shared", "--scale", "0.01", "--candidates", "16", "--requests", "8"),
        # A roomy budget: each router must count successes, whatever the machine's load.
        *("--budget-ms", "1000"),
        *("--workdir", str(tmp_path / "work"), "--json", str(out)),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["deployments"]) == ["incast-off", "incast-on"]
    assert report["incast_control"] == ["off", "on"]
    for name, control in (("incast-off", False), ("incast-on", True)):
        assert load_plan(report["plans"][name]).incast_control is control
        dep = report["deployments"][name]
        assert dep["http_502"] == 0, name
        assert [p["rate"] for p in dep["rates"]] == [20.0, 40.0]
        for point in dep["rates"]:
            # The client sent each router its share, and each router counted requests.
            sent = point["sent_by_router"]
            assert len(sent) == 2 and min(sent) > 0 and sum(sent) == point["sent"], point
            counted = point["metrics"]["requests_by_router"]
            assert len(counted) == 2 and min(counted.values()) > 0, (counted, point["errors"])
    assert report["max_abs_diff"] is not None and report["max_abs_diff"] <= 1e-5
    ratios = report["ratios"]
    assert {"max_goodput_incast_on_over_off", "max_rate_incast_on_over_off"} <= set(ratios)
    assert set(ratios["goodput_incast_on_over_off_by_rate"]) == {"20.0", "40.0"}
    assert "HTTP 502s: 0" in result.stdout and "goodput_incast_on_over_off_by_rate" in result.stdout


def test_incast_control_refuses_bad_values_and_a_missing_plan(tmp_path):
    for flags, message in [
        (["--plan", "p.yaml", "--incast-control", "maybe"], "got 'maybe'"),
        (["--plan", "p.yaml", "--incast-control", "on,on"], "expected distinct values of off, on"),
        (["--incast-control", "on"], "--incast-control: only with --plan"),
        (["--shard-hosts", "1", "--incast-control", "off,on"], "got --shard-hosts"),
    ]:
        assert message in refused("bench", "serve", *flags, "--workdir", str(tmp_path)), flags
