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


def kjt_segments(kjt: dict, inputs: Mapping[str, torch.Tensor]) -> dict[str, dict]:
    """Each key's ids, offsets (with the final one) and weights of a KJT input (docs/bundle.md,
    "kjts"): key k's bags are lengths[k*B : (k+1)*B], its ids the values they cover."""
    keys = kjt["keys"]
    lengths = inputs[kjt["lengths"]].to(torch.int64).view(len(keys), -1)
    sizes = lengths.sum(dim=1).tolist()
    values = inputs[kjt["values"]].split(sizes)
    weights = inputs[kjt["weights"]].split(sizes) if kjt.get("weights") else [None] * len(keys)
    zero = torch.zeros(len(keys), 1, dtype=torch.int64)
    offsets = torch.cat([zero, lengths.cumsum(dim=1)], dim=1)
    return {
        key: {"ids": values[k], "offsets": offsets[k], "weights": weights[k]}
        for k, key in enumerate(keys)
    }


def key_lengths(kjt: dict, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A KJT's lengths cut by key, [B] each, named by its `lengths_by_key` (docs/bundle.md,
    "kjts"): what the dense program of an EmbeddingCollection reads; none without them."""
    names = kjt.get("lengths_by_key") or []
    lengths = inputs[kjt["lengths"]].view(len(kjt["keys"]), -1) if names else []
    return dict(zip(names, lengths, strict=True))


def _kjt_inputs(feature: dict, segments: dict) -> tuple[dict, dict]:
    """A KJT feature as the offsets-layout feature over its key's segment; unpooled, as the
    gather of the segment's rows."""
    seg = segments[feature["kjt"]][feature["key"]]
    if feature["pooling"] == "none":
        return {**feature, "ids": "ids", "layout": "gather"}, seg
    names = {
        "ids": "ids",
        "offsets": "offsets",
        "weights": "weights" if feature["weights"] else None,
    }
    as_offsets = {**feature, **names, "layout": "offsets", "include_last_offset": True}
    return as_offsets, seg


def run_sparse(
    manifest: dict,
    inputs: Mapping[str, torch.Tensor],
    table: Callable[[str], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """All boundary tensors of one request: lookups, plus inputs that cross as they are."""
    segments = {k["name"]: kjt_segments(k, inputs) for k in manifest.get("kjts", [])}
    out = {}
    for f in manifest["features"]:
        feature, given = _kjt_inputs(f, segments) if f["layout"] == "kjt" else (f, inputs)
        out[f["output"]] = lookup(feature, given, table(f["table"]))
    for k in manifest.get("kjts", []):
        out.update(key_lengths(k, inputs))
    for b in manifest["boundary"]:
        if b["name"] not in out and b["name"] in inputs:
            out[b["name"]] = inputs[b["name"]]
    return out
