"""The streamed row update's Kafka record (docs/streaming.md, "Record format"): golden bytes,
round trips for every table dtype, and every malformed case refused with what was expected."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from cleave.bundle import tables
from cleave.stream import RecordError, decode_record, encode_record, record_key

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("CLEAVE_GOLDEN_REGEN") == "1"
TABLES = {
    "f32": {"name": "f32", "rows": 20, "dim": 3, "dtype": "float32", "row_bytes": 12},
    "f16": {"name": "f16", "rows": 20, "dim": 4, "dtype": "float16", "row_bytes": 8},
    "i8": {"name": "i8", "rows": 20, "dim": 4, "dtype": "int8_rowwise", "row_bytes": 12},
}


def test_golden_record():
    """tests/golden/stream_record.bin is what encode_record writes for the content in
    stream_record.json, and decodes back to it."""
    spec = json.loads((GOLDEN / "stream_record.json").read_text())
    table = spec["table"]
    value = encode_record(spec["model"], table, spec["ids"], np.array(spec["rows"]), "7")
    path = GOLDEN / "stream_record.bin"
    if REGEN:
        path.write_bytes(value)
    assert value == path.read_bytes()
    record = decode_record(path.read_bytes(), {table["name"]: table}, spec["model"], "7")
    assert (record.model, record.version, record.table) == (spec["model"], "7", table["name"])
    assert record.ids.tolist() == spec["ids"]
    np.testing.assert_array_equal(record.rows.view("<f4"), np.array(spec["rows"], np.float32))
    assert record_key(spec["model"], table["name"]) == b"dlrm/t_item"


@pytest.mark.parametrize("name", list(TABLES))
def test_round_trip_every_dtype(name):
    table = TABLES[name]
    rng = np.random.default_rng(1)
    ids = np.array([3, 0, 19, 3])
    if table["dtype"].startswith("float"):
        rows = rng.standard_normal((4, table["dim"]))
        want = rows.astype(np.float32 if name == "f32" else np.float16).view(np.uint8)
    else:
        rows = want = rng.integers(0, 256, (4, table["row_bytes"]), dtype=np.uint8)
    for version in ("", "1"):
        value = encode_record("m", table, ids, rows, version)
        record = decode_record(value, TABLES, "m", "1")
        assert record.version == version and record.table == name
        assert record.ids.tolist() == ids.tolist()
        np.testing.assert_array_equal(record.rows, want.reshape(4, table["row_bytes"]))
    if not table["dtype"].startswith("float"):  # floats are quantized as the bundle does
        floats = rng.standard_normal((4, table["dim"]))
        record = decode_record(encode_record("m", table, ids, floats), TABLES, "m", "1")
        np.testing.assert_array_equal(record.rows, tables.encode(floats, table["dtype"]))
    empty = encode_record("m", TABLES["f32"], [], np.zeros((0, 3)))
    assert len(decode_record(empty, TABLES, "m", "1").ids) == 0


def good() -> bytes:
    return encode_record("m", TABLES["f32"], [1, 2], np.ones((2, 3)), "")


def patched(at: int, fmt: str, value) -> bytes:
    data = bytearray(good())
    struct.pack_into(fmt, data, at, value)
    return bytes(data)


def renamed(table: dict, **changes) -> bytes:
    other = {**table, **changes}
    width = other["row_bytes"] // 4 if other["dtype"] == "float32" else other["dim"]
    return encode_record("m", other, [1], np.ones((1, width), np.float32), "")


@pytest.mark.parametrize(
    "value, says",
    [
        (b"", "0 bytes, shorter than the 28-byte header"),
        (None, "0 bytes, shorter than the 28-byte header"),
        (b"garbage bytes that are long enough to be a header", "not a Cleave record"),
        (patched(4, "<H", 2), "format version 2, expected 1"),
        (good()[:-1], "truncated or padded: the header promises 2 rows"),
        (good() + b"\0", "truncated or padded"),
        (encode_record("other", TABLES["f32"], [1], np.ones((1, 3))), "model 'other'"),
        (encode_record("m", TABLES["f32"], [1], np.ones((1, 3)), "2"), "model version '2'"),
        (renamed(TABLES["f32"], name="nope"), "table 'nope', the model has ['f16', 'f32', 'i8']"),
        (renamed(TABLES["f32"], dim=4, row_bytes=16), "rows float32 x 4 (16 bytes)"),
        (renamed(TABLES["f32"], dtype="float16", row_bytes=6), "rows float16 x 3"),
        (encode_record("m", {**TABLES["f32"], "rows": 99}, [20], np.ones((1, 3))), "id 20 out"),
        (patched(28, "<B", 0xFF), "not UTF-8"),
    ],
)
def test_malformed_records_are_refused(value, says):
    with pytest.raises(RecordError) as err:
        decode_record(value, TABLES, "m", "1")
    assert says in str(err.value), str(err.value)


def test_the_writer_refuses_rows_that_do_not_fit():
    with pytest.raises(RecordError, match="2 ids but 1 rows"):
        encode_record("m", TABLES["f32"], [1, 2], np.ones((1, 3)))
    with pytest.raises(RecordError, match=r"floats of shape \(n, 3\) or the stored bytes"):
        encode_record("m", TABLES["f32"], [1], np.ones((1, 4)))
