"""What a reference model's sparse inputs look like, for its request generator and docs."""

from __future__ import annotations

from dataclasses import dataclass

from cleave.errors import UsageError

#: No scaled table has fewer rows than this (unless the real table is smaller).
MIN_ROWS = 16


def scaled_rows(rows: int, scale: float) -> int:
    """Rows of a table shrunk by `scale`; a table already smaller than MIN_ROWS stays as it is."""
    if not scale > 0:
        raise UsageError(f"scale must be a number > 0, got {scale!r}")
    return min(rows, max(MIN_ROWS, int(rows * scale)))


@dataclass(frozen=True)
class Feature:
    """One sparse input of a model: where its ids come from and how many a bag holds.

    `id_space` is the range ids are drawn from, `rows` the table they land in; the two differ
    only where the model hashes ids with `% rows` itself (raw Criteo ids exceed the table).
    `pooling` is the mean bag length; `length`, when set, is the fixed length of every bag
    (a `[B, length]` id tensor rather than values + offsets).
    """

    name: str
    table: str
    id_space: int
    rows: int
    dim: int
    pooling: float = 1.0
    length: int | None = None
    weighted: bool = False

    @property
    def hashed(self) -> bool:
        return self.id_space != self.rows


def table_bytes(features: list[Feature]) -> int:
    """float32 bytes of the distinct tables behind `features`."""
    tables = {f.table: f.rows * f.dim * 4 for f in features}
    return sum(tables.values())
