"""TorchRec's own models, unmodified: `torchrec.models.dlrm.DLRM`, `DLRM_DCN`,
`DLRM_Projection` and `torchrec.models.deepfm.SimpleDeepFMNN`, each over an
`EmbeddingBagCollection` fed a `KeyedJaggedTensor` (docs/models.md, "TorchRec models").

`build(name, spec)` returns `(model, example_inputs)`; `spec` says the tables (rows, dim,
pooling, the keys each serves, weighted or not) and the KJT's key order, which need not be the
tables' order. `requests(spec, batch, generator)` draws forward arguments. Over the Criteo
Kaggle tables, `reference(name, scale, seed)`, `features` and `request` are what
`cleave.models.MODELS` registers as `torchrec_dlrm`, `torchrec_dcn` and `torchrec_deepfm`.
Importing this module imports TorchRec: the partitioner's and the benchmarks' side only, never
a served process (but the eager baseline's ranker, which runs the TorchRec model itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from cleave.models.feature import Feature
from cleave.models.requests import Draw

ARCHITECTURES = ("dlrm", "dlrm_dcn", "dlrm_projection", "deepfm")
_POOLING = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}


@dataclass(frozen=True)
class Table:
    name: str
    rows: int
    keys: tuple[str, ...]  # the KJT keys it serves (two: a table shared by two features)
    pooling: str = "sum"


@dataclass(frozen=True)
class Spec:
    tables: tuple[Table, ...]
    dim: int = 8
    keys: tuple[str, ...] = ()  # the KJT's key order; default: the tables' order
    weighted: bool = False
    dense_features: int = 13
    max_bag: int = 4  # ids per bag in requests: 0 to max_bag
    mlp: tuple[int, ...] = field(default=(16,))

    @property
    def key_order(self) -> tuple[str, ...]:
        return self.keys or tuple(k for t in self.tables for k in t.keys)


def small(weighted: bool = False) -> Spec:
    """Test sizes: three tables of unlike rows and poolings, one shared by two keys, the KJT's
    keys in another order than the tables'. Weighted bags pool by sum only (PyTorch's rule)."""
    return Spec(
        tables=(
            Table("t_user", 41, ("user",), "sum" if weighted else "mean"),
            Table("t_item", 67, ("item", "seen_item")),
            Table("t_city", 13, ("city",)),
        ),
        dim=4,
        keys=("city", "seen_item", "user", "item"),
        weighted=weighted,
        dense_features=5,
    )


def criteo_kaggle(scale: float = 1.0) -> Spec:
    """The Criteo Kaggle shape of TorchRec's DLRM example: 26 sparse features (table sizes of
    the day's data capped at 1M rows), dim 16, 13 dense features. `scale` shrinks every
    table, keeping at least 16 rows (or its real size, if smaller)."""
    rows = [1460, 583, 1_000_000, 800_000, 305, 24, 12517, 633, 3, 93145, 5683, 1_000_000]
    rows += [3194, 27, 14992, 1_000_000, 10, 5652, 2173, 4, 1_000_000, 18, 15, 286181, 105]
    rows += [142572]
    rows = [min(r, max(16, int(r * scale))) for r in rows]
    tables = tuple(Table(f"t_cat_{i}", r, (f"cat_{i}",)) for i, r in enumerate(rows))
    return Spec(tables=tables, dim=16, max_bag=1, mlp=(512, 256))


def reference(name: str, scale: float, seed: int = 0):
    """TorchRec model `name` over the Criteo Kaggle tables at `scale`, with an example: a
    reference model of `cleave.models.MODELS`."""
    return build(name, criteo_kaggle(scale), seed)


def features(scale: float) -> list[Feature]:
    """The reference models' sparse features: one id per bag, as Criteo's."""
    spec = criteo_kaggle(scale)
    return [
        Feature(key, t.name, t.rows, t.rows, spec.dim, pooling=1.0)
        for t in spec.tables
        for key in t.keys
    ]


def request(draw: Draw, batch: int) -> tuple:
    """One request of the reference models: dense features and a KJT of the drawn ids."""
    keys = list(draw.features)
    lengths = [draw.lengths(key, batch) for key in keys]
    values = torch.cat([draw.ids(key, int(n.sum())) for key, n in zip(keys, lengths, strict=True)])
    kjt = KeyedJaggedTensor(
        keys=keys, values=values, lengths=torch.from_numpy(np.concatenate(lengths))
    )
    return draw.dense(batch, criteo_kaggle().dense_features), kjt


def build(name: str, spec: Spec, seed: int = 0) -> tuple[torch.nn.Module, tuple]:
    """TorchRec model `name` (one of ARCHITECTURES) over `spec`'s tables, and an example."""
    torch.manual_seed(seed)
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=spec.dim,
            num_embeddings=t.rows,
            feature_names=list(t.keys),
            pooling=_POOLING[t.pooling],
        )
        for t in spec.tables
    ]
    ebc = EmbeddingBagCollection(
        tables=configs, is_weighted=spec.weighted, device=torch.device("cpu")
    )
    dense, mlp = spec.dense_features, list(spec.mlp)
    if name == "dlrm":
        model = DLRM(ebc, dense, [*mlp, spec.dim], [*mlp, 1])
    elif name == "dlrm_dcn":
        model = DLRM_DCN(ebc, dense, [*mlp, spec.dim], [*mlp, 1], 2, 4)
    elif name == "dlrm_projection":
        model = DLRM_Projection(
            ebc, dense, [*mlp, spec.dim], [*mlp, 1], [8, 2 * spec.dim], [8, 3 * spec.dim]
        )
    elif name == "deepfm":
        model = SimpleDeepFMNN(dense, ebc, mlp[0], spec.dim)
    else:
        raise ValueError(f"unknown TorchRec architecture {name!r}; one of {ARCHITECTURES}")
    model.eval()
    return model, requests(spec, 4, torch.Generator().manual_seed(seed))


def requests(spec: Spec, batch: int, generator: torch.Generator) -> tuple:
    """Forward arguments of `batch` samples: dense features and a KJT built from lengths."""
    keys = spec.key_order
    rows = {k: t.rows for t in spec.tables for k in t.keys}
    lengths = torch.randint(0, spec.max_bag + 1, (len(keys), batch), generator=generator)
    values = torch.cat(
        [
            torch.randint(0, rows[k], (int(lengths[i].sum()),), generator=generator)
            for i, k in enumerate(keys)
        ]
    )
    weights = torch.rand(values.shape, generator=generator) if spec.weighted else None
    kjt = KeyedJaggedTensor(
        keys=list(keys), values=values, weights=weights, lengths=lengths.reshape(-1)
    )
    return torch.randn(batch, spec.dense_features, generator=generator), kjt


def small_dlrm() -> tuple[torch.nn.Module, tuple]:
    """`cleave partition --model cleave.models.torchrec_models:small_dlrm`: TorchRec's DLRM
    over the test tables (`small()`), for the README's example."""
    return build("dlrm", small())
