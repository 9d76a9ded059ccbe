"""`cleave bench front-door`: what one request costs at the router's front door in KServe v2
JSON against binary tensors (what tritonclient sends): the same model, the same requests, one
offered rate for --duration seconds on each, one disaggregated deployment per protocol started
in turn; same-run ratios of binary over JSON (p50, p99, router CPU in parsing and encoding).
"""

from __future__ import annotations

import argparse
import sys

from cleave.bench.harness.measurement import measure
from cleave.bench.harness.summary import (
    Ratio,
    codec_cpu_us,
    new_result,
    print_table,
    ratio,
    same_run_ratios,
    write_json,
)
from cleave.bench.harness.target import Target
from cleave.bench.harness.workload import Workload
from cleave.errors import UsageError

PROTOCOLS = ["json", "binary"]


def _at_rate(key: str):
    """A latency of a deployment's one probe."""
    return lambda of, to: ratio(of["rates"][0][key], to["rates"][0][key])


RATIOS = (
    Ratio("p50_binary_over_json", "binary", "json", _at_rate("p50_ms")),
    Ratio("p99_binary_over_json", "binary", "json", _at_rate("p99_ms")),
    Ratio(
        "codec_cpu_binary_over_json",
        "binary",
        "json",
        lambda of, to: ratio(codec_cpu_us(of, "binary"), codec_cpu_us(to, "json")),
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="dlrm", help="reference model (cleave.models.MODELS)")
    parser.add_argument("--scale", type=float, help="table scale (default: the model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="out/bench-front-door", help="where bundles go")
    parser.add_argument("--rate", type=float, default=50.0, help="offered load, requests/s")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per protocol")
    parser.add_argument("--candidates", type=int, default=100, help="rows per request")
    parser.add_argument("--budget-ms", type=float, default=25.0, help="latency budget (SLO)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="a smoke run (tests, CI)")
    # What the harness reads that this command does not vary.
    parser.set_defaults(bundle=None, alpha=1.05, requests=16, single=20, shards=1, rankers=1)
    parser.set_defaults(search=False, check=False, max_error_pct=0.0, protocols=PROTOCOLS)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.duration, args.rate, args.single = 1.0, 20.0, 5
    if args.rate <= 0 or args.duration <= 0 or args.candidates < 1:
        raise UsageError("--rate, --duration and --candidates must be positive")
    args.rate_list = [args.rate]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    workload = Workload(args)
    result = new_result(args, workload)
    result["benchmark"] = "front-door"
    flags = ["--shards", "1", "--rankers", "1"]
    for protocol in PROTOCOLS:
        log(f"{protocol}:")
        with Target(workload.bundle_dir, flags, protocol=protocol) as target:
            result["deployments"][protocol] = measure(target, workload, args, log)
    result["ratios"] = same_run_ratios(result["deployments"], RATIOS)
    print_table(result)
    if args.json:
        write_json(result, args.json)
        log(f"wrote {args.json}")
    return 0
