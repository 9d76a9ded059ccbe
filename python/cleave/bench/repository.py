"""`cleave bench repository`: what a new model version costs in a model repository
(docs/repository.md). `cleave serve REPO` starts with version 1 of a reference model; then
version 2 (its dense weights and one table changed) and version 3 (dense weights only) are
loaded through the repository API while it serves. After each step: the table bytes every
shard process holds (from their /metrics), their resident memory, the processes running, and
how long the load took. The same-run reference is what version 2 would hold served alone (a
copy of every table): `table_growth_over_changed_table` should be 1.0 and
`table_growth_over_copy` the changed table's share of the model.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from cleave.bench.harness.processes import process_tree, pss_bytes, sample_process
from cleave.bench.harness.summary import write_json
from cleave.bench.machine import describe, parse_pin, pinned
from cleave.errors import UsageError

MODEL = "dlrm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", type=float, default=0.05, help="dlrm's table scale")
    parser.add_argument("--table", default="emb_l.2.weight", help="the parameter version 2 changes")
    parser.add_argument(
        "--load-share",
        type=float,
        default=0.5,
        help="the rollout's open-loop load, a share of the closed-loop capacity (0: no rollout)",
    )
    parser.add_argument("--budget-ms", type=float, default=250.0, help="each request's budget")
    parser.add_argument("--candidates", type=int, default=100, help="rows per request")
    parser.add_argument("--hold-s", type=float, default=4.0, help="seconds between rollout steps")
    parser.add_argument(
        "--pin", default="auto", help="SERVER:CLIENT CPU lists for the rollout (auto, off)"
    )
    parser.add_argument("--workdir", help="where the repository goes (default: a temporary one)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="a smoke run (tests, CI)")


def run(args: argparse.Namespace) -> int:
    import torch

    import cleave
    from cleave.launch.process import ServeProcess
    from cleave.models import MODELS

    if args.quick:
        args.scale, args.hold_s, args.candidates = 0.002, 1.0, 16
    if not 0 <= args.load_share < 1 or args.budget_ms <= 0 or args.candidates < 1:
        raise UsageError("--load-share: expected [0, 1); --budget-ms and --candidates: > 0")
    server_cpus, client_cpus = parse_pin(args.pin)
    if not args.scale > 0:
        raise UsageError(f"--scale: expected > 0, got {args.scale}")
    base, example = MODELS[MODEL].factory(scale=args.scale, seed=0)
    if args.table not in dict(base.named_parameters()):
        raise UsageError(f"--table: {MODEL} has no parameter {args.table!r}")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="cleave-bench-repository-")) / "repo"

    def write(version: int, dense: float, table: str | None = None):
        """Version `version`'s bundle; its model (its manifest for version 1)."""
        model = copy.deepcopy(base)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.startswith("emb"):
                    p.mul_(1.0 + dense)
            if table:
                dict(model.named_parameters())[table].add_(0.01)
        path = cleave.partition(model, example).save(root / MODEL / str(version), overwrite=True)
        return json.loads((path / "manifest.json").read_text()) if version == 1 else model

    manifest = write(1, 0.0)
    size = {t["source"]: t["rows"] * t["row_bytes"] for t in manifest["tables"]}
    row_bytes = {t["name"]: t["row_bytes"] for t in manifest["tables"]}
    result = {
        "benchmark": "repository",
        "machine": describe(),
        "model": MODEL,
        "scale": args.scale,
        "changed_table": args.table,
        "changed_table_bytes": size[args.table],
        "copy_bytes": sum(size.values()),
        "steps": [],
    }
    models = {"1": base}
    # Every role started inherits the server's cores; the load generator runs on the others.
    with pinned(server_cpus), ServeProcess(root, "--threads", "1") as server:
        result["steps"].append(_step("start: version 1", server, 0.0, row_bytes))
        models["2"], models["3"] = write(2, 0.1, args.table), write(3, -0.1)
        for version in ("2", "3"):
            took = _load(server.url, version)
            result["steps"].append(_step(f"load version {version}", server, took, row_bytes))
        if args.load_share:
            # Version 2 is loaded again under the load: a load is one of the rollout's steps.
            _post(f"{server.url}/v2/repository/models/{MODEL}/unload?version=2", {})
            with pinned(client_cpus):
                result["rollout"] = _rollout(server.url, models, example, args)
            result["rollout"]["router_shed_log"] = [
                line for line in list(server.log) if "requests shed" in line
            ]
            result["rollout"]["layout"] = {"server_cpus": server_cpus, "client_cpus": client_cpus}
    grew = result["steps"][1]["table_bytes"] - result["steps"][0]["table_bytes"]
    result["ratios"] = {
        "table_growth_over_changed_table": grew / result["changed_table_bytes"],
        "table_growth_over_copy": grew / result["copy_bytes"],
        "dense_only_table_growth_bytes": result["steps"][2]["table_bytes"]
        - result["steps"][1]["table_bytes"],
    }
    print_table(result)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _load(url: str, version: str) -> float:
    return _post(f"{url}/v2/repository/models/{MODEL}/load?version={version}", {})


