"""`cleave bench idle-gap`: what an idle gap before a request costs the dense program. A ranker
at a low request rate runs each request after a gap of milliseconds; this times one request's
dense program (each dtype the bundle approves, one torch thread) called back to back (the
same-run reference) and after each gap, the thread sleeping through it or spinning, so that
per-request CPU at low rates can be told apart from the program's own cost (docs/benchmarks.md,
"The ranker's batch, taken apart"). In one process: no sockets, no other role.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from cleave.bench.harness.command import in_workdir, positives, report
from cleave.bench.machine import describe
from cleave.errors import UsageError

MODES = ("sleep", "spin")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="dlrm", help="a reference model")
    parser.add_argument("--scale", type=float, help="table scale (default: the model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bundle", help="a bundle of --model (default: partitioned here)")
    parser.add_argument("--candidates", type=int, default=100, help="rows per request")
    parser.add_argument("--gaps", default="1,3,10", help="idle gaps before a call, ms, by commas")
    parser.add_argument("--calls", type=int, default=100, help="calls per gap, mode and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; median kept")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--workdir", help="where the bundle goes (default: a temporary one)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="a smoke run (tests, CI)")
    # What the workload reads that this command does not vary (None: every dtype approved).
    parser.set_defaults(alpha=1.05, budget_ms=25.0, requests=1, dense_dtype=None)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.calls, args.rounds = 5, 1
    gaps = positives(args.gaps, "--gaps")
    if min(args.candidates, args.calls, args.rounds, args.threads) < 1:
        raise UsageError(
            "--candidates, --calls, --rounds and --threads must be at least 1, got "
            f"{args.candidates}, {args.calls}, {args.rounds}, {args.threads}"
        )

    def measure(workdir) -> dict:
        args.workdir = str(workdir)
        return _measure(args, [0.0, *gaps])

    report(in_workdir(args, "idle-gap", measure), args, print_table)
    return 0


def _measure(args, gaps: list[float]) -> dict:
    import torch

    from cleave.bench.harness.workload import Workload

    workload = Workload(args, roofline=False)
    bundle = workload.bundle
    dense_args = bundle.dense_inputs(*workload.inputs[0])
    programs = {d: bundle.dense_module(d) for d in workload.served_dtypes}
    torch.set_num_threads(args.threads)
    result = {
        "benchmark": "idle-gap",
        "machine": describe(),
        "load_average": [os.getloadavg()],
        "model": args.model,
        "candidates": args.candidates,
        "threads": args.threads,
        "calls": args.calls,
        "rounds": args.rounds,
        "dtypes": {},
    }
    cases = [(g, m) for g in gaps for m in (MODES[:1] if g == 0 else MODES)]
    seen: dict = {(d, g, m): [] for d in programs for g, m in cases}
    with torch.inference_mode():
        for program in programs.values():
            for _ in range(20):  # first calls are slow
                program(*dense_args)
        for _ in range(args.rounds):
            for dtype, program in programs.items():
                for gap, mode in cases:
                    took = _calls(program, dense_args, gap, mode, args.calls)
                    seen[dtype, gap, mode].append(took)
    for dtype in programs:
        rows = result["dtypes"][dtype] = []
        for gap, mode in cases:
            wall = statistics.median(r[0] for r in seen[dtype, gap, mode])
            cpu = statistics.median(r[1] for r in seen[dtype, gap, mode])
            rows.append({"gap_ms": gap, "mode": mode, "call_ms": wall, "cpu_ms": cpu})
        reference = rows[0]["call_ms"]
        for row in rows:
            row["ratio"] = row["call_ms"] / max(reference, 1e-9)
    result["load_average"].append(os.getloadavg())
    return result


def _calls(program, dense_args, gap_ms: float, mode: str, calls: int) -> tuple[float, float]:
    """(median ms per call, mean thread CPU ms per call) of `calls` calls, each after `gap_ms`
    slept or spun."""
    took, cpu = [], 0.0
    gap = gap_ms / 1e3
    for _ in range(calls):
        if mode == "sleep":
            time.sleep(gap)
        else:
            until = time.perf_counter() + gap
            while time.perf_counter() < until:
                pass
        c0, t0 = time.thread_time(), time.perf_counter()
        program(*dense_args)
        took.append(time.perf_counter() - t0)
        cpu += time.thread_time() - c0
    return statistics.median(took) * 1e3, cpu / calls * 1e3


def print_table(result: dict) -> None:
    print(
        f"{result['model']}, {result['candidates']} rows per call, {result['threads']} torch "
        f"thread(s): the dense program after an idle gap, against back to back (gap 0)"
    )
    print(f"{'dtype':>9} {'gap ms':>7} {'mode':>6} {'call ms':>8} {'cpu ms':>7} {'vs gap 0':>8}")
    for dtype, rows in result["dtypes"].items():
        for r in rows:
            print(
                f"{dtype:>9} {r['gap_ms']:>7g} {r['mode']:>6} {r['call_ms']:>8.3f} "
                f"{r['cpu_ms']:>7.3f} {r['ratio']:>7.2f}x"
            )
    load = ", ".join(f"{a:.2f}" for a in result["load_average"][0])
    print(f"{result['machine'].get('cpu', '')}; load average at the start {load}")
