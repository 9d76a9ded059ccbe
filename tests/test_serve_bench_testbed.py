"""`cleave bench serve` on the testbed (network namespaces, one per emulated host): a
shard-host sweep, and a run stopped by SIGTERM that leaves no namespace behind. Apart from
tests/test_serve_bench.py so that only these hold the workers' testbed lock
(tests/conftest.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cleave.testbed import commands
from support.bench import FLOAT32, SMALL_MODEL, serve_bench
from support.served import reference_bundle


@pytest.mark.testbed
@pytest.mark.skipif(commands.unavailable() is not None, reason=commands.unavailable() or "")
def test_bench_serve_shard_host_sweep_on_the_testbed(tmp_path):
    result, report = serve_bench(tmp_path, "--quick", "--shard-hosts", "1,2")
    assert list(report["deployments"]) == ["1 shard host", "2 shard hosts"]
    assert report["runner"] == "testbed" and report["link_gbit"] == 1.0
    for dep in report["deployments"].values():
        metrics = dep["rates"][0]["metrics"]
        assert "lookup_network_us" in metrics["stages_us"]
        assert set(metrics["link_drops"]["h0"]) == {"to_host", "from_host"}
    assert "max_rate_2_shard_hosts_over_first" in report["ratios"]
    assert "shard-host sweep, 1 Gbit/s links" in result.stdout
    assert (tmp_path / "serve.png").stat().st_size > 10_000


@pytest.mark.testbed
@pytest.mark.skipif(commands.unavailable() is not None, reason=commands.unavailable() or "")
def test_bench_serve_stopped_by_sigterm_leaves_no_testbed_behind(tmp_path):
    from support.processes import descendants, namespaces_of_testbeds
    from support.waiting import wait_for

    before = namespaces_of_testbeds()
    argv = [sys.executable, "-m", "cleave.cli", "bench", "serve", "--shard-hosts", "1"]
    argv += [*SMALL_MODEL, *FLOAT32, "--bundle", str(reference_bundle("shared", tmp_path))]
    argv += ["--rates", "20", "--duration", "600", "--workdir", str(tmp_path / "work")]
    bench = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(
            lambda: namespaces_of_testbeds() - before or bench.poll() is not None,
            "the deployment's testbed to be up",
            240,
        )
        roles = descendants(bench.pid)
        bench.send_signal(signal.SIGTERM)
        _, stderr = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert namespaces_of_testbeds() - before == set()
    assert roles and not [pid for pid in roles if Path(f"/proc/{pid}").exists()]
