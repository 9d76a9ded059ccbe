"""`cleave bench serve --model torchrec_dlrm`: a TorchRec reference model served disaggregated
beside the same model run eagerly by TorchRec in one process (the eager baseline), every score
checked against the model, with the same-run ratios (docs/benchmarks.md, "TorchRec models")."""

from __future__ import annotations

import pytest
from support.bench import FLOAT32, run_bench

pytestmark = pytest.mark.slow  # two deployments of a 26-table TorchRec model


def test_bench_serve_runs_a_torchrec_model_beside_torchrec_eager(tmp_path):
    result, report = run_bench(
        tmp_path, "serve", "--quick", "--check", "--model", "torchrec_dlrm",
        "--scale", "0.0001", "--candidates", "8", "--requests", "4", "--budget-ms", "5000",
        *FLOAT32,
    )  # fmt: skip
    assert list(report["deployments"]) == ["torchrec-eager", "disaggregated"]
    for deployment in report["deployments"].values():
        assert deployment["single"]["ok"] > 0
        assert all(point["ok"] > 0 for point in deployment["rates"])
    # Both answer with the model's scores: the eager one runs it, the other its bundle.
    assert report["max_abs_diff"] is not None and report["max_abs_diff"] <= 1e-5
    assert {"single_p50_disagg_over_torchrec", "max_goodput_disagg_over_torchrec"} <= set(
        report["ratios"]
    )
    assert "single_p50_disagg_over_torchrec" in result.stdout
