"""`cleave update`: apply a model update to every live shard replica holding a table, in two
phases (docs/tiers.md, "Updates"): stage the new version on every shard, then switch each to
it. A stage that fails anywhere aborts the update everywhere, and the old version keeps
serving.

Also the delta format's writer, `write_delta` (and `read_delta_header`, which checks one).
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cleave.errors import CleaveError
from cleave.shard_update import UpdateError, _Shard

DELTA_MAGIC = b"CLVD"
DELTA_VERSION = 1
# magic, version, name bytes, dtype bytes, 0, dim, row bytes, count (crates/cleave-embed update.rs)
_HEADER = struct.Struct("<4sHHHHIIQ")
CHUNK_BYTES = 4 << 20  # one UPDATE frame's data: far under the frame size limit
_SECRET_ENV = "CLEAVE_INTERNAL_SECRET"  # what every role reads (docs/security.md)


def _stored(table: dict, rows: np.ndarray) -> np.ndarray:
    """`rows` as the table's stored bytes: float32/float16 values for those dtypes (cast from
    any float), else uint8 rows of exactly row_bytes (row-wise quantized layouts)."""
    rows = np.asarray(rows)
    dtype, dim, row_bytes = table["dtype"], int(table["dim"]), int(table["row_bytes"])
    if dtype in ("float32", "float16") and rows.dtype.kind == "f":
        if rows.ndim != 2 or rows.shape[1] != dim:
            raise UpdateError(
                f"table {table['name']!r}: rows of shape {rows.shape}, expected (n, {dim})"
            )
        rows = rows.astype(np.float32 if dtype == "float32" else np.float16)
    elif rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != row_bytes:
        raise UpdateError(
            f"table {table['name']!r} ({dtype} x {dim}): rows must be floats of shape (n, {dim}) "
            f"or its stored bytes, uint8 of shape (n, {row_bytes}); got {rows.dtype} {rows.shape}"
        )
    return np.ascontiguousarray(rows).astype("<" + rows.dtype.str[1:], copy=False)


def write_delta(path: str | os.PathLike, table: dict, ids, rows) -> Path:
    """Writes a delta for `table` (its manifest entry: name, dim, dtype, row_bytes, rows):
    new rows for `ids`, to `path`. A later id wins over an earlier one."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    data = _stored(table, rows)
    if len(data) != len(ids):
        raise UpdateError(f"{len(ids)} ids but {len(data)} rows")
    if len(ids) and (ids.min() < 0 or ids.max() >= int(table["rows"])):
        raise UpdateError(f"ids must be in [0, {table['rows']}), got {ids.min()}..{ids.max()}")
    name, dtype = table["name"].encode(), table["dtype"].encode()
    header = _HEADER.pack(
        DELTA_MAGIC, DELTA_VERSION, len(name), len(dtype), 0, int(table["dim"]),
        int(table["row_bytes"]), len(ids),
    )  # fmt: skip
    out = Path(path)
    out.write_bytes(header + name + dtype + ids.astype("<u8").tobytes() + data.tobytes())
    return out


