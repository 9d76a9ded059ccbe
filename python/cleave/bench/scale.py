"""`cleave bench scale`: the goodput a second ranker adds, scaled in and out with `cleave scale`
under steady load, on Ray (docs/ray.md, docs/benchmarks.md "Scaling rankers on Ray").

One deployment (router, 2 shards, `--rankers`' first count of rankers) is served with the Ray
runner, on `--ray-address` or on a 3-node local Ray cluster this command starts (Ray's own
cluster utilities; nodes labelled cleave-host=h0..h2: the router on h0, the shards on h1, the
rankers from h2). A closed loop of `--clients` clients sends requests without a pause from
before the first window to after the last; between windows `cleave scale NAME --rankers R`
runs (the real command, under that load) and the router's membership must show R active
rankers before the next window starts. Reported per window: rankers, goodput (answers within
the budget per second), p50/p99, failures; and each window's goodput over the first window's
(the reference, measured in the same run). Exit 1 if any request failed, in a window or while
scaling.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from cleave.bench.harness.command import counts
from cleave.bench.loadgen import Answer, ClosedLoop
from cleave.bench.machine import describe
from cleave.errors import CleaveError, UsageError

NODE_CPUS = 6  # logical, per local node: Ray's accounting, not this machine's cores
OBJECT_STORE = 80 * 1024 * 1024  # the roles pass no objects through Ray
SCALE_TIMEOUT_S = 600.0
TOLERANCE = 1e-5  # --check: scores equal to the model's within this


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="dlrm", help="reference model (cleave.models.MODELS)")
    parser.add_argument("--scale", type=float, help="table scale (default: the model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bundle", help="serve this bundle of --model (default: partition it)")
    parser.add_argument("--workdir", default="out/bench-scale", help="bundles and the plan")
    parser.add_argument(
        "--rankers", default="1,2,1", help="rankers per window, in order (default 1,2,1)"
    )
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per window")
    parser.add_argument("--clients", type=int, default=6, help="closed-loop clients")
    parser.add_argument("--candidates", type=int, default=64, help="rows per request")
    parser.add_argument("--requests", type=int, default=32, help="distinct request bodies")
    parser.add_argument("--alpha", type=float, default=1.05, help="Zipf skew of ids")
    parser.add_argument("--threads", type=int, default=1, help="threads per ranker")
    parser.add_argument(
        "--budget-ms", type=float, default=1000.0, help="goodput counts answers within this"
    )
    parser.add_argument("--check", action="store_true", help="compare every score to the model")
    parser.add_argument(
        "--ray-address", help="a running Ray cluster's head HOST:PORT (default: start 3 nodes)"
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="short windows (tests, CI)")


def window_summary(answers: list[Answer], start: float, end: float, budget_ms: float) -> dict:
    inside = [a for a in answers if start <= a.done_s < end]
    ok = np.array([a.latency_s * 1e3 for a in inside if not a.error])
    duration = end - start
    diffs = [a.max_abs_diff for a in inside if a.max_abs_diff is not None]
    return {
        "duration_s": duration,
        "answered": len(ok),
        "failed": sum(1 for a in inside if a.error),
        "throughput_rps": len(ok) / duration,
        "goodput_rps": float(np.sum(ok <= budget_ms)) / duration,
        "p50_ms": float(np.percentile(ok, 50)) if len(ok) else None,
        "p99_ms": float(np.percentile(ok, 99)) if len(ok) else None,
        "max_abs_diff": max(diffs) if diffs else None,
    }


def local_cluster():
    """Three Ray nodes on this machine, labelled cleave-host=h0..h2."""
    from ray import cluster_utils

    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": NODE_CPUS,
            "object_store_memory": OBJECT_STORE,
            "labels": {"cleave-host": "h0"},
            "include_dashboard": False,
        },
    )
    try:
        for name in ("h1", "h2"):
            cluster.add_node(
                num_cpus=NODE_CPUS, object_store_memory=OBJECT_STORE, labels={"cleave-host": name}
            )
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def write_plan(bundle_dir: Path, rankers: int, threads: int, path: Path):
    """The router on h0, both shards on h1, the rankers on h2 (then h1, h2, ...)."""
    from cleave.plan import Host, make_plan, save_plan
    from cleave.settings import RankerConfig, ServeConfig

    hosts = [Host(f"h{i}", cpus=NODE_CPUS, memory_gib=4.0, gpus=0) for i in range(3)]
    config = ServeConfig(ranker=RankerConfig(threads=threads, device="cpu"))
    plan = make_plan(bundle_dir, hosts, 2, 1, rankers, 1, config)
    plan.shards = [dataclasses.replace(s, host="h1", port=0, metrics_port=0) for s in plan.shards]
    for i, r in enumerate(plan.rankers):
        r.host, r.port, r.metrics_port = f"h{2 - i % 2}", 0, 0
    plan.routers[0].host, plan.routers[0].http_port = "h0", 0
    path.parent.mkdir(parents=True, exist_ok=True)
    save_plan(plan, path)
    return plan


def scale_to(name: str, address: str, rankers: int, url: str) -> float:
    """`cleave scale NAME --rankers R`, then R active rankers on the router; its seconds."""
    from cleave.runners import membership

    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cleave.cli", "scale", name, "--ray-address", address,
         "--rankers", str(rankers)],
        capture_output=True,
        text=True,
        timeout=SCALE_TIMEOUT_S,
    )  # fmt: skip
    if done.returncode != 0:
        raise CleaveError(f"cleave scale --rankers {rankers} failed: {done.stderr.strip()}")
    active = [r for r in membership.members(url)["rankers"] if r["state"] == "active"]
    if len(active) != rankers:
        raise CleaveError(f"after scaling to {rankers} rankers the router has {active}")
    return time.monotonic() - start


def measure(args, workload, address: str, log) -> dict:
    from cleave.bench.harness.target import Target

    steps = counts(args.rankers, "--rankers")
    plan_path = Path(args.workdir) / f"{workload.name}-scale-plan.yaml"
    plan = write_plan(workload.bundle_dir, steps[0], args.threads, plan_path)
    target = Target(plan=plan_path, flags=["--runner", "ray", "--ray-address", address])
    windows = []
    with target:
        url = target.infer_url(workload)
        log(f"serving {plan.name} on Ray at {target.url}; {args.clients} clients")
        check = workload.check if args.check else None
        load = ClosedLoop(url, workload.bodies, args.clients, check)
        load.start()
        try:
            time.sleep(min(5.0, args.duration / 2))  # warm-up: not measured
            for i, rankers in enumerate(steps):
                scaled_s = None
                if i > 0 and rankers != steps[i - 1]:
                    scaled_s = scale_to(plan.name, address, rankers, target.url)
                    log(f"  scaled to {rankers} rankers in {scaled_s:.1f} s (under load)")
                start = time.monotonic()
                time.sleep(args.duration)
                window = window_summary(load.answers, start, time.monotonic(), args.budget_ms)
                window.update(rankers=rankers, scale_s=scaled_s)
                windows.append(window)
                log(
                    f"  window {i}: {rankers} rankers, {window['goodput_rps']:.1f} req/s, "
                    f"p99 {window['p99_ms'] or 0:.1f} ms, {window['failed']} failed"
                )
        finally:
            load.stop()
    failures = [a.error for a in load.answers if a.error]
    reference = windows[0]["goodput_rps"]
    for w in windows:
        w["goodput_over_first"] = w["goodput_rps"] / reference if reference else float("nan")
    fewest = [w["goodput_rps"] for w in windows if w["rankers"] == min(steps)]
    most = [w["goodput_rps"] for w in windows if w["rankers"] == max(steps)]
    return {
        "windows": windows,
        # Drift on a shared machine hits every window: the means of alternating windows too.
        "mean_most_over_mean_fewest": float(np.mean(most) / np.mean(fewest))
        if np.mean(fewest)
        else float("nan"),
        "requests": len(load.answers),
        "failed": len(failures),
        "failures_first": failures[:5],
        # The first window with the most rankers over the first (not the best of several).
        "gain_of_most_rankers": next(
            w["goodput_over_first"] for w in windows if w["rankers"] == max(steps)
        ),
    }


def print_table(result: dict) -> None:
    print(f"{'window':>6} {'rankers':>7} {'good/s':>8} {'/first':>7} {'p50 ms':>8} {'p99 ms':>8}")
    for i, w in enumerate(result["windows"]):
        p50 = f"{w['p50_ms']:8.1f}" if w["p50_ms"] is not None else f"{'-':>8}"
        p99 = f"{w['p99_ms']:8.1f}" if w["p99_ms"] is not None else f"{'-':>8}"
        print(
            f"{i:>6} {w['rankers']:>7} {w['goodput_rps']:8.1f} {w['goodput_over_first']:7.3f} "
            f"{p50} {p99}  {w['failed'] or ''}"
        )
    print(
        f"first window of most rankers over first window: {result['gain_of_most_rankers']:.3f}; "
        f"mean of most-ranker windows over fewest: {result['mean_most_over_mean_fewest']:.3f}"
    )
    print(f"failed requests, whole run (scaling included): {result['failed']}")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.duration, args.requests = 3.0, 8
    counts(args.rankers, "--rankers")
    if args.duration <= 0 or args.clients < 1 or args.candidates < 1 or args.requests < 1:
        raise UsageError("--duration, --clients, --candidates and --requests must be positive")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UsageError("bench scale needs Ray: pip install 'cleave[ray]'") from None
    from cleave.bench.harness.workload import Workload
    from cleave.runners.ray import _check_reachable

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if args.ray_address:  # before the workload is built: a bad address fails in seconds
        _check_reachable(args.ray_address)

    t0 = time.monotonic()
    workload = Workload(args)
    log(f"workload: {workload.name} ({time.monotonic() - t0:.1f} s)")
    cluster = None if args.ray_address else local_cluster()
    try:
        address = args.ray_address or cluster.address
        log(f"Ray at {address}" + ("" if args.ray_address else " (3 local nodes, started here)"))
        report = measure(args, workload, address, log)
    finally:
        if cluster is not None:
            cluster.shutdown()
    result = {
        "benchmark": "scale",
        "machine": describe(),
        "model": args.model,
        "scale": workload.scale,
        "candidates": args.candidates,
        "clients": args.clients,
        "ranker_threads": args.threads,
        "budget_ms": args.budget_ms,
        "local_cluster": cluster is not None,
        **report,
    }
    print_table(result)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {path}")
    if result["failed"]:
        log(f"{result['failed']} requests failed, e.g. {result['failures_first']}")
        return 1
    worst = max((w["max_abs_diff"] or 0.0 for w in result["windows"]), default=0.0)
    if worst > TOLERANCE:  # --check: a score that differs from the model's is a failure too
        log(f"a score differs from the model's by {worst:g} (> {TOLERANCE:g})")
        return 1
    if any(w["answered"] == 0 for w in result["windows"]):  # the load itself did not run
        log("a window got no answer at all: nothing to compare")
        return 1
    return 0
