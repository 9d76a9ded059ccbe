"""The Kafka record of a streamed row update (docs/streaming.md, "Record format"): one record
carries new rows for some ids of one table of one model. `encode_record` writes one (for
producers and tests); `decode_record` reads one and checks it against the tables served.

Value, little-endian (the delta format's fields, docs/tiers.md, with the model's name and
version in front and a u32 count):

    0  magic "CLVS"   4  u16 format version (1)   6  u16 model name bytes (M)
    8  u16 model version bytes (V)   10 u16 table name bytes (N)   12 u16 dtype name bytes (D)
    14 u16 0   16 u32 dim   20 u32 row_bytes   24 u32 count
    28 model | model version | table | dtype (UTF-8) | count x u64 ids | count x row_bytes rows

Key: `MODEL/TABLE` (UTF-8), so the records of one table stay in order in one partition.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from cleave.bundle import tables as table_io
from cleave.errors import CleaveError

RECORD_MAGIC = b"CLVS"
RECORD_VERSION = 1
_HEADER = struct.Struct("<4sHHHHHHIII")


class RecordError(CleaveError):
    """A record that is not a row update of a table served here; says what was expected."""


@dataclass(frozen=True)
class Record:
    model: str
    version: str  # "": whichever version serves the table
    table: str
    ids: np.ndarray  # int64, (n,)
    rows: np.ndarray  # uint8 (n, row_bytes): the table's stored layout


def record_key(model: str, table: str) -> bytes:
    return f"{model}/{table}".encode()


def encode_record(model: str, table: dict, ids, rows, version: str = "") -> bytes:
    """The value of one record: new `rows` for `ids` of `table` (its manifest entry: name,
    dim, dtype, row_bytes, rows) of `model` at `version` ("": whichever serves). `rows` are
    floats of shape (n, dim), stored as the table's dtype (row-wise quantized ones
    quantized), or the stored bytes, uint8 of shape (n, row_bytes)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    data = _stored(table, np.asarray(rows))
    if len(data) != len(ids):
        raise RecordError(f"{len(ids)} ids but {len(data)} rows")
    names = [s.encode() for s in (model, version, table["name"], table["dtype"])]
    header = _HEADER.pack(
        RECORD_MAGIC, RECORD_VERSION, *(len(n) for n in names), 0, int(table["dim"]),
        int(table["row_bytes"]), len(ids),
    )  # fmt: skip
    return header + b"".join(names) + ids.astype("<u8").tobytes() + data.tobytes()


def _stored(table: dict, rows: np.ndarray) -> np.ndarray:
    dim, row_bytes = int(table["dim"]), int(table["row_bytes"])
    if rows.dtype == np.uint8 and rows.ndim == 2 and rows.shape[1] == row_bytes:
        return rows
    if rows.dtype.kind == "f" and rows.ndim == 2 and rows.shape[1] == dim:
        return table_io.encode(rows, table["dtype"])
    raise RecordError(
        f"table {table['name']!r} ({table['dtype']} x {dim}): rows must be floats of shape "
        f"(n, {dim}) or the stored bytes, uint8 of shape (n, {row_bytes}); got {rows.dtype} "
        f"{rows.shape}"
    )


def decode_record(value: bytes, tables: dict[str, dict], model: str, version: str) -> Record:
    """Reads one record value and checks it against the tables of `model` at `version` (each
    table's manifest entry by name). Raises RecordError naming what is wrong."""
    if value is None or len(value) < _HEADER.size:
        size = 0 if value is None else len(value)
        raise RecordError(f"{size} bytes, shorter than the {_HEADER.size}-byte header")
    magic, fmt, n_model, n_version, n_table, n_dtype, _, dim, row_bytes, count = (
        _HEADER.unpack_from(value)
    )
    if magic != RECORD_MAGIC:
        raise RecordError(f"magic {magic!r}, expected {RECORD_MAGIC!r} (not a Cleave record)")
    if fmt != RECORD_VERSION:
        raise RecordError(f"format version {fmt}, expected {RECORD_VERSION}")
    end = _HEADER.size + n_model + n_version + n_table + n_dtype
    expected = end + count * (8 + row_bytes)
    if len(value) != expected:
        raise RecordError(
            f"truncated or padded: the header promises {count} rows ({expected} bytes), "
            f"the record has {len(value)} bytes"
        )
    fields, at = [], _HEADER.size
    for n in (n_model, n_version, n_table, n_dtype):
        try:
            fields.append(value[at : at + n].decode())
        except UnicodeDecodeError:
            raise RecordError("a model, version, table or dtype name is not UTF-8") from None
        at += n
    r_model, r_version, r_table, r_dtype = fields
    if r_model != model:
        raise RecordError(f"model {r_model!r}, this deployment serves {model!r}")
    if r_version not in ("", version):
        raise RecordError(f"model version {r_version!r}, this deployment serves {version!r}")
    table = tables.get(r_table)
    if table is None:
        raise RecordError(f"table {r_table!r}, the model has {sorted(tables)}")
    if (r_dtype, dim, row_bytes) != (table["dtype"], int(table["dim"]), int(table["row_bytes"])):
        raise RecordError(
            f"table {r_table!r}: rows {r_dtype} x {dim} ({row_bytes} bytes), the table is "
            f"{table['dtype']} x {table['dim']} ({table['row_bytes']} bytes)"
        )
    ids = np.frombuffer(value, dtype="<u8", count=count, offset=end)
    if count and int(ids.max()) >= int(table["rows"]):
        raise RecordError(
            f"table {r_table!r}: id {int(ids.max())} out of range, the table has "
            f"{table['rows']} rows"
        )
    rows = np.frombuffer(value, dtype=np.uint8, count=count * row_bytes, offset=end + 8 * count)
    return Record(r_model, r_version, r_table, ids.astype(np.int64), rows.reshape(count, row_bytes))