def read_delta_header(path: Path, table: dict) -> int:
    """Checks the delta at `path` against `table` (manifest entry) and returns its row count;
    the shard checks it again, ids included."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(_HEADER.size + 2 * 65535)
    where = f"delta {path} for table {table['name']!r}"
    if len(head) < _HEADER.size:
        raise UpdateError(
            f"{where}: truncated: {size} bytes, shorter than the {_HEADER.size}-byte header"
        )
    magic, version, n_name, n_dtype, _, dim, row_bytes, count = _HEADER.unpack_from(head)
    if magic != DELTA_MAGIC:
        raise UpdateError(
            f"{where}: magic {magic!r}, expected {DELTA_MAGIC!r} (not a Cleave delta)"
        )
    if version != DELTA_VERSION:
        raise UpdateError(f"{where}: format version {version}, expected {DELTA_VERSION}")
    rest = head[_HEADER.size :]
    name = rest[:n_name].decode(errors="replace")
    dtype = rest[n_name : n_name + n_dtype].decode(errors="replace")
    if name != table["name"]:
        raise UpdateError(f"{where}: the delta is for table {name!r}")
    if (dtype, dim, row_bytes) != (table["dtype"], int(table["dim"]), int(table["row_bytes"])):
        raise UpdateError(
            f"{where}: shape {dtype} x {dim} ({row_bytes}-byte rows), the table is "
            f"{table['dtype']} x {table['dim']} ({table['row_bytes']}-byte rows)"
        )
    expected = _HEADER.size + n_name + n_dtype + count * (8 + row_bytes)
    if size != expected:
        raise UpdateError(
            f"{where}: truncated or padded: the header promises {count} rows "
            f"({expected} bytes), the file has {size} bytes"
        )
    return count


@dataclass
class Target:
    """A shard replica to update: its frame address and the range of the table it holds."""

    addr: str
    rows: tuple[int, int]


def targets_from_router(
    url: str, table: str, token: str | None, version: tuple[str, str] | None = None
) -> list[Target]:
    """Every live replica holding `table`, from the router's admin API (its membership); with
    `version` (model, version), that served version's (a repository's router lists each)."""
    from cleave.runners.membership import MembershipError, members

    try:
        found = members(url, token=token)
    except MembershipError as err:
        raise UpdateError(f"--router: {err}") from None
    if version is not None:
        each = found.get("versions", [found])
        served = [(v.get("model"), v.get("version")) for v in each]
        if version not in served:
            raise UpdateError(
                f"--router {url}: model {version[0]!r} version {version[1]} is not served "
                f"(served: {', '.join(f'{m}/{v}' for m, v in served)})"
            )
        found = each[served.index(version)]
    out = []
    for shard in found.get("shards", []):
        for r in shard.get("ranges", []):
            if r.get("table") == table:
                out.append(Target(shard["addr"], (int(r["row_start"]), int(r["row_end"]))))
    return out


def _switch(shard: _Shard, header: dict) -> tuple[int, int] | str:
    """(the version `shard` switched to, µs its switch came after the switch time), or why it
    could not."""
    try:
        reply = shard.step({**header, "op": "switch"})
        return int(reply["version"]), int(reply.get("late_us") or 0)
    except UpdateError as err:
        return str(err)


SWITCH_MARGIN_S = 2.0  # from sending the switch to its switch time: it must reach every shard


@dataclass
class Change:
    """One table's new version for `apply_changes`: `source` is a delta (kind "rows") or a
    table file (kind "file"), for the shards at `addrs`; `tag`, if given, is recorded by each
    shard with the version it switches to (reported by the UPDATE `status` step)."""

    table: str
    source: Path
    kind: str
    addrs: list[str]
    tag: object = None


def apply_update(
    addrs: list[str],
    table: str,
    source: Path,
    kind: str,
    timeout_s: float = 60.0,
    log=None,
    switch_margin_s: float = SWITCH_MARGIN_S,
    announce=None,
) -> dict[str, int]:
    """Stages `source` (a delta: kind "rows"; a table file: kind "file") of `table` on every
    shard at `addrs`, then switches them all at one time, `switch_margin_s` from now: requests
    that arrived before it read the old version on every shard, later ones the new (docs/tiers.md,
    "One version per request"). Returns {addr: new version} once that time has passed. A failed
    stage aborts the update on every shard (the old version keeps serving) and raises
    UpdateError. `announce(table, switch_at_us)`, when given, tells the router before any
    shard switches (its cache keys requests from then on anew, docs/cache.md); if it fails,
    the update is aborted."""
    change = Change(table, source, kind, addrs)
    return apply_changes([change], timeout_s, log, switch_margin_s, announce)[table]


def apply_changes(
    changes: list[Change],
    timeout_s: float = 60.0,
    log=None,
    switch_margin_s: float = SWITCH_MARGIN_S,
    announce=None,
) -> dict[str, dict[str, int]]:
    """`apply_update` of several tables (one change per table) with one switch time for all:
    a request reads every table old or every table new. Returns {table: {addr: version}}."""
    log = log or (lambda _m: None)
    if len({c.table for c in changes}) != len(changes):
        raise UpdateError(f"one change per table, got {[c.table for c in changes]}")
    clients = {a: _Shard(a, timeout_s) for c in changes for a in c.addrs}
    steps = [
        (clients[a], {"update": secrets.randbits(63), "table": c.table}, c)
        for c in changes
        for a in dict.fromkeys(c.addrs)
    ]

    def abort_all():
        for shard, base, _ in steps:
            try:
                shard.step({**base, "op": "abort"})
            except UpdateError as err:  # an unreachable shard drops it when it restarts
                log(f"abort: {err}")
        log("the update was aborted on every shard; the old version keeps serving")

    try:
        for shard, base, change in steps:
            offset = 0
            with change.source.open("rb") as f:
                while True:  # bounded: the file's size / CHUNK_BYTES chunks
                    data = f.read(CHUNK_BYTES)
                    last = len(data) < CHUNK_BYTES
                    h = {**base, "op": "stage", "kind": change.kind, "offset": offset}
                    reply = shard.step({**h, "last": last}, data)
                    offset += len(data)
                    if last:
                        break
            log(f"staged on {shard.addr}: version {reply.get('version')} of {change.table}")
    except UpdateError:
        abort_all()
        raise
    # Every shard gets the same switch time, far enough ahead for the switch to reach them all.
    switch_at_us = int((time.time() + switch_margin_s) * 1e6)
    log(f"switch at {switch_at_us} us (Unix time)")
    # The router hears of it first: once any shard could serve the new version, the router's
    # cache already keys requests as of the switch time with a new epoch (docs/cache.md).
    if announce is not None:
        try:
            for c in changes:
                announce(c.table, switch_at_us)
        except CleaveError as err:
            abort_all()
            raise UpdateError(f"telling the router of the switch failed: {err}") from None
    headers = [
        {**base, "switch_at_unix_us": switch_at_us}
        | ({} if change.tag is None else {"source": change.tag})
        for _, base, change in steps
    ]
    with ThreadPoolExecutor(max_workers=min(len(steps), 32)) as pool:
        outcomes = list(pool.map(_switch, [s for s, _, _ in steps], headers))
    failed = [v for v in outcomes if isinstance(v, str)]
    if failed:
        raise UpdateError(
            "switch failed on some shards after every shard had staged (they keep serving the "
            "old version; run the update again): " + "; ".join(failed)
        )
    out: dict[str, dict[str, int]] = {c.table: {} for c in changes}
    for (shard, _, change), (version, late_us) in zip(steps, outcomes, strict=True):
        out[change.table][shard.addr] = version
        if late_us:
            log(
                f"warning: the switch reached {shard.addr} {late_us / 1e3:.1f} ms after the "
                "switch time: requests of that interval may have read both versions (raise "
                "--switch-margin-ms)"
            )
    time.sleep(max(0.0, switch_at_us / 1e6 - time.time()))  # serving it when this returns
    return out


def bundle_tables(bundle: Path) -> dict[str, dict]:
    """The bundle's tables by name, from its manifest."""
    manifest_path = Path(bundle) / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise UpdateError(f"{manifest_path}: {err}") from None
    return {t["name"]: t for t in manifest.get("tables", [])}


