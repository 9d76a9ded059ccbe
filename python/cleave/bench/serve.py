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

This file declares the deployments (targets) and their same-run ratios; cleave.bench.harness
builds the workload, measures and summarises. `--overload` and `--soak` are
cleave.bench.overload's, `--plan` and `--shard-hosts` cleave.bench.hosts's.
"""

from __future__ import annotations

import argparse
import sys
import time

from cleave.bench import hosts
from cleave.bench.harness.command import positives
from cleave.bench.harness.measurement import measure, paired_single
from cleave.bench.harness.summary import (
    Ratio,
    codec_cpu_us,
    cpu_per_request,
    max_goodput,
    max_rate,
    new_result,
    print_table,
    ratio,
    ratio_of,
    same_run_ratios,
    single_p50,
    write_json,
    write_outputs,
)
from cleave.bench.harness.target import Target, serve_flags
from cleave.bench.harness.workload import Workload, parse_protocols, print_roofline
from cleave.bench.machine import go_realtime, parse_pin, pinned
from cleave.bench.plot import plot_hosts, plot_results
from cleave.errors import UsageError
from cleave.settings.choices import DENSE_DTYPES, DEVICES

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
        choices=DENSE_DTYPES.names,
        help="serve a bundle with this dense precision (refused if it fails its accuracy "
        "check); default: a bundle approving every dtype that passes, served at the rankers' "
        "own choice; a reduced one is compared with float32 served the same way",
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads per ranker (default: cleave serve's split)"
    )
    parser.add_argument(
        "--compile", action="store_true", help="rankers compile their dense program (CPU)"
    )
    parser.add_argument(
        "--device",
        choices=DEVICES.names,
        help="the rankers' device in the disaggregated and router-held deployments (default: "
        "cleave serve's); the monolithic baseline runs on the CPU",
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
    parser.add_argument(
        "--transport",
        metavar="T[,T...]",
        help="internal sockets of the deployments started here: unix, shm, tcp or mptcp; several, "
        "comma-separated, measure each in the same run on its own deployment, with the "
        "`transfer` stage and the router's CPU per request as ratios against the first "
        "(default: cleave serve's)",
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
    parser.add_argument(
        "--rankers", type=int, default=1, help="rankers of each deployment but the monolith's one"
    )
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
        help="capacity C closed loop (8 clients), then per --bursts factor X: 40%% of C, X·C, "
        "40%% again, --duration seconds each (2 s client timeout; requests carry --budget-ms "
        "if given, else the router's default applies)",
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
        "--bursts",
        default="1.5,3,10",
        help="--overload: burst factors over the capacity, comma-separated (default 1.5,3,10)",
    )
    parser.add_argument(
        "--generator",
        choices=["cleave", "vegeta"],
        default="cleave",
        help="--overload: the bursts' load generator: the project's (Poisson arrivals) or "
        "vegeta, an independent one (constant rate; on PATH or in $VEGETA)",
    )
    parser.add_argument(
        "--pin",
        default="auto",
        metavar="SERVER:CLIENT",
        help="--overload/--soak: CPU lists for the deployment and for the load generator, "
        "e.g. 0-2:3 (default auto: every allowed core but the last for the deployment, the "
        "last for the generator; off: no pinning)",
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


def _median_of_rounds(dis: dict, mono: dict) -> float:
    """The median over the paired single-request rounds of disaggregated p50 / monolithic p50."""
    rounds = zip(
        dis["single"].get("round_p50_ms", []), mono["single"].get("round_p50_ms", []), strict=True
    )
    ratios = sorted(d / m for d, m in rounds if d and m)
    return ratios[len(ratios) // 2] if ratios else float("nan")


# Same-run ratios between this command's deployments, reported when both ran.
RATIOS = (
    Ratio("single_p50_disagg_over_mono", "disaggregated", "monolithic", ratio_of(single_p50)),
    Ratio(
        "single_p50_disagg_over_mono_median_of_rounds",
        "disaggregated",
        "monolithic",
        _median_of_rounds,
    ),
    Ratio("max_rate_disagg_over_mono", "disaggregated", "monolithic", ratio_of(max_rate)),
    Ratio("cpu_per_request_disagg_over_mono", "disaggregated", "monolithic", cpu_per_request),
    Ratio(
        "max_rate_dtype_over_float32", "disaggregated", "disaggregated-float32", ratio_of(max_rate)
    ),
    Ratio(
        "single_p50_dtype_over_float32",
        "disaggregated",
        "disaggregated-float32",
        ratio_of(single_p50),
    ),
    Ratio(
        "single_p50_disagg_over_torchrec", "disaggregated", "torchrec-eager", ratio_of(single_p50)
    ),
    Ratio("max_rate_disagg_over_torchrec", "disaggregated", "torchrec-eager", ratio_of(max_rate)),
    Ratio(
        "max_goodput_disagg_over_torchrec", "disaggregated", "torchrec-eager", ratio_of(max_goodput)
    ),
    Ratio("single_p50_held_over_disagg", "router-held", "disaggregated", ratio_of(single_p50)),
    Ratio("max_rate_held_over_disagg", "router-held", "disaggregated", ratio_of(max_rate)),
    Ratio("max_goodput_held_over_disagg", "router-held", "disaggregated", ratio_of(max_goodput)),
    Ratio(
        "max_rate_joined_over_per_request",
        "disaggregated",
        "disaggregated-per-request",
        ratio_of(max_rate),
    ),
    Ratio(
        "max_goodput_joined_over_per_request",
        "disaggregated",
        "disaggregated-per-request",
        ratio_of(max_goodput),
    ),
)


def _protocol_ratios(protocols: list[str], monolithic: bool) -> list[Ratio]:
    """Each further protocol against the first, on the main deployment of the same run."""
    first, *others = protocols
    base = "monolithic" if monolithic else "disaggregated"
    declared = []
    for protocol in others:
        key, other = f"{protocol}_over_{first}", f"{base}/{protocol}"
        codec = _codec_ratio(protocol, first)
        declared += [
            Ratio(f"max_rate_{key}", other, base, ratio_of(max_rate)),
            Ratio(f"max_goodput_{key}", other, base, ratio_of(max_goodput)),
            Ratio(f"single_p50_{key}", other, base, ratio_of(single_p50)),
            Ratio(f"codec_cpu_{key}", other, base, codec),
        ]
    return declared


def _transport_ratios(transports: list[str], monolithic: bool) -> list[Ratio]:
    """Each further transport against the first (docs/benchmarks.md, "Pass-by-reference")."""
    first, *others = transports or ["unix"]
    base = "monolithic" if monolithic else "disaggregated"
    declared = []
    for transport in others:
        key, other = f"{transport}_over_{first}", f"{base}/{transport}"
        declared += [
            Ratio(f"transfer_ms_{key}", other, base, _at_common_rates(_transfer_ms)),
            Ratio(f"send_cpu_ms_{key}", other, base, _at_common_rates(_send_cpu_ms)),
            Ratio(f"router_cpu_ms_{key}", other, base, _at_common_rates(_router_cpu_ms)),
            Ratio(f"single_p50_{key}", other, base, ratio_of(single_p50)),
            Ratio(f"max_rate_{key}", other, base, ratio_of(max_rate)),
        ]
    return declared


def _transfer_ms(point: dict) -> float | None:
    """The router's `transfer` stage of one probe (the ranker's round trip less its queue and
    compute), ms."""
    us = point.get("metrics", {}).get("stages_us", {}).get("transfer_us")
    return us / 1e3 if us is not None else None


def _pickup_ms(point: dict) -> float | None:
    """The rankers' pickup (stages.py): the part of their queue spent in the frame server, ms."""
    us = point.get("metrics", {}).get("stages_us", {}).get("pickup_us")
    return us / 1e3 if us is not None else None


