"""Synthetic request streams for the reference models: Zipf-skewed ids, Poisson bag lengths.

`RequestGenerator("dlrm").batch(256)` returns the positional arguments of the model's forward
for 256 samples. Ids follow a bounded Zipf law over each table's rows (rank k drawn with
probability proportional to 1 / k**alpha, by inverse CDF), scattered over the table by a fixed
bijection so the hot rows do not all sit at the start of the table (and in one shard). Bag
lengths are `min_pooling + Poisson(mean - min_pooling)`, so `min_pooling=0` allows empty bags.
Everything is deterministic given `seed`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from cleave.errors import UsageError
from cleave.models.feature import Feature

if TYPE_CHECKING:
    from cleave.models import ModelEntry

__all__ = [
    "Draw",
    "ExampleDraw",
    "RequestGenerator",
    "ZipfSampler",
    "example_inputs",
    "row_permutation",
]


class ZipfSampler:
    """Ranks in [0, n) with P(k) proportional to 1 / (k + 1)**alpha; alpha == 0 is uniform."""

    def __init__(self, n: int, alpha: float):
        self.n = n
        self.alpha = alpha
        self._cdf: np.ndarray | None = None
        if alpha > 0 and n > 1:
            cdf = np.arange(1, n + 1, dtype=np.float64)  # in place: tables reach 40 M rows
            np.power(cdf, -alpha, out=cdf)
            np.cumsum(cdf, out=cdf)
            cdf /= cdf[-1]
            self._cdf = cdf

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        if self._cdf is None:
            return rng.integers(0, self.n, size=size, dtype=np.int64)
        ranks = np.searchsorted(self._cdf, rng.random(size), side="right")
        return np.minimum(ranks, self.n - 1).astype(np.int64)


def row_permutation(table: str, n: int) -> tuple[int, int]:
    """(mult, shift) of the bijection rank -> (rank * mult + shift) % n over [0, n), fixed per
    table so features sharing a table share its hot rows."""
    shift = zlib.crc32(table.encode()) % n
    mult = 2_654_435_761  # Knuth's multiplicative hash constant, a prime
    while math.gcd(mult, n) != 1:
        mult += 2
    return mult % n or 1, shift


class Draw:
    """Draws the random parts of one request for a model's features."""

    def __init__(
        self,
        features: list[Feature],
        rng: np.random.Generator,
        *,
        alpha: float = 1.05,
        pooling: float | None = None,
        min_pooling: int = 1,
        scatter: bool = True,
    ):
        self.features = {f.name: f for f in features}
        self.rng = rng
        self.alpha = alpha
        self.pooling = pooling
        self.min_pooling = min_pooling
        self.scatter = scatter
        self._samplers: dict[int, ZipfSampler] = {}

    def feature(self, name: str) -> Feature:
        return self.features[name]

    def ids(self, name: str, shape: tuple[int, ...] | int) -> torch.Tensor:
        """int64 ids of feature `name`, drawn from its id space, in the given shape."""
        f = self.features[name]
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        size = int(np.prod(shape, dtype=np.int64))
        sampler = self._samplers.get(f.id_space)
        if sampler is None:
            sampler = self._samplers[f.id_space] = ZipfSampler(f.id_space, self.alpha)
        ranks = sampler.sample(self.rng, size)
        if self.scatter and f.id_space > 1:
            mult, shift = row_permutation(f.table, f.id_space)
            ranks = (ranks * mult + shift) % f.id_space
        return torch.from_numpy(ranks.reshape(shape))

    def lengths(self, name: str, bags: int) -> np.ndarray:
        f = self.features[name]
        mean = f.pooling if self.pooling is None else self.pooling
        extra = self.rng.poisson(max(mean - self.min_pooling, 0.0), size=bags)
        return self.min_pooling + extra

    def bag(self, name: str, bags: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, offsets) of `bags` bags of feature `name`: embedding_bag's layout."""
        lengths = self.lengths(name, bags)
        offsets = np.zeros(bags, dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        return self.ids(name, int(lengths.sum())), torch.from_numpy(offsets)

    def weights(self, n: int) -> torch.Tensor:
        """Per-sample weights for n ids, in [0.5, 1.5)."""
        return torch.from_numpy(self.rng.uniform(0.5, 1.5, size=n).astype(np.float32))

    def dense(self, batch: int, width: int) -> torch.Tensor:
        """Non-negative dense features shaped like Criteo's log-transformed counts."""
        counts = self.rng.exponential(8.0, size=(batch, width))
        return torch.from_numpy(np.log1p(counts).astype(np.float32))


class ExampleDraw(Draw):
    """Example inputs for torch.export: uniform ids and bags of 2 or 3 ids (lengths that vary
    and are >= 2, so export keeps every jagged size symbolic)."""

    def __init__(self, features: list[Feature], seed: int = 0):
        super().__init__(features, np.random.default_rng(seed), alpha=0.0, scatter=False)

    def lengths(self, name: str, bags: int) -> np.ndarray:
        return 2 + np.arange(bags, dtype=np.int64) % 2


#: A model's request layout: draws one request of `batch` samples.
Assemble = Callable[[Draw, int], tuple]


def example_inputs(features: list[Feature], assemble: Assemble, batch: int, seed: int) -> tuple:
    """Forward arguments to hand torch.export: batch >= 3 so no batch dim is specialised."""
    if not (isinstance(batch, int) and batch >= 3):
        raise UsageError(
            f"example batch must be an int >= 3 (torch.export specialises sizes 0 and 1), "
            f"got {batch!r}"
        )
    return assemble(ExampleDraw(features, seed), batch)


class RequestGenerator:
    """Requests for one reference model, deterministic given `seed`.

    `model` is a short name from `cleave.models.MODELS` or a factory registered there. `scale`
    must match the model's (default: the factory's default). `alpha` is the Zipf skew (0 is
    uniform); `pooling`, when set, replaces every jagged feature's mean bag length;
    `min_pooling=0` allows empty bags.
    """

    def __init__(
        self,
        model: str | Callable,
        *,
        scale: float | None = None,
        alpha: float = 1.05,
        pooling: float | None = None,
        min_pooling: int = 1,
        scatter: bool = True,
        seed: int = 0,
    ):
        self.entry = _entry(model)
        self.scale = self.entry.default_scale if scale is None else scale
        if not (isinstance(self.scale, int | float) and self.scale > 0):
            raise UsageError(f"scale must be a number > 0, got {scale!r}")
        if not (isinstance(alpha, int | float) and alpha >= 0):
            raise UsageError(f"alpha must be a number >= 0 (0 is uniform), got {alpha!r}")
        if pooling is not None and not (isinstance(pooling, int | float) and pooling > 0):
            raise UsageError(f"pooling must be a mean bag length > 0 or None, got {pooling!r}")
        if not (isinstance(min_pooling, int) and min_pooling >= 0):
            raise UsageError(f"min_pooling must be an int >= 0, got {min_pooling!r}")
        self.features = self.entry.features(self.scale)
        self.seed = seed
        self.draw = Draw(
            self.features,
            np.random.default_rng(seed),
            alpha=alpha,
            pooling=pooling,
            min_pooling=min_pooling,
            scatter=scatter,
        )

    def batch(self, batch_size: int) -> tuple:
        """The forward arguments of one request with `batch_size` samples (candidates)."""
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise UsageError(f"batch_size must be an int >= 1, got {batch_size!r}")
        return self.entry.assemble(self.draw, batch_size)

    def labelled(
        self,
        n: int,
        batch_size: int = 256,
        *,
        teacher: torch.nn.Module | None = None,
        sharpness: float = 3.0,
    ) -> list[tuple[tuple, torch.Tensor]]:
        """`n` samples in batches of `batch_size`, each with 0/1 labels (float32, [B]).

        Labels are Bernoulli draws from a fixed "teacher": the model built with this
        generator's scale and seed (or `teacher`). Its logits are standardised over the n
        samples and multiplied by `sharpness`, so the teacher scores an AUC well above 0.5
        on these labels and a model that computes something else does not.
        """
        if not (isinstance(n, int) and n >= 1):
            raise UsageError(f"n must be an int >= 1, got {n!r}")
        if teacher is None:
            teacher, _ = self.entry.factory(scale=self.scale, seed=self.seed)
        batches = []
        left = n
        while left > 0:
            batches.append(self.batch(min(batch_size, left)))
            left -= batch_size
        with torch.no_grad():
            per_batch = [teacher(*args).reshape(-1) for args in batches]
        scores = torch.cat(per_batch)
        logits = torch.logit(scores.double(), eps=1e-7)
        z = (logits - logits.mean()) / logits.std().clamp_min(1e-12)
        p = torch.sigmoid(sharpness * z).numpy()
        rng = np.random.default_rng([self.seed, 0x1ABE1])
        labels = torch.from_numpy((rng.random(len(p)) < p).astype(np.float32))
        sizes = [len(s) for s in per_batch]
        return list(zip(batches, torch.split(labels, sizes), strict=True))


def _entry(model: str | Callable) -> ModelEntry:
    from cleave.models import MODELS

    if isinstance(model, str):
        if model not in MODELS:
            raise UsageError(f"unknown model {model!r}; expected one of {sorted(MODELS)}")
        return MODELS[model]
    for entry in MODELS.values():
        if entry.factory is model:
            return entry
    raise UsageError(
        f"no request layout for {model!r}; expected a name or factory from {sorted(MODELS)}"
    )