def use_plan_secret(plan) -> None:
    """Every UPDATE connection proves the deployment's secret (docs/security.md): the plan's
    `internal_secret_env`, copied into the variable the connections read."""
    secret_env = plan.router.internal_secret_env
    if secret_env:
        secret = os.environ.get(secret_env, "")
        if not secret:
            raise UpdateError(f"the plan's internal_secret_env {secret_env} is unset or empty")
        os.environ[_SECRET_ENV] = secret


def announce_to(router: str, token: str | None):
    """`announce` for `apply_changes`: tells the router at `router` of each switch."""
    from cleave.runners.membership import cache_switch

    return lambda table, switch_at_us: cache_switch(router, table, switch_at_us, token)


def live_shards(
    router: str, table: str, token: str | None, version: tuple[str, str] | None = None
) -> list[str]:
    """The router's live shard replicas holding `table` (of `version`, (model, version), when
    the router serves a repository), each address once."""
    targets = targets_from_router(router, table, token, version)
    return list(dict.fromkeys(t.addr for t in targets))


def _repository_tables(repo, args, what: str) -> tuple[dict[str, dict], tuple[str, str]]:
    """The tables of MODEL/VERSION's bundle in `repo` (named by `what`: --repository, or a
    repository plan), and (model, version)."""
    if not (args.model and args.version):
        raise UpdateError(f"{what} needs --model NAME and --version V (bundle REPO/NAME/V)")
    from cleave.bundle.repository import version_bundle

    try:
        bundle = version_bundle(repo, args.model, args.version)
    except ValueError as err:
        raise UpdateError(str(err)) from None
    return bundle_tables(bundle), (args.model, args.version)


