"""`cleave bench serve`: open-loop serving load against a deployment started by `cleave serve`,
disaggregated and/or monolithic, on the same cores one after the other; or any deployment plan
under a runner (`--plan PLAN --runner local|testbed`); or the shard-host sweep on the emulated
testbed (`--shard-hosts 1,2,4`: a router host, S shard hosts and a ranker host per plan); or a
plan with incast control off and on (`--plan PLAN --incast-control off,on`).

For each deployment: single-request latency (one request at a time, the first router), then
each offered rate (Poisson arrivals, split evenly over every router of the deployment) for
`--duration` seconds, optionally a search for the highest rate whose
p99 stays within the budget. Prints a table, writes JSON and a PNG (latency vs rate, stage
breakdown). Every response can be checked against the original model's outputs (--check).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from cleave.bench import hosts
from cleave.bench.machine import describe, go_realtime
from cleave.bench.plot import plot_hosts, plot_results, plot_stress
from cleave.errors import UsageError
from cleave.partitioner.accuracy import REFERENCE_SAMPLES

__all__ = [
    "Target",
    "Workload",
    "measure",
    "new_result",
    "plot_results",
    "print_table",
    "write_json",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="dlrm", help="reference model (cleave.models.MODELS)")
    parser.add_argument("--scale", type=float, help="table scale (default: the model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bundle", help="serve this bundle of --model (default: partition it)")
    parser.add_argument("--workdir", default="out/bench-serve", help="where bundles are written")
    parser.add_argument("--rates", default="50,100,200", help="offered loads, requests/s")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per rate")
    parser.add_argument(
        "--budget-ms",
        type=float,
        help="latency budget (SLO); default: 25 ms, or twice the float32 dense program's time "
        "per request on one thread when that is more (rounded up to 5 ms)",
    )
    parser.add_argument(
        "--dense-dtype",
        choices=["float32", "bfloat16", "int8"],
        default="float32",
        help="serve a bundle with this dense precision (refused if it fails its accuracy "
        "check); a reduced one is compared with the float32 bundle served the same way",
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads per ranker (default: cleave serve's split)"
    )
    parser.add_argument(
        "--compile", action="store_true", help="rankers compile their dense program (CPU)"
    )
    parser.add_argument("--candidates", type=int, default=100, help="rows per request")
    parser.add_argument(
        "--protocol",
        default="json",
        metavar="P[,P...]",
        help="request bodies: json (KServe v2 JSON tensors), binary (binary tensors, what "
        "tritonclient sends) or grpc (raw tensors); several, comma-separated, measure each in "
        "the same run on its own deployment, with ratios against the first",
    )
    parser.add_argument("--alpha", type=float, default=1.05, help="Zipf skew of ids")
    parser.add_argument("--requests", type=int, default=64, help="distinct request bodies")
    parser.add_argument("--single", type=int, default=200, help="single-request samples")
    parser.add_argument("--search", action="store_true", help="find the max rate within budget")
    parser.add_argument(
        "--max-error-pct",
        type=float,
        help="a rate is within budget with at most this %% of errors (default 0; 1 with "
        "--shard-hosts)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--compare",
        action="store_true",
        help="monolithic, disaggregated, then router-held (the tables in the router)",
    )
    mode.add_argument("--monolithic", action="store_true", help="only the monolithic baseline")
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--rankers", type=int, default=1)
    parser.add_argument("--config", help="cleave serve TOML config for both deployments")
    parser.add_argument("--check", action="store_true", help="compare every score to the model")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write the PNG here (default: next to --json)")
    parser.add_argument("--url", help="measure an already running deployment instead")
    parser.add_argument(
        "--plan", help="measure this deployment plan (cleave plan), started with --runner"
    )
    parser.add_argument(
        "--shard-hosts",
        metavar="S,S,...",
        help="sweep: for each S, a plan of a router host, S shard hosts (one shard each) and a "
        "ranker host, served with --runner (default testbed); goodput compared to the first S",
    )
    parser.add_argument(
        "--runner",
        choices=["local", "testbed"],
        help="what runs --plan or --shard-hosts deployments (default local for --plan, "
        "testbed for --shard-hosts)",
    )
    parser.add_argument(
        "--link-gbit", type=float, help="testbed runner: host link rate, Gbit/s (default 1)"
    )
    parser.add_argument(
        "--incast-control",
        metavar="off,on",
        help="with --plan: one deployment per value (incast-off, incast-on), each served from "
        "a copy of the plan with incast control set, measured one after the other; ratios of "
        'on over off (docs/benchmarks.md, "Incast control end to end")',
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run of a few seconds (tests, CI)"
    )
    stress = parser.add_mutually_exclusive_group()
    stress.add_argument(
        "--overload",
        action="store_true",
        help="40%% of capacity, a 3x burst, 40%% again, --duration seconds each (2 s client "
        "timeout; requests carry no budget, the router's default applies)",
    )
    stress.add_argument(
        "--soak",
        type=float,
        metavar="MINUTES",
        help="40%% of capacity for MINUTES, sampling every process's RSS and open files",
    )
    parser.add_argument(
        "--capacity", type=float, help="requests/s for --overload/--soak (default: search)"
    )
    parser.add_argument(
        "--idle-connections",
        type=int,
        default=0,
        help="with --overload: hold this many idle connections open during the run",
    )
    parser.add_argument(
        "--idle-wait-s",
        type=float,
        default=90.0,
        help="after --overload, how long to wait for the router to close the idle connections",
    )
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="run the load generator and the deployments (which inherit it) under SCHED_FIFO, "
        "so other processes on a shared machine do not add their scheduling delays (root)",
    )


class Workload:
    """A model, its bundle, request bodies for the HTTP API and the model's own outputs."""

    def __init__(self, args: argparse.Namespace):
        import torch
        import torch.utils._pytree as pytree

        import cleave
        from cleave.bench.loadgen import build_body
        from cleave.models import MODELS, RequestGenerator

        if args.model not in MODELS:
            raise UsageError(f"--model must be one of {sorted(MODELS)}, got {args.model!r}")
        entry = MODELS[args.model]
        scale = entry.default_scale if args.scale is None else args.scale
        model, example = entry.factory(scale=scale, seed=args.seed)
        model.eval()
        dtype = getattr(args, "dense_dtype", "float32")
        base = Path(args.workdir) / f"{args.model}-{scale:g}-{args.seed}"
        if args.bundle:
            self.bundle_dir = Path(args.bundle)
            bundle = cleave.load_bundle(self.bundle_dir, verify=False)
        else:
            self.bundle_dir = base if dtype == "float32" else base.with_name(f"{base.name}-{dtype}")
            labelled = (
                None
                if dtype == "float32"
                else RequestGenerator(args.model, scale=scale, seed=args.seed).labelled(
                    REFERENCE_SAMPLES, 256
                )
            )
            bundle = cleave.partition(model, example, dense_dtype=dtype, labelled=labelled)
            bundle.save(self.bundle_dir, overwrite=True)
        # A reduced-precision bundle is also served in float32, the same way, for the ratio.
        self.float32_dir = None
        if bundle.dense_dtype != "float32":
            self.float32_dir = base
            cleave.partition(model, example).save(base, overwrite=True)
        generator = RequestGenerator(args.model, scale=scale, alpha=args.alpha, seed=args.seed + 1)
        self.bundle = bundle
        self.inputs = [generator.batch(args.candidates) for _ in range(args.requests)]
        self.roofline = None
        if hasattr(args, "dense_dtype"):  # cleave bench serve: the dense program vs the CPU
            self.roofline = _rooflines(self, args)
            if args.budget_ms is None:
                fp32_ms = self.roofline["float32_one_thread_ms"]
                args.budget_ms = max(25.0, 5.0 * math.ceil(2 * fp32_ms / 5.0))
        # Overload and soak runs send no budget: the router's default is what they test.
        stress = getattr(args, "overload", False) or getattr(args, "soak", None)
        body_budget = None if stress else args.budget_ms
        protocols = getattr(args, "protocols", ["json"])
        self.bodies_for: dict[str, list] = {p: [] for p in protocols}
        self.expected, self.model_expected = [], []
        self.float32_distance = 0.0
        with torch.inference_mode():
            for inputs in self.inputs:
                named = bundle.named_inputs(*inputs)
                for protocol, bodies in self.bodies_for.items():
                    bodies.append(build_body(named, body_budget, protocol))
                flat = [t.double().numpy() for t in pytree.tree_leaves(model(*inputs))]
                self.model_expected.append(flat)
                if bundle.dense_dtype == "float32":
                    self.expected.append(flat)
                    continue
                # A reduced-precision bundle is checked against its own reference executor;
                # its distance to the float32 model is reported apart.
                own = [t.double().numpy() for t in pytree.tree_leaves(bundle.reference(*inputs))]
                self.expected.append(own)
                for o, f in zip(own, flat, strict=True):
                    if f.size:
                        self.float32_distance = max(self.float32_distance, float(abs(o - f).max()))
        # The first protocol's bodies: what a single-protocol command sends.
        self.bodies = self.bodies_for[protocols[0]]
        self.name = self.bundle_dir.name
        self.scale = scale

    def check(self, index: int, response: dict, want_model: bool = False) -> float:
        """Largest distance of a response's outputs from the expected ones: the bundle's own
        reference executor's (the model's for float32 bundles), or with `want_model` the
        float32 model's."""
        from cleave.bench.loadgen import outputs_of

        got = outputs_of(response)
        want = (self.model_expected if want_model else self.expected)[index]
        if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want, strict=True)):
            return float("inf")
        return max(
            float(abs(g - w).max()) if g.size else 0.0 for g, w in zip(got, want, strict=True)
        )


