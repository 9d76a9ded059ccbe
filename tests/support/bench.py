"""`cleave bench NAME` as a child process, with its scratch files and JSON report under the
test's directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.served import SCALES, reference_bundle


def run_bench(
    tmp_path: Path, name: str, *flags: str, timeout: float = 300
) -> tuple[subprocess.CompletedProcess, dict]:
    """Runs it to completion (exit 0 required) and returns the process and its report."""
    out = tmp_path / f"{name}.json"
    result = subprocess.run(
        [sys.executable, "-m", "cleave.cli", "bench", name, *flags]
        + ["--workdir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-1000:] + result.stderr[-3000:]
    return result, json.loads(out.read_text())


# A small model: `cleave bench serve` in a few seconds a deployment.
SMALL_MODEL = ("--model", "shared", "--scale", f"{SCALES['shared']:g}")
SMALL_MODEL += ("--candidates", "16", "--requests", "8")


# The program as partitioned: what most tests of `cleave bench serve` check does not depend on
# the dense dtype, and the command's default (every dtype partitioned, the rankers' choice
# served beside a float32 twin) costs a run about twice.
FLOAT32 = ("--dense-dtype", "float32")


def serve_bench(
    tmp_path: Path, *flags: str, dtype_choice: bool = False
) -> tuple[subprocess.CompletedProcess, dict]:
    """`cleave bench serve FLAGS` on the small model, in float32 (the session's bundle of it,
    not partitioned again) unless `dtype_choice` (the command's default: the rankers'
    choice)."""
    model = SMALL_MODEL
    if not dtype_choice:
        model += (*FLOAT32, "--bundle", str(reference_bundle("shared", tmp_path / "bundle")))
    return run_bench(tmp_path, "serve", *flags, *model)
