"""`cleave bench repository`: what a new model version costs in a model repository
(docs/repository.md). `cleave serve REPO` starts with version 1 of a reference model; then
version 2 (its dense weights and one table changed) and version 3 (dense weights only) are
loaded through the repository API while it serves. After each step: the table bytes every
shard process holds (from their /metrics), their resident memory, the processes running, and
how long the load took. The same-run reference is what version 2 would hold served alone (a
copy of every table): `table_growth_over_changed_table` should be 1.0 and
`table_growth_over_copy` the changed table's share of the model.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from cleave.bench.harness.processes import process_table
from cleave.bench.harness.summary import write_json
from cleave.bench.machine import describe
from cleave.errors import UsageError

MODEL = "dlrm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", type=float, default=0.05, help="dlrm's table scale")
    parser.add_argument("--table", default="emb_l.2.weight", help="the parameter version 2 changes")
    parser.add_argument("--workdir", help="where the repository goes (default: a temporary one)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="a smoke run (tests, CI)")


def run(args: argparse.Namespace) -> int:
    import torch

    import cleave
    from cleave.launch.process import ServeProcess
    from cleave.models import MODELS

    if args.quick:
        args.scale = 0.002
    if not args.scale > 0:
        raise UsageError(f"--scale: expected > 0, got {args.scale}")
    base, example = MODELS[MODEL].factory(scale=args.scale, seed=0)
    if args.table not in dict(base.named_parameters()):
        raise UsageError(f"--table: {MODEL} has no parameter {args.table!r}")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="cleave-bench-repository-")) / "repo"

    def write(version: int, dense: float, table: str | None = None) -> dict:
        model = copy.deepcopy(base)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.startswith("emb"):
                    p.mul_(1.0 + dense)
            if table:
                dict(model.named_parameters())[table].add_(0.01)
        path = cleave.partition(model, example).save(root / MODEL / str(version), overwrite=True)
        return json.loads((path / "manifest.json").read_text())

    manifest = write(1, 0.0)
    size = {t["source"]: t["rows"] * t["row_bytes"] for t in manifest["tables"]}
    row_bytes = {t["name"]: t["row_bytes"] for t in manifest["tables"]}
    result = {
        "benchmark": "repository",
        "machine": describe(),
        "model": MODEL,
        "scale": args.scale,
        "changed_table": args.table,
        "changed_table_bytes": size[args.table],
        "copy_bytes": sum(size.values()),
        "steps": [],
    }
    with ServeProcess(root, "--threads", "1") as server:
        result["steps"].append(_step("start: version 1", server, 0.0, row_bytes))
        write(2, 0.1, args.table)
        write(3, -0.1)
        for version in ("2", "3"):
            took = _load(server.url, version)
            result["steps"].append(_step(f"load version {version}", server, took, row_bytes))
    grew = result["steps"][1]["table_bytes"] - result["steps"][0]["table_bytes"]
    result["ratios"] = {
        "table_growth_over_changed_table": grew / result["changed_table_bytes"],
        "table_growth_over_copy": grew / result["copy_bytes"],
        "dense_only_table_growth_bytes": result["steps"][2]["table_bytes"]
        - result["steps"][1]["table_bytes"],
    }
    print_table(result)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _load(url: str, version: str) -> float:
    request = urllib.request.Request(
        f"{url}/v2/repository/models/{MODEL}/load?version={version}", b"{}", method="POST"
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()
    return time.perf_counter() - start


def _step(what: str, server, load_s: float, row_bytes: dict[str, int]) -> dict:
    """The shards' table bytes (their /metrics) and resident memory, the processes running."""
    table_bytes = 0
    for line in list(server.log):
        if " metrics " in line and "-shard-" in line:
            table_bytes += _shard_table_bytes(line.split()[4], row_bytes)
    children = [pid for pid, (parent, _) in process_table().items() if parent == server.proc.pid]
    argv = {pid: process_table()[pid][1] for pid in children if pid in process_table()}
    shards = [pid for pid, a in argv.items() if Path(a[0]).name == "cleave-shard"]
    rankers = [pid for pid, a in argv.items() if "ranker" in a]
    return {
        "step": what,
        "load_s": load_s,
        "table_bytes": table_bytes,
        "shard_processes": len(shards),
        "ranker_processes": len(rankers),
        "shard_rss_bytes": sum(_rss(pid) for pid in shards),
        "ranker_rss_bytes": sum(_rss(pid) for pid in rankers),
    }


def _shard_table_bytes(url: str, row_bytes: dict[str, int]) -> int:
    """Rows held per table (a live shard's /metrics) times the table's row bytes; 0 for a
    shard that stopped."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return 0
    held = 0
    for line in text.splitlines():
        if line.startswith("cleave_shard_table_rows{"):
            table = line.split('table="')[1].split('"')[0]
            held += float(line.rsplit(" ", 1)[1]) * row_bytes[table]
    return int(held)


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def print_table(result: dict) -> None:
    mib = 1 << 20
    print(
        f"{MODEL} scale {result['scale']:g}: all tables {result['copy_bytes'] / mib:.1f} MiB, "
        f"{result['changed_table']} {result['changed_table_bytes'] / mib:.1f} MiB"
    )
    print(f"{'step':>18} {'load s':>7} {'tables MiB':>10} {'shards':>6} {'rankers':>7}", end="")
    print(f" {'shard RSS MiB':>13} {'ranker RSS MiB':>14}")
    for s in result["steps"]:
        print(
            f"{s['step']:>18} {s['load_s']:>7.1f} {s['table_bytes'] / mib:>10.1f} "
            f"{s['shard_processes']:>6} {s['ranker_processes']:>7} "
            f"{s['shard_rss_bytes'] / mib:>13.1f} {s['ranker_rss_bytes'] / mib:>14.1f}"
        )
    r = result["ratios"]
    print(
        f"table growth of version 2 / its changed table: "
        f"{r['table_growth_over_changed_table']:.3f}x; / a copy of every table: "
        f"{r['table_growth_over_copy']:.3f}x; version 3 (dense only): "
        f"{r['dense_only_table_growth_bytes']} bytes"
    )
