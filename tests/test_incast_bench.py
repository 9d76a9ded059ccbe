"""`cleave bench incast --quick` end to end on the testbed: the JSON has exactly the issue's
schema and its values are sane (fractions in [0, 1] and complementary, goodput within the
link, credits measured on both channels). Needs the testbed, like tests/test_testbed*.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cleave.testbed import commands
from support.cli import refused

pytestmark = [
    pytest.mark.testbed,
    pytest.mark.skipif(commands.unavailable() is not None, reason=commands.unavailable() or ""),
]

CASE_KEYS = {
    "incast",
    "control",
    "order",
    "window_bytes",
    "failed_fraction",
    "slo_attainment",
    "p99_ms",
    "goodput_mib_s",
}


def test_quick_bench_writes_the_schema(tmp_path):
    out = tmp_path / "incast.json"
    argv = [sys.executable, "-m", "cleave.cli", "bench", "incast", "--quick", "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) == {"cases", "credits"}
    assert set(result["credits"]) == {"priority_p99_us", "piggyback_p99_us"}
    assert all(v > 0 for v in result["credits"].values()), result["credits"]
    kinds = {(c["control"], c["order"]) for c in result["cases"]}
    assert {("none", "fcfs"), ("fixed", "fcfs"), ("fixed", "edf"), ("adaptive", "edf")} <= kinds
    link_mib_s = 1e9 / 8 / 2**20
    for case in result["cases"]:
        assert set(case) == CASE_KEYS, case
        assert case["incast"] == 10
        assert (case["window_bytes"] is None) == (case["control"] != "fixed"), case
        assert 0.0 <= case["failed_fraction"] <= 1.0
        assert case["failed_fraction"] + case["slo_attainment"] == pytest.approx(1.0)
        assert 0.0 <= case["goodput_mib_s"] <= 1.1 * link_mib_s, case
        assert case["slo_attainment"] == 0.0 or case["goodput_mib_s"] > 0.0, case
        assert case["p99_ms"] is not None and case["p99_ms"] > 0.0, case
    assert (tmp_path / "incast.png").stat().st_size > 0


def test_prioritize_port_adds_the_class_and_filters():
    from cleave.testbed import Testbed
    from cleave.testbed.commands import tc

    with Testbed(2, link_gbit=0.5) as tb:
        tb.prioritize_port(7400)
        tb.prioritize_port(7500)  # a second port adds only its filters
        for h in tb.hosts:
            for where, dev in ((["-n", h.netns], h.veth), ([], h.bridge_port)):
                classes = tc(*where, "class", "show", "dev", dev)
                assert classes.count("htb 1:5 ") == 1, classes
                assert "prio 0" in classes.split("htb 1:5 ")[1].splitlines()[0], classes
                assert "prio 1" in classes.split("htb 1:10 ")[1].splitlines()[0], classes
                filters = tc(*where, "filter", "show", "dev", dev)
                assert filters.count("flowid 1:5") == 4, filters  # dport and sport, 2 ports
        with pytest.raises(ValueError, match="port must be 1..65535"):
            tb.prioritize_port(0)


def test_quick_end_to_end_bench_serves_both_ways_and_writes_ratios(tmp_path):
    """`cleave bench incast-serve --quick` (a preset of `cleave bench serve --plan
    --incast-control off,on`): routers on their own testbed hosts, control off then on, the
    load split over every router, no 502; the ratios are there."""
    out = tmp_path / "incast-serve.json"
    argv = [sys.executable, "-m", "cleave.cli", "bench", "incast-serve", "--quick"]
    argv += ["--workdir", str(tmp_path / "work"), "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result["deployments"]) == ["incast-off", "incast-on"]
    assert result["runner"] == "testbed" and result["incast_control"] == ["off", "on"]
    assert result["incast_serve"]["routers"] == 2 and result["incast_serve"]["payload_bytes"] > 0
    assert result["incast_serve"]["window"] == "adaptive"  # the ranker's window follows congestion
    for name, dep in result["deployments"].items():
        assert dep["http_502"] == 0, name
        for point in dep["rates"]:
            assert point["sent"] > 0 and point["throughput_rps"] > 0, (name, point)
            # Both routers got their share: sent by the client, counted by each router.
            sent = point["sent_by_router"]
            assert len(sent) == 2 and min(sent) > 0 and sum(sent) == point["sent"], point
            counted = point["metrics"]["requests_by_router"]
            assert len(counted) == 2 and min(counted.values()) > 0, (counted, point["errors"])
    ratios = result["ratios"]
    assert {"max_goodput_incast_on_over_off", "max_rate_incast_on_over_off"} <= set(ratios)
    assert set(ratios["goodput_incast_on_over_off_by_rate"]) == {"10.0"}
    assert "incast-on" in proc.stdout and "HTTP 502s: 0" in proc.stdout  # the table


def test_end_to_end_bench_refuses_bad_rates():
    assert "--rates must be > 0" in refused("bench", "incast-serve", "--rates", "0")
