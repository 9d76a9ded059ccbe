"""A tiny dense program (7 weights) with the manifest that describes it, and its requests: the
ranker's unit tests run it without a bundle."""

from __future__ import annotations

import torch

DENSE_MANIFEST = {
    "inputs": [
        {"name": "dense_x", "dtype": "float32", "shape": ["B", 4], "role": "dense"},
        {"name": "ids", "dtype": "int64", "shape": ["N0"], "role": "ids"},
        {"name": "offsets", "dtype": "int64", "shape": ["B"], "role": "offsets"},
    ],
    "outputs": [{"name": "output_0", "dtype": "float32", "shape": ["B", 1]}],
    "features": [
        {
            "name": "f0",
            "table": "t0",
            "ids": "ids",
            "offsets": "offsets",
            "layout": "offsets",
            "include_last_offset": False,
            "weights": None,
            "pooling": "sum",
            "transform": [],
            "output": "pooled_0",
        }
    ],
    "boundary": [{"name": "pooled_0", "dtype": "float32", "shape": ["B", 3]}],
    "dense": {"program": "dense.pt2", "inputs": ["dense_x", "pooled_0"]},
    "shared_inputs": [],
}


class Dense(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(7, 1, generator=g))

    def forward(self, dense_x, pooled):
        return (torch.sigmoid(torch.cat([dense_x, pooled], dim=1) @ self.w),)


def dense_request(rows: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 4, generator=g), torch.randn(rows, 3, generator=g)]