def _send_cpu_ms(point: dict) -> float | None:
    """The routers' CPU per ranker round trip on the send path (stages.py), ms."""
    us = point.get("metrics", {}).get("send_cpu_us")
    return us / 1e3 if us is not None else None


def _router_cpu_ms(point: dict) -> float | None:
    """The routers' CPU per request answered in one probe, ms: every router process's CPU
    time (its send path included) over the requests."""
    by_role = point.get("cpu_ms_by_role", {})
    routers = [v for role, v in by_role.items() if role.startswith("router")]
    return sum(routers) if routers else None


def _at_common_rates(metric):
    """The ratio of a probe metric's means over the rates both deployments served within
    budget (every common rate when none was): the same offered load on both sides."""

    def value(of: dict, to: dict) -> float:
        def by_rate(d: dict, good: bool) -> dict:
            return {
                p["rate"]: metric(p)
                for p in d["rates"]
                if (p["within_budget"] or not good) and metric(p) is not None
            }

        a, b = by_rate(of, True), by_rate(to, True)
        if not set(a) & set(b):
            a, b = by_rate(of, False), by_rate(to, False)
        common = sorted(set(a) & set(b))
        if not common:
            return float("nan")
        return ratio(sum(a[r] for r in common), sum(b[r] for r in common))

    return value


