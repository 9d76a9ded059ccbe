"""Seeded initialisation and the MLP block shared by the reference models."""

from __future__ import annotations

import math

import torch
from torch import nn

#: Embedding values are uniform in +-EMBED_RANGE / sqrt(mean bag length): a bag's pooled values
#: are then O(0.01..0.1) whatever its length, so no feature drowns the others and scores stay
#: unsaturated even for bags several times longer than the model's usual ones.
EMBED_RANGE = 0.05
#: The score layer's weights are multiplied by this so that logits spread over O(1) across
#: requests (an untrained net's barely move): AUC and tolerance tests then have signal.
SCORE_GAIN = 40.0


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def init_table_(weight: torch.Tensor, gen: torch.Generator, pooling: float = 1.0) -> torch.Tensor:
    bound = EMBED_RANGE / math.sqrt(max(pooling, 1.0))
    with torch.no_grad():
        return weight.uniform_(-bound, bound, generator=gen)


def init_linear_(layer: nn.Linear, gen: torch.Generator) -> nn.Linear:
    # Glorot-normal weights and small biases, as DLRM does; drawn from `gen` for determinism.
    fan_out, fan_in = layer.weight.shape
    with torch.no_grad():
        layer.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)), generator=gen)
        layer.bias.normal_(0.0, math.sqrt(1.0 / fan_out) * 0.1, generator=gen)
    return layer


def mlp(
    sizes: list[int],
    gen: torch.Generator,
    *,
    last: nn.Module | None = None,
    gain: float = 1.0,
) -> nn.Sequential:
    """Linear+ReLU layers through `sizes`; the last layer is followed by `last` (or ReLU) and
    its weights are multiplied by `gain` (used to spread a score's logits to O(1))."""
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(init_linear_(nn.Linear(fan_in, fan_out), gen))
        is_last = i == len(sizes) - 2
        layers.append(last if is_last and last is not None else nn.ReLU())
    with torch.no_grad():
        layers[-2].weight.mul_(gain)
    return nn.Sequential(*layers)
