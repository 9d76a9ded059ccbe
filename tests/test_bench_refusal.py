"""`cleave bench refusal --quick`: every request refused, on one kept connection or on a new
connection each, per body size, with the keep-alive / close ratios in the JSON."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.bench import run_bench
from support.cli import refused
from support.processes import children, descendants
from support.waiting import wait_for


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


def test_a_run_stopped_by_sigterm_stops_its_deployment(tmp_path):
    """Every `cleave bench` command unwinds on SIGTERM as on Ctrl-C (cleave.cli), stopping
    what it started, even a deployment still starting: this one's was left serving."""
    argv = [sys.executable, "-m", "cleave.cli", "bench", "refusal", "--pin", "off"]
    argv += ["--model", "shared", "--scale", "0.01", "--candidates", "4", "--count", "1000000"]
    argv += ["--workdir", str(tmp_path / "work")]
    bench = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    roles: list[int] = []
    try:
        wait_for(
            lambda: "router" in children(bench.pid) or bench.poll() is not None,
            "the benchmark's router to start",
            120,
        )
        roles = descendants(bench.pid)
        bench.send_signal(signal.SIGTERM)
        _, stderr = bench.communicate(timeout=60)
        assert bench.returncode == 128 + signal.SIGTERM, stderr[-3000:]
        assert roles
        wait_for(lambda: not [p for p in roles if Path(f"/proc/{p}").exists()], "its roles", 30)
        roles = []
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in roles:  # only where it failed: a failure leaves nothing behind either
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


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
