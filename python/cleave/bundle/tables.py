"""Embedding table files: rows back to back, no header (docs/bundle.md).

Storage types: float32, float16, int8_rowwise (u8 codes followed by an f32 scale and an f32
bias per row, value = q * scale + bias) and int4_rowwise (the same with 4-bit codes, two per
byte: element 2k in the low nibble of byte k, ceil(dim / 2) bytes, then scale and bias).
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

import numpy as np

from cleave.errors import BundleError
from cleave.settings.choices import TABLE_DTYPES

# Codes per row-wise type: the largest code, and the bytes its codes take for `dim` elements.
_ROWWISE = {"int8_rowwise": (255, lambda dim: dim), "int4_rowwise": (15, lambda dim: -(-dim // 2))}
_CRC_CHUNK = 64 << 20


def row_bytes(dtype: str, dim: int) -> int:
    if dtype == "float32":
        return 4 * dim
    if dtype == "float16":
        return 2 * dim
    if dtype in _ROWWISE:
        return _ROWWISE[dtype][1](dim) + 8
    raise BundleError(f"table dtype must be {TABLE_DTYPES.expected()}, got {dtype!r}")


def encode(weight: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 [rows, dim] -> the on-disk rows as a uint8 [rows, row_bytes] array."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    rows, dim = weight.shape
    if dtype == "float32":
        return weight.view(np.uint8).reshape(rows, 4 * dim)
    if dtype == "float16":
        return weight.astype(np.float16).view(np.uint8).reshape(rows, 2 * dim)
    if dtype in _ROWWISE:
        top, code_bytes = _ROWWISE[dtype]
        low = weight.min(axis=1, initial=np.inf) if dim else np.zeros(rows, np.float32)
        high = weight.max(axis=1, initial=-np.inf) if dim else np.zeros(rows, np.float32)
        scale = ((high - low) / top).astype(np.float32)
        # A constant row has scale 0: every code decodes to the bias exactly.
        safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
        codes = np.rint((weight - low[:, None]) / safe[:, None]).clip(0, top).astype(np.uint8)
        if top == 15:  # two codes a byte, the even element in the low nibble
            padded = np.zeros((rows, 2 * code_bytes(dim)), dtype=np.uint8)
            padded[:, :dim] = codes
            codes = padded[:, 0::2] | (padded[:, 1::2] << 4)
        n = code_bytes(dim)
        out = np.empty((rows, n + 8), dtype=np.uint8)
        out[:, :n] = codes
        out[:, n : n + 4] = scale.view(np.uint8).reshape(rows, 4)
        out[:, n + 4 :] = low.astype(np.float32).view(np.uint8).reshape(rows, 4)
        return out
    row_bytes(dtype, dim)  # raises the clear error
    raise AssertionError


def decode(raw: np.ndarray, dtype: str, dim: int) -> np.ndarray:
    """The on-disk rows (uint8 [rows, row_bytes]) -> fp32 [rows, dim]."""
    rows = raw.shape[0]
    if dtype == "float32":
        return np.ascontiguousarray(raw).view(np.float32).reshape(rows, dim)
    if dtype == "float16":
        return np.ascontiguousarray(raw).view(np.float16).reshape(rows, dim).astype(np.float32)
    if dtype in _ROWWISE:
        top, code_bytes = _ROWWISE[dtype]
        n = code_bytes(dim)
        codes = raw[:, :n]
        if top == 15:
            codes = np.stack([codes & 0x0F, codes >> 4], axis=2).reshape(rows, 2 * n)[:, :dim]
        scale = np.ascontiguousarray(raw[:, n : n + 4]).view(np.float32)
        bias = np.ascontiguousarray(raw[:, n + 4 : n + 8]).view(np.float32)
        return codes.astype(np.float32) * scale + bias
    row_bytes(dtype, dim)
    raise AssertionError


def open_rows(path: Path, meta: dict) -> np.ndarray:
    """Memory-maps a table file as uint8 [rows, row_bytes], checking its size."""
    expected = meta["rows"] * meta["row_bytes"]
    try:
        found = path.stat().st_size
    except OSError as err:
        raise BundleError(f"{path}: table {meta['name']!r} cannot be read: {err}") from None
    if found != expected:
        raise BundleError(
            f"{path}: table {meta['name']!r} should be {expected} bytes "
            f"({meta['rows']} rows x {meta['row_bytes']} bytes), found {found}"
        )
    if expected == 0:
        return np.zeros((0, meta["row_bytes"]), dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(meta["rows"], meta["row_bytes"]))


def sha256_of(path: Path) -> str:
    """The SHA-256 of a whole table file, hex: the table's content key (docs/bundle.md)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc
