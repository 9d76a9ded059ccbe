"""`cleave bench admission`: the router's admission rules below capacity, A/B (issue 23).

Admission must cost nothing while the deployment keeps up. The adaptive rule (a concurrency
limit per backend pool; crates/cleave-router/src/admission/) and the earlier one (`estimate`:
the stage averages and queues against the budget) each serve their own deployment of one
bundle, kept up side by side on the same cores; C is the adaptive deployment's closed-loop
maximum (8 clients, no budget). In each round both are measured at each load (a share of C,
Poisson arrivals), in alternating order (AB, then BA), so that drift on a shared machine falls
on both; the medians over rounds give the ratios adaptive / estimate of answered requests per
second and of p50 and p99 latency. Target: throughput ratio >= 0.97 at 50% and 90% of C."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

from cleave.errors import UsageError

RULES = ("adaptive", "estimate")
CAPACITY_CLIENTS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="dlrm", help="a reference model (cleave.models)")
    parser.add_argument("--scale", type=float, default=0.05, help="the model's table scale")
    parser.add_argument("--candidates", type=int, default=100, help="rows per request")
    parser.add_argument("--loads", default="0.5,0.9", help="shares of C to measure at")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians kept")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--shards", type=int, default=2, help="shard processes per deployment")
    parser.add_argument("--pin", default="auto", help="SERVER:CLIENT CPU lists, auto or off")
    parser.add_argument("--quick", action="store_true", help="a short run (tests)")
    parser.add_argument("--workdir", help="keep the bundle and configs here (default: a temp dir)")
    parser.add_argument("--json", help="write the results here")


def run(args: argparse.Namespace) -> int:
    from cleave.bench.harness.command import in_workdir, positives, report
    from cleave.bench.machine import parse_pin

    if args.quick:  # the shape of a run, not a measurement
        args.scale, args.rounds, args.duration, args.shards = 0.01, 1, 0.5, 1
    loads = positives(args.loads, "--loads")
    if args.rounds < 1 or not args.duration > 0 or args.candidates < 1 or args.shards < 1:
        raise UsageError(
            "--rounds, --candidates and --shards must be at least 1 and --duration positive, "
            f"got {args.rounds}, {args.candidates}, {args.shards}, {args.duration}"
        )
    pins = parse_pin(args.pin)
    result = in_workdir(args, "admission", lambda workdir: measure(workdir, args, loads, pins))
    report(result, args, print_table)
    return 0


def measure(workdir: Path, args, loads: list[float], pins) -> dict:
    import cleave
    from cleave.bench.loadgen import closed_loop, infer_body, open_loop, sequential
    from cleave.bench.machine import pinned
    from cleave.launch.process import ServeProcess
    from cleave.models import MODELS, RequestGenerator

    model, example = MODELS[args.model].factory(scale=args.scale, seed=0)
    partitioned = cleave.partition(model.eval(), example)
    bundle = partitioned.save(workdir / args.model)
    generator = RequestGenerator(args.model, scale=args.scale, seed=7)
    bodies = [
        infer_body(partitioned.named_inputs(*generator.batch(args.candidates))) for _ in range(64)
    ]
    server_cpus, client_cpus = pins
    servers = {}
    try:
        for rule in RULES:
            toml = workdir / f"{rule}.toml"
            toml.write_text(f'[router]\nadmission = "{rule}"\n')
            with pinned(server_cpus):
                flags = ("--shards", str(args.shards), "--config", str(toml))
                servers[rule] = ServeProcess(bundle, *flags).start()
        urls = {r: f"{s.url}/v2/models/{bundle.name}/infer" for r, s in servers.items()}
        with pinned(client_cpus):
            for url in urls.values():
                sequential(url, bodies, len(bodies))  # warm: first calls pay for allocation
            closed_loop(urls["adaptive"], bodies, CAPACITY_CLIENTS, args.duration / 2)
            done = closed_loop(urls["adaptive"], bodies, CAPACITY_CLIENTS, args.duration)
            capacity = sum(1 for s in done if not s.error) / args.duration
            if capacity <= 0:
                raise UsageError("the adaptive deployment answered nothing in its capacity run")
            runs = {(r, x): [] for r in RULES for x in loads}
            for i in range(args.rounds):
                order = RULES if i % 2 == 0 else RULES[::-1]
                for x in loads:
                    for rule in order:
                        samples = open_loop(
                            urls[rule], bodies, x * capacity, args.duration, 2.0, seed=i
                        )
                        runs[(rule, x)].append(_point(samples, args.duration))
    finally:
        for server in servers.values():
            server.stop()
    return _summary(args, capacity, loads, runs)


def _point(samples, duration_s: float) -> dict:
    ok = [s.latency_s * 1e3 for s in samples if not s.error]
    errors: dict[str, int] = {}
    for s in samples:
        if s.error:
            errors[s.error] = errors.get(s.error, 0) + 1
    return {
        "sent": len(samples),
        "ok_per_s": len(ok) / duration_s,
        "p50_ms": float(np.percentile(ok, 50)) if ok else None,
        "p99_ms": float(np.percentile(ok, 99)) if ok else None,
        "errors": errors,
    }


def _median(points: list[dict], key: str) -> float | None:
    values = [p[key] for p in points if p[key] is not None]
    return statistics.median(values) if values else None


def _summary(args, capacity: float, loads: list[float], runs: dict) -> dict:
    rules = {
        rule: [
            {
                "load_share": x,
                "rate": round(x * capacity, 1),
                **{k: _median(runs[(rule, x)], k) for k in ("ok_per_s", "p50_ms", "p99_ms")},
                "errors": sum(sum(p["errors"].values()) for p in runs[(rule, x)]),
                "rounds": runs[(rule, x)],
            }
            for x in loads
        ]
        for rule in RULES
    }
    ratios = {}
    for i, x in enumerate(loads):
        a, b = rules["adaptive"][i], rules["estimate"][i]
        tag = f"{round(x * 100)}"
        for key, name in (("ok_per_s", "throughput"), ("p50_ms", "p50"), ("p99_ms", "p99")):
            ratios[f"{name}_adaptive_over_estimate_at_{tag}"] = (
                a[key] / b[key] if a[key] and b[key] else None
            )
    return {
        "bench": "admission",
        "model": args.model,
        "scale": args.scale,
        "candidates": args.candidates,
        "shards": args.shards,
        "rounds": args.rounds,
        "duration_s": args.duration,
        "capacity_rps": round(capacity, 1),
        "rules": rules,
        "ratios": ratios,
    }


def print_table(result: dict) -> None:
    print(
        f"C = {result['capacity_rps']}/s (adaptive, {CAPACITY_CLIENTS} closed-loop clients); "
        f"medians of {result['rounds']} interleaved rounds of {result['duration_s']:g} s"
    )
    print(f"{'rule':9} {'load':>5} {'rate/s':>7} {'ok/s':>7} {'p50 ms':>7} {'p99 ms':>7} errors")
    for rule, rows in result["rules"].items():
        for r in rows:
            p50 = f"{r['p50_ms']:.2f}" if r["p50_ms"] is not None else "-"
            p99 = f"{r['p99_ms']:.2f}" if r["p99_ms"] is not None else "-"
            print(
                f"{rule:9} {r['load_share']:5.2f} {r['rate']:7.1f} {r['ok_per_s'] or 0:7.1f} "
                f"{p50:>7} {p99:>7} {r['errors']}"
            )
    for k, v in result["ratios"].items():
        print(f"{k}: {'-' if v is None else round(v, 3)}")
    sys.stdout.flush()