def transport_summary(deployments: dict) -> dict:
    """Per deployment: its mean `transfer` stage, rankers' pickup, routers' send-path CPU per
    round trip and routers' CPU per request, ms, over its probes within budget (every probe
    when none was)."""
    out = {}
    for name, d in deployments.items():
        points = [p for p in d["rates"] if p["within_budget"]] or d["rates"]
        row = {}
        for key, metric in (
            ("transfer_ms", _transfer_ms),
            ("pickup_ms", _pickup_ms),
            ("send_cpu_ms", _send_cpu_ms),
            ("router_cpu_ms", _router_cpu_ms),
        ):
            values = [v for v in map(metric, points) if v is not None]
            row[key] = sum(values) / len(values) if values else None
        out[name] = row
    return out


def _codec_ratio(protocol: str, first: str):
    return lambda of, to: ratio(codec_cpu_us(of, protocol), codec_cpu_us(to, first))


def _targets(args, workload: Workload, result: dict) -> dict[str, Target]:
    """The deployments to measure, by name, in order."""
    first, *others = args.protocols
    started_here = not (args.url or args.plan or args.shard_hosts)
    if not started_here and args.transports:
        raise UsageError("--transport: only for deployments this command starts")
    if not started_here and ("grpc" in args.protocols or others):
        raise UsageError(
            "--protocol grpc or several protocols: only for deployments this "
            "command starts (not --url, --plan or --shard-hosts)"
        )
    if args.plan or args.shard_hosts:
        return hosts.targets(args, workload, result)
    if args.url:
        return {"given": Target(url=args.url, protocol=first)}
    if args.compare:  # the baseline, then shards as processes, then shards in the router
        names = ["monolithic", "disaggregated", "router-held"]
    else:
        names = ["monolithic"] if args.monolithic else ["disaggregated"]
    bundle = workload.bundle_dir
    targets = {}
    if workload.eager_model is not None and not args.monolithic:
        # TorchRec's model run as it is, eagerly, in one process: the baseline (first).
        flags = serve_flags(args, "monolithic", first)
        targets["torchrec-eager"] = Target(
            bundle, [*flags, "--eager-model", str(workload.eager_model)], protocol=first
        )
    # One deployment per mode, its router listening for every protocol asked for (gRPC too):
    # the first protocol's target keeps the mode's name, the others' are MODE/PROTOCOL.
    listen = "grpc" if "grpc" in args.protocols else first
    for protocol in args.protocols:
        for name in names:
            if protocol == first:
                targets[name] = Target(bundle, serve_flags(args, name, listen), protocol=first)
            else:
                targets[f"{name}/{protocol}"] = targets[name].through(protocol)
    if not args.monolithic and workload.bundle.per_request_inputs:
        # The same ranker running the model one request per batch, as before batched programs.
        targets["disaggregated-per-request"] = Target(
            bundle,
            [*serve_flags(args, "disaggregated", first), "--no-shared-batching"],
            protocol=first,
        )
    _transport_targets(args, targets, names, listen)
    # The float32 twin for the ratio; an overload or soak measures the one deployment asked for.
    stress = args.overload or args.soak is not None
    if workload.float32_dir is not None and not args.monolithic and not stress:
        targets["disaggregated-float32"] = Target(
            workload.float32_dir,
            [*serve_flags(args, "disaggregated", first), *workload.float32_flags],
            model=workload.float32_dir.name,
            want_model=True,
            protocol=first,
        )
    return targets


