"""`cleave.partition(model, example_inputs)`: cut a PyTorch model at its sparse/dense seam.

capture.py (torch.export, all sizes dynamic) -> graph.py (find the seam) -> emit.py (bundle),
then accuracy.py when the dense program is served at reduced precision.
"""

from __future__ import annotations

import sys

import torch

from cleave.bundle import Bundle
from cleave.bundle import kjt as kjt_io
from cleave.bundle.precision import check_dtype, count_flops, slow_reason
from cleave.errors import UsageError
from cleave.partitioner.accuracy import AccuracyError, AccuracyLimits, batch_rows, demand, measure
from cleave.partitioner.capture import capture, input_names, kjt_inputs
from cleave.partitioner.emit import emit
from cleave.partitioner.graph import find_seam
from cleave.partitioner.kjt import kjt_fields

__all__ = ["AccuracyError", "AccuracyLimits", "partition"]


def partition(
    model: torch.nn.Module,
    example_inputs: tuple,
    *,
    table_dtype: str = "float32",
    dense_dtype: str = "float32",
    labelled=None,
    limits: AccuracyLimits | None = None,
    typical_inputs: tuple | None = None,
) -> Bundle:
    """Captures `model` on `example_inputs` (a tuple of forward's positional arguments) and
    returns a Bundle that serves any batch size and bag length. `table_dtype` is one of
    float32, float16, int8_rowwise, int4_rowwise. `dense_dtype` (float32, bfloat16, int8) is
    the precision the dense program is served at; a reduced one needs `labelled`, a list of (forward
    arguments, labels), to measure its accuracy cost, and raises AccuracyError past `limits`.
    `typical_inputs` (forward arguments of a typical request; default: the labelled set's
    first batch, else `example_inputs`) is where the sparse and dense sides' costs per sample
    are timed for `cleave serve`'s split of cores.
    Raises UnsupportedModelError naming the operator when the model cannot be cut."""
    check_dtype(dense_dtype)
    limits = (limits or AccuracyLimits()).check()
    if dense_dtype != "float32" and labelled is None:
        raise UsageError(
            f"dense dtype {dense_dtype} needs a labelled set to measure its accuracy cost "
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
    values = {**inputs, **bundle.sparse_reference(inputs)}
    dense_args = [values[n] for n in dense["inputs"]]
    bundle.record_probe(dense_args)
    rows = max(1, batch_rows(bundle, inputs))
    dense["flops_per_sample"] = count_flops(bundle.dense_module("float32"), dense_args) // rows
    if dense_dtype != "float32":
        reason = slow_reason(dense_dtype)
        if reason:
            print(f"cleave partition: warning: {reason}", file=sys.stderr)
        dense["accuracy"] = measure(bundle, dense_dtype, labelled, limits)
        if "int8_layers" in dense["accuracy"]:
            dense["int8_layers"] = dense["accuracy"].pop("int8_layers")
    dense["dtype"] = dense_dtype
    if typical_inputs is None:
        typical_inputs = labelled[0][0] if labelled else example_inputs
    dense["demand"] = demand(bundle, dense_dtype, typical_inputs)
    return bundle
