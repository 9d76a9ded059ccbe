"""A model that exercises the sparse side's less common shapes.

Three features share one table (the same EmbeddingBag called on three id inputs, two of them
with per-sample weights), one feature is mean-pooled, one max-pooled, and one is a
fixed-length bag written as `nn.Embedding(ids2d).sum(dim=1)`; an MLP scores the result.
"""

from __future__ import annotations

import torch
from torch import nn

from cleave.models.feature import Feature, scaled_rows
from cleave.models.layers import EMBED_RANGE, SCORE_GAIN, generator, init_table_, mlp
from cleave.models.requests import Draw, example_inputs

SHARED_ROWS = 4_000_000
MEAN_ROWS = 1_000_000
MAX_ROWS = 500_000
FIXED_ROWS = 100_000
DIM = 32
FIXED_LENGTH = 4
DENSE_FEATURES = 8
HIDDEN = [256, 64, 1]
#: The shared table's features: (name, weighted, mean bag length).
SHARED = [("query_terms", True, 4.0), ("clicked_terms", True, 12.0), ("title_terms", False, 8.0)]
#: 5.6 M rows, 717 MB of float32 tables at scale 1; 1.1 M rows, 143 MB at the default.
DEFAULT_SCALE = 0.2


def features(scale: float = DEFAULT_SCALE) -> list[Feature]:
    shared = scaled_rows(SHARED_ROWS, scale)
    mean = scaled_rows(MEAN_ROWS, scale)
    top = scaled_rows(MAX_ROWS, scale)
    fixed = scaled_rows(FIXED_ROWS, scale)
    return [
        *(
            Feature(name, "terms", shared, shared, DIM, pooling=pooling, weighted=weighted)
            for name, weighted, pooling in SHARED
        ),
        Feature("pages", "pages", mean, mean, DIM, pooling=6.0),
        Feature("ads", "ads", top, top, DIM, pooling=3.0),
        Feature("slots", "slots", fixed, fixed, DIM, pooling=FIXED_LENGTH, length=FIXED_LENGTH),
    ]


class SharedWeighted(nn.Module):
    def __init__(self, shared: int, mean: int, top: int, fixed: int, seed: int = 0):
        super().__init__()
        gen = generator(seed)
        self.terms = nn.EmbeddingBag(shared, DIM, mode="sum")
        self.pages = nn.EmbeddingBag(mean, DIM, mode="mean")
        self.ads = nn.EmbeddingBag(top, DIM, mode="max")
        self.slots = nn.Embedding(fixed, DIM)
        # Sum-pooled tables are scaled for their bag lengths; mean and max need no scaling.
        init_table_(self.terms.weight, gen, pooling=max(p for _, _, p in SHARED))
        init_table_(self.pages.weight, gen)
        init_table_(self.ads.weight, gen)
        init_table_(self.slots.weight, gen, pooling=FIXED_LENGTH)
        # Brought down to the pooled embeddings' magnitude so the dense features do not drown them.
        self.dense = mlp([DENSE_FEATURES, DIM], gen, gain=EMBED_RANGE)
        self.top = mlp([DIM * (len(SHARED) + 4)] + HIDDEN, gen, last=nn.Sigmoid(), gain=SCORE_GAIN)

    def forward(
        self,
        dense_x: torch.Tensor,
        term_ids: list[torch.Tensor],
        term_offsets: list[torch.Tensor],
        term_weights: list[torch.Tensor],
        page_ids: torch.Tensor,
        page_offsets: torch.Tensor,
        ad_ids: torch.Tensor,
        ad_offsets: torch.Tensor,
        slot_ids: torch.Tensor,
    ) -> torch.Tensor:
        # The weighted features come first in term_ids; the rest of the shared ones follow.
        weights = [*term_weights, *([None] * (len(term_ids) - len(term_weights)))]
        terms = [
            self.terms(ids, offsets, per_sample_weights=w)
            for ids, offsets, w in zip(term_ids, term_offsets, weights, strict=True)
        ]
        pooled = [
            self.dense(dense_x),
            *terms,
            self.pages(page_ids, page_offsets),
            self.ads(ad_ids, ad_offsets),
            self.slots(slot_ids).sum(dim=1),
        ]
        return self.top(torch.cat(pooled, dim=1))


def request(draw: Draw, batch: int) -> tuple:
    bags = [draw.bag(name, batch) for name, _, _ in SHARED]
    weights = [
        draw.weights(len(ids))
        for (ids, _), (_, weighted, _) in zip(bags, SHARED, strict=True)
        if weighted
    ]
    page_ids, page_offsets = draw.bag("pages", batch)
    ad_ids, ad_offsets = draw.bag("ads", batch)
    return (
        draw.dense(batch, DENSE_FEATURES),
        [ids for ids, _ in bags],
        [offsets for _, offsets in bags],
        weights,
        page_ids,
        page_offsets,
        ad_ids,
        ad_offsets,
        draw.ids("slots", (batch, FIXED_LENGTH)),
    )


def shared_weighted(
    scale: float = DEFAULT_SCALE, seed: int = 0, batch: int = 5
) -> tuple[SharedWeighted, tuple]:
    """The shared-table model with synthetic weights, and example forward arguments."""
    specs = {f.name: f for f in features(scale)}
    model = SharedWeighted(
        specs["query_terms"].rows,
        specs["pages"].rows,
        specs["ads"].rows,
        specs["slots"].rows,
        seed=seed,
    ).eval()
    return model, example_inputs(list(specs.values()), request, batch, seed)
