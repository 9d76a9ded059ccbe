"""`cleave.partition(model, example_inputs)`: cut a PyTorch model at its sparse/dense seam.

capture.py (torch.export, all sizes dynamic) -> graph.py (find the seam) -> emit.py (bundle).
"""

from __future__ import annotations

import torch

from cleave.bundle import Bundle
from cleave.partitioner.capture import capture, input_names
from cleave.partitioner.emit import emit
from cleave.partitioner.graph import find_seam

__all__ = ["partition"]


def partition(
    model: torch.nn.Module, example_inputs: tuple, *, table_dtype: str = "float32"
) -> Bundle:
    """Captures `model` on `example_inputs` (a tuple of forward's positional arguments) and
    returns a Bundle that serves any batch size and bag length. `table_dtype` is one of
    float32, float16, int8_rowwise. Raises UnsupportedModelError naming the operator when the
    model cannot be cut."""
    program = capture(model, example_inputs)
    seam = find_seam(program)
    return emit(program, example_inputs, input_names(model, example_inputs), seam, table_dtype)
