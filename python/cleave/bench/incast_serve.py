"""End-to-end incast control (docs/traffic.md, docs/benchmarks.md "Incast control end to
end"): one testbed plan of R router hosts, a shard host and a ranker host, served with
incast control off and then on; open-loop load split evenly over the routers (each router
its own Poisson stream: the routers' fused payloads meet at the ranker's link). Per rate:
throughput, goodput (200s within the budget per second), p99 and the errors by status.

    cleave bench incast-serve --json out/incast-serve.json

`cleave bench serve` sends to one router URL only; this bench spreads the same load
generator (`cleave.bench.loadgen.open_loop`) over every router, one thread each."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dlrm")
    p.add_argument("--candidates", type=int, default=256, help="rows per request")
    p.add_argument("--routers", type=int, default=4)
    p.add_argument("--link-gbit", type=float, default=1.0, help="every host link's rate")
    p.add_argument("--rates", default="20,40,60,80", help="total requests/s, all routers")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per rate")
    p.add_argument("--budget-ms", type=float, default=25.0)
    p.add_argument("--window-bytes", type=int, default=0, help="ranker window; 0: 2 payloads")
    p.add_argument("--threshold-bytes", type=int, default=64 << 10)
    p.add_argument("--requests", type=int, default=16, help="distinct request bodies")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--quick", action="store_true", help="CI: 2 routers, 16 candidates, one short rate"
    )


def check_args(args: argparse.Namespace) -> list[float]:
    """The rates, after --quick; a clear error for values that cannot run."""
    from cleave.errors import UsageError

    if args.quick:
        args.routers, args.candidates, args.rates = 2, 16, "10"
        args.duration, args.requests = 1.5, 4
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        raise UsageError(
            f"--rates: expected numbers separated by commas, got {args.rates!r}"
        ) from None
    if not rates or min(rates) <= 0:
        raise UsageError(f"--rates must be > 0, got {args.rates!r}")
    if args.routers < 1 or args.candidates < 1 or args.duration <= 0 or args.requests < 1:
        raise UsageError("--routers, --candidates, --duration and --requests must be positive")
    return rates


def build(args, root: Path):
    import cleave
    from cleave.bench.loadgen import infer_body
    from cleave.models import MODELS, RequestGenerator

    entry = MODELS[args.model]
    model, example = entry.factory(scale=entry.default_scale, seed=0)
    model.eval()
    bundle = cleave.partition(model, example)
    bundle_dir = bundle.save(root / args.model, overwrite=True)
    gen = RequestGenerator(args.model, scale=entry.default_scale, seed=1)
    batches = [gen.batch(args.candidates) for _ in range(args.requests)]
    bodies = [infer_body(bundle.named_inputs(*b), args.budget_ms) for b in batches]
    return bundle_dir, bodies


def payload_bytes(bundle_dir: Path, candidates: int) -> int:
    """The fused payload's size: dense inputs plus one pooled row per table per candidate."""
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    dims = sum(t["dim"] * 4 for t in manifest["tables"])
    dense = sum(
        4 * int(np.prod([d for d in i["shape"][1:] if isinstance(d, int)] or [1]))
        for i in manifest["inputs"]
        if i.get("role") == "dense"
    )
    return candidates * (dims + dense)


def make_testbed_plan(args, bundle_dir: Path, out: Path, control: bool, window: int) -> Path:
    from cleave.launch.config import RankerConfig, ServeConfig
    from cleave.plan import emulated_hosts, make_plan, save_plan

    hosts = emulated_hosts(args.routers + 2)
    config = ServeConfig(ranker=RankerConfig(threads=1, device="cpu"))
    plan = make_plan(bundle_dir, hosts, 1, 1, 1, args.routers, serve_config=config)
    # Each router on its own host (the planner puts them together on h0): their payloads
    # cross their own links and meet at the ranker's.
    for i, r in enumerate(plan.routers):
        r.host = hosts[i].name
    plan.shards[0].host = hosts[args.routers].name
    plan.rankers[0].host = hosts[args.routers + 1].name
    plan.incast_control = control
    plan.incast_threshold_bytes = args.threshold_bytes
    plan.rankers[0].control_port = 7200
    plan.rankers[0].incast_window_bytes = window
    plan.rankers[0].link_gbit = args.link_gbit
    return save_plan(plan, out)


