"""`cleave profile BUNDLE -o PROFILE.json`: what one request of the bundle costs on the machine
at hand, measured (docs/sizing.md, "The profile"):

* the shard: a real `cleave-shard` process on one thread, sent request-shaped lookups over
  loopback; its CPU time per request at two request sizes gives the cost of a call and of an
  id (`shard.call_us`, `shard.ns_per_id`), and each table's own ns per id is timed in-process;
* the dense program: ms per batch for each dtype the bundle approves, thread count and batch
  size; on a GPU machine also per batch on the GPU, as the ranker serves it there (CUDA
  graphs, the inputs copied in and the scores out);
* bytes per candidate each way, from the bundle's signature and probe batch;
* the hit rate of a cache of the hottest rows under the profile's Zipf traffic.

The profile names its bundle by the SHA-256 of its manifest, so `cleave size` refuses one
measured on another bundle."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

from cleave.errors import UsageError

FORMAT, VERSION = "cleave-profile", 1
BATCHES = (1, 4, 16, 64, 256)
QUICK_BATCHES = (1, 16, 64)
CACHE_FRACTIONS = (0.001, 0.01, 0.05, 0.1, 0.2, 0.5)
SHARD_READY_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="bundle directory")
    parser.add_argument("-o", "--output", required=True, help="profile JSON to write")
    parser.add_argument("--candidates", type=int, default=100, help="rows per request")
    parser.add_argument(
        "--ids-per-candidate",
        type=float,
        default=1.0,
        help="ids each feature looks up per candidate (pooling factor); default 1",
    )
    parser.add_argument("--alpha", type=float, default=1.05, help="Zipf skew of the ids")
    parser.add_argument("--threads", default=None, help="dense thread counts, e.g. 1,4")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="also time the dense program on the GPU (auto: when one is present)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer batch sizes, shorter runs")
    parser.add_argument(
        "--no-serve",
        action="store_true",
        help="do not serve the bundle to time the router (cleave size then estimates it)",
    )
    parser.add_argument(
        "--capped",
        metavar="CATALOG",
        help="also serve the bundle on testbed hosts of each kind of this testbed catalog and "
        "measure what each role spends per request there (docs/sizing.md, 'Capped hosts')",
    )
    parser.add_argument(
        "--p99-ms",
        type=float,
        default=None,
        help="with --capped: the p99 target of the plans you will size (their routers' budget "
        "follows it, and the capped runs serve as they will; default 500)",
    )


def run(args: argparse.Namespace) -> int:
    if args.candidates < 1 or not args.ids_per_candidate > 0 or not args.alpha > 0:
        raise UsageError(
            f"--candidates, --ids-per-candidate and --alpha must be positive, got "
            f"{args.candidates}, {args.ids_per_candidate}, {args.alpha}"
        )
    cores = len(os.sched_getaffinity(0))
    threads = _thread_counts(args.threads, cores)
    if args.p99_ms is not None and (not args.capped or not args.p99_ms > 0):
        raise UsageError(
            f"--p99-ms: expected a positive target in ms, with --capped; got {args.p99_ms} "
            f"{'with' if args.capped else 'without'} --capped"
        )
    if args.capped:  # a capped host's ranker runs one thread: its factor is over that
        from cleave.sizing.capped import testbed_kinds

        testbed_kinds(args.capped)  # a bad catalog is refused before the measurements
        threads = sorted({1, *threads})
    profile = measure(
        Path(args.bundle),
        candidates=args.candidates,
        ids_per_candidate=args.ids_per_candidate,
        alpha=args.alpha,
        threads=threads,
        quick=args.quick,
        serve=not args.no_serve,
        gpu=_gpu_asked(args.device),
        capped=args.capped,
        capped_p99_ms=args.p99_ms,
    )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(profile, indent=1) + "\n")
    tmp.replace(out)
    print_summary(profile)
    print(f"cleave profile: wrote {out}")
    return 0


def fingerprint(bundle_dir: Path) -> str:
    """The bundle a profile belongs to: its manifest's SHA-256 (it names every table's bytes)."""
    from cleave.bundle import manifest as manifest_io

    manifest_io.read(bundle_dir, whole=False)  # a clear error for a directory that is no bundle
    return hashlib.sha256((bundle_dir / manifest_io.MANIFEST).read_bytes()).hexdigest()


def measure(
    bundle_dir: Path,
    candidates: int,
    ids_per_candidate: float,
    alpha: float,
    threads: list[int],
    quick: bool,
    serve: bool = True,
    gpu: bool = False,
    capped: str | None = None,
    capped_p99_ms: float | None = None,
    log=print,
) -> dict:
    from cleave.bundle import manifest as manifest_io

    started = time.monotonic()
    manifest = manifest_io.read(bundle_dir)
    rng = np.random.default_rng(0)
    traffic = {"candidates": candidates, "ids_per_candidate": ids_per_candidate, "alpha": alpha}
    features = _features(manifest)
    profile = {
        "format": FORMAT,
        "version": VERSION,
        "bundle": {"path": str(bundle_dir.resolve()), "fingerprint": fingerprint(bundle_dir)},
        "machine": this_machine(),
        "traffic": traffic,
        "tables": _tables(bundle_dir, manifest, features, ids_per_candidate, alpha, rng),
        "shard": _shard(bundle_dir, features, candidates, ids_per_candidate, alpha, quick, rng),
        "dense": _dense(bundle_dir, threads, QUICK_BATCHES if quick else BATCHES, quick),
        **({"cuda": _dense_cuda(bundle_dir, QUICK_BATCHES if quick else BATCHES)} if gpu else {}),
        "bytes_per_candidate": _bytes(bundle_dir, manifest, features, ids_per_candidate),
        "cache": _cache_curve(features, ids_per_candidate, alpha),
        "router": _router(bundle_dir, manifest, traffic, quick, rng)
        if serve
        else _unmeasured("not asked (--no-serve)"),
    }
    if capped:
        from cleave.sizing.capped import measure_capped

        profile["capped"] = measure_capped(bundle_dir, profile, capped, quick, log, capped_p99_ms)
    profile["seconds"] = round(time.monotonic() - started, 1)
    return profile


def this_machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(memory / (1 << 30), 1),
    }


def _thread_counts(text: str | None, cores: int) -> list[int]:
    if text is None:
        return sorted({1, cores})
    try:
        counts = sorted({int(t) for t in text.split(",")})
    except ValueError:
        raise UsageError(f"--threads: expected counts like 1,4, got {text!r}") from None
    if not counts or counts[0] < 1:
        raise UsageError(f"--threads: expected counts of at least 1, got {text!r}")
    return counts


def _features(manifest: dict) -> list[dict]:
    """Each feature's table facts: rows, dim, row bytes, pooled or gathered."""
    tables = {t["name"]: t for t in manifest["tables"]}
    out = []
    for f in manifest["features"]:
        t = tables[f["table"]]
        out.append(
            {
                "table": t["name"],
                "rows": int(t["rows"]),
                "dim": int(t["dim"]),
                "row_bytes": int(t["row_bytes"]),
                # Gathered rows: no pooling ("none" in the manifest, or absent).
                "pooling": None if f.get("pooling") in (None, "none") else f["pooling"],
                "weighted": bool(f.get("weights")),
            }
        )
    return out


