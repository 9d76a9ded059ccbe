"""End-to-end incast control (docs/traffic.md, docs/benchmarks.md "Incast control end to
end"): a preset of `cleave bench serve`. It writes one testbed plan of R router hosts, a shard
host and a ranker host (each router on its own host: their fused payloads meet at the ranker's
link), then runs `cleave bench serve --plan PLAN --runner testbed --incast-control off,on`
on it: the plan served with incast control off, then on, open-loop load split evenly over the
routers; its JSON and table are bench serve's.

    cleave bench incast-serve --json out/incast-serve.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
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
    p.add_argument(
        "--window-bytes",
        type=int,
        default=0,
        help="ranker window (adaptive: its start); 0: 2 payloads",
    )
    p.add_argument(
        "--window",
        choices=["adaptive", "fixed"],
        default="adaptive",
        help="the ranker's incast window follows congestion (default) or stays at --window-bytes",
    )
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
        # A roomy budget: CI checks the split and the ratios, not latency on a busy machine.
        args.duration, args.requests, args.budget_ms = 1.5, 4, 1000.0
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


def build(args, root: Path) -> Path:
    """The model's bundle, partitioned as `cleave bench serve` would (its default scale and
    seed): bench serve then reads it from the plan."""
    import cleave
    from cleave.errors import UsageError
    from cleave.models import MODELS

    if args.model not in MODELS:
        raise UsageError(f"--model must be one of {sorted(MODELS)}, got {args.model!r}")
    entry = MODELS[args.model]
    model, example = entry.factory(scale=entry.default_scale, seed=0)
    model.eval()
    return cleave.partition(model, example).save(root / args.model, overwrite=True)


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


def make_testbed_plan(args, bundle_dir: Path, out: Path, window: int) -> Path:
    """Incast control off; bench serve's --incast-control turns it on in its copy."""
    from cleave.plan import emulated_hosts, make_plan, save_plan
    from cleave.settings import RankerConfig, ServeConfig

    hosts = emulated_hosts(args.routers + 2)
    config = ServeConfig(ranker=RankerConfig(threads=1, device="cpu"))
    plan = make_plan(bundle_dir, hosts, 1, 1, 1, args.routers, serve_config=config)
    # Each router on its own host (the planner puts them together on h0): their payloads
    # cross their own links and meet at the ranker's.
    for i, r in enumerate(plan.routers):
        r.host = hosts[i].name
    plan.shards[0].host = hosts[args.routers].name
    plan.rankers[0].host = hosts[args.routers + 1].name
    plan.incast_threshold_bytes = args.threshold_bytes
    plan.rankers[0].control_port = 7200
    plan.rankers[0].incast_window_bytes = window
    plan.rankers[0].incast_adaptive = args.window == "adaptive"
    plan.rankers[0].link_gbit = args.link_gbit
    return save_plan(plan, out)


def serve_args(args, plan: Path, root: Path) -> argparse.Namespace:
    """`cleave bench serve --plan PLAN --runner testbed --incast-control off,on` with this
    bench's workload and load, from bench serve's own parser (its defaults apply)."""
    from cleave.bench import serve

    argv = ["--plan", str(plan), "--runner", "testbed", "--link-gbit", str(args.link_gbit)]
    argv += ["--incast-control", "off,on", "--model", args.model, "--workdir", str(root)]
    argv += ["--candidates", str(args.candidates), "--requests", str(args.requests)]
    argv += ["--rates", args.rates, "--duration", str(args.duration)]
    argv += ["--budget-ms", str(args.budget_ms)]
    if args.quick:  # bench serve's --quick would replace the rates: only its single requests
        argv += ["--single", "20"]
    if args.json:
        argv += ["--json", args.json]
    parser = argparse.ArgumentParser(prog="cleave bench serve")
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    from cleave.bench import serve
    from cleave.errors import UsageError
    from cleave.testbed import commands

    check_args(args)
    reason = commands.unavailable()
    if reason:
        raise UsageError(f"cleave bench incast-serve runs on the testbed: {reason}")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="cleave-incast-serve-"))
    root.mkdir(parents=True, exist_ok=True)
    bundle_dir = build(args, root)
    payload = payload_bytes(bundle_dir, args.candidates)
    window = args.window_bytes or 2 * payload
    print(
        f"{args.model}, {args.candidates} candidates: fused payload ~{payload / 1024:.0f} KiB, "
        f"{payload * 8 / (args.link_gbit * 1e9) * 1e3:.2f} ms on a {args.link_gbit:g} Gbit/s "
        f"link; window {window} bytes ({args.window})",
        file=sys.stderr,
        flush=True,
    )
    plan = make_testbed_plan(args, bundle_dir, root / "incast.yaml", window)
    code = serve.run(serve_args(args, plan, root))
    if args.json:  # what this preset chose, beside bench serve's result
        result = json.loads(Path(args.json).read_text())
        result["incast_serve"] = {
            "routers": args.routers,
            "payload_bytes": payload,
            "window_bytes": window,
            "window": args.window,
            "threshold_bytes": args.threshold_bytes,
        }
        serve.write_json(result, args.json)
    return code