def _rooflines(workload: Workload, args) -> dict:
    """The served dense program (and the float32 one) against the matmul peak, at the threads
    a ranker gets; and the float32 program on one thread, which the default budget scales by."""
    import cleave
    from cleave.bench.roofline import roofline
    from cleave.launch.config import ServeConfig

    bundle = workload.bundle
    config = ServeConfig(rankers=args.rankers)
    threads = args.threads or config.ranker_threads(bundle.manifest["dense"].get("demand"))
    inputs = bundle.named_inputs(*workload.inputs[0])
    values = {**inputs, **bundle.sparse_reference(inputs)}
    dense_args = [values[n] for n in bundle.manifest["dense"]["inputs"]]
    program = None
    if args.compile:
        from cleave.ranker.program import compile_program

        program = compile_program(bundle.dense_module(), Path(args.workdir) / "inductor")
    served = roofline(bundle, dense_args, threads, program)
    fp32 = bundle
    if workload.float32_dir is not None:
        fp32 = cleave.load_bundle(workload.float32_dir, verify=False)
    result = {"served": served, "float32": served}
    if fp32 is not bundle:
        result["float32"] = roofline(fp32, dense_args, threads)
    result["float32_one_thread_ms"] = roofline(fp32, dense_args, 1)["dense_ms"]
    return result


