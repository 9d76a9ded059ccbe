"""Small models for partitioner tests, importable as `factories:NAME` by the CLI tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShapeControlFlow(nn.Module):
    """Python control flow on shapes, a loop over a static list, list arguments, and a
    constant built inside forward."""

    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(50 + 10 * i, 8, mode="sum") for i in range(3))
        self.mlp = nn.Linear(3 * 8 + 4, 1)

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]):
        pooled = [
            t(i % t.num_embeddings, o) for t, i, o in zip(self.tables, ids, offsets, strict=True)
        ]
        scale = torch.arange(1, 5, dtype=torch.float32).softmax(0)  # folded once
        x = torch.cat([*pooled, dense * scale], dim=1)
        if dense.shape[1] == 4:  # static shape: fine for export
            x = x * 2
        return torch.sigmoid(self.mlp(x)), pooled[0].sum(dim=1)


def shape_control_flow():
    torch.manual_seed(0)
    ids = [torch.randint(0, 1000, (9,)) for _ in range(3)]
    offsets = [torch.tensor([0, 2, 5, 7]) for _ in range(3)]
    return ShapeControlFlow(), (torch.randn(4, 4), ids, offsets)


class PerPosition(nn.Module):
    """An embedding read per position, pooled twice: the size-aware transfer decides what
    crosses."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 8)
        self.out = nn.Linear(16, 1)

    def forward(self, seq: torch.Tensor):
        rows = self.emb(seq)
        return self.out(torch.cat([rows.sum(dim=1), rows.amax(dim=1)], dim=1))


def per_position(length: int = 6):
    torch.manual_seed(0)
    return PerPosition(), (torch.randint(0, 40, (5, length)),)


class NoEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(3, 1)

    def forward(self, x):
        return self.mlp(x)


def no_embedding():
    return NoEmbedding(), (torch.randn(4, 3),)


class ValueBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4)
        self.mlp = nn.Linear(4, 1)

    def forward(self, ids, offsets):
        if ids.sum() > 5:  # data-dependent: export cannot capture it
            return self.mlp(self.emb(ids, offsets))
        return self.mlp(self.emb(ids, offsets)) * 2


def value_branch():
    return ValueBranch(), (torch.randint(0, 10, (6,)), torch.tensor([0, 2, 4]))


class CondLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4)
        self.mlp = nn.Linear(4, 1)

    def forward(self, ids, offsets):
        pooled = torch.cond(
            ids.sum() > 5,
            lambda i, o: self.emb(i, o),
            lambda i, o: self.emb(i, o) * 2,
            (ids, offsets),
        )
        return self.mlp(pooled)


def cond_lookup():
    return CondLookup(), (torch.randint(0, 10, (6,)), torch.tensor([0, 2, 4]))


class ComputedIds(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4)
        self.mlp = nn.Linear(4, 1)

    def forward(self, ids, offsets):
        return self.mlp(self.emb((ids * 3 + 1) % 10, offsets))


def computed_ids():
    return ComputedIds(), (torch.randint(0, 10, (6,)), torch.tensor([0, 2, 4]))


class PaddingIdx(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10, 4))
        self.mlp = nn.Linear(4, 1)

    def forward(self, ids, offsets):
        return self.mlp(F.embedding_bag(ids, self.weight, offsets, mode="mean", padding_idx=0))


def padding_idx():
    return PaddingIdx(), (torch.randint(0, 10, (6,)), torch.tensor([0, 2, 4]))


def raises():
    raise RuntimeError("checkpoint not found")


def wrong_type():
    return {"model": NoEmbedding()}
