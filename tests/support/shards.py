"""Shard bundles written with numpy (docs/bundle.md: manifest.json + tables/*.bin, one table
per dtype), `cleave shard` processes on them, and raw frames of the internal protocol
(docs/protocol.md)."""

from __future__ import annotations

import json
import signal
import socket
import struct
import zlib
from pathlib import Path

import numpy as np

from support.processes import Process, cli, get

ROWS = {"f32": 1000, "f16": 300, "i8": 257, "wide": 40}
DIMS = {"f32": 16, "f16": 8, "i8": 12, "wide": 128}
DTYPES = {"f32": "float32", "f16": "float16", "i8": "int8_rowwise", "wide": "float32"}
LOOKUP = 0x0100
HEADER = struct.Struct("<4sBBHQIIQQ")  # protocol version 2: deadline_unix_us, trace_id
START_TIMEOUT_S = 30


# ---------------------------------------------------------------------------------------------
# Bundles, shard processes, raw frames


class Tables(dict):
    """Table name -> its values as float32 (what a lookup reads: dequantized for float16 and
    int8_rowwise). `terms`: per value, the magnitude of the terms it is computed from (|value|,
    or |q * scale| + |bias| for int8_rowwise), the scale of its rounding error."""

    def __init__(self):
        super().__init__()
        self.terms: dict[str, np.ndarray] = {}


def write_bundle(root: Path, seed: int = 0) -> Tables:
    """Writes a bundle of the tables above and returns their values."""
    rng = np.random.default_rng(seed)
    (root / "tables").mkdir(parents=True)
    metas, values = [], Tables()
    for name, rows in ROWS.items():
        dim, dtype = DIMS[name], DTYPES[name]
        w = rng.standard_normal((rows, dim)).astype(np.float32) * 3
        if dtype == "float32":
            data, values[name] = w.tobytes(), w
        elif dtype == "float16":
            h = w.astype(np.float16)
            data, values[name] = h.tobytes(), h.astype(np.float32)
        else:
            lo, hi = w.min(axis=1), w.max(axis=1)
            scale = ((hi - lo) / 255).astype(np.float32)
            q = np.round((w - lo[:, None]) / scale[:, None]).clip(0, 255).astype(np.uint8)
            bias = lo.astype(np.float32)
            row = np.zeros((rows, dim + 8), dtype=np.uint8)
            row[:, :dim] = q
            row[:, dim : dim + 4] = scale.view(np.uint8).reshape(rows, 4)
            row[:, dim + 4 :] = bias.view(np.uint8).reshape(rows, 4)
            data = row.tobytes()
            values[name] = q.astype(np.float32) * scale[:, None] + bias[:, None]
            values.terms[name] = np.abs(q * scale[:, None]) + np.abs(bias[:, None])
        values.terms.setdefault(name, np.abs(values[name]))
        (root / "tables" / f"{name}.bin").write_bytes(data)
        metas.append(
            {
                "name": name,
                "file": f"tables/{name}.bin",
                "rows": rows,
                "dim": dim,
                "dtype": dtype,
                "row_bytes": len(data) // rows,
                "crc32": zlib.crc32(data),
            }
        )
    manifest = {"format": "cleave-bundle", "version": 1, "producer": "test_shard", "tables": metas}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return values


class Shard:
    """One `cleave shard` process; `address` and `metrics` come from its ready line."""

    def __init__(self, bundle: Path, *flags: str, listen: str = "127.0.0.1:0"):
        argv = cli("shard", "--bundle", str(bundle), "--listen", listen, "--metrics-port", "0")
        self.process = Process([*argv, *flags], name="shard")
        self.proc = self.process.proc
        self.address = ""
        self.metrics = ""

    def wait_ready(self) -> Shard:
        self.process.wait_ready_line(START_TIMEOUT_S)
        self.address, self.metrics = self.process.address, self.process.metrics_url
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return self.process.stop(sig, timeout_s=20)

    def get(self, path: str) -> tuple[int, str]:
        return get(self.metrics + path)

    def metric(self, name: str) -> float:
        _, text = self.get("/metrics")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"metric {name} missing")


def start(bundle: Path, specs: list[tuple[str, ...]]) -> list[Shard]:
    """Starts shards in parallel (each spec: extra flags) and waits until all are ready."""
    shards = [Shard(bundle, *flags) for flags in specs]
    return [s.wait_ready() for s in shards]


def split_ranges(n_shards: int) -> list[str]:
    """--rows for shard i of n: every table cut into n contiguous ranges (some may be empty)."""
    return [
        ",".join(f"{t}={r * i // n_shards}:{r * (i + 1) // n_shards}" for t, r in ROWS.items())
        for i in range(n_shards)
    ]


def routes_for(shards: list[Shard], n: int) -> list[tuple[str, int, int, str]]:
    return [
        (t, r * i // n, r * (i + 1) // n, s.address)
        for i, s in enumerate(shards)
        for t, r in ROWS.items()
    ]


def frame(kind: int, rid: int, payload: bytes, flags: int = 0, deadline_us: int = 0) -> bytes:
    return HEADER.pack(b"CLVW", 2, flags, kind, rid, len(payload), 0, deadline_us, 0) + payload


def connect(address: str, hello: bool = True) -> socket.socket:
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    if hello:
        s.sendall(frame(0, 0, bytes([0, 0, 0, 0])))
        flags, kind, _, payload = read_frame(s)
        assert (flags, kind, len(payload)) == (1, 0, 4)
    return s


def read_frame(s: socket.socket) -> tuple[int, int, int, bytes]:
    head = recv_exact(s, HEADER.size)
    magic, version, flags, kind, rid, n, _, _, _ = HEADER.unpack(head)
    assert (magic, version) == (b"CLVW", 2)
    return flags, kind, rid, recv_exact(s, n)


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def error_of(f: tuple[int, int, int, bytes]) -> tuple[int, str]:
    flags, _, _, payload = f
    assert flags == 3, f"expected an error frame, got flags {flags}"
    return struct.unpack("<H", payload[:2])[0], payload[2:].decode()


def assert_closed(s: socket.socket) -> None:
    s.settimeout(10)
    assert s.recv(1) == b"", "expected the shard to close the connection"


# Error codes (docs/protocol.md).
MALFORMED, UNSUPPORTED_VERSION, TOO_LARGE, TIMEOUT, HANDSHAKE = 1, 2, 3, 4, 5
UNKNOWN_KIND, BAD_REQUEST, NOT_FOUND, OUT_OF_RANGE = 6, 7, 8, 9
DEADLINE = 13
