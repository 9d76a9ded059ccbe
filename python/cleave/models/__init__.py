"""Reference recommendation models with deterministic synthetic weights, and their requests.

Each factory returns `(model, example_inputs)` and takes `scale` (shrinks every table) and
`seed`. `MODELS` maps a short name to the factory, its sparse features and its request
layout; `RequestGenerator(name)` draws requests for it. The `torchrec_*` entries are TorchRec's
own models (cleave.models.torchrec_models), imported only when used. See docs/models.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from cleave.models import dcn, din, dlrm, shared_tables
from cleave.models.dcn import dlrm_v2_dcn
from cleave.models.din import user_sequence
from cleave.models.dlrm import criteo_kaggle
from cleave.models.feature import Feature, scaled_rows, table_bytes
from cleave.models.requests import Draw, RequestGenerator
from cleave.models.shared_tables import shared_weighted

__all__ = [
    "MODELS",
    "Feature",
    "ModelEntry",
    "RequestGenerator",
    "criteo_kaggle",
    "dlrm_v2_dcn",
    "scaled_rows",
    "shared_weighted",
    "table_bytes",
    "user_sequence",
]


@dataclass(frozen=True)
class ModelEntry:
    """A reference model: how to build it, what its sparse inputs are, how to draw requests."""

    name: str
    factory: Callable[..., tuple[nn.Module, tuple]]
    features: Callable[[float], list[Feature]]
    assemble: Callable[[Draw, int], tuple]
    default_scale: float
    torchrec: bool = False  # TorchRec's model: its forward takes a KeyedJaggedTensor

    def generator(self, **kwargs) -> RequestGenerator:
        return RequestGenerator(self.name, **kwargs)


MODELS: dict[str, ModelEntry] = {
    name: ModelEntry(name, factory, module.features, module.request, module.DEFAULT_SCALE)
    for name, factory, module in [
        ("dlrm", criteo_kaggle, dlrm),
        ("dcn", dlrm_v2_dcn, dcn),
        ("din", user_sequence, din),
        ("shared", shared_weighted, shared_tables),
    ]
}


def _torchrec(attr: str, *bound) -> Callable:
    """cleave.models.torchrec_models.ATTR, imported at the first call: TorchRec loads only
    where one of its models is used."""

    def call(*args, **kwargs):
        from cleave.models import torchrec_models

        return getattr(torchrec_models, attr)(*bound, *args, **kwargs)

    return call


# TorchRec's own models over the Criteo Kaggle tables (torchrec.models.dlrm, .deepfm); at the
# default scale 0.27 M rows, 16 MiB of tables (scale 1: the Kaggle sizes capped at 1 M rows).
MODELS.update(
    (
        name,
        ModelEntry(
            name,
            _torchrec("reference", architecture),
            _torchrec("features"),
            _torchrec("request"),
            0.05,
            torchrec=True,
        ),
    )
    for name, architecture in [
        ("torchrec_dlrm", "dlrm"),
        ("torchrec_dcn", "dlrm_dcn"),
        ("torchrec_deepfm", "deepfm"),
    ]
)
