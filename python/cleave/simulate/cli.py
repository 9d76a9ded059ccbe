"""`cleave simulate --trace TRACE.csv --nodes NODES.csv` replays a trace of instance arrivals
and departures under monolithic and disaggregated deployment and capacity loaning;
`cleave simulate --load LOAD.csv --cn-rps X --hn-rps Y` prints scaling signals
(docs/simulate.md)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from cleave.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", help="instance trace CSV (Alibaba cluster-trace-gpu-v2025)")
    parser.add_argument("--nodes", help="node list CSV (sn, cpu_milli, memory_mib, gpu, model)")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    parser.add_argument(
        "--cluster-scale",
        default="auto",
        help="auto (peak at about 90%% allocation) or F: each host type's count times F",
    )
    parser.add_argument(
        "--loan-percentile",
        type=float,
        default=50.0,
        help="percentile of the HN load the dedicated GPU pool is sized for (default 50)",
    )
    parser.add_argument("--plot", metavar="DIR", help="write PNG plots over time to DIR")
    parser.add_argument(
        "--like-for-like",
        action="store_true",
        help="only apps whose every monolithic instance fits some host type",
    )
    signals = parser.add_argument_group("scaling signals (instead of --trace/--nodes)")
    signals.add_argument("--load", help="load trace CSV: time_s,requests_per_s")
    signals.add_argument("--cn-rps", type=float, help="requests/s one CN instance serves")
    signals.add_argument("--hn-rps", type=float, help="requests/s one HN instance serves")
    signals.add_argument("--window", type=float, default=300.0, help="window in seconds")
    signals.add_argument("--headroom", type=float, default=0.8, help="target utilisation")


def _scale(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--cluster-scale: expected auto or a number > 0, got {text!r}") from None
    if not value > 0 or value > 1000:
        raise UsageError(f"--cluster-scale: expected auto or 0 < F <= 1000, got {text!r}")
    return value


def _write_json(path: str, doc: dict) -> None:
    out = Path(path)
    if not out.parent.is_dir():
        raise UsageError(f"--json {out}: directory {out.parent} does not exist")
    out.write_text(json.dumps(doc, indent=2) + "\n")


def _signals(args: argparse.Namespace) -> int:
    from cleave.simulate.scaling import load_load, scaling_signals

    if args.trace or args.nodes:
        raise UsageError("--load computes scaling signals; it takes no --trace or --nodes")
    if args.cn_rps is None or args.hn_rps is None:
        raise UsageError("--load needs --cn-rps and --hn-rps: what one instance of each serves")
    windows = scaling_signals(
        load_load(args.load), args.window, args.cn_rps, args.hn_rps, args.headroom
    )
    print(f"{'window start (s)':>16}  {'peak req/s':>12}  {'CN':>6}  {'HN':>6}")
    for w in windows:
        print(f"{w.start_s:>16g}  {w.peak_rps:>12g}  {w.cn:>6}  {w.hn:>6}")
    if args.json:
        _write_json(args.json, {"windows": [asdict(w) for w in windows]})
    return 0


def run(args: argparse.Namespace) -> int:
    if args.load:
        return _signals(args)
    if not args.trace or not args.nodes:
        raise UsageError("expected --trace TRACE.csv and --nodes NODES.csv (or --load LOAD.csv)")
    from cleave.simulate.capacity import run_study
    from cleave.simulate.nodes import load_nodes
    from cleave.simulate.report import plots, table, to_json
    from cleave.simulate.trace import load_trace

    scale = _scale(args.cluster_scale)
    if args.json and Path(args.json).is_dir():
        raise UsageError(f"--json {args.json}: is a directory; expected a file name")
    types = load_nodes(args.nodes)
    trace = load_trace(args.trace)
    study = run_study(trace, types, scale, args.loan_percentile, args.like_for_like)
    doc = to_json(study)
    print(table(doc))
    if args.json:
        _write_json(args.json, doc)
        print(f"cleave simulate: wrote {args.json}", file=sys.stderr)
    if args.plot:
        for path in plots(study, Path(args.plot)):
            print(f"cleave simulate: wrote {path}", file=sys.stderr)
    return 0
