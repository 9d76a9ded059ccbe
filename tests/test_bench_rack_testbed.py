"""`cleave bench rack --quick` on the rack testbed (issue 28 item 4; docs/benchmarks.md): both
modes up, the four cases (zipf and uniform ids, ToR and pool mode) served and reported with
their embedding latencies, goodput, per-NIC bytes and the ratios, and the plot written. Which
mode is faster is the benchmark's claim, not this test's: only what the run did is checked
(every request answered, the hot host's NIC carrying the zipf bytes in ToR mode)."""

from __future__ import annotations

import pytest
from cleave.testbed import commands
from support.bench import run_bench

pytestmark = [
    pytest.mark.testbed,
    pytest.mark.skipif(commands.unavailable() is not None, reason=commands.unavailable() or ""),
]


def test_bench_rack_quick_reports_every_case_of_both_modes(tmp_path):
    # One short case each: plumbing and the report, not the latency claim.
    result, report = run_bench(tmp_path, "rack", "--quick", "--case-s", "1", timeout=120)
    cases = {(c["ids"], c["mode"]): c for c in report["cases"]}
    assert set(cases) == {(k, m) for k in ("zipf", "uniform") for m in ("tor", "pool")}
    hosts = 2 * 4  # shard hosts of the two racks
    for case in cases.values():
        assert case["requests"] > 0 and case["failed"] == 0, case
        assert case["embedding_avg_ms"] > 0 and case["embedding_p99_ms"] > 0
        assert case["goodput_rps"] > 0
        assert len(case["nic_sent_bytes"]) == hosts and len(case["nic_utilisation"]) == hosts
    # ToR mode: a host's replies leave only by its own NIC, so the zipf case's hot rows load
    # the first shard host's NIC more than any other.
    sent = cases[("zipf", "tor")]["nic_sent_bytes"]
    hot = max(sent, key=sent.get)
    assert sent[hot] > 0.5 * sum(sent.values()), sent
    assert report["transport"] == "mptcp"
    assert set(report["ratios"]) == {
        "embedding_avg_pool_over_tor",
        "embedding_avg_pool_over_tor_uniform",
        "goodput_pool_over_tor",
    }
    assert all(v > 0 for v in report["ratios"].values()), report["ratios"]
    assert (tmp_path / "rack.png").exists()
    assert "embedding_avg_pool_over_tor" in result.stderr
