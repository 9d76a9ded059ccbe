"""Synthetic bundles: tables without a model, for the benchmarks that drive a shard or the
lookup engine directly (shard, misses, tier, lookup). The one writer: table files in the
bundle layout (docs/bundle.md), their CRC-32s, and a manifest through cleave.bundle.manifest.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cleave.bundle import manifest as manifest_io
from cleave.errors import BundleError


@dataclass(frozen=True)
class Table:
    """One synthetic table: `rows` rows of `row_bytes` bytes (float32: 4 x dim)."""

    name: str
    rows: int
    dim: int
    dtype: str = "float32"
    row_bytes: int = 0  # 0: 4 x dim

    @property
    def file(self) -> str:
        return f"tables/{self.name}.bin"

    @property
    def size(self) -> int:
        return self.rows * (self.row_bytes or 4 * self.dim)


def write_bundle(
    root: Path,
    tables: list[Table],
    rows_of: Callable[[Table, int], np.ndarray],
    producer: str,
    chunk_rows: int = 1 << 18,
) -> Path:
    """Writes `tables` under `root`, each `chunk_rows` rows at a time from `rows_of(table, n)`
    (an array of n rows in the table's encoding), synced to disk so no write-back of dirty
    pages runs during the measurements; then the manifest (tables only: no inputs, features
    or dense program). Returns `root`."""
    root = Path(root)
    (root / "tables").mkdir(parents=True, exist_ok=True)
    metas = []
    for table in tables:
        crc = 0
        with open(root / table.file, "wb") as f:
            for start in range(0, table.rows, chunk_rows):
                chunk = rows_of(table, min(chunk_rows, table.rows - start)).tobytes()
                crc = zlib.crc32(chunk, crc)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        metas.append(
            {
                "name": table.name,
                "file": table.file,
                "rows": table.rows,
                "dim": table.dim,
                "dtype": table.dtype,
                "row_bytes": table.row_bytes or 4 * table.dim,
                "crc32": crc,
            }
        )
    manifest = {
        "format": manifest_io.FORMAT,
        "version": manifest_io.VERSION,
        "producer": producer,
        "inputs": [],
        "outputs": [],
        "tables": metas,
        "features": [],
        "boundary": [],
        "shared_inputs": [],
    }
    manifest_io.write(root, manifest)
    return root


def is_complete(root: Path, tables: list[Table]) -> bool:
    """A bundle `write_bundle` wrote with these tables is there whole (a rerun reuses it)."""
    try:
        manifest = manifest_io.read(Path(root), whole=False)
    except BundleError:  # missing or unreadable: write it again
        return False
    written = {t["name"]: t for t in manifest["tables"]}
    return len(written) == len(tables) and all(
        t.name in written
        and written[t.name]["rows"] == t.rows
        and written[t.name]["dtype"] == t.dtype
        and (Path(root) / t.file).is_file()
        and (Path(root) / t.file).stat().st_size == t.size
        for t in tables
    )
