"""`cleave demo` (what `make demo` runs), small: partition, serve, load, every score checked,
the JSON and the plot written, exit 0."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # cleave demo: partition, serve, load, plot
def test_demo_runs_end_to_end_and_checks_every_score(tmp_path):
    out = tmp_path / "demo"
    argv = [sys.executable, "-m", "cleave.cli", "demo", "--out", str(out), "--scale", "0.002"]
    argv += ["--rates", "20", "--duration", "1.5", "--candidates", "16", "--shards", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "done" in done.stdout.splitlines()[-1], done.stdout[-2000:]
    result = json.loads((out / "demo.json").read_text())
    (deployment,) = result["deployments"].values()
    assert deployment["single"]["checked"] > 0 and deployment["rates"][0]["ok"] > 0
    assert (out / "demo.png").stat().st_size > 0
