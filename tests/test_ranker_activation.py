"""A ranker's memory per batch row (cleave.ranker.activation), measured on a program whose
peak is known: the input, the layer being written and the one it reads from are live at once."""

from __future__ import annotations

import torch
from cleave.ranker.activation import bytes_per_row


def mlp(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width),
        torch.nn.ReLU(),
        torch.nn.Linear(2 * width, 2 * width),
        torch.nn.ReLU(),
        torch.nn.Linear(2 * width, 1),
    ).eval()


def measured(width: int, rows: int = 64) -> int:
    model = mlp(width)
    return bytes_per_row(
        lambda n: ([torch.randn(n, width)], n), lambda inputs: model(*inputs), "cpu", rows
    )


def test_the_peak_per_row_is_the_live_tensors_of_the_widest_step():
    width = 256
    # At the widest step the input (width) and two hidden layers (2·width each) are live;
    # fewer than the input and one hidden layer cannot be, more than every tensor cannot.
    got = measured(width)
    assert 4 * (width + 2 * width) <= got <= 4 * (width + 3 * 2 * width + 1), got
    # Twice the widths, twice the memory per row (within the allocator's rounding).
    assert abs(measured(2 * width) - 2 * got) <= 0.05 * 2 * got


def test_a_batch_that_cannot_be_built_measures_nothing():
    assert bytes_per_row(lambda n: None, lambda inputs: None, "cpu", 8) is None


def test_requests_that_are_not_joined_count_their_one_batch():
    # batch() gives the same rows whatever is asked (one request per batch): its peak / rows.
    model = mlp(64)
    got = bytes_per_row(
        lambda n: ([torch.randn(10, 64)], 10), lambda inputs: model(*inputs), "cpu", 8
    )
    assert got >= 4 * (64 + 128)