def print_roofline(roof: dict) -> None:
    print("dense program vs the matrix-multiply peak (same dtype and threads, this run):")
    for name in dict.fromkeys(("served", "float32")):
        r = roof[name]
        peak = f"{r['peak_gflops']:.0f}" if r["peak_gflops"] else "-"
        share = f"{100 * r['fraction_of_peak']:.0f}%" if r["fraction_of_peak"] else "-"
        print(
            f"  {r['dtype']:<9} {r['threads']} threads{' compiled' if r['compiled'] else ''}: "
            f"{r['dense_ms']:.2f} ms per request of {r['rows']}, {r['achieved_gflops']:.0f} "
            f"GFLOP/s of a {peak} GFLOP/s peak ({share})"
        )
        if roof["served"] is roof["float32"]:
            break


def read_bundle_summary(bundle_dir: Path) -> dict:
    manifest = json.loads((Path(bundle_dir) / "manifest.json").read_text())
    return {
        "tables": len(manifest["tables"]),
        "table_mib": sum(t["rows"] * t["row_bytes"] for t in manifest["tables"]) / 2**20,
        "dense_inputs": len(manifest["dense"]["inputs"]),
        "dense_dtype": manifest["dense"].get("dtype", "float32"),
        "accuracy": manifest["dense"].get("accuracy"),
    }


def new_result(args, workload: Workload) -> dict:
    return {
        "benchmark": "serve",
        "machine": describe(),
        "model": args.model,
        "scale": workload.scale,
        "candidates": args.candidates,
        "alpha": args.alpha,
        "budget_ms": args.budget_ms,
        "max_error_pct": args.max_error_pct,
        "duration_s": args.duration,
        "shards": args.shards,
        "rankers": args.rankers,
        "realtime": bool(getattr(args, "realtime", False)),
        "protocols": getattr(args, "protocols", ["json"]),
        "bundle": read_bundle_summary(workload.bundle_dir),
        "roofline": workload.roofline,
        "deployments": {},
    }