def measure(urls: list[str], bodies, rate: float, args) -> dict:
    from cleave.bench.loadgen import open_loop

    per = rate / len(urls)
    results: list[list] = [[] for _ in urls]

    def one(i: int) -> None:
        results[i] = open_loop(urls[i], bodies, per, args.duration, timeout_s=10.0, seed=17 + i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    samples = [s for r in results for s in r]
    lat = np.array([s.latency_s * 1e3 if not s.error else np.inf for s in samples])
    good = sum(1 for s in samples if not s.error and s.latency_s * 1e3 <= args.budget_ms)
    ok = sum(1 for s in samples if not s.error)
    errors = Counter(s.error for s in samples if s.error)
    return {
        "rate": rate,
        "sent": len(samples),
        "throughput_rps": ok / args.duration,
        "goodput_rps": good / args.duration,
        # A failed request counts as infinitely late ("higher": no interpolation with inf).
        "p50_ms": float(np.percentile(lat, 50, method="higher")) if len(lat) else None,
        "p99_ms": float(np.percentile(lat, 99, method="higher")) if len(lat) else None,
        "p99_answered_ms": float(np.percentile(lat[np.isfinite(lat)], 99)) if ok else None,
        "errors": dict(errors),
    }


def run_deployment(plan: Path, args, bodies, log) -> list[dict]:
    from cleave.launch.process import ServeProcess

    url_file = plan.with_suffix(".urls")
    flags = ["--plan", str(plan), "--runner", "testbed", "--link-gbit", str(args.link_gbit)]
    points = []
    with ServeProcess(None, *flags, "--url-file", str(url_file), ready_timeout_s=300) as server:
        urls = [f"{u}/v2/models/{args.model}/infer" for u in url_file.read_text().split()]
        log(f"  routers: {len(urls)}")
        measure(urls, bodies, min(float(r) for r in args.rates.split(",")), args)  # warm-up
        for rate in [float(r) for r in args.rates.split(",")]:
            p = measure(urls, bodies, rate, args)
            log(
                f"  rate {rate:6.1f}/s: tput {p['throughput_rps']:6.1f} "
                f"good {p['goodput_rps']:6.1f} p50 {p['p50_ms']:8.1f} "
                f"p99 {p['p99_ms']:8.1f} ms errors {p['errors']}"
            )
            points.append(p)
        server.stop()
    return points


def summary(points: list[dict], budget_ms: float) -> dict:
    within = [p for p in points if p["p99_ms"] is not None and p["p99_ms"] <= budget_ms]
    return {
        "max_rate_within_budget": max((p["rate"] for p in within), default=0.0),
        "max_goodput_rps": max((p["goodput_rps"] for p in points), default=0.0),
        "http_502": sum(p["errors"].get("http_502", 0) for p in points),
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None  # None: the baseline has none (strict JSON has no infinity)


def ratios(off: dict, on: dict) -> dict:
    """Control on over off: best goodput, highest rate within budget, goodput per rate."""
    return {
        "max_goodput_on_over_off": _ratio(on["max_goodput_rps"], off["max_goodput_rps"]),
        "max_rate_within_budget_on_over_off": _ratio(
            on["max_rate_within_budget"], off["max_rate_within_budget"]
        ),
        "goodput_on_over_off_by_rate": {
            str(a["rate"]): _ratio(b["goodput_rps"], a["goodput_rps"])
            for a, b in zip(off["rates"], on["rates"], strict=True)
        },
    }


def print_table(result: dict) -> None:
    print(f"{'deployment':<12} {'rate/s':>8} {'tput/s':>8} {'good/s':>8} {'p99 ms':>9}  errors")
    for name, dep in result["deployments"].items():
        for p in dep["rates"]:
            p99 = f"{p['p99_ms']:9.1f}" if p["p99_ms"] is not None else f"{'-':>9}"
            print(
                f"{name:<12} {p['rate']:8.1f} {p['throughput_rps']:8.1f} "
                f"{p['goodput_rps']:8.1f} {p99}  {p['errors'] or ''}"
            )
    for key, value in result["ratios"].items():
        if not isinstance(value, dict):
            print(f"{key}: {'-' if value is None else f'{value:.3f}'}")


def run(args: argparse.Namespace) -> int:
    from cleave.errors import UsageError
    from cleave.testbed import commands

    check_args(args)
    reason = commands.unavailable()
    if reason:
        raise UsageError(f"cleave bench incast-serve runs on the testbed: {reason}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    root = Path(args.workdir or tempfile.mkdtemp(prefix="cleave-incast-serve-"))
    root.mkdir(parents=True, exist_ok=True)
    bundle_dir, bodies = build(args, root)
    payload = payload_bytes(bundle_dir, args.candidates)
    window = args.window_bytes or 2 * payload
    log(
        f"{args.model}, {args.candidates} candidates: fused payload ~{payload / 1024:.0f} KiB, "
        f"{payload * 8 / (args.link_gbit * 1e9) * 1e3:.2f} ms on a {args.link_gbit:g} Gbit/s "
        f"link; window {window} bytes"
    )
    result = {
        "model": args.model,
        "candidates": args.candidates,
        "routers": args.routers,
        "link_gbit": args.link_gbit,
        "budget_ms": args.budget_ms,
        "payload_bytes": payload,
        "window_bytes": window,
        "threshold_bytes": args.threshold_bytes,
        "deployments": {},
    }
    for name, control in (("control-off", False), ("control-on", True)):
        log(f"{name}:")
        plan = make_testbed_plan(args, bundle_dir, root / f"{name}.yaml", control, window)
        points = run_deployment(plan, args, bodies, log)
        result["deployments"][name] = {"rates": points, **summary(points, args.budget_ms)}
    off, on = result["deployments"]["control-off"], result["deployments"]["control-on"]
    result["ratios"] = ratios(off, on)
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
