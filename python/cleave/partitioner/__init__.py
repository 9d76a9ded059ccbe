"""`cleave.partition(model, example_inputs)`: cut a PyTorch model at its sparse/dense seam.

capture.py (torch.export, all sizes dynamic) -> graph.py (find the seam) -> emit.py (bundle),
then accuracy.py when the dense program is served at reduced precision.
"""

from __future__ import annotations

import sys

import torch

from cleave.bundle import Bundle
from cleave.bundle import kjt as kjt_io
from cleave.bundle.precision import check_dtype, check_dtypes, count_flops, slow_reason
from cleave.errors import UsageError
from cleave.partitioner.accuracy import (
    AccuracyError,
    AccuracyLimits,
    LabelledSet,
    batch_rows,
    demand,
    measure,
)
from cleave.partitioner.capture import capture, input_names, kjt_inputs
from cleave.partitioner.emit import emit
from cleave.partitioner.graph import find_seam
from cleave.partitioner.kjt import kjt_fields
from cleave.settings.choices import DENSE_DTYPES

__all__ = ["AccuracyError", "AccuracyLimits", "partition"]


def partition(
    model: torch.nn.Module,
    example_inputs: tuple,
    *,
    table_dtype: str = "float32",
    dense_dtype: str = "float32",
    dense_dtypes=None,
    labelled=None,
    limits: AccuracyLimits | None = None,
    typical_inputs: tuple | None = None,
) -> Bundle:
    """Captures `model` on `example_inputs` (a tuple of forward's positional arguments) and
    returns a Bundle that serves any batch size and bag length. `table_dtype` is one of
    float32, float16, int8_rowwise, int4_rowwise. `dense_dtype` (float32, bfloat16, int8) is
    the precision the dense program is served at; a reduced one needs `labelled`, a list of (forward
    arguments, labels), to measure its accuracy cost, and raises AccuracyError past `limits`.
    `dense_dtypes` instead (a list of them): the precisions a ranker may choose among where it
    runs — float32 always, each reduced one approved when it passes the accuracy check and
    recorded as refused, with the reason, when it does not; each approved one timed here.
    `typical_inputs` (forward arguments of a typical request; default: the labelled set's
    first batch, else `example_inputs`) is where the sparse and dense sides' costs per sample
    are timed for `cleave serve`'s split of cores.
    Raises UnsupportedModelError naming the operator when the model cannot be cut."""
    check_dtype(dense_dtype)
    if dense_dtypes is not None:
        dense_dtypes = check_dtypes(dense_dtypes)
        if dense_dtype != "float32":
            raise UsageError(
                f"give dense_dtype ({dense_dtype!r}) or dense_dtypes ({dense_dtypes}), not both"
            )
    limits = (limits or AccuracyLimits()).check()
    reduced = [d for d in dense_dtypes or [dense_dtype] if d != "float32"]
    if reduced and labelled is None:
        raise UsageError(
            f"dense dtype {reduced[0]} needs a labelled set to measure its accuracy cost "
            "(labelled=[(forward args, labels), ...]; CLI: --labelled PKG.MODULE:FUNCTION, "
            "automatic for the reference models)"
        )
    example_inputs = kjt_io.normalize(example_inputs)  # a KJT built from offsets: lengths
    program = capture(model, example_inputs)
    names, kjts = input_names(model, example_inputs), kjt_inputs(model, example_inputs)
    seam = find_seam(program, kjt_fields(program, names, kjts))
    bundle = emit(program, example_inputs, names, seam, table_dtype, kjts)
    dense = bundle.manifest["dense"]
    inputs = bundle.named_inputs(*example_inputs)
    dense_args = bundle.dense_inputs(*example_inputs)
    bundle.record_probe(dense_args)
    rows = max(1, batch_rows(bundle, inputs))
    dense["flops_per_sample"] = count_flops(bundle.dense_module("float32"), dense_args) // rows
    if typical_inputs is None:
        typical_inputs = labelled[0][0] if labelled else example_inputs
    if dense_dtypes is not None:
        dense["dtype"] = "float32"  # what a ranker serves when nothing chooses
        dense["demand"] = demand(bundle, "float32", typical_inputs)
        dense["dtypes"] = approve(bundle, dense_dtypes, labelled, limits, typical_inputs)
        return bundle
    if dense_dtype != "float32":
        _warn_if_slow(dense_dtype)
        dense["accuracy"] = measure(bundle, dense_dtype, labelled, limits)
        if "int8_layers" in dense["accuracy"]:
            dense["int8_layers"] = dense["accuracy"].pop("int8_layers")
    dense["dtype"] = dense_dtype
    dense["demand"] = demand(bundle, dense_dtype, typical_inputs)
    return bundle


def approve(bundle: Bundle, dtypes: list[str], labelled, limits, typical_inputs) -> dict:
    """manifest dense.dtypes: per dtype (float32 and `dtypes`), whether a ranker may serve it
    (`approved`; else `refused`, why), the accuracy measured and the dense program's time per
    sample on one thread here (`dense_us_per_sample`)."""
    data = LabelledSet(bundle, labelled) if labelled is not None else None
    dense = bundle.manifest["dense"]  # float32's demand: measured already
    table: dict[str, dict] = {}
    for dtype in DENSE_DTYPES:
        if dtype != "float32" and dtype not in dtypes:
            continue
        entry: dict = {"approved": True}
        if dtype != "float32":
            _warn_if_slow(dtype)
            try:
                entry["accuracy"] = measure(bundle, dtype, data, limits)
            except AccuracyError as err:
                table[dtype] = {"approved": False, "refused": str(err)}
                continue
            if "int8_layers" in entry["accuracy"]:
                dense["int8_layers"] = entry["accuracy"].pop("int8_layers")
        cost = demand(bundle, dtype, typical_inputs) if dtype != "float32" else dense["demand"]
        entry["dense_us_per_sample"] = cost["dense_us_per_sample"]
        table[dtype] = entry
    return table


def _warn_if_slow(dtype: str) -> None:
    reason = slow_reason(dtype)
    if reason:
        print(f"cleave partition: warning: {reason}", file=sys.stderr)
