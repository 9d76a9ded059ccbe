"""Inference requests from a model's forward arguments, for a client that holds them as the
model takes them: tensors, lists of tensors and TorchRec KeyedJaggedTensors (a KJT `p` is sent
as `p.values`, `p.lengths` and `p.weights`, as `kjt.values()` etc. give them; docs/api.md).
Needs only the bundle's manifest, not its tables or dense program."""

from __future__ import annotations

from pathlib import Path

import torch

from cleave.bench.loadgen import build_body
from cleave.bundle import kjt as kjt_io
from cleave.bundle import manifest as manifest_io

__all__ = ["request_body", "request_inputs"]


def request_inputs(bundle_dir: str | Path, *args) -> dict[str, torch.Tensor]:
    """The forward arguments `args` as tensors by the bundle's input names."""
    names = [i["name"] for i in manifest_io.read(Path(bundle_dir))["inputs"]]
    return kjt_io.named_inputs(names, args)


def request_body(
    bundle_dir: str | Path, *args, protocol: str = "json", budget_ms: float | None = None
) -> bytes:
    """A KServe v2 infer request for `args`: `protocol` "json" or "binary" (REST; a binary
    body's `.headers` go with it) or "grpc" (a serialized ModelInferRequest)."""
    return build_body(request_inputs(bundle_dir, *args), budget_ms, protocol)
