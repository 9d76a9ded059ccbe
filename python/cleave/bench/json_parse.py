"""`cleave bench json-parse`: what the router's CPU spends parsing KServe v2 JSON requests, its
scanner for the `data` arrays (crates/cleave-router/src/codec/json_scan.rs, the request path)
against serde_json's deserializer that it replaced (the same-run reference), on reference
models' requests at each candidate count. In-process through the native module, interleaved
rounds, medians: whole requests as the router parses them (`parse_infer`), and their `data`
arrays alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from cleave.bench.harness.command import counts
from cleave.bench.harness.summary import write_json
from cleave.bench.harness.workload import Workload
from cleave.bench.machine import describe
from cleave.errors import UsageError

PARSERS = ("serde", "scan")  # the reference first
PARTS = ("request", "data")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="dcn,dlrm", help="reference models, by commas")
    parser.add_argument("--scale", type=float, help="table scale (default: each model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--candidates", default="100,2048", help="rows per request, by commas")
    parser.add_argument("--requests", type=int, default=4, help="distinct requests per case")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; median kept")
    parser.add_argument("--seconds", type=float, default=0.2, help="per parser, part and round")
    parser.add_argument("--workdir", default="out/bench-json-parse", help="where bundles go")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="a smoke run (tests, CI)")
    # What the workload reads that this command does not vary.
    parser.set_defaults(bundle=None, alpha=1.05, budget_ms=25.0)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.rounds, args.seconds, args.requests = 1, 0.01, 1
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models:
        raise UsageError(f"--models: expected names separated by commas, got {args.models!r}")
    sizes = counts(args.candidates, "--candidates")
    if args.rounds < 1 or args.seconds <= 0 or args.requests < 1:
        raise UsageError("--rounds, --seconds and --requests must be positive")
    result = {
        "benchmark": "json-parse",
        "machine": describe(),
        "load_average": os.getloadavg(),
        "parsers": list(PARSERS),
        "cases": [],
        "ratios": {},
    }
    for model in models:
        bundle = None  # the first count's bundle serves the others
        for count in sizes:
            workload = Workload(
                argparse.Namespace(**{**vars(args), "model": model, "candidates": count})
            )
            args.bundle = bundle = bundle or str(workload.bundle_dir)
            case = _measure(workload, model, count, args)
            result["cases"].append(case)
            for part in PARTS:
                result["ratios"][f"{model}_{count}_{part}"] = case["ratios"][part]
        args.bundle = None
    result["load_average"] = [result["load_average"], os.getloadavg()]
    print_table(result)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _jobs(workload: Workload) -> dict:
    """Per part, the calls that parse every request once: (function, its arguments but the
    parser) and the bytes parsed."""
    from cleave._native import time_json_data, time_json_request

    requests, data = [], []
    for body in workload.bodies:
        requests.append((time_json_request, (str(workload.bundle_dir), body)))
        for tensor in json.loads(body)["inputs"]:
            text = json.dumps(tensor["data"])  # as json.dumps wrote it into the body
            data.append((time_json_data, (text, tensor["datatype"], tensor["shape"])))
    sizes = {
        "request": sum(len(body) for body in workload.bodies),
        "data": sum(len(a[0]) for _, a in data),
    }
    return {"request": (requests, sizes["request"]), "data": (data, sizes["data"])}


def _measure(workload: Workload, model: str, count: int, args) -> dict:
    """Each parser over every request, in interleaved rounds of about --seconds each: bytes
    parsed per second, CPU per request, and the scanner's rate over the reference's."""
    jobs = _jobs(workload)
    requests = len(workload.bodies)
    case = {"model": model, "candidates": count, "requests": requests, "parsers": {}}
    case["bytes_per_request"] = {part: jobs[part][1] / requests for part in PARTS}
    rates: dict = {p: {part: [] for part in PARTS} for p in PARSERS}
    for part in PARTS:
        calls, size = jobs[part]
        for fn, call in calls:  # both parsers give the same bytes, or the run stops
            if fn(*call, "scan", 1)[1] != fn(*call, "serde", 1)[1]:
                raise RuntimeError(f"the parsers disagree on a {model} {part} of {count} rows")
        once = sum(fn(*call, "serde", 1)[0] for fn, call in calls)
        repeat = max(1, int(args.seconds / max(once, 1e-6)))
        for _ in range(args.rounds):
            for p in PARSERS:
                seconds = sum(fn(*call, p, repeat)[0] for fn, call in calls)
                rates[p][part].append(size * repeat / seconds)
    for p in PARSERS:
        row = case["parsers"][p] = {}
        for part in PARTS:
            rate = statistics.median(rates[p][part])
            row[part] = {
                "mb_per_s": rate / 1e6,
                "us_per_request": case["bytes_per_request"][part] / rate * 1e6,
                "rounds_mb_per_s": [r / 1e6 for r in rates[p][part]],
            }
    case["ratios"] = {
        part: case["parsers"]["scan"][part]["mb_per_s"]
        / max(case["parsers"]["serde"][part]["mb_per_s"], 1e-12)
        for part in PARTS
    }
    return case


def print_table(result: dict) -> None:
    head = f"{'model':>6} {'candidates':>10} {'part':>8} {'KB/request':>10}"
    print(head + "".join(f" {p + ' MB/s':>11} {p + ' us':>10}" for p in PARSERS) + "  scan/serde")
    for case in result["cases"]:
        for part in PARTS:
            line = (
                f"{case['model']:>6} {case['candidates']:>10} {part:>8} "
                f"{case['bytes_per_request'][part] / 1e3:>10.1f}"
            )
            for p in PARSERS:
                row = case["parsers"][p][part]
                line += f" {row['mb_per_s']:>11.1f} {row['us_per_request']:>10.1f}"
            print(f"{line}  {case['ratios'][part]:>9.2f}x")
    load = ", ".join(f"{a:.2f}" for a in result["load_average"][0])
    print(f"{result['machine'].get('cpu', '')}; load average at the start {load}")
