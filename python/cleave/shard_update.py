"""The UPDATE frame's client (docs/tiers.md, "Updates"): one shard's update steps (stage,
switch, abort, status) over the internal frame protocol. `cleave update` and `cleave stream`
drive several shards with it; a repository deployment asks it whether a table took updates."""

from __future__ import annotations

import json
import struct

from cleave.errors import CleaveError


class UpdateError(CleaveError):
    """A bad delta or table file, no shard to update, or a shard that refused a step."""


def _message(header: dict, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<I", len(text)) + text + data


class _Shard:
    def __init__(self, addr: str, timeout_s: float):
        from cleave import _native

        self.addr = addr
        self.kind = _native.KIND_UPDATE
        self.client = _native.FrameClient(addr, timeout_s=timeout_s, connections=1)
        self.error_type = _native.WireError

    def step(self, header: dict, data: bytes = b"") -> dict:
        try:
            return json.loads(self.client.call(self.kind, _message(header, data)))
        except self.error_type as err:
            raise UpdateError(
                f"shard {self.addr}: {header['op']} of table {header['table']!r}: {err}"
            ) from None


def table_status(addr: str, table: str, timeout_s: float = 10.0) -> dict:
    """The shard at `addr`'s committed `version` of `table` and the `source` (tag) its last
    switch recorded (None if none did)."""
    return tables_status(addr, [table], timeout_s)[table]


def tables_status(addr: str, tables: list[str], timeout_s: float = 10.0) -> dict[str, dict]:
    """`table_status` of each of `tables`, over one client of the shard at `addr`."""
    shard = _Shard(addr, timeout_s)
    return {t: shard.step({"op": "status", "update": 0, "table": t}) for t in tables}
