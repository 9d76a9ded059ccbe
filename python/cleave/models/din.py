"""A DIN-style model: one user's behaviour sequence attended by each candidate item.

A request scores B candidate items for ONE user. The user inputs (a fixed-length history of
item ids and one bag of profile ids) have batch size 1 and are broadcast to the candidates
after their lookups: looked up once per request, not once per candidate ("shared inputs").
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cleave.models.feature import Feature, scaled_rows
from cleave.models.layers import SCORE_GAIN, generator, init_table_, mlp
from cleave.models.requests import Draw, example_inputs

ITEMS = 10_000_000
CATEGORIES = 10_000
PROFILE_ROWS = 2_000_000
DIM = 32
HISTORY = 50
PROFILE_POOLING = 20.0
HIDDEN = [200, 80, 1]
#: 12 M rows, 1.5 GB of float32 tables at scale 1; 1.2 M rows, 154 MB at the default.
DEFAULT_SCALE = 0.1


def features(scale: float = DEFAULT_SCALE) -> list[Feature]:
    items = scaled_rows(ITEMS, scale)
    profile = scaled_rows(PROFILE_ROWS, scale)
    cats = scaled_rows(CATEGORIES, scale)
    return [
        Feature("user_hist", "items", items, items, DIM, pooling=HISTORY, length=HISTORY),
        Feature("user_profile", "profile", profile, profile, DIM, pooling=PROFILE_POOLING),
        Feature("cand_item", "items", items, items, DIM),
        Feature("cand_cat", "categories", cats, cats, DIM),
    ]


class DIN(nn.Module):
    def __init__(self, items: int, categories: int, profile: int, seed: int = 0):
        super().__init__()
        gen = generator(seed)
        self.item = nn.Embedding(items, DIM)
        self.category = nn.Embedding(categories, DIM)
        self.profile = nn.EmbeddingBag(profile, DIM, mode="sum")
        init_table_(self.item.weight, gen)
        init_table_(self.category.weight, gen)
        init_table_(self.profile.weight, gen, pooling=PROFILE_POOLING)
        self.mlp = mlp([5 * DIM] + HIDDEN, gen, last=nn.Sigmoid(), gain=SCORE_GAIN)

    def forward(
        self,
        user_hist: torch.Tensor,
        profile_ids: torch.Tensor,
        profile_offsets: torch.Tensor,
        cand_items: torch.Tensor,
        cand_cats: torch.Tensor,
    ) -> torch.Tensor:
        hist = self.item(user_hist)  # [1, L, D]
        profile = self.profile(profile_ids, profile_offsets)  # [1, D]
        query = self.item(cand_items) + self.category(cand_cats)  # [B, D]
        batch = query.shape[0]
        # Target attention: each candidate weighs the user's history by similarity.
        scores = torch.matmul(query.unsqueeze(1), hist.transpose(1, 2)) / math.sqrt(DIM)
        interest = torch.matmul(torch.softmax(scores, dim=-1), hist).squeeze(1)  # [B, D]
        user = torch.cat([profile, hist.mean(dim=1)], dim=1).expand(batch, 2 * DIM)
        return self.mlp(torch.cat([interest, query, interest * query, user], dim=1))


def request(draw: Draw, batch: int) -> tuple:
    profile_ids, profile_offsets = draw.bag("user_profile", 1)
    items = draw.ids("cand_item", batch)
    # A candidate's category is a fixed function of the item, as in a real catalogue.
    categories = items % draw.feature("cand_cat").id_space
    return (draw.ids("user_hist", (1, HISTORY)), profile_ids, profile_offsets, items, categories)


def user_sequence(scale: float = DEFAULT_SCALE, seed: int = 0, batch: int = 5) -> tuple[DIN, tuple]:
    """The DIN-style model with synthetic weights, and example forward arguments."""
    specs = {f.name: f for f in features(scale)}
    model = DIN(
        specs["cand_item"].rows, specs["cand_cat"].rows, specs["user_profile"].rows, seed=seed
    ).eval()
    return model, example_inputs(list(specs.values()), request, batch, seed)
