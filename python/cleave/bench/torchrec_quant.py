"""`cleave bench torchrec-quant`: the score cost of quantized tables on an unmodified TorchRec
DLRM, Cleave's way against TorchRec's. The same float model (Criteo Kaggle's 26 tables, scaled
by --scale) is (a) partitioned with `--table-dtype int8` and `int4` (row-wise codes with an f32
scale and bias) and scored by the bundle's reference executor, which the served engines
match within 1e-5 (tests/test_torchrec.py, tests/test_int4_tables.py), and (b) converted by
`torchrec.inference`'s `quantize_inference_model` (int8 and int4 rows with fp16 scale and bias)
and run eagerly on FBGEMM's CPU kernels. Each is compared with the float model's scores on the
same requests: the largest and the mean absolute score difference. Needs TorchRec (`make
setup` installs it).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

TABLE_DTYPES = {"int8": ("int8_rowwise", torch.qint8), "int4": ("int4_rowwise", torch.quint4x2)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", type=float, default=0.01, help="table scale (1.0: Criteo)")
    parser.add_argument("--batches", type=int, default=8, help="request batches to score")
    parser.add_argument("--batch", type=int, default=256, help="samples per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")


def run(args: argparse.Namespace) -> int:
    from torchrec.inference.modules import quantize_inference_model

    import cleave
    from cleave.models import torchrec_models as tm

    spec = tm.criteo_kaggle(args.scale)
    model, example = tm.build("dlrm", spec, seed=args.seed)
    generator = torch.Generator().manual_seed(args.seed + 1)
    requests = [tm.requests(spec, args.batch, generator) for _ in range(args.batches)]
    with torch.inference_mode():
        float_scores = torch.cat([model(*r) for r in requests])
    result = {
        "model": "torchrec.models.dlrm.DLRM",
        "tables": len(spec.tables),
        "rows": sum(t.rows for t in spec.tables),
        "dim": spec.dim,
        "samples": int(float_scores.numel()),
        "score_diff": {},
    }
    for name, (cleave_dtype, torchrec_dtype) in TABLE_DTYPES.items():
        bundle = cleave.partition(model, example, table_dtype=cleave_dtype)
        with torch.inference_mode():
            ours = torch.cat([bundle.reference(*r) for r in requests])
        theirs_model = quantize_inference_model(
            copy.deepcopy(model), quantization_dtype=torchrec_dtype
        )
        with torch.inference_mode():
            theirs = torch.cat([theirs_model(*r) for r in requests])
        result["score_diff"][name] = {
            "cleave": _diff(ours, float_scores),
            "torchrec_fbgemm": _diff(theirs, float_scores),
        }
    print(
        f"{result['model']}, {result['tables']} tables, {result['rows']:,} rows, dim "
        f"{result['dim']}, {result['samples']} samples: |score - float score|"
    )
    print(f"{'tables':8} {'Cleave max':>12} {'mean':>10} {'TorchRec max':>14} {'mean':>10}")
    for name, d in result["score_diff"].items():
        ours, theirs = d["cleave"], d["torchrec_fbgemm"]
        print(
            f"{name:8} {ours['max']:12.2e} {ours['mean']:10.2e} "
            f"{theirs['max']:14.2e} {theirs['mean']:10.2e}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _diff(scores: torch.Tensor, reference: torch.Tensor) -> dict:
    d = (scores.double() - reference.double()).abs()
    return {"max": float(d.max()), "mean": float(d.mean())}
