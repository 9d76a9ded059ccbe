"""A TorchRec model with an EmbeddingCollection (rows read unpooled) beside an
EmbeddingBagCollection, and its requests: used by the TorchRec and the batch-scoring tests."""

from __future__ import annotations

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class Sequences(torch.nn.Module):
    """TorchRec's EmbeddingCollection (unpooled): keys "item" and "seen" share a table, "city"
    has its own. "item" is padded to 3 rows per sample by `to_padded_dense` (`padded`) or,
    like "seen" and "city", reduced per sample with ATen operators on values() and lengths();
    `bags` adds an EmbeddingBagCollection (mean) over key "user" of the same KJT."""

    def __init__(self, padded: bool, bags: bool):
        super().__init__()
        shared = EmbeddingConfig(
            name="t_item", embedding_dim=4, num_embeddings=20, feature_names=["item", "seen"]
        )
        city = EmbeddingConfig(
            name="t_city", embedding_dim=4, num_embeddings=7, feature_names=["city"]
        )
        self.rows = EmbeddingCollection(tables=[shared, city])
        user = EmbeddingBagConfig(
            name="t_user",
            embedding_dim=4,
            num_embeddings=9,
            feature_names=["user"],
            pooling=PoolingType.MEAN,
        )
        self.bags = EmbeddingBagCollection(tables=[user]) if bags else None
        self.padded = padded
        width = 3 + (12 if padded else 4) + 4 + 4 + (4 if bags else 0)
        self.top = torch.nn.Sequential(
            torch.nn.Linear(width, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )

    def forward(self, dense, kjt):
        rows = self.rows(kjt)
        item = (
            rows["item"].to_padded_dense(3).flatten(1)
            if self.padded
            else per_sample_mean(rows["item"])
        )
        city = rows["city"]  # a per-sample sum through segment_reduce
        total = torch.segment_reduce(city.values(), "sum", lengths=city.lengths(), unsafe=True)
        parts = [dense, item, per_sample_mean(rows["seen"]), total]
        if self.bags is not None:
            parts.append(self.bags(kjt)["user"])
        return self.top(torch.cat(parts, 1))


def per_sample_mean(jt) -> torch.Tensor:
    """Each sample's rows averaged (zeros for none), with ATen operators only."""
    values, lengths = jt.values(), jt.lengths()
    sample = torch.repeat_interleave(
        torch.arange(lengths.shape[0]), lengths, output_size=values.shape[0]
    )
    sums = values.new_zeros(lengths.shape[0], values.shape[1]).index_add(0, sample, values)
    return sums / lengths.clamp(min=1).unsqueeze(1)


SEQUENCE_ROWS = {"item": 20, "seen": 20, "city": 7, "user": 9}


def sequence_requests(bags: bool, batch: int, generator: torch.Generator, city=None) -> tuple:
    """(dense [batch, 3], KJT of keys seen, city, [user,] item: 0-4 ids per sample, or the
    lengths `city` for key city)."""
    keys = ["seen", "city", *(["user"] if bags else []), "item"]
    lengths = torch.randint(0, 5, (len(keys), batch), generator=generator)
    if city is not None:
        lengths[1] = torch.tensor(city)
    values = [
        torch.randint(0, SEQUENCE_ROWS[k], (int(n.sum()),), generator=generator)
        for k, n in zip(keys, lengths, strict=True)
    ]
    kjt = KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=lengths.flatten())
    return torch.randn(batch, 3, generator=generator), kjt


def sequence_model(padded: bool, bags: bool):
    """The model, and an example of batch 4 whose key city has a single id (a size export
    would pin, were it not told otherwise: the bundle serves any number)."""
    torch.manual_seed(3)
    model = Sequences(padded, bags).eval()
    return model, sequence_requests(bags, 4, torch.Generator().manual_seed(1), [0, 1, 0, 0])
