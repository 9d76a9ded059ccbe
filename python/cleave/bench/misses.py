"""`cleave bench misses`: what a lookup that reads the SSD does to the lookups that do not, on
one `cleave shard` with one I/O thread (docs/tiers.md, "Asynchronous completion").

One float32 table several times the shard's DRAM budget is served from the SSD tier. Two
open-loop streams run at once, each from its own load generator: **hot** requests, whose ids
come from a small set the row cache holds, and **cold** ones, whose ids are uniform over the
table (nearly every row a device read). The same run serves them twice, with misses read on
the I/O thread (`--miss-threads 0`) and completed by miss workers (`--miss-threads 8`): with
the first, a hot request that arrives behind a cold one waits for the cold one's reads.

    cleave bench misses --json out/misses.json

Prints a table and writes JSON: per case the hot and cold streams' rates and latency
quantiles (µs) and the shard's count of handed-over lookups, and the ratios of the inline case
over the workers' one.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

from cleave.bench.harness.bundles import Table, write_bundle
from cleave.bench.harness.command import counts
from cleave.bench.harness.summary import write_json
from cleave.bench.machine import describe
from cleave.errors import CleaveError, UsageError

IDS_PER_REQUEST = 256
HOT_ROWS = 2048


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1_000_000, help="table rows (dim 64)")
    parser.add_argument("--dram-budget", default="16M", help="the shard's DRAM budget")
    parser.add_argument("--hot-rate", type=float, default=200.0, help="hot requests/s")
    parser.add_argument("--cold-rate", type=float, default=40.0, help="cold requests/s")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per case")
    parser.add_argument("--miss-threads", default="0,8", help="the cases, comma-separated")
    parser.add_argument("--workdir", help="where the table is written (default: a temp dir)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="a small table, 1 s cases (CI)")


def write_table(root: Path, rows: int, dim: int) -> None:
    """A bundle of one float32 table `t` (random rows, written in chunks)."""
    rng = np.random.default_rng(0)

    def rows_of(table: Table, n: int) -> np.ndarray:
        return rng.standard_normal((n, dim), dtype=np.float32)

    write_bundle(root, [Table("t", rows, dim)], rows_of, "bench", chunk_rows=1 << 16)


def requests(rng: np.random.Generator, ids_from: np.ndarray | int, n: int = 64) -> list:
    """`n` requests of one sum-pooled bag of IDS_PER_REQUEST ids: from the array `ids_from`,
    or uniform below the int `ids_from`."""
    out = []
    for _ in range(n):
        if isinstance(ids_from, int):
            ids = rng.integers(0, ids_from, size=IDS_PER_REQUEST, dtype=np.int64)
        else:
            ids = rng.choice(ids_from, size=IDS_PER_REQUEST)
        out.append([("t", "sum", ids, np.array([0, IDS_PER_REQUEST]))])
    return out


class ShardProcess:
    """`cleave shard` on loopback with one I/O thread, the SSD tier and `miss_threads`."""

    def __init__(self, bundle: Path, budget: str, miss_threads: int):
        argv = [sys.executable, "-m", "cleave.cli", "shard", "--bundle", str(bundle)]
        argv += ["--listen", "127.0.0.1:0", "--metrics-port", "0", "--io-threads", "1"]
        argv += ["--dram-budget", budget, "--miss-threads", str(miss_threads)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            self.proc.kill()
            raise CleaveError(f"the shard did not start (exit {self.proc.wait()}): {line!r}")
        words = line.split()
        self.address = words[1]
        self.metrics = next(w for w in words if w.startswith("metrics="))[len("metrics=") :]

    def counter(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.metrics}/metrics", timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise CleaveError(f"the shard's /metrics has no {name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def measure(shard: ShardProcess, hot: list, cold: list, args) -> dict:
    """Both streams at once, each on its own thread and connection (the GIL is released)."""
    import threading

    from cleave import _native

    load = _native.bench_shard_load
    load(shard.address, hot, mode="closed", duration_s=0.5)  # the hot rows into the cache
    before = shard.counter("cleave_shard_lookups_deferred_total")
    got: dict = {}

    def run(name: str, batches: list, rate: float) -> None:
        got[name] = load(
            shard.address, batches, mode="open", rate=rate, duration_s=args.duration,
            timeout_s=5.0,
        )  # fmt: skip

    threads = [
        threading.Thread(target=run, args=("hot", hot, args.hot_rate)),
        threading.Thread(target=run, args=("cold", cold, args.cold_rate)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keep = ("offered_rps", "achieved_rps", "p50_us", "p99_us", "p999_us", "errors", "lost")
    return {
        **{name: {k: got[name][k] for k in keep} for name in ("hot", "cold")},
        "deferred": shard.counter("cleave_shard_lookups_deferred_total") - before,
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.rows, args.duration, args.hot_rate, args.cold_rate = 100_000, 1.0, 100.0, 20.0
    cases = counts(args.miss_threads, "--miss-threads", least=0)
    if args.rows < 10 * HOT_ROWS or args.duration <= 0 or min(args.hot_rate, args.cold_rate) <= 0:
        raise UsageError(f"--rows must be at least {10 * HOT_ROWS}, --duration and the rates > 0")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="cleave-bm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    bundle = workdir / "bundle"
    dim = 64
    free = shutil.disk_usage(workdir).free
    if free < 2 * args.rows * dim * 4:
        raise UsageError(
            f"--rows {args.rows}: the table needs {args.rows * dim * 4 >> 20} MiB, "
            f"{free >> 20} MiB free in {workdir}"
        )
    write_table(bundle, args.rows, dim)
    rng = np.random.default_rng(1)
    hot_ids = rng.choice(args.rows, size=HOT_ROWS, replace=False).astype(np.int64)
    # Cold requests are never repeated within a case, or they would be cached by the next pass.
    cold_count = int(args.cold_rate * args.duration * 1.5) + 64
    hot, cold = requests(rng, hot_ids), requests(rng, args.rows, cold_count)
    result = {
        "benchmark": "misses",
        "machine": describe(),
        "config": {
            "rows": args.rows,
            "dim": dim,
            "dram_budget": args.dram_budget,
            "ids_per_request": IDS_PER_REQUEST,
            "hot_rows": HOT_ROWS,
            "hot_rate": args.hot_rate,
            "cold_rate": args.cold_rate,
            "duration_s": args.duration,
            "io_threads": 1,
        },  # fmt: skip
        "cases": [],
    }
    try:
        for m in cases:
            shard = ShardProcess(bundle, args.dram_budget, m)
            try:
                case = {"miss_threads": m, **measure(shard, hot, cold, args)}
            finally:
                shard.stop()
            result["cases"].append(case)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    by = {c["miss_threads"]: c for c in result["cases"]}
    inline, workers = by.get(0), next((c for c in result["cases"] if c["miss_threads"]), None)
    if inline and workers:
        result["ratios"] = {
            f"{s}_{q}_inline_over_workers": _ratio(inline[s][q], workers[s][q])
            for s in ("hot", "cold")
            for q in ("p50_us", "p99_us")
        }
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(result, args.json)
    return 0


def print_table(r: dict) -> None:
    c = r["config"]
    print(
        f"cleave bench misses: 1 table x {c['rows']} rows x dim {c['dim']} float32 on the SSD "
        f"tier, budget {c['dram_budget']}, 1 I/O thread; hot {c['hot_rate']:g}/s + cold "
        f"{c['cold_rate']:g}/s, {c['ids_per_request']} ids a request; {r['machine']['cores']} "
        "cores"
    )
    print(
        f"  {'miss threads':>12} {'stream':>6} {'achieved/s':>10} {'p50 us':>9} {'p99 us':>9} "
        f"{'p99.9 us':>9} {'errors':>6} {'handed over':>11}"
    )
    for case in r["cases"]:
        for s in ("hot", "cold"):
            p = case[s]
            print(
                f"  {case['miss_threads']:>12} {s:>6} {p['achieved_rps']:10.1f} "
                f"{p['p50_us']:9.0f} {p['p99_us']:9.0f} {p['p999_us']:9.0f} {p['errors']:6d} "
                f"{case['deferred']:11.0f}"
            )
    for key, value in r.get("ratios", {}).items():
        print(f"  {key}: {'-' if value is None else f'{value:.2f}'}")