def _transport_targets(args, targets: dict[str, Target], names: list[str], listen: str) -> None:
    """--transport: the main deployments use the first; each further one gets a deployment of
    its own per mode, `MODE/TRANSPORT`, on the same bundle and flags."""
    if not args.transports:
        return
    first, *others = args.transports
    for name in names:
        targets[name].flags += ["--transport", first]
        for transport in others:
            flags = [*serve_flags(args, name, listen), "--transport", transport]
            targets[f"{name}/{transport}"] = Target(
                targets[name].bundle, flags, protocol=args.protocols[0]
            )


def _check_args(args: argparse.Namespace) -> None:
    """This command's flags, checked and completed (--quick, the rate list, the protocols, the
    deployment flags)."""
    if args.quick:
        args.rates, args.duration, args.single, args.requests = "20,40", 1.5, 20, 8
        args.search = False
    args.rate_list = positives(args.rates, "--rates")
    if args.duration <= 0 or args.candidates < 1 or args.requests < 1 or args.single < 1:
        raise UsageError("--duration, --candidates, --requests and --single must be positive")
    if args.soak is not None and args.soak <= 0:
        raise UsageError(f"--soak takes minutes > 0, got {args.soak}")
    if (args.overload or args.soak) and args.compare:
        raise UsageError("--overload and --soak measure one deployment: drop --compare")
    if args.idle_connections < 0 or args.capacity is not None and args.capacity <= 0:
        raise UsageError("--idle-connections must be >= 0 and --capacity > 0")
    try:
        args.burst_list = [float(b) for b in args.bursts.split(",") if b.strip()]
    except ValueError:
        args.burst_list = []
    if not args.burst_list or min(args.burst_list) <= 0:
        raise UsageError(f"--bursts: expected factors > 0 separated by commas, got {args.bursts!r}")
    args.pin_cpus = parse_pin(args.pin) if args.overload or args.soak else (None, None)
    if args.overload and args.generator == "vegeta":
        from cleave.bench import vegeta

        vegeta.binary()  # before anything starts
    args.protocols = parse_protocols(args.protocol)
    args.transports = _parse_transports(args.transport)
    if len(args.transports) > 1 and len(args.protocols) > 1:
        raise UsageError("several --transport and several --protocol: give one of them a list")
    if len(args.protocols) > 1 and (args.overload or args.soak):
        raise UsageError("--overload and --soak measure one deployment: give one --protocol")
    vars(args).update(hosts.deployment_settings(args))


def _print_transports(result: dict) -> None:
    rows = result.get("by_transport")
    if not rows:
        return
    heads = ("transfer ms", "pickup ms", "send CPU ms", "router CPU ms/req")
    print(f"{'deployment':<28}" + "".join(f"{h:>18}" for h in heads))
    for name, row in rows.items():
        cells = [f"{row[k]:.3f}" if row[k] is not None else "-" for k in row]
        print(f"{name:<28}" + "".join(f"{c:>18}" for c in cells))
    for key, value in result.get("ratios", {}).items():
        if key.startswith(("transfer_ms_", "send_cpu_ms_", "router_cpu_ms_")):
            print(f"{key}: {value:.3f}")