def _post(url: str, body: dict) -> float:
    """POSTs `body`; the seconds until it was answered (an error status raises)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}, method="POST"
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()
    return time.perf_counter() - start


def _rollout(url: str, models: dict, example, args) -> dict:
    """Open-loop load at --load-share of the closed-loop capacity, each request with its
    budget, while version 2 is loaded, goes through a 10% canary, promotion, rollback,
    promotion again, and version 1 is unloaded: every answer checked against the model of
    the version that says it served it."""
    import numpy as np
    import torch
    import torch.utils._pytree as pytree

    import cleave
    from cleave.bench.loadgen import closed_loop, infer_body, open_loop, outputs_of
    from cleave.models import RequestGenerator

    bundle = cleave.partition(models["1"], example)  # for its inputs' names
    generator = RequestGenerator(MODEL, scale=args.scale, seed=7, min_pooling=0)
    bodies, want = [], []
    for _ in range(16):
        batch = generator.batch(args.candidates)
        bodies.append(infer_body(bundle.named_inputs(*batch), budget_ms=args.budget_ms))
        with torch.inference_mode():
            want.append(
                {
                    v: [t.double().numpy() for t in pytree.tree_leaves(m(*batch))]
                    for v, m in models.items()
                }
            )
    infer = f"{url}/v2/models/{MODEL}/infer"
    seconds = 3.0
    capacity = sum(s.status == 200 for s in closed_loop(infer, bodies, 8, seconds)) / seconds
    rate = args.load_share * capacity
    served: dict[str, int] = {}

    def check(index: int, reply: dict) -> float:
        version = reply.get("model_version", "")
        served[version] = served.get(version, 0) + 1
        if version not in want[index]:  # a version that should not serve: never right
            return float("inf")
        pairs = zip(outputs_of(reply), want[index][version], strict=True)
        return max(float(np.abs(g - w).max()) for g, w in pairs)

    admin = f"{url}/admin/v1"
    steps = [
        ("load version 2", f"{url}/v2/repository/models/{MODEL}/load?version=2", {}),
        ("canary 10%", f"{admin}/rollout", {"model": MODEL, "version": "2", "percent": 10}),
        ("promote", f"{admin}/rollout", {"model": MODEL, "version": "2", "percent": 100}),
        ("rollback", f"{admin}/rollback", {"model": MODEL}),
        ("promote again", f"{admin}/rollout", {"model": MODEL, "version": "2", "percent": 100}),
        ("unload version 1", f"{url}/v2/repository/models/{MODEL}/unload?version=1", {}),
    ]
    duration = args.hold_s * (len(steps) + 2)
    # The same load with nothing changing first: what the deployment fails on its own.
    baseline = _failed(open_loop(infer, bodies, rate, duration, timeout_s=10.0, seed=2))
    samples: list = []
    load = threading.Thread(
        target=lambda: samples.extend(
            open_loop(infer, bodies, rate, duration, timeout_s=10.0, seed=1, check=check)
        )
    )
    load.start()
    start, done = time.perf_counter(), []
    time.sleep(args.hold_s)  # the steps are spread over the load: each runs under it
    for name, where, body in steps:
        at = time.perf_counter() - start
        done.append({"step": name, "at_s": at, "took_s": _post(where, body)})
        time.sleep(args.hold_s)
    load.join()
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        refusals = [  # why the router refused what it refused, whole run
            line
            for line in response.read().decode().splitlines()
            if line.startswith(("cleave_router_shed_total", "cleave_router_errors_total"))
            and not line.endswith(" 0")
        ]
    diffs = [s.max_abs_diff for s in samples if s.max_abs_diff is not None]
    return {
        "capacity_rps": capacity,
        "rate_rps": rate,
        "budget_ms": args.budget_ms,
        "candidates": args.candidates,
        "sent": len(samples),
        "ok": sum(s.status == 200 for s in samples),
        "failed": _failed(samples),
        "baseline_failed": baseline,
        "router_refusals": refusals,
        "failed_at_s": [round(x.scheduled_s, 2) for x in samples if x.status != 200],
        "served_by_version": served,
        "max_abs_diff": max(diffs) if diffs else None,
        "steps": done,
    }


def _failed(samples) -> dict[str, int]:
    """Requests not answered 200, by kind."""
    failed: dict[str, int] = {}
    for sample in samples:
        if sample.status != 200:
            failed[sample.error or "unknown"] = failed.get(sample.error or "unknown", 0) + 1
    return failed


def _step(what: str, server, load_s: float, row_bytes: dict[str, int]) -> dict:
    """The shards' table bytes (their /metrics) and resident memory, the processes running,
    and the whole deployment's PSS (forked rankers share the fork server's pages, which RSS
    counts in each)."""
    table_bytes = 0
    for line in list(server.log):
        if " metrics " in line and "-shard-" in line:
            table_bytes += _shard_table_bytes(line.split()[4], row_bytes)
    roles = process_tree(server.proc.pid)
    shards = [pid for pid, role in roles.items() if role.startswith("shard")]
    rankers = [pid for pid, role in roles.items() if role.startswith("ranker")]
    return {
        "step": what,
        "load_s": load_s,
        "table_bytes": table_bytes,
        "shard_processes": len(shards),
        "ranker_processes": len(rankers),
        "shard_rss_bytes": sum(s.rss for pid in shards if (s := sample_process(pid))),
        "ranker_rss_bytes": sum(s.rss for pid in rankers if (s := sample_process(pid))),
        "deployment_pss_bytes": sum(map(pss_bytes, roles)),
    }


def _shard_table_bytes(url: str, row_bytes: dict[str, int]) -> int:
    """Rows held per table (a live shard's /metrics) times the table's row bytes; 0 for a
    shard that stopped."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return 0
    held = 0
    for line in text.splitlines():
        if line.startswith("cleave_shard_table_rows{"):
            table = line.split('table="')[1].split('"')[0]
            held += float(line.rsplit(" ", 1)[1]) * row_bytes[table]
    return int(held)


def print_table(result: dict) -> None:
    mib = 1 << 20
    print(
        f"{MODEL} scale {result['scale']:g}: all tables {result['copy_bytes'] / mib:.1f} MiB, "
        f"{result['changed_table']} {result['changed_table_bytes'] / mib:.1f} MiB"
    )
    print(f"{'step':>18} {'load s':>7} {'tables MiB':>10} {'shards':>6} {'rankers':>7}", end="")
    print(f" {'shard RSS MiB':>13} {'ranker RSS MiB':>14} {'all PSS MiB':>11}")
    for s in result["steps"]:
        print(
            f"{s['step']:>18} {s['load_s']:>7.1f} {s['table_bytes'] / mib:>10.1f} "
            f"{s['shard_processes']:>6} {s['ranker_processes']:>7} "
            f"{s['shard_rss_bytes'] / mib:>13.1f} {s['ranker_rss_bytes'] / mib:>14.1f} "
            f"{s['deployment_pss_bytes'] / mib:>11.1f}"
        )
    if "rollout" in result:
        r = result["rollout"]
        share = r["rate_rps"] / r["capacity_rps"]
        print(
            f"rollout under load: {r['rate_rps']:.0f}/s ({share:.0%} of "
            f"{r['capacity_rps']:.0f}/s), {r['candidates']} candidates, {r['budget_ms']:g} ms "
            f"budget: {r['ok']} of {r['sent']} answered 200, failed {r['failed'] or 'none'} "
            f"(the same load unchanged: {r['baseline_failed'] or 'none'}); "
            f"by version {r['served_by_version']}; max score error {r['max_abs_diff']}"
        )
        steps = (f"{s['step']} at {s['at_s']:.1f} s ({s['took_s']:.2f} s)" for s in r["steps"])
        print("  steps: " + ", ".join(steps) + f"; failures at {r['failed_at_s']} s")
        for line in r.get("router_shed_log", []):
            print(f"  router: {line}")
    r = result["ratios"]
    print(
        f"table growth of version 2 / its changed table: "
        f"{r['table_growth_over_changed_table']:.3f}x; / a copy of every table: "
        f"{r['table_growth_over_copy']:.3f}x; version 3 (dense only): "
        f"{r['dense_only_table_growth_bytes']} bytes"
    )
