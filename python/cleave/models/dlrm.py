"""A DLRM shaped like facebookresearch/dlrm's Criteo Kaggle configuration.

26 sum-pooled tables of dim 16 with the Kaggle cardinalities, bottom MLP 13-512-256-64-16,
dot interaction (pairwise dot products of the 27 vectors, each pair once), top MLP
512-256-1 with a sigmoid. Raw ids are hashed into the (scaled) tables with `% rows` in
forward, as Criteo's hashed categorical features are.
"""

from __future__ import annotations

import torch
from torch import nn

from cleave.models.feature import Feature, scaled_rows
from cleave.models.layers import SCORE_GAIN, generator, init_table_, mlp
from cleave.models.requests import Draw, example_inputs

# Criteo Kaggle Display Advertising: distinct values of C1..C26 (facebookresearch/dlrm kaggle).
KAGGLE_ROWS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
DENSE_FEATURES = 13
DIM = 16
BOTTOM = [DENSE_FEATURES, 512, 256, 64, DIM]
TOP_HIDDEN = [512, 256, 1]
#: 33.8 M rows, 2.2 GB of float32 tables at scale 1; 1.69 M rows, 108 MB at the default.
DEFAULT_SCALE = 0.05


def features(scale: float = DEFAULT_SCALE) -> list[Feature]:
    # Criteo Kaggle features are one-hot: one id per bag.
    return [
        Feature(f"C{i + 1}", f"t{i}", rows, scaled_rows(rows, scale), DIM, pooling=1.0)
        for i, rows in enumerate(KAGGLE_ROWS)
    ]


class DLRM(nn.Module):
    def __init__(self, rows: list[int], seed: int = 0):
        super().__init__()
        gen = generator(seed)
        self.rows = list(rows)
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(n, DIM, mode="sum") for n in rows)
        for bag in self.emb_l:
            init_table_(bag.weight, gen)
        self.bot_l = mlp(BOTTOM, gen)
        vectors = len(rows) + 1
        pairs = vectors * (vectors - 1) // 2
        self.top_l = mlp([DIM + pairs] + TOP_HIDDEN, gen, last=nn.Sigmoid(), gain=SCORE_GAIN)
        i, j = torch.triu_indices(vectors, vectors, offset=1)
        # Flat positions of the pairs (i < j) in the [vectors, vectors] Gram matrix.
        self.register_buffer("pair_index", i * vectors + j, persistent=False)

    def forward(
        self, dense_x: torch.Tensor, lS_i: list[torch.Tensor], lS_o: list[torch.Tensor]
    ) -> torch.Tensor:
        x = self.bot_l(dense_x)
        pooled = [
            bag(ids % rows, offsets)
            for bag, rows, ids, offsets in zip(self.emb_l, self.rows, lS_i, lS_o, strict=True)
        ]
        t = torch.stack([x, *pooled], dim=1)  # [B, 27, DIM]
        gram = torch.bmm(t, t.transpose(1, 2)).flatten(1)  # [B, 27 * 27]
        z = torch.cat([x, gram.index_select(1, self.pair_index)], dim=1)
        return self.top_l(z)


def request(draw: Draw, batch: int) -> tuple:
    names = [f"C{i + 1}" for i in range(len(KAGGLE_ROWS))]
    bags = [draw.bag(name, batch) for name in names]
    return (
        draw.dense(batch, DENSE_FEATURES),
        [ids for ids, _ in bags],
        [offsets for _, offsets in bags],
    )


def criteo_kaggle(
    scale: float = DEFAULT_SCALE, seed: int = 0, batch: int = 5
) -> tuple[DLRM, tuple]:
    """The Criteo-Kaggle DLRM with synthetic weights, and example forward arguments."""
    specs = features(scale)
    model = DLRM([f.rows for f in specs], seed=seed).eval()
    return model, example_inputs(specs, request, batch, seed)
