"""Placement across tiers (docs/tiers.md): an access profile (per table: queries/s, mean
pooling factor, optionally the hottest row ids) and a DRAM budget per shard decide which of a
shard's tables stay in DRAM and which are read from SSD behind the row cache.

SDM §3 ranks tables by bandwidth need per byte: queries/s × pooling × row bytes ÷ table bytes.
Tables are taken in that order, most needy first, while they fit in the budget less the row
cache's reserve; the first that does not fit stops the walk, so a table never loses DRAM to one
that needs less per byte. Budget left over goes to the row cache, which keeps the hottest rows
of the SSD tables anyway. Pure functions: no files are opened except by `load_profile`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from cleave.errors import UsageError

FORMAT = "cleave-access-profile"
MIN_CACHE_BYTES = 1 << 20  # the SSD tier's smallest cache budget (cleave-embed MIN_BUDGET)
CACHE_SHARE = 0.25  # of a budget kept for the row cache when some table goes to SSD
_TABLE_KEYS = ("queries_per_s", "pooling", "hot_rows")


@dataclass(frozen=True)
class TableAccess:
    queries_per_s: float  # lookups of this table per second (requests × bags of it)
    pooling: float  # mean ids per bag
    hot_rows: tuple[int, ...] = ()  # hottest first; the shard warms its row cache with them


@dataclass(frozen=True)
class AccessProfile:
    tables: dict[str, TableAccess]
    source: str  # the file, for errors


@dataclass(frozen=True)
class TableSize:
    rows: int  # rows the shard holds
    row_bytes: int
    table_rows: int  # rows of the whole table (the profile's rates are for all of them)

    @property
    def bytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class Placement:
    dram: list[str]  # most needy per byte first
    ssd: list[str]
    dram_bytes: int  # of the tables kept in DRAM
    cache_bytes: int  # the rest of the budget: the SSD tier's caches (0 when nothing is on SSD)


def parse_bytes(text: str, flag: str) -> int:
    """Digits with an optional K, M or G (powers of 1024), as cleave-shard reads them."""
    t = text.strip()
    shift = {"K": 10, "M": 20, "G": 30}.get(t[-1:].upper(), 0)
    digits = t[:-1] if shift else t
    if not digits.isdigit():
        raise UsageError(f"{flag}: expected bytes (digits, optionally K, M or G), got {text!r}")
    return int(digits) << shift


def _number(value, where: str, source: str, positive: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        expected = "a number > 0" if positive else "a number >= 0"
        raise UsageError(f"{source}: {where}: expected {expected}, got {value!r}")
    return float(value)


def parse_profile(data, source: str) -> AccessProfile:
    """An AccessProfile from parsed JSON, or a UsageError naming `source` and the field."""
    if not isinstance(data, dict):
        raise UsageError(f"{source}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise UsageError(f"{source}: format: expected {FORMAT!r}, got {data.get('format')!r}")
    unknown = set(data) - {"format", "version", "tables"}
    if unknown:
        raise UsageError(f"{source}: {sorted(unknown)[0]}: unknown key; known: format, tables")
    tables = data.get("tables")
    if not isinstance(tables, dict) or not tables:
        raise UsageError(f"{source}: tables: expected a non-empty object, got {tables!r}")
    out = {}
    for name, entry in tables.items():
        where = f"tables.{name}"
        if not isinstance(entry, dict):
            raise UsageError(f"{source}: {where}: expected an object, got {entry!r}")
        for key in entry:
            if key not in _TABLE_KEYS:
                known = ", ".join(_TABLE_KEYS)
                raise UsageError(f"{source}: {where}.{key}: unknown key; known: {known}")
        for key in _TABLE_KEYS[:2]:
            if key not in entry:
                raise UsageError(f"{source}: {where}.{key}: missing (required)")
        hot = entry.get("hot_rows", [])
        bad = not isinstance(hot, list) or any(
            not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in hot
        )
        if bad:
            raise UsageError(
                f"{source}: {where}.hot_rows: expected a list of row ids >= 0, got {hot!r:.80}"
            )
        out[name] = TableAccess(
            queries_per_s=_number(entry["queries_per_s"], f"{where}.queries_per_s", source),
            pooling=_number(entry["pooling"], f"{where}.pooling", source, positive=True),
            hot_rows=tuple(hot),
        )
    return AccessProfile(tables=out, source=source)


def load_profile(path: str | Path) -> AccessProfile:
    from cleave.plan.files import read_json

    return parse_profile(read_json(path, "--profile", "an access profile as JSON"), str(path))


def check_profile(profile: AccessProfile, manifest: dict) -> None:
    """Every table of the profile is in the bundle and its hot rows inside it."""
    rows = {t["name"]: int(t["rows"]) for t in manifest["tables"]}
    for name, access in profile.tables.items():
        if name not in rows:
            known = ", ".join(rows)
            raise UsageError(
                f"{profile.source}: tables.{name}: not a table of the bundle (it has {known})"
            )
        over = [r for r in access.hot_rows if r >= rows[name]]
        if over:
            raise UsageError(
                f"{profile.source}: tables.{name}.hot_rows: expected ids below the table's "
                f"{rows[name]} rows, got {over[0]}"
            )


def need_per_byte(access: TableAccess | None, size: TableSize) -> float:
    """Bytes per second read per byte held (SDM §3); a table the profile omits needs 0."""
    if access is None or size.table_rows == 0:
        return 0.0
    table_bytes = size.table_rows * size.row_bytes
    return access.queries_per_s * access.pooling * size.row_bytes / table_bytes


def place_tables(
    budget: int, tables: dict[str, TableSize], profile: AccessProfile | None
) -> Placement:
    """Which of `tables` stay in DRAM under `budget` bytes (tables and caches together)."""
    total = sum(s.bytes for s in tables.values())
    if total <= budget:
        return Placement(dram=sorted(tables), ssd=[], dram_bytes=total, cache_bytes=0)
    reserve = max(MIN_CACHE_BYTES, int(budget * CACHE_SHARE))
    if budget < reserve:
        raise UsageError(
            f"--dram-budget {budget}: expected at least {MIN_CACHE_BYTES} bytes (the SSD tier's "
            f"smallest cache) when the tables ({total} bytes) do not fit"
        )
    access = profile.tables if profile else {}
    order = sorted(tables, key=lambda n: (-need_per_byte(access.get(n), tables[n]), n))
    dram, used = [], 0
    for name in order:
        if used + tables[name].bytes > budget - reserve:
            break  # never skip to a smaller table that needs less per byte
        dram.append(name)
        used += tables[name].bytes
    ssd = order[len(dram) :]
    return Placement(dram=dram, ssd=ssd, dram_bytes=used, cache_bytes=budget - used)


def place_plan(plan, manifest: dict, budget: int, profile: AccessProfile | None, ref: str):
    """Sets every shard's `dram_budget`, `ssd_tables` and `profile` (`ref`: the profile's path
    as the plan names it); returns one line per shard for the plan's header."""
    if profile is not None:
        check_profile(profile, manifest)
    meta = {t["name"]: t for t in manifest["tables"]}
    lines = []
    for i, shard in enumerate(plan.shards):
        sizes = {
            t: TableSize(max(0, b - a), int(meta[t]["row_bytes"]), int(meta[t]["rows"]))
            for t, (a, b) in shard.ranges.items()
            if t in meta
        }
        placed = place_tables(budget, sizes, profile)
        shard.dram_budget = budget
        shard.ssd_tables = placed.ssd
        shard.profile = ref if placed.ssd else ""
        lines.append(
            f"shards[{i}] ({shard.name}): DRAM {placed.dram or 'none'} ({placed.dram_bytes} B), "
            f"SSD {placed.ssd or 'none'}, caches {placed.cache_bytes} B"
        )
    return lines
