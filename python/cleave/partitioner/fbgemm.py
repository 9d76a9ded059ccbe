"""ATen for the fbgemm operators TorchRec's jagged tensors emit, so that a dense program which
reads an EmbeddingCollection's rows stays plain ATen (the served side runs no fbgemm).

`JaggedTensor.to_padded_dense(L)` exports as

    offsets = fbgemm.asynchronous_complete_cumsum(lengths)
    padded  = fbgemm.jagged_to_padded_dense(rows, [offsets], [L], padding_value)

emit.py copies each such node into the dense program as a call of the function below, which
export then traces into ATen operators. fbgemm itself is never imported: nodes are matched by
their operator's name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx


def is_fbgemm(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith("fbgemm.")


def decomposition(node: fx.Node) -> Callable | None:
    """The ATen function that computes `node`'s fbgemm operator, or None when Cleave has none
    (for that operator, or for these arguments: several jagged dimensions, say)."""
    name = str(node.target)
    if name == "fbgemm.asynchronous_complete_cumsum.default":
        return complete_cumsum
    if name == "fbgemm.jagged_to_padded_dense.default" and len(node.args[1]) == 1:
        return jagged_to_padded_dense
    return None


def complete_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    """Offsets from lengths along the last dimension, with the leading zero."""
    zero = lengths.new_zeros((*lengths.shape[:-1], 1))
    return torch.cat([zero, lengths.cumsum(-1, dtype=lengths.dtype)], -1)


def jagged_to_padded_dense(
    values: torch.Tensor,
    offsets: list[torch.Tensor],
    max_lengths: list[int],
    padding_value: float = 0.0,
) -> torch.Tensor:
    """[B, L, ...] from jagged `values` [N, ...] with one offsets tensor [B + 1]: sample b's
    first L rows, then `padding_value`."""
    (offsets,), (length,) = offsets, max_lengths
    offsets = offsets.long()
    rows, batch = values.shape[0], offsets.shape[0] - 1
    sample = torch.repeat_interleave(offsets.diff(), output_size=rows)
    position = torch.arange(rows, device=values.device) - offsets[sample]
    # Rows past L land in a spare column that is cut off.
    position = position.clamp(max=length)
    padded = values.new_full((batch, length + 1, *values.shape[1:]), padding_value)
    padded = padded.index_put((sample, position), values)
    return padded[:, :length]
