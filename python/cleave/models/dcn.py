"""A DCN-v2 shaped like the MLPerf Inference/Training DLRMv2 model (Criteo 1TB multi-hot).

26 sum-pooled multi-hot features of dim 128 with the MLPerf table sizes and multi-hot sizes,
bottom MLP 13-512-256-128, a low-rank cross network (3 layers, rank 512) over the
concatenated [B, 27 * 128] vector, top MLP 1024-1024-512-256-1 with a sigmoid.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cleave.models.feature import Feature, scaled_rows
from cleave.models.layers import SCORE_GAIN, generator, init_table_, mlp
from cleave.models.requests import Draw, example_inputs

# MLPerf DLRMv2: --num_embeddings_per_feature and --multi_hot_sizes of the reference
# (torchrec_dlrm with --interaction_type=dcn, materialized Criteo 1TB multi-hot data set).
MLPERF_ROWS = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]  # fmt: skip
MULTI_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
DENSE_FEATURES = 13
DIM = 128
BOTTOM = [DENSE_FEATURES, 512, 256, DIM]
TOP_HIDDEN = [1024, 1024, 512, 256, 1]
CROSS_LAYERS = 3
CROSS_RANK = 512
#: 204 M rows, 105 GB of float32 tables at scale 1; 0.20 M rows, 105 MB at the default
#: (every 40 M-row table becomes 40 k rows).
DEFAULT_SCALE = 0.001


def features(scale: float = DEFAULT_SCALE) -> list[Feature]:
    return [
        Feature(f"C{i + 1}", f"t{i}", r := scaled_rows(rows, scale), r, DIM, pooling=float(hot))
        for i, (rows, hot) in enumerate(zip(MLPERF_ROWS, MULTI_HOT, strict=True))
    ]


class LowRankCross(nn.Module):
    """DCN-v2 cross network with low-rank weights: x_{l+1} = x0 * (U_l V_l x_l + b_l) + x_l."""

    def __init__(self, width: int, layers: int, rank: int, gen: torch.Generator):
        super().__init__()
        self.V = nn.ModuleList(nn.Linear(width, rank, bias=False) for _ in range(layers))
        self.U = nn.ModuleList(nn.Linear(rank, width) for _ in range(layers))
        with torch.no_grad():
            for v, u in zip(self.V, self.U, strict=True):
                v.weight.normal_(0.0, math.sqrt(2.0 / (width + rank)), generator=gen)
                u.weight.normal_(0.0, math.sqrt(2.0 / (width + rank)), generator=gen)
                u.bias.zero_()

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for v, u in zip(self.V, self.U, strict=True):
            x = x0 * u(v(x)) + x
        return x


class DCN(nn.Module):
    def __init__(self, rows: list[int], seed: int = 0):
        super().__init__()
        gen = generator(seed)
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(n, DIM, mode="sum") for n in rows)
        for bag, hot in zip(self.emb_l, MULTI_HOT, strict=True):
            init_table_(bag.weight, gen, pooling=hot)
        self.bot_l = mlp(BOTTOM, gen)
        width = DIM * (len(rows) + 1)
        self.cross = LowRankCross(width, CROSS_LAYERS, CROSS_RANK, gen)
        self.top_l = mlp([width] + TOP_HIDDEN, gen, last=nn.Sigmoid(), gain=SCORE_GAIN)

    def forward(
        self, dense_x: torch.Tensor, lS_i: list[torch.Tensor], lS_o: list[torch.Tensor]
    ) -> torch.Tensor:
        x = self.bot_l(dense_x)
        pooled = [
            bag(ids, offsets) for bag, ids, offsets in zip(self.emb_l, lS_i, lS_o, strict=True)
        ]
        return self.top_l(self.cross(torch.cat([x, *pooled], dim=1)))


def request(draw: Draw, batch: int) -> tuple:
    names = [f"C{i + 1}" for i in range(len(MLPERF_ROWS))]
    bags = [draw.bag(name, batch) for name in names]
    return (
        draw.dense(batch, DENSE_FEATURES),
        [ids for ids, _ in bags],
        [offsets for _, offsets in bags],
    )


def dlrm_v2_dcn(scale: float = DEFAULT_SCALE, seed: int = 0, batch: int = 5) -> tuple[DCN, tuple]:
    """The MLPerf-DLRMv2-shaped DCN-v2 with synthetic weights, and example forward arguments."""
    specs = features(scale)
    model = DCN([f.rows for f in specs], seed=seed).eval()
    return model, example_inputs(specs, request, batch, seed)