def _parse_transports(text: str | None) -> list[str]:
    from cleave.settings.choices import TRANSPORTS

    if not text:
        return []
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TRANSPORTS.names]
    if bad or not names or len(set(names)) != len(names):
        raise UsageError(
            f"--transport: expected distinct names among {', '.join(TRANSPORTS.names)} "
            f"separated by commas, got {text!r}"
        )
    return names


def _stress(targets: dict, workload: Workload, result: dict, args, log) -> int:
    """--overload or --soak on the one deployment, server and load generator on the cores
    --pin gives each: measure, print, write."""
    from cleave.bench import overload, soak
    from cleave.bench.plot import plot_stress

    ((name, target),) = targets.items()
    log(f"{name}:")
    server_cpus, client_cpus = args.pin_cpus
    target.cpus = server_cpus
    result["layout"] = {"server_cpus": server_cpus, "client_cpus": client_cpus}
    with target, pinned(client_cpus):
        report = (overload.overload if args.overload else soak.soak)(target, workload, args, log)
    # The rankers' choice moves capacity most between runs of a bundle approving several.
    report["dense_dtype_served"] = target.dense_dtype
    result["benchmark"] = "serve-overload" if args.overload else "serve-soak"
    result["deployments"][name] = report
    (overload.print_overload if args.overload else soak.print_soak)(report)
    write_outputs(result, args, plot_stress, log)
    return 0


def _measure_all(targets: dict[str, Target], workload: Workload, args, log) -> dict:
    """Each deployment measured: single requests of all in alternating rounds (all up: idle
    ones cost nothing), then each one's rates alone on the machine. A --quick smoke run keeps
    them all up instead of starting each again."""
    paired = {}
    if len(targets) > 1:
        log("single-request latency, deployments in alternating rounds:")
        for target in targets.values():
            target.start()
        paired = paired_single(targets, workload, args, log)
        if not args.quick:
            for target in targets.values():
                target.stop()
    deployments = {}
    for name, target in targets.items():
        log(f"{name}:")
        if not target.running:
            target.start()
        deployments[name] = measure(target, workload, args, log, single=not paired)
        if not args.quick:
            target.stop()
        if paired:
            deployments[name]["single"] = paired[name]
    return deployments


def run(args: argparse.Namespace) -> int:
    _check_args(args)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    workload = Workload(args)
    args.budget_ms = workload.budget_ms
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
    try:
        result["deployments"] = _measure_all(targets, workload, args, log)
    finally:
        for target in targets.values():
            target.stop()
    deps = result["deployments"]
    declared = [
        *RATIOS,
        *_protocol_ratios(args.protocols, args.monolithic),
        *_transport_ratios(args.transports, args.monolithic),
        *hosts.INCAST_RATIOS,
    ]
    ratios = same_run_ratios(deps, declared)
    if ratios:
        result["ratios"] = ratios
    if len(args.transports) > 1:
        result["transports"] = args.transports
        result["by_transport"] = transport_summary(deps)
    if workload.float32_dir is not None:
        served = targets["disaggregated"].dense_dtype if "disaggregated" in targets else None
        result["dense_dtype_served"] = served or workload.bundle.dense_dtype
        result["float32_distance"] = workload.distance_for.get(served, workload.float32_distance)
        by_dtype = (workload.roofline or {}).get("by_dtype", {})
        if served in by_dtype:  # the rankers' own choice
            workload.roofline["served"] = by_dtype[served]
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
    _print_transports(result)
    if args.shard_hosts:
        hosts.print_hosts(result)
    write_outputs(result, args, plot_hosts if args.shard_hosts else plot_results, log)
    return 0
