"""`cleave bench misses --quick` (docs/benchmarks.md, "Misses off the I/O thread"): two real
shard processes on the SSD tier, one reading misses inline and one with miss workers, driven
with hot and cold streams at once; the JSON has both cases, every request answered, cold
lookups handed over only where workers exist; bad flags exit 2 naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cleave.cli", "bench", "misses", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_quick_run_measures_both_cases(tmp_path):
    out = tmp_path / "misses.json"
    done = bench("--quick", "--json", str(out), "--workdir", str(tmp_path / "w"))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    cases = {c["miss_threads"]: c for c in result["cases"]}
    assert set(cases) == {0, 8}
    for case in cases.values():
        for stream in ("hot", "cold"):
            assert case[stream]["errors"] == 0 and case[stream]["lost"] == 0, case
            assert case[stream]["achieved_rps"] > 0 and case[stream]["p99_us"] > 0, case
    assert cases[0]["deferred"] == 0, "inline: nothing is handed over"
    assert cases[8]["deferred"] > 0, "workers: the cold lookups are handed over"
    assert set(result["ratios"]) >= {"hot_p99_us_inline_over_workers"}
    assert "hot_p99_us_inline_over_workers" in done.stdout


def test_bad_flags_are_refused():
    for args, says in (
        (("--miss-threads", "x"), "--miss-threads"),
        (("--miss-threads", "-1"), "--miss-threads"),
        (("--rows", "10"), "--rows"),
    ):
        done = bench(*args)
        assert done.returncode == 2 and says in done.stderr, (args, done.stderr)
