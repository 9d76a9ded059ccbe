"""`cleave bench shard`: one `cleave shard` process on loopback over a generated table set,
driven with lookups of 2,000 ids in 26 bags (one bag per table, as Criteo's 26 sparse
features) by an open-loop load generator in Rust (`cleave._native.bench_shard_load`).

Steps, all in one run on the same cores:

1. reference: the same requests pooled in this process by torch.nn.functional.embedding_bag
   (FBGEMM kernels), one at a time: the cost of the lookups alone, without a network;
2. single requests through `ShardClient` (the client a router uses), one at a time;
3. the most the shard serves: closed loop, several requests outstanding;
4. open loop (Poisson arrivals) at fractions of that maximum: throughput, p50/p99/p99.9.

The target is a p99 under 350 µs at half the maximum throughput (HugeCTR HPS reports 346 µs
for 2,000-key lookups). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cleave.bench.harness.bundles import Table, write_bundle
from cleave.bench.harness.command import positives
from cleave.bench.harness.summary import nearest_rank, write_json
from cleave.bench.machine import describe, go_realtime
from cleave.errors import CleaveError, UsageError

TABLES = 26
IDS_PER_REQUEST = 2000
TARGET_P99_US = 350.0  # HugeCTR HPS, 2,000-key lookups


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="small tables, short runs (< 30 s)")
    parser.add_argument("--rows", type=int, help="rows per table (default 100000; quick 20000)")
    parser.add_argument("--dim", type=int, help="embedding dim (default 64; quick 32)")
    parser.add_argument("--duration", type=float, help="seconds per load point (default 3)")
    parser.add_argument(
        "--fractions",
        default="0.1,0.25,0.5,0.75,0.9",
        help="offered loads as fractions of the measured maximum",
    )
    parser.add_argument("--io-threads", type=int, default=1, help="shard I/O threads")
    parser.add_argument("--threads", type=int, default=1, help="shard lookup threads")
    parser.add_argument("--connections", type=int, default=1, help="load generator connections")
    parser.add_argument("--window", type=int, default=4, help="closed loop: outstanding per conn")
    parser.add_argument("--workdir", help="where the tables are written (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="run the shard, the load generator and the reference under SCHED_FIFO, so that "
        "other processes on a shared machine do not add their scheduling delays (needs root)",
    )


def write_tables(root: Path, rows: int, dim: int, seed: int) -> list[np.ndarray]:
    """A bundle of TABLES float32 tables (manifest + tables/*.bin); returns their values."""
    rng = np.random.default_rng(seed)
    values: list[np.ndarray] = []

    def rows_of(table: Table, n: int) -> np.ndarray:
        values.append(rng.standard_normal((n, dim), dtype=np.float32))
        return values[-1]

    tables = [Table(f"t{t}", rows, dim) for t in range(TABLES)]
    write_bundle(root, tables, rows_of, "bench", chunk_rows=rows)
    return values


def make_batches(n: int, rows: int, seed: int) -> list[list[tuple]]:
    """`n` requests, each 2,000 uniform ids in 26 bags (one per table, sizes 76-77)."""
    rng = np.random.default_rng(seed + 1)
    sizes = [IDS_PER_REQUEST // TABLES + (t < IDS_PER_REQUEST % TABLES) for t in range(TABLES)]
    return [
        [
            (f"t{t}", "sum", rng.integers(0, rows, size=k, dtype=np.int64), np.array([0, k]))
            for t, k in enumerate(sizes)
        ]
        for _ in range(n)
    ]


def start_shard(bundle: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "cleave.cli", "shard", "--bundle", str(bundle)]
    argv += ["--listen", "127.0.0.1:0", "--threads", str(args.threads)]
    argv += ["--io-threads", str(args.io_threads)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        raise CleaveError(f"the shard did not start (exit code {proc.wait()}): {line!r}")
    return proc, line.split()[1]


def quantiles_us(samples_s: list[float]) -> dict:
    a = np.asarray(samples_s) * 1e6
    return {
        "p50_us": nearest_rank(a, 0.5),
        "p99_us": nearest_rank(a, 0.99),
        "mean_us": float(a.mean()),
    }


def torch_reference(values: list[np.ndarray], batches, samples: int) -> dict:
    """embedding_bag over the 26 tables, in this process, one request at a time."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    weights = [torch.from_numpy(v) for v in values]
    prepared = [
        [(torch.from_numpy(ids), torch.zeros(1, dtype=torch.int64)) for _, _, ids, _ in batch]
        for batch in batches
    ]
    times = []
    for i in range(samples):
        batch = prepared[i % len(prepared)]
        t0 = time.perf_counter()
        for w, (ids, offs) in zip(weights, batch, strict=True):
            F.embedding_bag(ids, w, offs, mode="sum")
        times.append(time.perf_counter() - t0)
    return quantiles_us(times[samples // 10 :])


def client_single(address: str, batches, samples: int) -> dict:
    """ShardClient round trips, one request at a time."""
    from cleave import _native

    client = _native.ShardClient(
        [(f"t{t}", 0, 1 << 62, address) for t in range(TABLES)], timeout_s=5
    )
    times = []
    for i in range(samples):
        t0 = time.perf_counter()
        client.lookup(batches[i % len(batches)])
        times.append(time.perf_counter() - t0)
    return quantiles_us(times[samples // 10 :])


def run(args: argparse.Namespace) -> int:
    from cleave import _native

    rows = args.rows or (20_000 if args.quick else 100_000)
    dim = args.dim or (32 if args.quick else 64)
    duration = args.duration or (0.4 if args.quick else 3.0)
    fractions = positives(args.fractions, "--fractions")
    if args.quick:
        fractions = [0.25, 0.5, 0.9]
    if not fractions or any(not 0 < f <= 2 for f in fractions):
        raise UsageError(f"--fractions must lie in (0, 2], got {args.fractions!r}")

    if args.realtime:
        go_realtime()
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="cleave-bs-"))
    bundle = workdir / "bundle"
    if bundle.exists():
        shutil.rmtree(bundle)
    values = write_tables(bundle, rows, dim, args.seed)
    batches = make_batches(64, rows, args.seed)
    samples = 200 if args.quick else 2000
    result = {
        "benchmark": "shard",
        "machine": describe(),
        "config": {
            "tables": TABLES,
            "rows": rows,
            "dim": dim,
            "dtype": "float32",
            "ids_per_request": IDS_PER_REQUEST,
            "bags_per_request": TABLES,
            "pooling": "sum",
            "shard_io_threads": args.io_threads,
            "shard_threads": args.threads,
            "connections": args.connections,
            "duration_s": duration,
            "realtime": args.realtime,
        },
        "target_p99_us": TARGET_P99_US,
    }
    result["torch_in_process"] = torch_reference(values, batches, samples)
    proc, address = start_shard(bundle, args)
    try:
        load = _native.bench_shard_load
        load(address, batches[:4], mode="closed", duration_s=0.2)  # warm-up: touch the pages
        result["client_single"] = client_single(address, batches, samples)
        closed = load(
            address,
            batches,
            mode="closed",
            duration_s=duration,
            connections=args.connections,
            window=args.window,
        )
        result["closed_loop"] = closed
        max_rps = closed["achieved_rps"]
        points = []
        for f in fractions:
            p = load(
                address,
                batches,
                mode="open",
                rate=f * max_rps,
                duration_s=duration,
                connections=args.connections,
                timeout_s=2.0,
            )
            p["fraction"] = f
            points.append(p)
        result["open_loop"] = points
    finally:
        proc.terminate()
        code = proc.wait(timeout=30)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if code != 0:
        raise CleaveError(f"the shard exited with code {code} after SIGTERM")
    result["max_rps"] = max([max_rps] + [p["achieved_rps"] for p in points])
    half = min(points, key=lambda p: abs(p["fraction"] - 0.5))
    result["at_half_max"] = {
        "fraction": half["fraction"],
        "offered_rps": half["offered_rps"],
        "p50_us": half["p50_us"],
        "p99_us": half["p99_us"],
        "sent_p99_us": half["sent_p99_us"],
    }
    result["meets_target"] = half["p99_us"] < TARGET_P99_US
    ref = result["torch_in_process"]["p50_us"]
    result["ratio_client_p50_to_torch_p50"] = result["client_single"]["p50_us"] / ref
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(result, args.json)
    return 0


def print_table(r: dict) -> None:
    c = r["config"]
    print(
        f"cleave bench shard: {c['tables']} tables x {c['rows']} rows x dim {c['dim']} float32, "
        f"{c['ids_per_request']} ids in {c['bags_per_request']} bags per request; "
        f"shard io_threads={c['shard_io_threads']} threads={c['shard_threads']}; "
        f"{'SCHED_FIFO; ' if c['realtime'] else ''}"
        f"{r['machine']['cores']} cores ({r['machine']['cpu']})"
    )
    t, s = r["torch_in_process"], r["client_single"]
    print(f"  torch embedding_bag in process (reference): p50 {t['p50_us']:8.1f} us")
    print(
        f"  ShardClient, one at a time over loopback:   p50 {s['p50_us']:8.1f} us   "
        f"p99 {s['p99_us']:8.1f} us   ({r['ratio_client_p50_to_torch_p50']:.2f}x the reference)"
    )
    cl = r["closed_loop"]
    print(
        f"  closed loop (max): {cl['achieved_rps']:9.0f} req/s   p50 {cl['p50_us']:8.1f} us   "
        f"p99 {cl['p99_us']:8.1f} us"
    )
    print(
        f"  {'offered/s':>10} {'achieved/s':>11} {'p50 us':>9} {'p99 us':>9} {'p99.9 us':>9} "
        f"{'p99 sent':>9} {'errors':>7} {'lost':>5}"
    )
    for p in r["open_loop"]:
        print(
            f"  {p['offered_rps']:10.0f} {p['achieved_rps']:11.0f} {p['p50_us']:9.1f} "
            f"{p['p99_us']:9.1f} {p['p999_us']:9.1f} {p['sent_p99_us']:9.1f} "
            f"{p['errors']:7d} {p['lost']:5d}"
        )
    print("  (latency from when a request was due; 'p99 sent': from when it was written)")
    h = r["at_half_max"]
    verdict = "meets" if r["meets_target"] else "misses"
    print(
        f"  max {r['max_rps']:.0f} req/s; p99 at {h['fraction']:.2f}x max: {h['p99_us']:.1f} us "
        f"({verdict} the {r['target_p99_us']:.0f} us target)"
    )
