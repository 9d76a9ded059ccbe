"""`cleave score` in tests: an input file exported from a model's requests with the model's
own scores, the command to its end, and its output read back."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.utils._pytree as pytree
from cleave.score.input import Schema, to_rows

from support.processes import cli


def write_input(bundle, model, batches: list[tuple], path: Path, row_group: int) -> np.ndarray:
    """The samples of `batches` (forward arguments) as `cleave score`'s rows at `path`, in
    row groups of `row_group` rows; returns the model's outputs, a row per sample."""
    schema = Schema(bundle.manifest)
    tables, want = [], []
    for args in batches:
        tables.append(to_rows(schema, bundle.named_inputs(*args)))
        with torch.inference_mode():
            leaves = pytree.tree_leaves(model(*args))
        want.append(np.concatenate([t.double().reshape(len(t), -1).numpy() for t in leaves], 1))
    pq.write_table(pa.concat_tables(tables), path, row_group_size=row_group)
    return np.concatenate(want)


def scores(path: Path) -> np.ndarray:
    """The model outputs of a `cleave score` output, a row per sample."""
    table = pq.read_table(path)
    outputs = [c for c in table.column_names if c.startswith("output_")]
    return np.stack([table.column(c).to_numpy().astype(np.float64) for c in outputs], 1)


def run_score(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """`cleave score ARGS` to its end."""
    return subprocess.run(cli("score", *args), capture_output=True, text=True, timeout=timeout_s)
