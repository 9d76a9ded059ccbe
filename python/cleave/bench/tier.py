"""`cleave bench tier`: a table larger than the DRAM budget served from SSD through the tier's
row cache (docs/tiers.md), against the same table all in DRAM and memory-mapped under a memory
cap of the same size, on the same requests, in one run.

One float32 table of dim 64 (256-byte rows), by default 8 GiB on disk with a 1 GiB budget (8x;
scaled down, with a message, when the disk has less room). Requests of 128 bags x 20 ids. Ids
(docs/tiers.md, "Benchmark"):

* ``meta``: per request, the multiplicities of its distinct ids are drawn from Meta's published
  per-batch reuse histogram (dlrm_datasets 2022, averaged over its 16 batches: how many times
  each distinct id recurs within a batch); the distinct ids are Zipf(1.05)-popular rows, the
  most popular getting the largest multiplicities. The run prints the generated histogram next
  to Meta's.
* ``zipf-A``: ids drawn independently, Zipf(A) over the rows.

Rows are scattered over the file (rank * a prime mod rows), so hot rows do not share pages.
For each trace: the tier warms up until it has seen twice its row capacity in distinct rows (or
a time limit, reported), then its hit rate, rows/s, read amplification and p99 are read; p99 at
half the tier's rate (open loop) is reported next to DRAM's at the same rate. Baselines: all rows
in DRAM (the window's pages touched before timing) and memory-mapped in a child process under a
cgroup-v1 memory limit of the budget (page cache is charged to the cgroup). Belady's hit rate is
computed on the same distinct-rows trace and capacity. The device's random-read rate at the
tier's read size is measured in the same run. Page cache is dropped for the table file
(fadvise DONTNEED) before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cleave.bench.harness.bundles import Table, write_bundle
from cleave.bench.harness.summary import write_json
from cleave.errors import UsageError

DIM = 64
ROW_BYTES = 4 * DIM
BAGS = 128
POOLING = 20
CHUNK = 250  # requests generated (and run) at a time
CHILD_SLACK = 16 << 20  # over the cap, for the capped child's own allocations
DRAM_BYTES = 2 << 30  # of the table copied into memory for the all-in-DRAM baseline
PAGE = 4096
# Meta's per-batch reuse histogram (dlrm_datasets, 2022 locality stats, mean of 16 batches):
# the share of a batch's distinct ids that occur (lo, hi] times in it.
META_BUCKETS = [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 128)]
META_BUCKETS += [(128, 256), (256, 512), (512, 1024), (1024, 2048)]
META_SHARES = [0.342, 0.144, 0.149, 0.138, 0.112, 0.068, 0.029, 0.010, 0.004, 0.002, 0.001, 0.001]
META_ALPHA = 1.05
CASES = {"meta": ("meta", META_ALPHA, "sieve"), "meta-lru": ("meta", META_ALPHA, "lru")}
CASES |= {"zipf-0.9": ("zipf", 0.9, "sieve"), "zipf-1.2": ("zipf", 1.2, "sieve")}
DEFAULT_CASES = "meta,meta-lru,zipf-0.9,zipf-1.2"
QUICK_CASES = "meta,zipf-1.2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="write {'cases': [...]} here (the issue's schema)")
    parser.add_argument("--quick", action="store_true", help="64 MiB table, 8 MiB budget")
    parser.add_argument("--table-mib", type=int, help="table size (default 8192; quick 64)")
    parser.add_argument("--budget-mib", type=int, help="DRAM budget (default table / 8)")
    parser.add_argument("--cases", help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--workdir", help="where the table is written (default: a temporary dir)")
    parser.add_argument("--threads", type=int, default=2, help="lookup threads")
    parser.add_argument("--warm-seconds", type=float, help="warm-up limit (default 240; quick 3)")
    parser.add_argument("--seconds", type=float, help="measured window limit (default 15)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the capped mmap run


@dataclass
class Trace:
    """Requests in chunks of CHUNK, each chunk from its own seed, so any chunk can be rebuilt
    (the capped mmap child rebuilds the tier's)."""

    kind: str
    alpha: float
    rows: int
    seed: int

    def chunk(self, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, offsets, bounds) of chunk `c`: bags of POOLING ids, BAGS bags a request."""
        rng = np.random.default_rng([self.seed, c, int(self.alpha * 1000)])
        n = CHUNK * BAGS * POOLING
        if self.kind == "zipf":
            ids = scatter(zipf_ranks(rng, self.alpha, self.rows, n), self.rows)
        else:
            ids = np.concatenate([self.meta_request(rng) for _ in range(CHUNK)])
        offsets = np.arange(0, n + 1, POOLING, dtype=np.uint32)
        bounds = np.arange(0, CHUNK * BAGS + 1, BAGS, dtype=np.int64)
        return ids, offsets, bounds

    def meta_request(self, rng: np.random.Generator) -> np.ndarray:
        total = BAGS * POOLING
        counts = meta_counts(rng, total)
        ranks = distinct_ranks(rng, self.alpha, self.rows, len(counts))
        # The most popular rows recur the most within the batch.
        ids = np.repeat(scatter(np.sort(ranks), self.rows), np.sort(counts)[::-1])
        rng.shuffle(ids)
        return ids


def zipf_ranks(rng: np.random.Generator, alpha: float, n: int, size: int) -> np.ndarray:
    """Ranks in [0, n) with P(rank k) ~ (k + 1)^-alpha (continuous inverse CDF)."""
    u = rng.random(size)
    if abs(alpha - 1.0) < 1e-9:
        r = np.floor(np.power(float(n), u))
    else:
        e = 1.0 - alpha
        r = np.floor(np.power((float(n) ** e - 1.0) * u + 1.0, 1.0 / e))
    return np.clip(r.astype(np.int64) - 1, 0, n - 1)


def distinct_ranks(rng: np.random.Generator, alpha: float, n: int, k: int) -> np.ndarray:
    got = np.empty(0, dtype=np.int64)
    for _ in range(20):  # each round adds distinct ranks; 20 is far more than ever needed
        more = zipf_ranks(rng, alpha, n, 2 * (k - len(got)) + 8)
        _, first = np.unique(np.concatenate([got, more]), return_index=True)
        got = np.concatenate([got, more])[np.sort(first)]
        if len(got) >= k:
            return got[:k]
    # A table with fewer rows than distinct ids asked for: take what there is.
    return np.resize(got, k)


def meta_counts(rng: np.random.Generator, total: int) -> np.ndarray:
    """Multiplicities of a batch's distinct ids, drawn from Meta's histogram, summing to total
    (the last one cut to fit)."""
    cumulative = np.cumsum(META_SHARES) / sum(META_SHARES)
    # A bucket per draw by its share; `total` draws of at least 1 each always reach `total`.
    buckets = np.minimum(np.searchsorted(cumulative, rng.random(total)), len(META_SHARES) - 1)
    lo = np.array([lo for lo, _ in META_BUCKETS])[buckets]
    hi = np.array([hi for _, hi in META_BUCKETS])[buckets]
    counts = lo + 1 + (rng.random(total) * (hi - lo)).astype(np.int64)  # uniform in (lo, hi]
    csum = np.cumsum(counts)
    k = int(np.searchsorted(csum, total))
    counts = counts[: k + 1].copy()
    counts[-1] -= csum[k] - total
    return counts


def scatter(ranks: np.ndarray, rows: int) -> np.ndarray:
    """Rank -> row: a bijection that spreads popular ranks over the file."""
    prime = 2_654_435_761
    while np.gcd(prime, rows) != 1:
        prime += 2
    return (ranks.astype(np.uint64) * np.uint64(prime) % np.uint64(rows)).astype(np.int64)


def reuse_histogram(ids_per_request: list[np.ndarray]) -> list[float]:
    """Share of each request's distinct ids per Meta bucket of in-request multiplicity."""
    hist = np.zeros(len(META_BUCKETS))
    edges = np.array([hi for _, hi in META_BUCKETS])
    for ids in ids_per_request:
        _, counts = np.unique(ids, return_counts=True)
        idx = np.searchsorted(edges, counts, side="left")
        hist += np.bincount(np.minimum(idx, len(edges) - 1), minlength=len(edges))
    return list(hist / max(hist.sum(), 1))


def distinct_per_request(ids: np.ndarray, bounds: np.ndarray, rows: int) -> list[np.ndarray]:
    per = BAGS * POOLING
    return [np.unique(ids[i * per : (i + 1) * per]) for i in range(len(bounds) - 1)]


def write_table(path: Path, rows: int, seed: int) -> None:
    """The bundle of one float32 table `t0` whose file is `path` (BUNDLE/tables/t0.bin)."""
    rng = np.random.default_rng(seed)

    def rows_of(table: Table, n: int) -> np.ndarray:
        return rng.random((n, DIM), dtype=np.float32) - 0.5

    table = Table("t0", rows, DIM, row_bytes=ROW_BYTES)
    if path != path.parent.parent / table.file:
        raise ValueError(f"write_table: expected a path BUNDLE/{table.file}, got {path}")
    write_bundle(path.parent.parent, [table], rows_of, "cleave bench tier")


def drop_cache(path: Path) -> None:
    """Drops the table file's pages from the page cache (this file only: the machine is shared)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def sizes(args: argparse.Namespace, workdir: Path) -> tuple[int, int]:
    table_mib = args.table_mib or (64 if args.quick else 8192)
    free_mib = shutil.disk_usage(workdir).free // (1 << 20)
    room = int((free_mib - 2048) * 0.8)  # leave 2 GiB and a fifth of the rest to others
    if table_mib > room:
        if room < 16:
            raise UsageError(f"{workdir}: {free_mib} MiB free, not enough for the table")
        print(
            f"bench tier: {workdir} has {free_mib} MiB free; scaling the table down from "
            f"{table_mib} MiB to {room} MiB (and the budget with it)"
        )
        table_mib = room
    budget_mib = args.budget_mib or max(1, table_mib // 8)
    if budget_mib * 8 > table_mib:
        print(f"bench tier: note: the table is only {table_mib / budget_mib:.1f}x the budget")
    return table_mib, budget_mib


def run(args: argparse.Namespace) -> int:
    if args.child:
        return _child(json.loads(args.child))
    names = (args.cases or (QUICK_CASES if args.quick else DEFAULT_CASES)).split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise UsageError(f"--cases: unknown {unknown}; known: {list(CASES)}")
    if args.threads < 1:
        raise UsageError(f"--threads must be at least 1, got {args.threads}")
    warm_s = args.warm_seconds if args.warm_seconds is not None else (3 if args.quick else 240)
    window_s = args.seconds if args.seconds is not None else (1.5 if args.quick else 15)
    tmp = None
    workdir = Path(args.workdir) if args.workdir else None
    if workdir is None:
        tmp = tempfile.mkdtemp(prefix="cleave-bench-tier-")
        workdir = Path(tmp)
    workdir.mkdir(parents=True, exist_ok=True)
    results, details = [], []
    try:
        table_mib, budget_mib = sizes(args, workdir)
        rows = table_mib * (1 << 20) // ROW_BYTES
        budget = budget_mib << 20
        table = workdir / "bundle" / "tables" / "t0.bin"
        print(f"bench tier: writing {table_mib} MiB of rows to {table} ...", flush=True)
        write_table(table, rows, args.seed)
        from cleave import _native

        drop_cache(table)
        iops, io = _native.device_read_iops(
            str(table), 512, 4000 if args.quick else 200_000, 64, "auto", args.threads
        )
        baselines: dict[tuple, dict] = {}
        for name in names:
            kind, alpha, policy = CASES[name]
            trace = Trace(kind, alpha, rows, args.seed)
            spec = {"table": str(table), "rows": rows, "budget": budget, "policy": policy}
            spec |= {"threads": args.threads, "warm_s": warm_s, "window_s": window_s}
            spec |= {"trace": [kind, alpha, args.seed]}
            drop_cache(table)
            tier = _tier_run(_native, trace, spec)
            key = (kind, alpha)
            if key not in baselines:
                drop_cache(table)
                capped = _capped_mmap(spec, tier["window"])
                dram = _dram_run(_native, trace, spec, tier["window"], tier["paced_interval_us"])
                baselines[key] = {"capped": capped, "dram": dram}
            capped, dram = baselines[key]["capped"], baselines[key]["dram"]
            case = {
                "name": name,
                "tier_rows_per_s": tier["rows_per_s"],
                "dram_rows_per_s": dram["rows_per_s"],
                "mmap_capped_rows_per_s": capped.get("rows_per_s"),
                "row_cache_hit_rate": tier["row_hit_rate"],
                "pooled_cache_hit_rate": tier["pooled_hit_rate"],
                "belady_hit_rate": tier["belady_hit_rate"],
                "p99_us": tier["p99_us"],
                "dram_p99_us": dram["p99_us"],
                "device_read_iops": iops,
                "read_amplification": tier["read_amplification"],
                "mmap_read_amplification": capped.get("read_amplification"),
            }
            results.append(case)
            detail = {k: v for k, v in tier.items() if k not in ("window",)}
            detail |= {"name": name, "io": io, "capped": capped, "dram": dram}
            details.append(detail)
            _print_case(case, detail)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        elif (workdir / "bundle").exists():
            shutil.rmtree(workdir / "bundle", ignore_errors=True)  # the big file goes
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json({"cases": results}, args.json)
        details_path = Path(args.json).with_suffix(".details.json")
        details_path.write_text(json.dumps(details, indent=1) + "\n")
    return 0


def _tier_run(native, trace: Trace, spec: dict) -> dict:
    ts = native.TableSet.open(
        str(Path(spec["table"]).parent.parent),
        threads=spec["threads"],
        dram_budget=spec["budget"],
        cache_policy=spec["policy"],
        pooled_fraction=0.01,
    )
    (_, capacity, _), *_ = ts.tier_stats()["row_caches"]
    seen = np.zeros(trace.rows, dtype=bool)
    distinct_trace: list[np.ndarray] = []
    hist_sample: list[np.ndarray] = []
    c, start = 0, time.monotonic()
    # Warm-up: until the cache has seen twice its capacity in distinct rows (or the limit).
    while seen.sum() < 2 * capacity and time.monotonic() - start < spec["warm_s"]:
        ids, offsets, bounds = trace.chunk(c)
        ts.run_requests("t0", ids, offsets, bounds)
        per = distinct_per_request(ids, bounds, trace.rows)
        distinct_trace += per
        seen[ids] = True
        if len(hist_sample) < 2000:
            per_request = BAGS * POOLING
            hist_sample += [ids[i * per_request : (i + 1) * per_request] for i in range(CHUNK)]
        c += 1
    warm = {"chunks": c, "seconds": time.monotonic() - start, "distinct_rows": int(seen.sum())}
    warm["steady"] = bool(seen.sum() >= 2 * capacity)
    warm_len = sum(len(d) for d in distinct_trace)
    ts.reset_tier_stats()
    first, latencies, busy = c, [], 0.0
    start = time.monotonic()
    while (time.monotonic() - start < spec["window_s"] or c == first) and c < first + 10_000:
        ids, offsets, bounds = trace.chunk(c)
        t0 = time.perf_counter()
        latencies.append(ts.run_requests("t0", ids, offsets, bounds))
        busy += time.perf_counter() - t0
        distinct_trace += distinct_per_request(ids, bounds, trace.rows)
        c += 1
    stats = ts.tier_stats()
    lat = np.concatenate(latencies)
    rows_per_s = stats["ids"] / busy
    # Open loop at half the tier's rate, on the next requests.
    interval = 2 * busy / len(lat) * 1e6
    ids, offsets, bounds = trace.chunk(c)
    paced = ts.run_requests("t0", ids, offsets, bounds, interval_us=interval)
    keys = np.concatenate(distinct_trace)
    belady = native.belady_hit_rate(keys, capacity, warm_len)
    used = stats["rows"] * ROW_BYTES
    return {
        "rows_per_s": rows_per_s,
        "row_hit_rate": stats["row_hit_rate"],
        "pooled_hit_rate": stats["pooled_hit_rate"],
        "belady_hit_rate": belady,
        "p99_us": float(np.percentile(paced, 99)),
        "closed_loop_p99_us": float(np.percentile(lat, 99)),
        "read_amplification": stats["device_bytes"] / max(used, 1),
        "miss_reads_per_s": stats["device_reads"] / busy,
        "capacity_rows": capacity,
        "warm": warm,
        "window": [first, c],
        "paced_interval_us": interval,
        "requests": len(lat),
        "io": stats["io"],
        "reuse_histogram": reuse_histogram(hist_sample) if trace.kind == "meta" else None,
    }


def _dram_run(native, trace: Trace, spec: dict, window: list[int], interval: float) -> dict:
    """All rows in DRAM: the first DRAM_ROWS rows of the table copied into memory (resident,
    huge pages) and the window's ids folded into them. A table far larger than the last-level
    cache runs at DRAM's random-access rate whatever its size, and a full copy of the table
    would not fit beside the rest of a shared machine."""
    rows = min(trace.rows, DRAM_BYTES // ROW_BYTES)
    ts = native.TableSet.open(
        str(Path(spec["table"]).parent.parent),
        rows=(0, rows),
        threads=spec["threads"],
        resident=True,
    )
    busy, count, start = 0.0, 0, time.monotonic()
    for c in range(*window):
        ids, offsets, bounds = trace.chunk(c)
        ids %= rows
        t0 = time.perf_counter()
        ts.run_requests("t0", ids, offsets, bounds)
        busy += time.perf_counter() - t0
        count += len(ids)
        if time.monotonic() - start > spec["window_s"]:
            break
    ids, offsets, bounds = trace.chunk(window[1])
    paced = ts.run_requests("t0", ids % rows, offsets, bounds, interval_us=interval)
    return {"rows_per_s": count / busy, "p99_us": float(np.percentile(paced, 99)), "rows": rows}


def _capped_mmap(spec: dict, window: list[int]) -> dict:
    """The table memory-mapped in a child process whose memory cgroup caps it at the budget."""
    child = dict(spec, window=window)
    proc = subprocess.run(
        [sys.executable, "-m", "cleave.cli", "bench", "tier", "--child", json.dumps(child)],
        capture_output=True,
        text=True,
        timeout=spec["warm_s"] + 10 * spec["window_s"] + 300,
    )
    if proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip()[-500:]
        return {"error": f"exit code {proc.returncode}: {why or '(no output: killed?)'}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cgroup_dir() -> Path | None:
    """This process's memory cgroup (v1), where a child cgroup can be made."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    return None


def _child(spec: dict) -> int:
    """Runs in the child: sets up, joins a memory cgroup capped at the budget, then warms up
    and measures the tier's window, memory-mapped. Prints one JSON line."""
    from cleave import _native

    trace = Trace(spec["trace"][0], spec["trace"][1], spec["rows"], spec["trace"][2])
    ts = _native.TableSet.open(str(Path(spec["table"]).parent.parent), threads=spec["threads"])
    first, end = spec["window"]
    # Warm up on the chunks just before the window: enough for twice the cap in distinct pages.
    pages_cap = spec["budget"] // PAGE
    begin, pages = first, set()
    while begin > 0 and len(pages) < 2 * pages_cap:
        begin -= 1
        ids, _, _ = trace.chunk(begin)
        pages.update(np.unique(ids * ROW_BYTES // PAGE).tolist())
    # Every request is built before joining the cgroup: memory allocated before is not charged
    # to it, so the cap is spent on the page cache, as the tier's budget is on its caches.
    warm = [trace.chunk(c) for c in range(begin, first)]
    window = [trace.chunk(c) for c in range(first, end)]
    base = _cgroup_dir()
    if base is None:
        raise SystemExit("no memory cgroup (v1) for this process")
    group = base / f"cleave-bench-tier-{os.getpid()}"
    group.mkdir()
    try:
        # Memory allocated from now on, page cache included, is charged to `group`.
        # The budget plus a little for the interpreter's own allocations while it measures.
        (group / "memory.limit_in_bytes").write_text(str(spec["budget"] + CHILD_SLACK))
        (group / "cgroup.procs").write_text(str(os.getpid()))
        start = time.monotonic()
        for chunk in warm:
            if time.monotonic() - start > spec["warm_s"]:
                break
            ts.run_requests("t0", *chunk)
        read_before = _read_bytes()
        busy, count, used, start = 0.0, 0, 0, time.monotonic()
        for ids, offsets, bounds in window:
            t0 = time.perf_counter()
            ts.run_requests("t0", ids, offsets, bounds)
            busy += time.perf_counter() - t0
            count += len(ids)
            used += sum(len(d) for d in distinct_per_request(ids, bounds, trace.rows))
            if time.monotonic() - start > spec["window_s"]:
                break
        device = _read_bytes() - read_before
        peak = int((group / "memory.max_usage_in_bytes").read_text())
    finally:
        parent = group.parent / "cgroup.procs"
        parent.write_text(str(os.getpid()))
        group.rmdir()
    out = {"rows_per_s": count / busy, "read_amplification": device / max(used * ROW_BYTES, 1)}
    out |= {"cgroup_peak_bytes": peak, "warm_chunks": first - begin, "device_bytes": device}
    print(json.dumps(out))
    return 0


def _read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _print_case(case: dict, detail: dict) -> None:
    def f(v, spec=".3g"):
        return "n/a" if v is None else format(v, spec)

    print(
        f"{case['name']:>10}: tier {f(case['tier_rows_per_s'])} rows/s "
        f"(DRAM {f(case['dram_rows_per_s'])}, capped mmap {f(case['mmap_capped_rows_per_s'])}); "
        f"row hit {f(case['row_cache_hit_rate'])} (Belady {f(case['belady_hit_rate'])}; "
        f"SDM reports 0.96), pooled hit {f(case['pooled_cache_hit_rate'])}; p99 "
        f"{f(case['p99_us'])} us vs DRAM {f(case['dram_p99_us'])} us at half rate; read amp "
        f"{f(case['read_amplification'])} vs mmap {f(case['mmap_read_amplification'])}; "
        f"device {f(case['device_read_iops'])} reads/s; io {detail['io']}; "
        f"warm-up steady={detail['warm']['steady']}",
        flush=True,
    )
    if detail.get("reuse_histogram"):
        print("  reuse histogram (share of distinct ids by in-request count): generated vs Meta")
        for (lo, hi), got, want in zip(
            META_BUCKETS, detail["reuse_histogram"], META_SHARES, strict=True
        ):
            print(f"    ({lo:>4}, {hi:>4}]: {got:.3f}  {want:.3f}")
    if "error" in detail["capped"]:
        print(f"  capped mmap baseline failed: {detail['capped']['error']}")