def add_arguments(parser) -> None:
    served = parser.add_mutually_exclusive_group(required=True)
    served.add_argument(
        "--plan",
        help="the deployment plan (its bundle, secret); a repository plan with --model and "
        "--version",
    )
    served.add_argument(
        "--repository",
        metavar="REPO",
        help="a model repository `cleave serve REPO` serves (with --model and --version)",
    )
    parser.add_argument("--model", help="with a repository (plan): the model whose table to update")
    parser.add_argument(
        "--version", help="with a repository (plan): the model version that names it"
    )
    parser.add_argument("--table", required=True, help="the table to update")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--rows", metavar="DELTA", help="a delta: new rows for some ids")
    what.add_argument("--file", metavar="NEW_TABLE", help="a whole new table file")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--router", metavar="URL", help="the router whose live shards to update")
    where.add_argument(
        "--shard", action="append", metavar="ADDR", help="a shard address (repeat for each)"
    )
    parser.add_argument(
        "--admin-token-env", default="", help="variable holding the router's admin token"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per step")
    parser.add_argument(
        "--switch-margin-ms",
        type=float,
        default=SWITCH_MARGIN_S * 1e3,
        help="the new version serves this long after the switch is sent, on every shard at "
        "once; it must cover sending the switch to all of them (default 2000)",
    )


def run(args) -> int:
    from cleave.bundle.repository import is_repository
    from cleave.plan.files import load_plan

    if not 0 <= args.switch_margin_ms <= 600_000:
        raise UpdateError(f"--switch-margin-ms: expected 0..600000, got {args.switch_margin_ms}")
    if args.plan:
        plan = load_plan(args.plan)
        if is_repository(plan.bundle_path()):
            what = f"--plan {args.plan} (a repository plan)"
            tables, version = _repository_tables(plan.bundle_path(), args, what)
        else:
            tables, version = bundle_tables(plan.bundle_path()), None
    else:
        tables, version = _repository_tables(args.repository, args, "--repository")
    table = tables.get(args.table)
    if table is None:
        raise UpdateError(f"--table {args.table!r}: the bundle has {sorted(tables)}")
    source = Path(args.rows or args.file)
    if not source.is_file():
        raise UpdateError(f"{'--rows' if args.rows else '--file'} {source}: no such file")
    if args.rows:
        read_delta_header(source, table)
    else:
        expected = int(table["rows"]) * int(table["row_bytes"])
        size = source.stat().st_size
        if size != expected:
            raise UpdateError(
                f"--file {source}: {size} bytes, expected {expected} ({table['rows']} rows of "
                f"{table['row_bytes']} bytes, {table['dtype']} x {table['dim']})"
            )
    if args.plan:  # a repository's secret, if it has one, is in the environment as served
        use_plan_secret(plan)
    token = os.environ.get(args.admin_token_env) if args.admin_token_env else None
    if args.shard:
        addrs = list(dict.fromkeys(args.shard))
    else:
        addrs = live_shards(args.router, args.table, token, version)
        if not addrs:
            raise UpdateError(f"--router {args.router}: no live shard holds table {args.table!r}")
    kind = "rows" if args.rows else "file"
    versions = apply_update(
        addrs,
        args.table,
        source,
        kind,
        args.timeout,
        log=lambda m: print(m, file=sys.stderr),
        switch_margin_s=args.switch_margin_ms / 1e3,
        announce=announce_to(args.router, token) if args.router else None,
    )
    print(json.dumps({"table": args.table, "versions": versions}))
    return 0