def write_json(result: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def _ok(point: dict, budget_ms: float, max_error_pct: float = 0.0) -> bool:
    """Within budget: errors at most `max_error_pct` of those sent (none by default), p99
    within it, and the deployment kept up with the load: 90 % of the requests *sent*
    answered. Not of `rate` x duration: a Poisson run of 5 s at 12.5/s sends 62 +- 8, so
    that failed deployments that answered everything."""
    errors = sum(point["errors"].values())
    return (
        errors <= max_error_pct / 100 * point["sent"]
        and point["p99_ms"] is not None
        and point["p99_ms"] <= budget_ms
        and point["ok"] >= 0.9 * point["sent"]
    )


class Target:
    """Where the load goes: a `cleave serve` this benchmark starts (and can restart), or the
    URL of a deployment someone else runs."""

    def __init__(
        self,
        bundle=None,
        flags: list[str] | None = None,
        url: str | None = None,
        plan=None,
        model: str | None = None,
        want_model: bool = False,
        protocol: str = "json",
    ):
        # plan: `cleave serve --plan PLAN *flags` (flags name the runner) instead of BUNDLE.
        self.bundle, self.plan, self.flags, self.server = bundle, plan, flags or [], None
        self.url = url.rstrip("/") if url else ""
        # Every router's URL (a plan may have several; the first is `url`). The load of each
        # open-loop probe is split over them.
        self.urls: list[str] = [self.url] if self.url else []
        self._url_dir: Path | None = None  # where `cleave serve --url-file` writes them
        self.model = model  # the served model's name when it is not the workload's
        self.want_model = want_model  # --check against the float32 model, not the bundle
        self.protocol = protocol  # what its requests are: json, binary or grpc
        self.endpoints: dict[str, str] = {}  # role -> /metrics URL
        # --protocol grpc: the port given to `cleave serve --grpc-port` (in `flags`).
        self.grpc_port = _grpc_port(self.flags)
        self.links: dict[str, tuple[str, str, str]] = {}  # testbed host -> its link

    @property
    def restartable(self) -> bool:
        return self.bundle is not None or self.plan is not None

    def start(self) -> Target:
        from cleave.bench.stages import metrics_endpoints, printed_all_metrics, testbed_links

        if self.restartable:
            from cleave.launch.process import ServeProcess

            where = [self.bundle] if self.plan is None else [None, "--plan", str(self.plan)]
            url_flags = []
            if self.plan is not None:  # written before its first "ready" line: read it then
                self._url_dir = Path(tempfile.mkdtemp(prefix="cleave-bench-urls-"))
                url_flags = ["--url-file", str(self._url_dir / "urls")]
            self.server = ServeProcess(*where, *self.flags, *url_flags)
            try:
                self.server.start()
            except BaseException:  # SIGTERM while it starts, say: stop what has started
                self.stop()
                raise
            self.url = self.server.url
            self.urls = [self.url]
            if self._url_dir is not None:
                self.urls = [u.rstrip("/") for u in (self._url_dir / "urls").read_text().split()]
            # Its "metrics" lines (stderr) come before "ready" (stdout), but each stream has
            # its own reader: wait a little for them. Read now: the log keeps only its last lines.
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and not printed_all_metrics(list(self.server.log)):
                time.sleep(0.02)
        log = list(self.server.log) if self.server else []
        self.endpoints = metrics_endpoints(log, self.url)
        self.links = testbed_links(log)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._url_dir is not None:  # `cleave serve` removed the file as it stopped
            shutil.rmtree(self._url_dir, ignore_errors=True)
            self._url_dir = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def bodies(self, workload: Workload) -> list:
        """The workload's requests in this target's protocol."""
        return workload.bodies_for.get(self.protocol, workload.bodies)

    def infer_url(self, workload: Workload) -> str:
        model = self.model or workload.name
        if self.protocol == "grpc":  # the load generator's form for gRPC: grpc://HOST:PORT/MODEL
            return f"grpc://127.0.0.1:{self.grpc_port}/{model}"
        return f"{self.url}/v2/models/{model}/infer"

    def infer_urls(self, workload: Workload) -> list[str]:
        """Every router's infer URL (gRPC: the one port this command gave `cleave serve`)."""
        if self.protocol == "grpc" or len(self.urls) < 2:
            return [self.infer_url(workload)]
        model = self.model or workload.name
        return [f"{url}/v2/models/{model}/infer" for url in self.urls]

    def checker(self, workload: Workload):
        """What --check compares this deployment's responses with."""
        return functools.partial(workload.check, want_model=self.want_model)

    def __enter__(self) -> Target:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def paired_single(targets: dict[str, Target], workload: Workload, args, log) -> dict:
    """Single-request latency of several running deployments, measured in alternating rounds
    (one request at a time, never overlapping), so drifting load on a shared machine hits
    them alike. Returns each deployment's summary plus the per-round p50s."""
    import numpy as np

    from cleave.bench.loadgen import sequential, summarize

    rounds = 10
    per_round = max(1, args.single // rounds)
    samples: dict[str, list] = {name: [] for name in targets}
    p50s: dict[str, list] = {name: [] for name in targets}
    for target in targets.values():  # warm-up
        sequential(target.infer_url(workload), target.bodies(workload), min(20, args.single))
    for _ in range(rounds):
        for name, target in targets.items():
            check = target.checker(workload) if args.check else None
            bodies = target.bodies(workload)
            got = sequential(target.infer_url(workload), bodies, per_round, check=check)
            samples[name].extend(got)
            ok = [s.latency_s * 1e3 for s in got if not s.error]
            p50s[name].append(float(np.median(ok)) if ok else None)
    result = {}
    for name in targets:
        result[name] = {**summarize(samples[name], 1.0, args.budget_ms), "round_p50_ms": p50s[name]}
        s = result[name]
        log(f"  {name} single request: p50 {_ms(s['p50_ms'])} ms  p99 {_ms(s['p99_ms'])} ms")
    return result


def measure(target: Target, workload: Workload, args, log, single: bool = True) -> dict:
    """Single-request latency (unless measured elsewhere), then each rate of the sweep (and the
    search). A deployment that missed its budget is restarted before the next probe, so no
    probe inherits another's backlog (or a wedged connection: see docs/benchmarks.md,
    "Serving")."""
    from cleave.bench.loadgen import open_loop_spread, sequential, summarize
    from cleave.bench.stages import breakdown, scrape

    def infer() -> str:
        return target.infer_url(workload)

    def warm_up() -> None:  # every router: each has its own connections to open
        for url in target.infer_urls(workload):
            sequential(url, bodies, min(20, args.single), check=None)

    bodies = target.bodies(workload)
    check = target.checker(workload) if args.check else None
    warm_up()
    result: dict = {"rates": []}
    if single:
        samples = sequential(infer(), bodies, args.single, check=check)
        result["single"] = summarize(samples, 1.0, args.budget_ms)
        s = result["single"]
        log(f"  single request: p50 {_ms(s['p50_ms'])} ms  p99 {_ms(s['p99_ms'])} ms")

    def probe(rate: float) -> dict:
        for point in result["rates"]:  # the search may come back to a rate of the sweep
            if point["rate"] == rate:
                return point
        before = scrape(target.endpoints, target.links)
        urls = target.infer_urls(workload)
        samples = open_loop_spread(urls, bodies, rate, args.duration, seed=int(rate), check=check)
        after = scrape(target.endpoints, target.links)
        metrics = breakdown(before, after)
        point = {"rate": rate, **summarize(samples, args.duration, args.budget_ms)}
        if len(urls) > 1:  # what the client sent each router, and what each one counted
            point["sent_by_router"] = [
                sum(s.router == i for s in samples) for i in range(len(urls))
            ]
            metrics["requests_by_router"] = _router_requests(before, after)
        point["metrics"] = metrics
        point["within_budget"] = _ok(point, args.budget_ms, args.max_error_pct)
        result["rates"].append(point)
        log(
            f"  {rate:8.1f}/s: {point['throughput_rps']:8.1f}/s ok, p50 "
            f"{_ms(point['p50_ms'])} ms, p99 {_ms(point['p99_ms'])} ms, errors {point['errors']}"
        )
        if not point["within_budget"] and target.restartable:
            target.restart()
            warm_up()
        return point

    for rate in args.rate_list:
        probe(rate)
    if args.search:
        result["max_rate_within_budget"] = _search(probe, args)
    else:
        good = [p["rate"] for p in result["rates"] if p["within_budget"]]
        result["max_rate_within_budget"] = max(good) if good else 0.0
    # Bad gateway: a role failed the router. Past capacity only 503s and 504s should come.
    result["http_502"] = sum(
        p["errors"].get("http_502", 0) for p in [result.get("single", {}), *result["rates"]] if p
    )
    return result


def _router_requests(before: dict, after: dict) -> dict[str, float]:
    """Requests each router counted between two scrapes (its `total` stage histogram)."""
    key = "router.total.count"
    return {
        role: values[key] - before.get(role, {}).get(key, 0.0)
        for role, values in after.items()
        if key in values
    }


def _stress(targets: dict, workload, result: dict, args, log) -> int:
    from cleave.bench import overload as stress

    ((name, target),) = targets.items()
    log(f"{name}:")
    with target:
        if args.overload:
            report = stress.overload(target, workload, args, log)
        else:
            report = stress.soak(target, workload, args, log)
    result["benchmark"] = "serve-overload" if args.overload else "serve-soak"
    result["deployments"][name] = report
    (stress.print_overload if args.overload else stress.print_soak)(report)
    _write(result, args, plot_stress, log)
    return 0


def _write(result: dict, args, plotter, log) -> None:
    """The JSON (--json) and the PNG (--plot, else next to the JSON)."""
    if args.json:
        write_json(result, args.json)
        log(f"wrote {args.json}")
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot:
        log(f"wrote {plotter(result, plot)}")


def _ms(value: float | None, width: int = 0) -> str:
    """A latency for the table; "-" when nothing succeeded (every request over budget)."""
    return f"{value:{width}.2f}" if value is not None else f"{'-':>{width}}"


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else float("nan")


def _search(probe, args) -> float:
    """Doubles the rate until a probe misses the budget, then bisects three times."""
    lo, hi = 0.0, None
    rate = min(args.rate_list) if args.rate_list else 25.0
    while hi is None and rate <= 100_000:
        if probe(rate)["within_budget"]:
            lo, rate = rate, rate * 2
        else:
            hi = rate
    for _ in range(3):
        if hi is None:
            break
        mid = round((lo + hi) / 2, 1)
        if probe(mid)["within_budget"]:
            lo = mid
        else:
            hi = mid
    return lo


def _targets(args, workload: Workload, result: dict) -> dict[str, Target]:
    """The deployments to measure, by name, in order."""
    first, *others = args.protocols
    started_here = not (args.url or args.plan or args.shard_hosts)
    if not started_here and ("grpc" in args.protocols or others):
        raise UsageError(
            "--protocol grpc or several protocols: only for deployments this "
            "command starts (not --url, --plan or --shard-hosts)"
        )
    if args.plan or args.shard_hosts:
        return hosts.targets(args, workload, result, Target)
    if args.url:
        return {"given": Target(url=args.url, protocol=first)}
    if args.compare:  # the baseline, then shards as processes, then shards in the router
        names = ["monolithic", "disaggregated", "router-held"]
    else:
        names = ["monolithic"] if args.monolithic else ["disaggregated"]
    bundle = workload.bundle_dir
    targets = {}
    for protocol in args.protocols:  # the first's keep their names; others' are NAME/PROTOCOL
        for name in names:
            flags = _serve_flags(args, name, protocol)
            key = name if protocol == first else f"{name}/{protocol}"
            targets[key] = Target(bundle, flags, protocol=protocol)
    if not args.monolithic and workload.bundle.per_request_inputs:
        # The same ranker running the model one request per batch, as before batched programs.
        targets["disaggregated-per-request"] = Target(
            bundle,
            [*_serve_flags(args, "disaggregated", first), "--no-shared-batching"],
            protocol=first,
        )
    if workload.float32_dir is not None and not args.monolithic:
        targets["disaggregated-float32"] = Target(
            workload.float32_dir,
            _serve_flags(args, "disaggregated", first),
            model=workload.float32_dir.name,
            want_model=True,
            protocol=first,
        )
    return targets


PROTOCOLS = ("json", "binary", "grpc")


def _protocols(text: str) -> list[str]:
    """--protocol's comma-separated list, checked."""
    protocols = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in protocols if p not in PROTOCOLS]
    if not protocols or bad or len(set(protocols)) != len(protocols):
        raise UsageError(
            f"--protocol: expected distinct names of {', '.join(PROTOCOLS)} separated by "
            f"commas, got {text!r}"
        )
    return protocols


def _codec_cpu_us(deployment: dict, protocol: str) -> float | None:
    """The router's CPU per request in parsing and encoding `protocol`, µs: the mean over the
    probes within budget (over every probe when none was)."""
    points = [p for p in deployment["rates"] if p["within_budget"]] or deployment["rates"]
    per_probe = [
        sum(v for k, v in p["metrics"].get("codec_cpu_us", {}).items() if k.endswith(protocol))
        for p in points
    ]
    per_probe = [v for v in per_probe if v > 0]
    return sum(per_probe) / len(per_probe) if per_probe else None


def _protocol_ratios(deps: dict, args) -> dict:
    """Each further protocol against the first, on the main deployment of the same run."""
    first, *others = args.protocols
    base = "monolithic" if args.monolithic else "disaggregated"
    ratios = {}
    for protocol in others:
        other, ref = deps.get(f"{base}/{protocol}"), deps.get(base)
        if not other or not ref:
            continue
        key = f"{protocol}_over_{first}"
        ratios[f"max_rate_{key}"] = _ratio(
            other["max_rate_within_budget"], ref["max_rate_within_budget"]
        )
        ratios[f"max_goodput_{key}"] = _ratio(_max_goodput(other), _max_goodput(ref))
        ratios[f"single_p50_{key}"] = _ratio(other["single"]["p50_ms"], ref["single"]["p50_ms"])
        ratios[f"codec_cpu_{key}"] = _ratio(
            _codec_cpu_us(other, protocol), _codec_cpu_us(ref, first)
        )
    return ratios


def _grpc_port(flags: list[str]) -> int | None:
    return int(flags[flags.index("--grpc-port") + 1]) if "--grpc-port" in flags else None


def _max_goodput(deployment: dict) -> float:
    return max((p["goodput_rps"] for p in deployment["rates"]), default=0.0)


def _serve_flags(args, mode: str, protocol: str = "json") -> list[str]:
    """`cleave serve`'s flags for a deployment in `mode` (disaggregated, monolithic,
    router-held) that gets requests in `protocol`."""
    flags = ["--shards", str(args.shards), "--rankers", str(args.rankers)]
    if protocol == "grpc":
        from cleave.runners.local import free_ports

        flags += ["--grpc-port", str(free_ports("127.0.0.1", 1)[0])]
    if args.config:
        flags += ["--config", args.config]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if args.compile:
        flags.append("--compile")
    if mode != "disaggregated":
        flags.append(f"--{mode}")
    return flags


def print_table(result: dict) -> None:
    print(
        f"{'deployment':<22} {'rate/s':>8} {'tput/s':>8} {'good/s':>8} {'p50 ms':>8} "
        f"{'p95 ms':>8} {'p99 ms':>8}  errors"
    )
    for name, dep in result["deployments"].items():
        s = dep["single"]
        print(
            f"{name:<22} {'single':>8} {'':>8} {'':>8} {_ms(s['p50_ms'], 8)} "
            f"{_ms(s['p95_ms'], 8)} {_ms(s['p99_ms'], 8)}  {s['errors'] or ''}"
        )
        for p in sorted(dep["rates"], key=lambda p: p["rate"]):
            fmt = [_ms(p[k], 8) for k in ("p50_ms", "p95_ms", "p99_ms")]
            print(
                f"{name:<22} {p['rate']:8.1f} {p['throughput_rps']:8.1f} {p['goodput_rps']:8.1f} "
                f"{' '.join(fmt)}  {p['errors'] or ''}"
            )
        print(
            f"{name:<22} max rate with p99 <= {result['budget_ms']:g} ms: "
            f"{dep['max_rate_within_budget']:g}/s; HTTP 502s: {dep.get('http_502', 0)}"
        )
    for key, value in result.get("ratios", {}).items():
        if isinstance(value, dict):  # per rate
            print(f"{key}: " + ", ".join(f"{k}/s {_ratio_text(v)}" for k, v in value.items()))
        else:
            print(f"{key}: {_ratio_text(value)}")


def _ratio_text(value: float | None) -> str:
    """None: the baseline had none (no rate within budget, say)."""
    return "-" if value is None else f"{value:.3f}"


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.rates, args.duration, args.single, args.requests = "20,40", 1.5, 20, 8
        args.search = False
    try:
        args.rate_list = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        raise UsageError(
            f"--rates: expected numbers separated by commas, got {args.rates!r}"
        ) from None
    if any(r <= 0 for r in args.rate_list):
        raise UsageError(f"--rates must be > 0, got {args.rates!r}")
    if args.duration <= 0 or args.candidates < 1 or args.requests < 1 or args.single < 1:
        raise UsageError("--duration, --candidates, --requests and --single must be positive")
    if args.soak is not None and args.soak <= 0:
        raise UsageError(f"--soak takes minutes > 0, got {args.soak}")
    if (args.overload or args.soak) and args.compare:
        raise UsageError("--overload and --soak measure one deployment: drop --compare")
    if args.idle_connections < 0 or args.capacity is not None and args.capacity <= 0:
        raise UsageError("--idle-connections must be >= 0 and --capacity > 0")
    args.protocols = _protocols(args.protocol)
    if len(args.protocols) > 1 and (args.overload or args.soak):
        raise UsageError("--overload and --soak measure one deployment: give one --protocol")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    hosts.check_deployment_flags(args)
    # SIGTERM unwinds like Ctrl-C: every deployment started here is stopped (and its testbed
    # removed) on the way out, instead of outliving the benchmark.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    t0 = time.perf_counter()
    workload = Workload(args)
    log(
        f"workload: {args.model} scale {workload.scale:g}, bundle {workload.bundle_dir} "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    result = new_result(args, workload)
    if args.realtime:  # after the workload is built: only the measurement runs under it
        go_realtime()  # children inherit it: the router, shards and rankers run under it too
    targets = _targets(args, workload, result)
    if args.overload or args.soak:
        return _stress(targets, workload, result, args, log)
    paired = {}
    if len(targets) > 1:  # both up (idle ones cost nothing), single requests in turns
        log("single-request latency, deployments in alternating rounds:")
        try:
            for target in targets.values():
                target.start()
            paired = paired_single(targets, workload, args, log)
        finally:
            for target in targets.values():
                target.stop()
    for name, target in targets.items():
        log(f"{name}:")
        with target:  # alone on the machine while loaded
            deployment = measure(target, workload, args, log, single=not paired)
        if paired:
            deployment["single"] = paired[name]
        result["deployments"][name] = deployment
    deps = result["deployments"]
    if "monolithic" in deps and "disaggregated" in deps:
        mono, dis = deps["monolithic"], deps["disaggregated"]
        rounds = zip(
            dis["single"].get("round_p50_ms", []),
            mono["single"].get("round_p50_ms", []),
            strict=True,
        )
        ratios = sorted(d / m for d, m in rounds if d and m)
        result["ratios"] = {
            "single_p50_disagg_over_mono": _ratio(
                dis["single"]["p50_ms"], mono["single"]["p50_ms"]
            ),
            "single_p50_disagg_over_mono_median_of_rounds": (
                ratios[len(ratios) // 2] if ratios else float("nan")
            ),
            "max_rate_disagg_over_mono": _ratio(
                dis["max_rate_within_budget"], mono["max_rate_within_budget"]
            ),
        }
    if "disaggregated-float32" in deps and "disaggregated" in deps:
        reduced, fp32 = deps["disaggregated"], deps["disaggregated-float32"]
        result.setdefault("ratios", {}).update(
            {
                "max_rate_dtype_over_float32": _ratio(
                    reduced["max_rate_within_budget"], fp32["max_rate_within_budget"]
                ),
                "single_p50_dtype_over_float32": _ratio(
                    reduced["single"]["p50_ms"], fp32["single"]["p50_ms"]
                ),
            }
        )
    if "router-held" in deps and "disaggregated" in deps:
        held, dis = deps["router-held"], deps["disaggregated"]
        result.setdefault("ratios", {}).update(
            {
                "single_p50_held_over_disagg": _ratio(
                    held["single"]["p50_ms"], dis["single"]["p50_ms"]
                ),
                "max_rate_held_over_disagg": _ratio(
                    held["max_rate_within_budget"], dis["max_rate_within_budget"]
                ),
                "max_goodput_held_over_disagg": _ratio(_max_goodput(held), _max_goodput(dis)),
            }
        )
    if "disaggregated-per-request" in deps and "disaggregated" in deps:
        joined, alone = deps["disaggregated"], deps["disaggregated-per-request"]
        result.setdefault("ratios", {}).update(
            {
                "max_rate_joined_over_per_request": _ratio(
                    joined["max_rate_within_budget"], alone["max_rate_within_budget"]
                ),
                "max_goodput_joined_over_per_request": _ratio(
                    _max_goodput(joined), _max_goodput(alone)
                ),
            }
        )
    if len(args.protocols) > 1:
        result.setdefault("ratios", {}).update(_protocol_ratios(deps, args))
    if "incast-off" in deps and "incast-on" in deps:
        result.setdefault("ratios", {}).update(hosts.incast_ratios(deps))
    if workload.float32_dir is not None:
        result["float32_distance"] = workload.float32_distance
    if args.shard_hosts:
        result["ratios"] = hosts.hosts_ratios(result)
    if args.check:
        diffs = [
            p["max_abs_diff"]
            for d in deps.values()
            for p in [d["single"], *d["rates"]]
            if p["max_abs_diff"] is not None
        ]
        result["max_abs_diff"] = max(diffs) if diffs else None
    print_table(result)
    if workload.roofline:
        print_roofline(workload.roofline)
    hosts.print_stages(result)
    if args.shard_hosts:
        hosts.print_hosts(result)
    _write(result, args, plot_hosts if args.shard_hosts else plot_results, log)
    return 0
