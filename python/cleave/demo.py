"""`cleave demo` (`make demo`): the whole path in about two minutes on a small machine.

Builds the Criteo-Kaggle-shaped DLRM (tables scaled to fit), partitions it into a bundle,
serves it disaggregated (`cleave serve`: embedding shards, a ranker, the router), drives
open-loop load at a few rates through the HTTP API, checks every score against the original
PyTorch model, and prints throughput, latency and the per-stage breakdown, with a plot.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

TOLERANCE = 1e-5  # max abs difference of any score from the original model's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="out/demo", help="where the bundle and results go")
    parser.add_argument("--scale", type=float, default=0.05, help="Criteo table size factor")
    parser.add_argument("--rates", default="20,50,100", help="offered loads, requests/s")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per rate")
    parser.add_argument("--candidates", type=int, default=100, help="items ranked per request")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--rankers", type=int, default=1)


def _as_outputs(scores) -> list[dict]:
    """The reference's output in the shape of a KServe response's `outputs`."""
    return [{"shape": list(scores.shape), "data": scores.reshape(-1).tolist()}]


def _stage_rank(stage: str) -> int:
    from cleave.bench.plot import STAGE_ORDER

    return STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER)


def run(args: argparse.Namespace) -> int:
    from cleave.bench import serve as bench
    from cleave.partitioner.cli import print_summary

    out = Path(args.out)
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    say(f"building the Criteo-Kaggle DLRM at scale {args.scale} and partitioning it")
    bench_args = argparse.Namespace(
        model="dlrm",
        scale=args.scale,
        seed=0,
        bundle=None,
        workdir=str(out),
        rates=args.rates,
        rate_list=[float(r) for r in args.rates.split(",")],
        duration=args.duration,
        budget_ms=25.0,
        max_error_pct=0.0,  # a rate is within budget only without errors, as in bench serve
        candidates=args.candidates,
        alpha=1.05,
        requests=64,
        single=100,
        search=False,
        shards=args.shards,
        rankers=args.rankers,
        config=None,
        check=True,
    )
    workload = bench.Workload(bench_args)
    print_summary(workload.bundle_dir, workload.bundle.summary())
    round_trip = max(
        workload.check(i, {"outputs": _as_outputs(workload.bundle.reference(*x))})
        for i, x in enumerate(workload.inputs)
    )
    say(
        f"round trip: bundle.reference equals the model on {len(workload.inputs)} requests "
        f"(max abs diff {round_trip:.2e})"
    )
    flags = ["--shards", str(args.shards), "--rankers", str(args.rankers)]
    say(f"starting cleave serve: {args.shards} shards, {args.rankers} ranker(s), router")
    with bench.Target(workload.bundle_dir, flags) as target:
        say(f"serving at {target.url}/v2/models/{workload.name}/infer")
        deployment = bench.measure(target, workload, bench_args, say)
    result = bench.new_result(bench_args, workload)
    result["deployments"]["disaggregated"] = deployment
    points = [deployment["single"], *deployment["rates"]]
    checked = sum(p["checked"] for p in points)
    worst = max((p["max_abs_diff"] for p in points if p["max_abs_diff"] is not None), default=None)
    errors: dict[str, int] = {}
    for p in points:
        for kind, n in p["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    # 504: the router gave up on a request whose 25 ms budget ran out (load shedding, not a
    # wrong answer). Anything else is a failure of the demo.
    failures = {kind: n for kind, n in errors.items() if kind != "http_504"}

    print()
    bench.print_table(result)
    print()
    print("stage breakdown at the highest rate (mean, router-measured):")
    stages = deployment["rates"][-1]["stages_us"]
    for stage in sorted(stages, key=_stage_rank):
        print(f"  {stage.removesuffix('_us'):<10} {stages[stage] / 1000:8.3f} ms")
    json_path = out / "demo.json"
    bench.write_json(result, json_path)
    plot = bench.plot_results(result, out / "demo.png")
    print(f"\nresults: {json_path}\nplot:    {plot}")
    served_ok = checked > 0 and worst is not None and worst <= TOLERANCE and not failures
    ok = round_trip <= TOLERANCE and served_ok
    print(
        f"checked {checked} responses against the original model: max abs diff "
        f"{worst if worst is not None else 'n/a'} (tolerance {TOLERANCE}); "
        f"{errors.get('http_504', 0)} requests over the 25 ms budget (504); "
        f"other errors: {failures or 'none'}"
    )
    say("done" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    from cleave.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