def _ids(rng, rows: int, count: int, alpha: float) -> np.ndarray:
    from cleave.bench.tier import scatter, zipf_ranks

    return scatter(zipf_ranks(rng, alpha, rows, count), rows)


def _tables(bundle_dir, manifest, features, ids_per_candidate, alpha, rng) -> dict:
    """Each table's pooled-lookup ns per id on one thread, in-process (the shard's engine)."""
    from cleave._native import TableSet

    tables = TableSet.open(bundle_dir, threads=1)
    k = max(1, round(ids_per_candidate))
    out = {}
    for t in manifest["tables"]:
        name, rows = t["name"], int(t["rows"])
        ids = _ids(rng, rows, 4096 * k, alpha)
        offsets = np.arange(0, len(ids) + 1, k, dtype=np.uint32)
        best = math.inf
        for _ in range(5):
            start = time.perf_counter()
            tables.pool(name, ids, offsets)
            best = min(best, time.perf_counter() - start)
        out[name] = {
            "rows": rows,
            "dim": int(t["dim"]),
            "dtype": t["dtype"],
            "bytes": rows * int(t["row_bytes"]),
            "ns_per_id": round(best * 1e9 / len(ids), 2),
            "features": sum(1 for f in features if f["table"] == name),
        }
    return out


def _lookups(features, candidates: int, ids_per_candidate: float, alpha: float, rng) -> list:
    """One request's lookups, as the router sends them: every feature, `candidates` bags."""
    k = max(1, round(ids_per_candidate))
    batch = []
    for f in features:
        ids = _ids(rng, f["rows"], candidates * k, alpha)
        if f["pooling"] is None:
            batch.append((f["table"], "none", ids, None))
            continue
        offsets = np.arange(0, len(ids) + 1, k, dtype=np.int64)
        pooling = "sum" if f["weighted"] else f["pooling"]
        weights = np.ones(len(ids), dtype=np.float32) if f["weighted"] else None
        lookup = (f["table"], pooling, ids, offsets)
        batch.append((*lookup, weights) if weights is not None else lookup)
    return batch


