"""`cleave bench lookup`: pooled-lookup rate of the Cleave engine against PyTorch and against the
memory limit, on the same tables and ids in one run.

Cases (docs/benchmarks.md explains the choice):

* ``fp32-uniform`` / ``fp32-zipf``: float32 tables of dim 64, 2 GiB in all (far larger than the
  last-level cache), written as bundle table files and memory-mapped; pooling factor 20; ids
  uniform or Zipf(1.05)-distributed.
* ``int8-cached``: one int8_rowwise table of dim 64 that fits in the last-level cache; pooling
  factor 100.

For each case and thread count it measures, interleaved over several rounds (medians reported;
ratios are medians of the per-round ratios):
Cleave (`cleave._native.TableSet.pool`), PyTorch (`torch.nn.functional.embedding_bag`, or for
int8 its fused 8-bit row-wise kernel) with the same thread count, and the memory limit: a minimal
loop that reads the same rows with software prefetch and does nothing else
(`TableSet.gather_sum_prefetch`, best of three prefetch distances). Every rate counts looked-up
rows (ids) per second. On one thread it also reports rates per CPU-second of the measuring
thread, which a busy shared machine disturbs less. `--resident` holds the tables in memory
instead of mapping them; `--realtime` measures under SCHED_FIFO.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cleave.bench.harness.bundles import Table, is_complete, write_bundle
from cleave.bench.harness.command import counts
from cleave.bench.harness.summary import write_json
from cleave.bench.machine import describe, go_realtime
from cleave.errors import UsageError

DIM = 64
ZIPF_ALPHA = 1.05
# Targets from the engine's brief, checked per case in the JSON.
TARGETS = {
    "fp32-uniform": {"per_core_vs_torch": 2.0, "vs_limit": 0.85},
    "int8-cached": {"vs_torch": 1.0},
}


@dataclass
class Case:
    name: str
    dtype: str
    tables: int
    rows: int  # per table
    pooling_factor: int
    bags: int  # per batch (one call)
    distribution: str


def cases(quick: bool) -> list[Case]:
    # Full: 4 x 2 Mi rows x 256 B = 2 GiB of float32 rows; the int8 table is 7 MB (72 B rows).
    big_rows = 1 << 16 if quick else 1 << 21
    return [
        Case("fp32-uniform", "float32", 4, big_rows, 20, 2048, "uniform"),
        Case("fp32-zipf", "float32", 4, big_rows, 20, 2048, "zipf"),
        Case("int8-cached", "int8_rowwise", 1, 100_000, 100, 512, "uniform"),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="small tables, one short round")
    parser.add_argument("--workdir", help="where tables are written (default: a temporary dir)")
    parser.add_argument("--threads", help="thread counts, e.g. 1,2 (default: 1 and all cores)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per case (default 7)")
    parser.add_argument("--seconds", type=float, help="seconds per measurement (default 0.3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--resident",
        action="store_true",
        help="tables in memory instead of memory-mapped: Cleave's resident mode (huge pages) "
        "and a numpy copy for torch",
    )
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="measure under SCHED_FIFO (root or CAP_SYS_NICE), ahead of other processes on a "
        "shared machine; tables and ids are prepared before",
    )


def run(args: argparse.Namespace) -> int:
    cores = len(os.sched_getaffinity(0))
    threads = _thread_counts(args.threads, cores)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 7)
    seconds = args.seconds if args.seconds is not None else (0.05 if args.quick else 0.3)
    if rounds < 1 or seconds <= 0:
        raise UsageError(f"--rounds must be >= 1 and --seconds > 0, got {rounds} and {seconds}")

    from cleave import _native

    rng = np.random.default_rng(args.seed)
    workdir = Path(args.workdir) if args.workdir else None
    tmp = None
    if workdir is None:
        tmp = tempfile.mkdtemp(prefix="cleave-bench-lookup-")
        workdir = Path(tmp)
    try:
        prepared = []
        bundles: dict[tuple, Path] = {}
        for case in cases(args.quick):
            key = (case.dtype, case.tables, case.rows)
            if key not in bundles:
                bundles[key] = _write_bundle(
                    workdir / f"{case.dtype}-{case.tables}x{case.rows}", case, rng
                )
            prepared.append((case, bundles[key], _batches(case, rng)))
        if args.realtime:  # threads started from now on (engine, torch, limit) inherit it
            go_realtime()
        results = []
        for case, bundle, batches in prepared:
            for n in threads:
                results.append(
                    _measure(_native, bundle, case, batches, n, rounds, seconds, args.resident)
                )
                _print_row(results[-1])
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    report = {
        "benchmark": "lookup",
        "machine": describe(),
        "config": {
            "quick": args.quick,
            "rounds": rounds,
            "seconds": seconds,
            "dim": DIM,
            "zipf_alpha": ZIPF_ALPHA,
            "seed": args.seed,
            "realtime": args.realtime,
            "resident": args.resident,
            "kernels_available": _native.TableSet.kernels(),
        },
        "cases": results,
    }
    print()
    print_table(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(report, args.json)
        print(f"\nwrote {args.json}")
    return 0


def _thread_counts(text: str | None, cores: int) -> list[int]:
    if text is None:
        return sorted({1, cores})
    return counts(text, "--threads")


# --- tables -------------------------------------------------------------------------------


def _write_bundle(directory: Path, case: Case, rng: np.random.Generator) -> Path:
    """Bundle-format table files + a manifest (tables only); reused if already complete."""
    row_bytes = 4 * DIM if case.dtype == "float32" else DIM + 8
    tables = [Table(f"t{i}", case.rows, DIM, case.dtype, row_bytes) for i in range(case.tables)]
    if is_complete(directory, tables):
        return directory
    return write_bundle(
        directory, tables, lambda table, n: _rows(case.dtype, n, rng), "cleave bench lookup"
    )


def _rows(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if dtype == "float32":
        return rng.random((n, DIM), dtype=np.float32) - np.float32(0.5)
    rows = np.empty((n, DIM + 8), dtype=np.uint8)
    rows[:, :DIM] = rng.integers(0, 256, size=(n, DIM), dtype=np.uint8)
    scale = rng.uniform(1e-3, 1e-2, size=n).astype(np.float32)
    bias = rng.uniform(-1.0, 1.0, size=n).astype(np.float32)
    rows[:, DIM : DIM + 4] = scale.view(np.uint8).reshape(n, 4)
    rows[:, DIM + 4 :] = bias.view(np.uint8).reshape(n, 4)
    return rows


def _table_array(bundle: Path, name: str, case: Case, resident: bool) -> np.ndarray:
    """The table file mapped copy-on-write (writable for torch, no copy, same page cache), or
    read into memory (numpy advises its large allocations for huge pages)."""
    path = bundle / "tables" / f"{name}.bin"
    if resident:
        dtype = np.float32 if case.dtype == "float32" else np.uint8
        return np.fromfile(path, dtype=dtype).reshape(case.rows, -1)
    if case.dtype == "float32":
        return np.memmap(path, dtype=np.float32, mode="c", shape=(case.rows, DIM))
    return np.memmap(path, dtype=np.uint8, mode="c", shape=(case.rows, DIM + 8))


# --- ids ----------------------------------------------------------------------------------


@dataclass
class Batch:
    table: str
    ids: np.ndarray  # int64
    offsets: np.ndarray  # uint32, bags + 1
    torch_offsets: object  # torch int64, bags


def _batches(case: Case, rng: np.random.Generator, count: int = 16) -> list[Batch]:
    import torch

    n = case.bags * case.pooling_factor
    if case.distribution == "zipf":
        # Bounded Zipf over the rows by inverse CDF; ranks scattered over the table.
        cdf = np.cumsum(np.arange(1, case.rows + 1, dtype=np.float64) ** -ZIPF_ALPHA)
        cdf /= cdf[-1]
        perm = rng.permutation(case.rows)
    offsets = np.arange(case.bags + 1, dtype=np.uint32) * case.pooling_factor
    batches = []
    for i in range(count):
        if case.distribution == "zipf":
            ids = perm[np.minimum(np.searchsorted(cdf, rng.random(n)), case.rows - 1)]
        else:
            ids = rng.integers(0, case.rows, size=n)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        batches.append(
            Batch(
                f"t{i % case.tables}", ids, offsets, torch.from_numpy(offsets[:-1].astype(np.int64))
            )
        )
    return batches


# --- measuring ----------------------------------------------------------------------------


def _rate(fn, batches: list, seconds: float, now=time.perf_counter) -> float:
    """Rows per second (by the clock `now`) of `fn(batch)` cycling over batches for at least
    `seconds`."""
    fn(batches[0])
    rows = 0
    start = now()
    while True:
        for b in batches:
            fn(b)
            rows += b.ids.size
        elapsed = now() - start
        if elapsed >= seconds:
            return rows / elapsed


def _measure(
    native,
    bundle: Path,
    case: Case,
    batches: list[Batch],
    threads: int,
    rounds: int,
    seconds: float,
    resident: bool,
) -> dict:
    import torch

    torch.set_num_threads(threads)
    ts = native.TableSet.open(str(bundle), threads=threads, resident=resident)
    names = sorted({b.table for b in batches})
    arrays = {name: _table_array(bundle, name, case, resident) for name in names}
    weights = {name: torch.from_numpy(a) for name, a in arrays.items()}
    # Map every page of both mappings before timing (first touches are page faults).
    for name in names:
        ts.gather_sum_prefetch(name, np.arange(0, case.rows, 16, dtype=np.int64))
        float(weights[name][::16].float().sum())

    if case.dtype == "float32":
        torch_path = "torch.nn.functional.embedding_bag(mode='sum'), float32"

        def torch_pool(b):
            return torch.nn.functional.embedding_bag(
                torch.from_numpy(b.ids), weights[b.table], b.torch_offsets, mode="sum"
            )
    else:
        torch_path = "torch.ops.quantized.embedding_bag_byte_rowwise_offsets (FBGEMM, 8-bit)"
        op = torch.ops.quantized.embedding_bag_byte_rowwise_offsets

        def torch_pool(b):
            return op(
                weights[b.table],
                torch.from_numpy(b.ids),
                b.torch_offsets,
                False,
                0,
                False,
                None,
                None,
                False,
            )

    def cleave_pool(b):
        return ts.pool(b.table, b.ids, b.offsets)

    # The limit loop gets all of a table's ids in one call, so that starting its threads
    # costs nothing measurable.
    by_table = [
        _Joined(name, np.concatenate([b.ids for b in batches if b.table == name])) for name in names
    ]

    # The limit is the best of a few prefetch distances around the engine's.
    distance = ts.prefetch_distance(names[0])
    distances = sorted({max(1, distance // 2), distance, 2 * distance})

    def limit_at(d):
        return lambda j: ts.gather_sum_prefetch(j.table, j.ids, threads, d)

    # Same results, so that the rates compare the same work.
    diff = _max_rel_diff(cleave_pool(batches[0])[0], torch_pool(batches[0]).numpy())

    # Wall-clock rates, and on one thread also rates per CPU-second of the calling thread
    # (which all three use alone then): those do not count time the thread was descheduled.
    clocks = {"wall": time.perf_counter, "cpu": time.thread_time}
    samples = {(c, k): [] for c in clocks for k in ("cleave", "torch", "limit")}
    with torch.inference_mode():
        for _ in range(rounds):
            for clock, now in clocks.items():
                if clock == "cpu" and threads != 1:
                    continue
                samples[clock, "cleave"].append(_rate(cleave_pool, batches, seconds, now))
                samples[clock, "torch"].append(_rate(torch_pool, batches, seconds, now))
                samples[clock, "limit"].append(
                    max(_rate(limit_at(d), by_table, seconds, now) for d in distances)
                )
    median = {key: statistics.median(v) for key, v in samples.items() if v}
    cleave, torch_rate, limit_rate = (median["wall", k] for k in ("cleave", "torch", "limit"))

    def ratio(clock, a, b):
        # Median of the per-round ratios: the three of a round ran within a second or two of
        # each other, so slow drifts of a shared machine cancel out of each ratio.
        pairs = zip(samples[clock, a], samples[clock, b], strict=True)
        return statistics.median(x / y for x, y in pairs)

    table_bytes = case.tables * case.rows * (4 * DIM if case.dtype == "float32" else DIM + 8)
    result = {
        "case": case.name,
        "threads": threads,
        "dtype": case.dtype,
        "dim": DIM,
        "tables": case.tables,
        "rows_per_table": case.rows,
        "table_bytes": table_bytes,
        "distribution": case.distribution
        if case.distribution == "uniform"
        else f"zipf({ZIPF_ALPHA})",
        "pooling_factor": case.pooling_factor,
        "bags_per_call": case.bags,
        "cleave_rows_per_s": cleave,
        "torch_rows_per_s": torch_rate,
        "limit_rows_per_s": limit_rate,
        "cleave_vs_torch": ratio("wall", "cleave", "torch"),
        "cleave_vs_limit": ratio("wall", "cleave", "limit"),
        "torch_vs_limit": ratio("wall", "torch", "limit"),
        "samples_rows_per_s": {k: samples["wall", k] for k in ("cleave", "torch", "limit")},
        "kernel": ts.kernel,
        "prefetch_distance": distance,
        "limit_distances": distances,
        "torch_path": torch_path,
        "residency": "resident" if resident else "mapped",
        "torch_table": "a copy in memory (numpy.fromfile)"
        if resident
        else "the same table file, memory-mapped (numpy.memmap, shared page cache)",
        "max_rel_diff_vs_torch": diff,
    }
    if threads == 1:
        cpu = {f"{k}_rows_per_cpu_s": median["cpu", k] for k in ("cleave", "torch", "limit")}
        cpu["cleave_vs_torch"] = ratio("cpu", "cleave", "torch")
        cpu["cleave_vs_limit"] = ratio("cpu", "cleave", "limit")
        result["cpu_time"] = cpu
    target = TARGETS.get(case.name)
    if target:
        met = {}
        if "per_core_vs_torch" in target and threads == 1:
            met["per_core_vs_torch"] = result["cleave_vs_torch"] >= target["per_core_vs_torch"]
        if "vs_torch" in target:
            met["vs_torch"] = result["cleave_vs_torch"] >= target["vs_torch"]
        if "vs_limit" in target:
            met["vs_limit"] = result["cleave_vs_limit"] >= target["vs_limit"]
        result["targets"] = {k: target[k] for k in met}
        result["targets_met"] = met
    return result


@dataclass
class _Joined:
    table: str
    ids: np.ndarray


def _max_rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    scale = max(float(np.abs(b).max()), 1e-30)
    return float(np.abs(a - b).max()) / scale


# --- reporting ----------------------------------------------------------------------------


_COLUMNS = (
    "case",
    "thr",
    "cleave Mrows/s",
    "torch Mrows/s",
    "limit Mrows/s",
    "vs torch",
    "vs limit",
)


def _cells(r: dict) -> tuple:
    return (
        r["case"],
        str(r["threads"]),
        f"{r['cleave_rows_per_s'] / 1e6:.1f}",
        f"{r['torch_rows_per_s'] / 1e6:.1f}",
        f"{r['limit_rows_per_s'] / 1e6:.1f}",
        f"{r['cleave_vs_torch']:.2f}x",
        f"{r['cleave_vs_limit']:.0%}",
    )


def _print_row(r: dict) -> None:
    print("  ".join(_cells(r)), flush=True)


def print_table(results: list[dict]) -> None:
    rows = [_COLUMNS] + [_cells(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    for k, row in enumerate(rows):
        print(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if k == 0:
            print("  ".join("-" * w for w in widths))
