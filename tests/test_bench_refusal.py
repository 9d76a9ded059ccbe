"""`cleave bench refusal --quick`: every request refused, on one kept connection or on a new
connection each, per body size, with the keep-alive / close ratios in the JSON."""

from __future__ import annotations

import pytest
from support.bench import run_bench
from support.cli import refused


def test_quick_run_refuses_on_kept_and_on_new_connections(tmp_path):
    _, report = run_bench(tmp_path, "refusal", "--quick", "--pin", "off", "--candidates", "4,64")
    count = report["count"]
    small, large = report["cases"]
    assert (small["candidates"], large["candidates"]) == (4, 64)
    assert small["body_bytes"] < large["body_bytes"]
    for case in report["cases"]:
        # A refused body under the router's bound keeps its connection; asked to close, the
        # client opens one per refusal.
        assert case["keep-alive"]["connections"] == 1, case
        assert case["close"]["connections"] == count + 1, case
        for mode in ("keep-alive", "close"):
            assert case[mode]["router_cpu_us"] > 0 and case[mode]["wall_us"] > 0, case
        assert case["router_cpu_keepalive_over_close"] > 0


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--candidates", "many"], "--candidates: expected integers >= 1"),
        (["--candidates", "100,0"], "--candidates: expected integers >= 1"),
        (["--count", "0"], "must be at least 1"),
    ],
)
def test_bad_flags_are_refused(flags, expected):
    assert expected in refused("bench", "refusal", *flags)
