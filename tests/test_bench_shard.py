"""`cleave bench shard --quick`: the benchmark runs end to end (a real shard process, the Rust
load generator, the torch reference) and writes complete JSON. Numbers are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys

from support.cli import refused


def test_quick_bench_writes_json_and_a_table(tmp_path):
    out = tmp_path / "bench-shard.json"
    argv = [sys.executable, "-m", "cleave.cli", "bench", "shard", "--quick", "--json", str(out)]
    argv += ["--workdir", str(tmp_path / "work")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "cleave bench shard: 26 tables" in r.stdout
    assert "torch embedding_bag in process (reference)" in r.stdout
    result = json.loads(out.read_text())
    assert result["config"]["ids_per_request"] == 2000
    assert result["config"]["bags_per_request"] == 26
    assert result["torch_in_process"]["p50_us"] > 0
    assert result["client_single"]["p50_us"] > 0
    points = result["open_loop"]
    assert [p["fraction"] for p in points] == [0.25, 0.5, 0.9]
    for p in points:
        assert p["completed"] > 0 and p["errors"] == 0 and p["lost"] == 0, p
        assert p["sent"] == p["completed"]
        assert 0 < p["p50_us"] <= p["p99_us"] <= p["p999_us"] <= p["max_us"], p
    assert result["closed_loop"]["achieved_rps"] > 0 and result["closed_loop"]["errors"] == 0
    assert result["at_half_max"]["fraction"] == 0.5
    assert isinstance(result["meets_target"], bool)


def test_bad_fractions_are_a_usage_error(tmp_path):
    assert "--fractions: expected numbers > 0" in refused("bench", "shard", "--fractions", "0.5,x")