def _shard(bundle_dir, features, candidates, ids_per_candidate, alpha, quick, rng) -> dict:
    """A real shard on one thread: CPU seconds per request at two request sizes, fitted to
    call_us + ids * ns_per_id; the larger size's median latency over loopback."""
    from cleave._native import ShardClient
    from cleave.bench.harness.processes import cpu_seconds
    from cleave.launch.supervisor import find_executable

    shard = subprocess.Popen(
        [find_executable("cleave-shard"), "--bundle", str(bundle_dir)]
        + ["--listen", "127.0.0.1:0", "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        address = _ready_address(shard)
        routes = [(f["table"], 0, f["rows"], address) for f in _distinct(features)]
        client = ShardClient(routes, timeout_s=10.0, connect_timeout_s=5.0, connections=1)
        client.ready()
        seconds = 0.3 if quick else 1.0
        points = []
        for size in sorted({max(1, candidates // 8), candidates}):
            batches = [_lookups(features, size, ids_per_candidate, alpha, rng) for _ in range(8)]
            ids = np.mean([sum(len(b[2]) for b in batch) for batch in batches])
            client.lookup(batches[0])  # connected, pages touched
            before, start, latencies = cpu_seconds(shard.pid), time.perf_counter(), []
            n = 0
            while (n < 20 or time.perf_counter() - start < seconds) and n < 100_000:
                t0 = time.perf_counter()
                client.lookup(batches[n % len(batches)])
                latencies.append(time.perf_counter() - t0)
                n += 1
            cpu = (cpu_seconds(shard.pid) or 0.0) - (before or 0.0)
            points.append((float(ids), cpu / n, float(np.median(latencies))))
    finally:
        shard.terminate()
        shard.wait(timeout=10)
    (ids_a, cpu_a, _), (ids_b, cpu_b, p50_b) = points[0], points[-1]
    ns_per_id = (cpu_b - cpu_a) / (ids_b - ids_a) * 1e9 if ids_b > ids_a else cpu_b / ids_b * 1e9
    ns_per_id = max(ns_per_id, 0.0)
    call_us = max(cpu_b * 1e6 - ids_b * ns_per_id / 1e3, 0.0)
    return {
        "call_us": round(call_us, 2),
        "ns_per_id": round(ns_per_id, 2),
        "ids_per_request": round(ids_b, 1),
        "cpu_us_per_request": round(cpu_b * 1e6, 1),
        "p50_ms": round(p50_b * 1e3, 3),
    }


def _distinct(features: list[dict]) -> list[dict]:
    seen, out = set(), []
    for f in features:
        if f["table"] not in seen:
            seen.add(f["table"])
            out.append(f)
    return out


def _ready_address(proc: subprocess.Popen) -> str:
    """The address on the shard's `ready ADDRESS ...` line (it binds port 0 itself)."""
    deadline = time.monotonic() + SHARD_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("ready "):
            return line.split()[1]
    raise UsageError(
        f"cleave profile: the shard did not report ready within {SHARD_READY_TIMEOUT_S:g} s "
        f"(exit status {proc.poll()})"
    )


def _router(bundle_dir: Path, manifest: dict, traffic: dict, quick: bool, rng) -> dict:
    from cleave.sizing.router import Unsupported, measure_router, synthetic_inputs

    try:
        named = synthetic_inputs(manifest, traffic["candidates"], traffic["ids_per_candidate"], rng)
    except Unsupported as why:
        return _unmeasured(f"cannot synthesize its requests: {why}")
    return {"measured": True, **measure_router(bundle_dir, named, 1.0 if quick else 2.0)}


def _unmeasured(why: str) -> dict:
    return {"measured": False, "why": why}


def _dense(bundle_dir: Path, threads: list[int], batches, quick: bool) -> dict:
    """ms per batch: dtype -> threads -> batch rows -> median of timed runs."""
    import torch

    from cleave.bundle import load_bundle
    from cleave.bundle.manifest import served_dtypes
    from cleave.ranker.dense_dtype import probe_batch
    from cleave.ranker.signature import signature

    bundle = load_bundle(bundle_dir, verify=False, stored_graphs=True)  # as a ranker does
    sig = signature(bundle.manifest, False, False)
    runs = 3 if quick else 7
    out = {}
    before = torch.get_num_threads()
    try:
        for dtype in served_dtypes(bundle.manifest):
            module = bundle.dense_module(dtype)
            per_threads = {}
            for t in threads:
                torch.set_num_threads(t)
                per_batch = {}
                for rows in batches:
                    inputs = probe_batch(bundle, sig, rows, rows)
                    if inputs is None:
                        continue
                    inputs, got_rows = inputs
                    per_batch[str(got_rows)] = round(_time_ms(module, inputs, runs, t), 4)
                per_threads[str(t)] = per_batch
            out[dtype] = per_threads
    finally:
        torch.set_num_threads(before)
    return out


def _gpu_asked(device: str) -> bool:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch.cuda.is_available() is False on this machine")
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _dense_cuda(bundle_dir: Path, batches) -> dict:
    """The dense program on this machine's GPU, as a ranker there serves it (its executor:
    CUDA graphs per batch bucket, inputs copied in and scores out): ms per batch for each
    dtype the bundle approves that runs on a GPU (int8 is FBGEMM's, CPU only)."""
    import torch

    from cleave.bundle import load_bundle
    from cleave.bundle.manifest import served_dtypes
    from cleave.ranker.dense_dtype import probe_batch
    from cleave.ranker.executor import DenseExecutor
    from cleave.ranker.signature import signature

    bundle = load_bundle(bundle_dir, verify=False, stored_graphs=True)  # as a ranker does
    sig = signature(bundle.manifest, False, False)
    timings = {}
    inputs = [b for b in (probe_batch(bundle, sig, rows, rows) for rows in batches) if b]
    for dtype in (d for d in served_dtypes(bundle.manifest) if d != "int8"):
        module = bundle.dense_module(dtype)
        executor = DenseExecutor(
            module, sig, "cuda", max_batch=max((r for _, r in inputs), default=1)
        )
        executor.warm_up()  # captures every bucket's graph, as a ranker does before serving
        timings[dtype] = {str(r): round(_time_ms(executor.run, [b], 7), 4) for b, r in inputs}
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "memory_gib": round(props.total_memory / 2**30, 1), "dense": timings}


def _time_ms(module, inputs, runs: int, threads: int) -> float:
    """The median time of a call on `threads` CPU threads. Each call counts the lesser of its
    wall time and the process's CPU time over `threads`: another process taking the core
    stretches the wall clock and not the CPU time (the CPU time of `threads` busy threads is
    `threads` x the call's own), so a profile taken on a loaded machine still says what the
    program costs."""
    import torch

    with torch.inference_mode():
        module(*inputs)  # warm-up
        times = []
        for _ in range(runs):
            wall, cpu = time.perf_counter(), time.process_time()
            module(*inputs)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            times.append(min(wall, cpu / threads))
    return float(np.median(times)) * 1e3


def _bytes(bundle_dir: Path, manifest: dict, features, ids_per_candidate: float) -> dict:
    """Bytes per candidate on each hop: client -> router, router -> shards (ids and offsets),
    shards -> router (pooled rows or gathered rows), router -> ranker (the boundary), ranker ->
    router -> client (the outputs)."""
    import torch

    probe = (
        torch.load(bundle_dir / manifest["dense"]["probe"])
        if manifest["dense"].get("probe")
        else None
    )
    k = ids_per_candidate
    dense_in = 0.0
    for spec in manifest["inputs"]:
        if spec.get("role") == "dense":
            per_row = math.prod(d for d in spec["shape"][1:] if isinstance(d, int))
            dense_in += per_row * np.dtype(spec["dtype"]).itemsize
    ids_out = sum(k * 8 + (0 if f["pooling"] is None else 4) for f in features)
    rows_in = sum(f["dim"] * 4 * (k if f["pooling"] is None else 1) for f in features)
    rank, reply = rows_in + dense_in, 4.0
    if probe is not None:
        rows = max(1, int(probe["inputs"][0].shape[0]))
        rank = sum(t.numel() * t.element_size() for t in probe["inputs"]) / rows
        reply = sum(t.numel() * t.element_size() for t in probe["outputs"]) / rows
    return {
        "request": round(dense_in + ids_out, 1),
        "lookup_request": round(ids_out, 1),
        "lookup_reply": round(rows_in, 1),
        "rank": round(rank, 1),
        "reply": round(reply, 1),
    }


def _cache_curve(features, ids_per_candidate: float, alpha: float) -> dict:
    """Hit rate of a cache holding the hottest fraction of every table's rows, for ids drawn
    Zipf(alpha) per table (each feature weighted by the ids it looks up: all alike here)."""
    hits = []
    for fraction in CACHE_FRACTIONS:
        shares = [
            harmonic(int(fraction * f["rows"]), alpha) / harmonic(f["rows"], alpha)
            for f in features
        ]
        hits.append(round(float(np.mean(shares)), 4) if shares else 0.0)
    cached = [
        sum(int(fr * f["rows"]) * f["row_bytes"] for f in _distinct(features))
        for fr in CACHE_FRACTIONS
    ]
    return {"fractions": list(CACHE_FRACTIONS), "hit_rate": hits, "bytes": cached}


def harmonic(n: int, alpha: float, exact: int = 100_000) -> float:
    """sum(k^-alpha, k = 1..n): the first `exact` terms summed, the rest by the integral
    (midpoint rule), so a table of billions of rows costs no more than one of 100,000."""
    m = min(n, exact)
    head = float((np.arange(1, m + 1, dtype=np.float64) ** -alpha).sum()) if m else 0.0
    if n <= m:
        return head
    a, b = m + 0.5, n + 0.5
    if abs(alpha - 1.0) < 1e-9:
        return head + math.log(b / a)
    return head + (b ** (1 - alpha) - a ** (1 - alpha)) / (1 - alpha)


def load_profile(path: str | os.PathLike, bundle_dir: Path) -> dict:
    """A profile written by `cleave profile` for this bundle, else a UsageError saying why."""
    from cleave.plan.files import read_json

    profile = read_json(path, "--profile", "a profile JSON")
    if not isinstance(profile, dict) or profile.get("format") != FORMAT:
        raise UsageError(
            f"--profile {path}: expected format {FORMAT!r}, got "
            f"{profile.get('format') if isinstance(profile, dict) else profile!r}"
        )
    if profile.get("version") != VERSION:
        raise UsageError(
            f"--profile {path}: version {profile.get('version')!r}, this cleave reads {VERSION}"
        )
    want, got = fingerprint(bundle_dir), profile.get("bundle", {}).get("fingerprint")
    if got != want:
        raise UsageError(
            f"--profile {path} was measured on another bundle ({profile['bundle'].get('path')}, "
            f"manifest sha256 {str(got)[:12]}...), not on {bundle_dir} (sha256 {want[:12]}...): "
            f"run `cleave profile {bundle_dir} -o PROFILE.json`"
        )
    return profile


def print_summary(profile: dict) -> None:
    shard = profile["shard"]
    print(
        f"machine: {profile['machine']['cpu']}, {profile['machine']['cores']} cores; traffic: "
        f"{profile['traffic']['candidates']} candidates x "
        f"{profile['traffic']['ids_per_candidate']:g} ids per feature"
    )
    print(
        f"shard (1 thread): {shard['call_us']:.1f} us per call + {shard['ns_per_id']:.1f} ns "
        f"per id = {shard['cpu_us_per_request']:.0f} us CPU per request, "
        f"p50 {shard['p50_ms']:.3f} ms"
    )
    print(f"{'dtype':<9} {'threads':>7}  ms per batch (rows: ms)")
    for dtype, per_threads in profile["dense"].items():
        for t, per_batch in per_threads.items():
            cells = "  ".join(f"{rows}: {ms:.3f}" for rows, ms in per_batch.items())
            print(f"{dtype:<9} {t:>7}  {cells}")
    router = profile["router"]
    if router["measured"]:
        print(
            f"router: {router['cpu_us_per_request']:.0f} us CPU per request "
            f"({router['request_bytes']} B binary requests), p50 {router['p50_ms']:.3f} ms"
        )
    else:
        print(f"router: not measured: {router['why']}")
    for kind, c in profile.get("capped", {}).items():
        print(
            f"capped {kind} ({c['cores']:g} core): CPU per request over the profile's, "
            f"low load {c['low']['factor']}, saturated {c['saturated']['factor']} "
            f"(at {c['saturated_rate']}/s)"
        )
    b = profile["bytes_per_candidate"]
    print(
        f"bytes per candidate: request {b['request']:.0f}, to shards {b['lookup_request']:.0f}, "
        f"from shards {b['lookup_reply']:.0f}, to rankers {b['rank']:.0f}, reply {b['reply']:.0f}"
    )
