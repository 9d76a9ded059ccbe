"""The dense program over many requests at once, for models with per-request inputs.

A model with shared inputs (one user, B candidates) feeds its dense program tensors with a
leading size of 1 that the program broadcasts against the candidates. Requests of such a model
cannot be concatenated as they are: each request's user row belongs to its own candidates only.
They can be once each request's per-request tensors are expanded to its candidate rows, *if*
the program treats row i of those tensors as candidate i's (true of broadcasting, attention
and concatenation; false of, say, a sum over the user's leading dimension). So the partitioner
exports the dense program a second time with those inputs carrying the batch dimension, and
keeps that program only when it scores two requests joined this way exactly as the original
scores each of them alone. Otherwise the ranker runs such a model one request per batch, as
before.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from cleave.partitioner.capture import dynamic_shapes

log = logging.getLogger("cleave.partition")

BATCHED_PROGRAM = "dense_batched.pt2"
# The joined batch must match the per-request outputs this closely (float32 sums reordered).
TOLERANCE = 1e-5


def per_request_inputs(manifest: dict) -> list[str]:
    """Dense inputs with a static leading size of 1 in a model whose batch varies; empty when
    any other dense input does not lead with the batch (a jagged one, say), since those are
    joined by rules this check does not exercise."""
    shapes = {t["name"]: t["shape"] for t in [*manifest["inputs"], *manifest["boundary"]]}
    per_request, batched = [], 0
    for name in manifest["dense"]["inputs"]:
        shape = shapes[name]
        if shape and shape[0] == 1:
            per_request.append(name)
        elif shape and shape[0] == "B":
            batched += 1
        else:
            return []
    return per_request if batched else []


def export_batched(
    module: fx.GraphModule, names: list[str], args: tuple, per_request: list[str]
) -> tuple[torch.export.ExportedProgram | None, str]:
    """(the program over joined requests, "") or (None, why not)."""
    index = [i for i, n in enumerate(names) if n in per_request]
    rows = next(int(t.shape[0]) for i, t in enumerate(args) if i not in index)
    if rows < 2:
        return None, "the example batch has fewer than 2 rows"
    expanded = tuple(_expand(t, rows) if i in index else t for i, t in enumerate(args))
    try:
        with torch.no_grad():
            program = torch.export.export(module, expanded, dynamic_shapes=dynamic_shapes(expanded))
    except Exception as err:  # export raises many types: each means "not batchable"
        return None, f"the program does not export with per-request inputs expanded: {err}"
    other = tuple(_other_user(t) if i in index else t for i, t in enumerate(args))
    joined = [
        torch.cat([_expand(a, rows), _expand(b, rows)]) if i in index else torch.cat([a, b])
        for i, (a, b) in enumerate(zip(args, other, strict=True))
    ]
    with torch.no_grad():
        alone = [
            torch.cat(pair) for pair in zip(_run(module, args), _run(module, other), strict=True)
        ]
        together = _run(program.module(), joined)
    for want, got in zip(alone, together, strict=True):
        if want.shape != got.shape or not torch.allclose(got, want, rtol=0, atol=TOLERANCE):
            return None, "two requests joined do not score as each alone"
    return program, ""


def _expand(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    return tensor.expand(rows, *tensor.shape[1:])


def _other_user(tensor: torch.Tensor) -> torch.Tensor:
    """A second request's per-request tensor, different from the first wherever it can be."""
    if tensor.is_floating_point():
        return -0.5 * tensor.flip(-1) + 0.25
    return tensor.flip(-1) if tensor.dim() else tensor


def _run(module, args) -> list[torch.Tensor]:
    out = module(*args)
    return [out] if isinstance(out, torch.Tensor) else list(torch.utils._pytree.tree_leaves(out))
