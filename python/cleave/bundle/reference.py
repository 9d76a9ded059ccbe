"""The reference executor of the sparse side: the semantics every native engine must match.

It runs a manifest's features with PyTorch's own embedding operators, so for fp32 tables its
boundary tensors are those of the original model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from cleave.errors import CleaveError

_MODES = {"sum": "sum", "mean": "mean", "max": "max"}


def apply_transform(ids: torch.Tensor, transform: list[dict]) -> torch.Tensor:
    for step in transform:
        if step["op"] == "remainder":
            ids = torch.remainder(ids, step["divisor"])
        elif step["op"] == "fmod":
            ids = torch.fmod(ids, step["divisor"])
        elif step["op"] == "cast":
            ids = ids.to(getattr(torch, step["dtype"]))
        else:
            raise CleaveError(f"unknown id transform {step!r}")
    return ids


def lookup(feature: dict, inputs: Mapping[str, torch.Tensor], table: torch.Tensor) -> torch.Tensor:
    """One feature's boundary tensor from the named inputs and its fp32 table."""
    ids = apply_transform(inputs[feature["ids"]], feature["transform"])
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]):
        bad = ids[(ids < 0) | (ids >= table.shape[0])][0]
        raise CleaveError(
            f"feature {feature['name']!r}: id {int(bad)} (after transform) is outside table "
            f"{feature['table']!r}, which has rows [0, {table.shape[0]})"
        )
    layout, pooling = feature["layout"], feature["pooling"]
    if layout == "gather":
        return F.embedding(ids, table)
    if layout == "fixed":
        rows = F.embedding(ids, table)
        if pooling == "sum":
            return rows.sum(dim=1)
        if pooling == "mean":
            return rows.mean(dim=1)
        return rows.amax(dim=1)
    weights = inputs[feature["weights"]] if feature.get("weights") else None
    return F.embedding_bag(
        ids,
        table,
        inputs[feature["offsets"]],
        mode=_MODES[pooling],
        per_sample_weights=weights,
        include_last_offset=feature.get("include_last_offset", False),
    )


def run_sparse(
    manifest: dict,
    inputs: Mapping[str, torch.Tensor],
    table: Callable[[str], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """All boundary tensors of one request: lookups, plus inputs that cross as they are."""
    out = {f["output"]: lookup(f, inputs, table(f["table"])) for f in manifest["features"]}
    for b in manifest["boundary"]:
        if b["name"] not in out and b["name"] in inputs:
            out[b["name"]] = inputs[b["name"]]
    return out
