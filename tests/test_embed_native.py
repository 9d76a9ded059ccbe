"""`cleave._native.TableSet` (the Rust embedding engine) against PyTorch's embedding_bag.

Bundles are written here with plain numpy, following docs/bundle.md; int8_rowwise tables are
dequantised in numpy for the reference. The reference is torch's embedding_bag in float64, so
the only rounding measured is the engine's.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from cleave._native import EmbedError, TableSet

DTYPES = ("float32", "float16", "int8_rowwise")
KERNELS = TableSet.kernels()


def _write_bundle(directory: Path, tables: dict[str, tuple[str, np.ndarray]]) -> None:
    """tables: name -> (dtype, stored rows as uint8 [rows, row_bytes])."""
    (directory / "tables").mkdir(parents=True)
    metas = []
    for name, (dtype, raw) in tables.items():
        dim = (
            raw.shape[1] // 4
            if dtype == "float32"
            else (raw.shape[1] // 2 if dtype == "float16" else raw.shape[1] - 8)
        )
        (directory / "tables" / f"{name}.bin").write_bytes(raw.tobytes())
        metas.append(
            {
                "name": name,
                "file": f"tables/{name}.bin",
                "rows": raw.shape[0],
                "dim": dim,
                "dtype": dtype,
                "row_bytes": raw.shape[1],
                "crc32": zlib.crc32(raw.tobytes()),
            }
        )
    manifest = {
        "format": "cleave-bundle",
        "version": 1,
        "producer": "test",
        "inputs": [],
        "outputs": [],
        "tables": metas,
        "features": [],
        "boundary": [],
        "shared_inputs": [],
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _random_table(dtype: str, rows: int, dim: int, rng) -> tuple[np.ndarray, ...]:
    """(stored rows uint8, values float32 as docs/bundle.md defines them, magnitudes)."""
    if dtype == "float32":
        values = rng.uniform(-4, 4, (rows, dim)).astype(np.float32)
        return values.view(np.uint8).reshape(rows, 4 * dim), values, np.abs(values)
    if dtype == "float16":
        half = rng.uniform(-4, 4, (rows, dim)).astype(np.float16)
        values = half.astype(np.float32)
        return half.view(np.uint8).reshape(rows, 2 * dim), values, np.abs(values)
    codes = rng.integers(0, 256, (rows, dim), dtype=np.uint8)
    scale = rng.uniform(1e-3, 0.1, rows).astype(np.float32)
    bias = rng.uniform(-1, 1, rows).astype(np.float32)
    raw = np.empty((rows, dim + 8), np.uint8)
    raw[:, :dim] = codes
    raw[:, dim : dim + 4] = scale.view(np.uint8).reshape(rows, 4)
    raw[:, dim + 4 :] = bias.view(np.uint8).reshape(rows, 4)
    values = codes.astype(np.float32) * scale[:, None] + bias[:, None]  # in float32
    # The engine folds biases separately: its error scales with |q * scale| + |bias|.
    magnitude = np.abs(codes * scale[:, None].astype(np.float64)) + np.abs(bias[:, None])
    return raw, values, magnitude


def _random_bags(rows: int, bags: int, max_len: int, rng) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(0, max_len + 1, bags)
    lengths[: bags // 4] = 0  # empty bags on purpose
    rng.shuffle(lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(0, rows, int(offsets[-1]))
    ids[: min(4, ids.size)] = [0, rows - 1, rows - 1, 0][: min(4, ids.size)]  # boundary rows
    return ids.astype(np.int64), offsets


def _reference(values, ids, offsets, pooling, weights):
    w = None if weights is None else torch.from_numpy(weights.astype(np.float64))
    return torch.nn.functional.embedding_bag(
        torch.from_numpy(ids),
        torch.from_numpy(values.astype(np.float64)),
        torch.from_numpy(offsets[:-1]),
        mode=pooling,
        per_sample_weights=w,
    ).numpy()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    rng = np.random.default_rng(7)
    directory = tmp_path_factory.mktemp("bundle")
    tables, data = {}, {}
    for i, dtype in enumerate(DTYPES):
        dim = (64, 37, 20)[i]  # a full AVX-512 block, and dims with vector tails
        raw, values, magnitude = _random_table(dtype, 300, dim, rng)
        tables[dtype] = (dtype, raw)
        data[dtype] = (values, magnitude)
    _write_bundle(directory, tables)
    return directory, data


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "pooling,weighted", [("sum", False), ("sum", True), ("mean", False), ("max", False)]
)
def test_pool_matches_torch_embedding_bag(bundle, kernel, dtype, pooling, weighted):
    directory, data = bundle
    values, magnitude = data[dtype]
    rng = np.random.default_rng(zlib.crc32(f"{kernel} {dtype} {pooling} {weighted}".encode()))
    ids, offsets = _random_bags(values.shape[0], 200, 12, rng)
    weights = rng.uniform(-2, 2, ids.size).astype(np.float32) if weighted else None
    ts = TableSet.open(directory, threads=1, kernel=kernel)
    out, counts = ts.pool(dtype, ids, offsets, weights, pooling)

    assert out.dtype == np.float32 and out.shape == (200, values.shape[1])
    assert counts.dtype == np.uint32
    np.testing.assert_array_equal(counts, np.diff(offsets))
    want = _reference(values, ids, offsets, pooling, weights)
    if pooling == "max":
        np.testing.assert_array_equal(out, want.astype(np.float32))  # a max is exact
        return
    abs_w = None if weights is None else np.abs(weights)
    scale = _reference(magnitude, ids, offsets, "sum", abs_w)
    if pooling == "mean":
        scale /= np.maximum(np.diff(offsets), 1)[:, None]
    rel = 1e-6 if dtype != "int8_rowwise" else 2e-6
    err = np.abs(out - want)
    assert np.all(err <= rel * scale), f"max error / magnitude {np.max(err / (scale + 1e-30))}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_returns_rows_exactly(bundle, dtype):
    directory, data = bundle
    values, _ = data[dtype]
    ids = np.array([0, 299, 5, 5, 17], dtype=np.int64)
    ts = TableSet.open(directory)
    np.testing.assert_array_equal(ts.gather(dtype, ids), values[ids])
    assert ts.gather(dtype, np.array([], dtype=np.int64)).shape == (0, values.shape[1])


def test_threads_and_id_dtypes_give_identical_results(bundle):
    directory, data = bundle
    rng = np.random.default_rng(3)
    ids, offsets = _random_bags(300, 4000, 10, rng)  # large enough to split over threads
    one = TableSet.open(directory, threads=1)
    two = TableSet.open(directory, threads=2)
    assert (one.threads, two.threads) == (1, 2)
    a, ca = one.pool("float32", ids, offsets, pooling="mean")
    b, cb = two.pool("float32", ids.astype(np.int32), offsets.astype(np.uint32), pooling="mean")
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ca, cb)
    # Non-contiguous inputs are copied, not misread.
    c, _ = two.pool("float32", np.repeat(ids, 2)[::2], offsets, pooling="mean")
    np.testing.assert_array_equal(a, c)


def test_row_ranges_hold_only_their_rows(bundle):
    directory, data = bundle
    values, _ = data["float32"]
    ts = TableSet.open(directory, tables=["float32"], rows=(100, 200))
    assert ts.tables == ["float32"] and ts.row_range("float32") == (100, 200)
    np.testing.assert_array_equal(ts.gather("float32", np.array([100, 199])), values[[100, 199]])
    with pytest.raises(EmbedError, match=r"id 99 at position 1 is outside rows \[100, 200\)"):
        ts.gather("float32", np.array([150, 99]))
    with pytest.raises(EmbedError, match="unknown table"):
        ts.pool("float16", np.array([100]), np.array([0, 1]))


@pytest.mark.parametrize(
    "call,error,message",
    [
        (
            lambda t: t.pool("float32", np.array([1, 300]), np.array([0, 2])),
            EmbedError,
            r"id 300 at position 1 is outside rows \[0, 300\)",
        ),
        (lambda t: t.pool("float32", np.array([-1]), np.array([0, 1])), EmbedError, "id -1"),
        (
            lambda t: t.pool("float32", np.array([1, 2]), np.array([0, 2, 1, 2])),
            EmbedError,
            "non-decreasing",
        ),
        (
            lambda t: t.pool("float32", np.array([1, 2]), np.array([1, 2])),
            EmbedError,
            "offsets\\[0\\] is 1, expected 0",
        ),
        (
            lambda t: t.pool("float32", np.array([1, 2]), np.array([0, 3])),
            EmbedError,
            "last offset is 3, expected the number of ids 2",
        ),
        (
            lambda t: t.pool("float32", np.array([1]), np.array([0, 2**40])),
            EmbedError,
            "does not fit",
        ),
        (
            lambda t: t.pool("float32", np.array([1, 2]), np.array([0, 2]), np.ones(3, np.float32)),
            EmbedError,
            "weights has 3 entries, expected one per id \\(2\\)",
        ),
        (
            lambda t: t.pool("float32", np.array([1]), np.array([0, 1]), np.ones(1), "max"),
            EmbedError,
            "per-sample weights need pooling",
        ),
        (
            lambda t: t.pool("float32", np.array([1]), np.array([0, 1]), pooling="median"),
            EmbedError,
            "pooling must be",
        ),
        (
            lambda t: t.pool("float32", np.array([1.0]), np.array([0, 1])),
            TypeError,
            "ids must be a 1-D numpy array of int64",
        ),
        (lambda t: t.pool("float32", np.array([[1]]), np.array([0, 1])), TypeError, "shape"),
        (lambda t: t.pool("float32", [1], np.array([0, 1])), TypeError, "list"),
        (
            lambda t: t.pool("float32", np.array([1]), np.array([0, 1]), np.array(["a"])),
            TypeError,
            "weights must be",
        ),
        (lambda t: t.gather("nope", np.array([1])), EmbedError, 'unknown table "nope"'),
    ],
)
def test_malformed_lookups_raise_clear_errors(bundle, call, error, message):
    directory, _ = bundle
    with pytest.raises(error, match=message):
        call(TableSet.open(directory, threads=2))
    assert issubclass(EmbedError, ValueError)


def test_malformed_bundles_raise_clear_errors(tmp_path):
    with pytest.raises(EmbedError, match="manifest.json"):
        TableSet.open(tmp_path)
    rng = np.random.default_rng(0)
    raw, _, _ = _random_table("float32", 10, 4, rng)
    _write_bundle(tmp_path / "b", {"t": ("float32", raw)})
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    manifest["version"] = 99
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EmbedError, match="version 99 is newer"):
        TableSet.open(tmp_path / "b")
    manifest["version"] = 1
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "b" / "tables" / "t.bin").write_bytes(raw.tobytes()[:-4])
    with pytest.raises(EmbedError, match=r"t\.bin: table file has 156 bytes, expected 160"):
        TableSet.open(tmp_path / "b")
    flipped = bytearray(raw.tobytes())
    flipped[0] ^= 1
    (tmp_path / "b" / "tables" / "t.bin").write_bytes(bytes(flipped))
    TableSet.open(tmp_path / "b")  # unverified: trusts the manifest
    with pytest.raises(EmbedError, match="CRC-32"):
        TableSet.open(tmp_path / "b", verify_checksums=True)
    with pytest.raises(ValueError, match="threads must be at least 1"):
        TableSet.open(tmp_path / "b", threads=0)
    with pytest.raises(ValueError, match="kernel must be"):
        TableSet.open(tmp_path / "b", kernel="sse9")


def test_resident_tables_match_mapped_ones(bundle):
    directory, _ = bundle
    ids = np.arange(300, dtype=np.int64)
    mapped = TableSet.open(directory).gather("int8_rowwise", ids)
    resident = TableSet.open(directory, resident=True).gather("int8_rowwise", ids)
    np.testing.assert_array_equal(mapped, resident)
