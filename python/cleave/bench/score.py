"""`cleave bench score`: `cleave score` over ranks x lag x injected imbalance (BLS §V, Fig. 7).

Each case scores the same Parquet input with `--ranks` rank processes at one lag:

* `balanced`: the reference model's requests as they are;
* `random_delay`: every rank sleeps uniform [0, 2d] seconds before each batch (its own draw
  per batch: BLS's randomized delays). A synchronous alltoallv pays the expected maximum of
  the ranks' delays, 2dP/(P+1); a lagged one tends to the mean, d: it can save at most
  (P-1)/(P+1) d per batch;
* `hot_table`: one table's bags hold 1 to 100 ids, a new length every batch (BLS's
  heterogeneous message sizes): its owner pools and sends far more than the others;
* `straggler`: the last rank sleeps d before every batch, the others never: no lag masks a
  delay that comes every batch.

Reported per case: rows/s, per-batch time (each rank's scoring time over its batches, the
mean over ranks: BLS's latency) with the percentiles of single iterations, and the scores'
equality with lag 0's; the same-run comparison is lag 0 of the same imbalance and rank count.

`--ranks` may list several counts (`1,2`): each case with more than one rank is then also
compared with one rank (`speedup_over_1_rank`, rows/s), and `--independent` adds, per count N,
N one-rank jobs scoring at once (`independent`): how far the cores scale for the same work
without any exchange. `--online` measures the online path on the same cores: `cleave bench
serve --search` on the same bundle (binary tensors, `--online-candidates` rows a request), its
highest rate within budget in rows/s (`online`, and `ratios.rank1_over_online`).
`--throughput` is the scaling run: 1 and 2 ranks of one thread, lags 0 and 2, balanced,
262,144 rows in batches of 4,096 (unless `--batch-size`), with the independent jobs, the online
path and, as its reference, one process on every core.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from cleave.bench.harness.command import counts
from cleave.bench.harness.summary import nearest_rank, write_outputs
from cleave.bench.machine import describe
from cleave.errors import UsageError

IMBALANCES = ("balanced", "random_delay", "hot_table", "straggler")
HOT_MAX_IDS = 100  # a hot bag's ids: 1 to this many, drawn per batch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="dlrm", help="reference model (cleave.models.MODELS)")
    parser.add_argument("--scale", type=float, default=0.002, help="table scale")
    parser.add_argument("--ranks", default="4", help="comma-separated rank counts")
    parser.add_argument("--lags", default="0,2,8", help="comma-separated lags; 0 is compared to")
    parser.add_argument(
        "--imbalance",
        default=",".join(IMBALANCES),
        help=f"comma-separated, of {', '.join(IMBALANCES)}",
    )
    parser.add_argument("--rows", type=int, default=32768, help="input rows")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="rows a batch (default 64; --throughput 4096)"
    )
    # d well above a batch's work on 4 ranks sharing 2 cores (20-30 ms), so that the delays,
    # not the cores, decide what a lag saves
    parser.add_argument("--delay-ms", type=float, default=50.0, help="d: the mean delay")
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the median kept")
    parser.add_argument("--workdir", default="out/bench-score", help="bundle, input, outputs")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write the plot here (default: next to --json)")
    parser.add_argument(
        "--independent", action="store_true", help="also N one-rank jobs at once, per count N"
    )
    parser.add_argument(
        "--throughput", action="store_true", help="the scaling run (1 vs 2 ranks; module doc)"
    )
    parser.add_argument(
        "--online", action="store_true", help="also the online path's rows/s (cleave bench serve)"
    )
    parser.add_argument("--online-candidates", type=int, default=100, help="rows a request")
    parser.add_argument("--quick", action="store_true", help="a smoke run (tests, CI)")


def run(args: argparse.Namespace) -> int:
    if args.throughput:
        args.ranks, args.lags, args.imbalance = "1,2", "0,2", "balanced"
        args.independent = args.online = True
        args.rows, args.threads = 262144, 1
        args.batch_size = args.batch_size or 4096
    args.batch_size = args.batch_size or 64
    if args.quick:
        args.rows, args.batch_size, args.delay_ms, args.repeats = min(args.rows, 2048), 64, 5.0, 1
    lags = counts(args.lags, "--lags", least=0)
    imbalances = args.imbalance.split(",")
    rank_counts = counts(args.ranks, "--ranks")
    if lags[0] != 0 or not set(imbalances) <= set(IMBALANCES):
        raise UsageError(f"--lags must start with 0; --imbalance among {', '.join(IMBALANCES)}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    bundle_dir, inputs = _prepare(args, work, log)
    d = args.delay_ms / 1e3
    result = {
        "benchmark": "score",
        "machine": describe(),
        "model": args.model,
        "scale": args.scale,
        "rows": args.rows,
        "batch_size": args.batch_size,
        "delay_s": d,
        "threads": args.threads,
        "cases": [],
    }
    # (imbalance, ranks, lag, threads) per case; lag None: `ranks` independent one-rank jobs
    keys = [
        (imbalance, ranks, lag, args.threads)
        for imbalance in imbalances
        for ranks in rank_counts
        for lag in ([0] if ranks == 1 else lags)
        + ([None] if args.independent and ranks > 1 else [])
    ]
    cores = describe()["cores"]
    if (
        args.online and cores != args.threads
    ):  # the online path's reference: one process, every core
        keys.append(("balanced", 1, 0, cores))
    runs: dict[tuple, list[dict]] = {}
    for repeat in range(args.repeats):  # repeats outermost: a drift in load hits every case
        for key in keys:
            imbalance, ranks, lag, threads = key
            data = inputs["hot_table" if imbalance == "hot_table" else "balanced"]
            if lag is None:
                case = _independent(bundle_dir, data, work, imbalance, ranks, args, d)
            else:
                case = _case(bundle_dir, data, work, imbalance, ranks, lag, threads, args, d)
            case["threads"] = threads
            case["cpu_us_per_row"] = case["cpu_s"] / max(case["rows"], 1) * 1e6
            log(f"[{repeat + 1}/{args.repeats}] {_line(case)}")
            runs.setdefault(key, []).append(case)
    reference: dict[str, set] = {}  # imbalance -> the bytes its first case wrote
    chosen: dict[tuple, dict] = {}
    for key in keys:
        imbalance, ranks, lag, threads = key
        mine = sorted(runs[key], key=lambda c: c["per_batch_s"])
        case = chosen[key] = mine[len(mine) // 2]  # the median run
        case["per_batch_runs_s"] = [c["per_batch_s"] for c in runs[key]]
        outputs = {c.pop("_output") for c in runs[key]}  # the files' bytes
        reference.setdefault(imbalance, outputs)
        case["same_scores_as_lag0"] = len(outputs) == 1 and outputs == reference[imbalance]
        if lag is not None:
            _compare(case, chosen[imbalance, ranks, 0, threads], imbalance, ranks, d)
        one = (imbalance, 1, 0, args.threads)
        if ranks > 1 and one in runs:  # per repeat (the same moment), median
            pairs = zip(runs[key], runs[one], strict=True)
            case["speedup_over_1_rank"] = float(
                np.median([c["rows_per_s"] / one["rows_per_s"] for c, one in pairs])
            )
        result["cases"].append(case)
    for case in result["cases"]:
        if case["imbalance"] == "random_delay":  # what the delays cost over balanced, same lag
            base = next(
                (
                    c
                    for c in result["cases"]
                    if (c["imbalance"], c["ranks"], c["lag"])
                    == ("balanced", case["ranks"], case["lag"])
                ),
                None,
            )
            if base:
                case["delay_cost_s"] = case["per_batch_s"] - base["per_batch_s"]
    if args.online:
        result["online"] = _online(bundle_dir, args, work, log)
        # the one-process case on the most threads: the cores the online path had
        one = [c for c in result["cases"] if (c["ranks"], c["lag"]) == (1, 0)]
        if one:
            best = max(one, key=lambda c: c["threads"])
            result["online"]["rank1_threads"] = best["threads"]
            if result["online"]["rows_per_s"]:  # 0: no rate met the budget (a loaded machine)
                rate = result["online"]["rows_per_s"]
                result["ratios"] = {"rank1_over_online": best["rows_per_s"] / rate}
    print_table(result)
    write_outputs(result, args, plot_cases, log)
    return 0


def _prepare(args, work: Path, log) -> tuple[Path, dict[str, Path]]:
    """The model's bundle and two inputs: its requests (balanced) and the same with one hot
    table (hot_table)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import cleave
    from cleave.models import MODELS, RequestGenerator
    from cleave.score.input import Schema, to_rows

    bundle_dir = work / f"{args.model}-{args.scale:g}"
    if not bundle_dir.exists():
        model, example = MODELS[args.model].factory(scale=args.scale, seed=0)
        model.eval()
        cleave.partition(model, example).save(bundle_dir)
    bundle = cleave.load_bundle(bundle_dir)
    schema = Schema(bundle.manifest)
    name = f"{args.model}-{args.scale:g}-{args.rows}-{args.batch_size}"
    inputs = {"balanced": work / f"{name}.parquet", "hot_table": work / f"{name}-hot.parquet"}
    if inputs["hot_table"].exists():
        return bundle_dir, inputs
    log(f"writing {args.rows} rows of {args.model} requests to {inputs['balanced']}")
    generator = RequestGenerator(args.model, scale=args.scale, seed=1)
    parts, left = [], args.rows
    while left:
        n = min(left, 1024)
        parts.append(to_rows(schema, bundle.named_inputs(*generator.batch(n))))
        left -= n
    table = pa.concat_tables(parts)
    pq.write_table(table, inputs["balanced"], row_group_size=16384)
    # The hot table: the largest (its owner is rank 0), bags of 1 to HOT_MAX_IDS ids.
    largest = max(bundle.manifest["tables"], key=lambda t: t["rows"] * t["row_bytes"])
    hot = next(f for f in schema.features if f.table == largest["name"])
    rng = np.random.default_rng(2)
    batches = -(-args.rows // args.batch_size)
    per_batch = rng.integers(1, HOT_MAX_IDS + 1, batches)
    lengths = np.repeat(per_batch, args.batch_size)[: args.rows]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = rng.integers(0, largest["rows"], int(offsets[-1]))
    bags = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
    hot_table = table.set_column(table.column_names.index(hot.column), hot.column, bags)
    pq.write_table(hot_table, inputs["hot_table"], row_group_size=16384)
    return bundle_dir, inputs


def _case(bundle_dir, data, work, imbalance, ranks, lag, threads, args, d) -> dict:
    from cleave.score import job as score_job

    inject = _inject(imbalance, d)
    job, out = _job(
        bundle_dir,
        data,
        work / f"scores-{imbalance}-r{ranks}-k{lag}-t{threads}.parquet",
        ranks,
        lag,
        threads,
        args,
        inject,
    )
    summary = score_job.run(job, processes=True)
    case = _statistics(summary["ranks"], imbalance, ranks, lag, d if inject else 0.0)
    return {
        **case,
        "rows": summary["rows"],
        "rows_per_s": summary["rows_per_s"],
        "_output": out.read_bytes(),
    }


def _inject(imbalance: str, d: float) -> dict:
    """cleave score's injected delays for an imbalance (none for balanced and hot_table)."""
    delayed = imbalance in ("random_delay", "straggler")
    return {"kind": imbalance, "delay_s": d, "seed": 1} if delayed else {}


def _independent(bundle_dir, data, work, imbalance, ranks, args, d) -> dict:
    """`ranks` one-rank jobs of the whole input at once, each in its own process and with the
    imbalance's delays: their rows/s summed, their statistics as one case's."""
    from concurrent.futures import ThreadPoolExecutor

    from cleave.score import job as score_job

    inject = _inject(imbalance, d)
    jobs = [
        _job(
            bundle_dir,
            data,
            work / f"scores-{imbalance}-independent-{n}.parquet",
            1,
            0,
            args.threads,
            args,
            inject,
        )
        for n in range(ranks)
    ]
    with ThreadPoolExecutor(ranks) as pool:
        summaries = list(pool.map(lambda j: score_job.run(j[0], processes=True), jobs))
    outputs = {out.read_bytes() for _, out in jobs}
    stats = [s["ranks"][0] for s in summaries]
    case = _statistics(stats, imbalance, ranks, None, d if inject else 0.0)
    return {
        **case,
        "kind": "independent",
        "rows": sum(s["rows"] for s in summaries),
        "rows_per_s": sum(s["rows_per_s"] for s in summaries),
        "_output": outputs.pop() if len(outputs) == 1 else b"differ",
    }


def _online(bundle_dir: Path, args, work: Path, log) -> dict:
    """The online path on the same cores: `cleave bench serve --search` on the bundle (router,
    shard, ranker), its highest rate within budget as rows/s."""
    out = work / "online.json"
    command = [sys.executable, "-m", "cleave.cli", "bench", "serve", "--model", args.model]
    command += ["--scale", f"{args.scale:g}", "--bundle", str(bundle_dir), "--search"]
    command += ["--protocol", "binary", "--candidates", str(args.online_candidates)]
    command += ["--workdir", str(work / "serve"), "--json", str(out)]
    if args.quick:
        command += ["--quick"]
    log(f"online path: {' '.join(command[2:])}")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise UsageError(f"cleave bench serve failed ({done.returncode}): {done.stderr[-2000:]}")
    served = json.loads(out.read_text())
    name, deployment = next(
        (n, d) for n, d in served["deployments"].items() if n.startswith("disaggregated")
    )
    rate = deployment["max_rate_within_budget"]
    return {
        "deployment": name,
        "candidates": args.online_candidates,
        "budget_ms": served["budget_ms"],
        "max_rate_within_budget": rate,
        "rows_per_s": rate * args.online_candidates,
    }


def _job(bundle_dir, data, out: Path, ranks: int, lag: int, threads: int, args, inject: dict):
    from cleave.score import job as score_job

    out.unlink(missing_ok=True)
    job, _ = score_job.prepare(
        bundle_dir,
        data,
        out,
        ranks=ranks,
        lag=lag,
        batch_size=args.batch_size,
        threads=threads,
        inject=inject,
    )
    return job, out


def _statistics(stats: list[dict], imbalance: str, ranks: int, lag, mean_delay: float) -> dict:
    per_batch = [s["seconds"] / max(s["iterations"], 1) for s in stats]
    steps = [t for s in stats for t in s["steps_s"]]
    stages = {
        k: float(np.mean([s["stages_s"][k] / max(s["iterations"], 1) for s in stats]))
        for k in stats[0]["stages_s"]
    }
    return {
        "imbalance": imbalance,
        "ranks": ranks,
        "lag": lag,
        "per_batch_s": float(np.mean(per_batch)),
        "per_batch_by_rank_s": per_batch,
        "cpu_s": sum(s["cpu_s"] for s in stats),  # the ranks' CPU over their scoring
        "iteration_p50_s": nearest_rank(steps, 0.50),
        "iteration_p95_s": nearest_rank(steps, 0.95),
        "iteration_p99_s": nearest_rank(steps, 0.99),
        "mean_delay_s": mean_delay,
        "stages_per_batch_s": stages,
    }


def _compare(case: dict, first: dict, imbalance: str, ranks: int, d: float) -> None:
    """The same-run comparison with lag 0: time saved per batch, and for random delays the
    share of the most a lag can save, (P-1)/(P+1) d."""
    case["per_batch_over_lag0"] = case["per_batch_s"] / first["per_batch_s"]
    case["saved_per_batch_s"] = first["per_batch_s"] - case["per_batch_s"]
    if imbalance == "random_delay" and ranks > 1:  # one rank has no peer to wait for
        bound = (ranks - 1) / (ranks + 1) * d
        case["bound_s"] = bound
        case["saved_of_bound"] = case["saved_per_batch_s"] / bound
    if imbalance == "straggler" and case["lag"]:
        case["why"] = (
            "the last rank sleeps d before every batch, so it falls further behind every "
            "batch: once the others are `lag` batches ahead they wait for it each batch, and "
            "the job goes at its pace, d plus its work per batch, whatever the lag"
        )


def _line(case: dict) -> str:
    extra = f", saved {case['saved_of_bound']:.0%} of the bound" if "saved_of_bound" in case else ""
    return (
        f"{case['imbalance']:<13} ranks {case['ranks']} {_lag(case)}, {case['threads']} thread(s): "
        f"{case['per_batch_s'] * 1e3:.2f} ms/batch, {case['rows_per_s']:,.0f} rows/s, "
        f"{case['cpu_us_per_row']:.2f} CPU us/row{extra}"
    )


def _lag(case: dict) -> str:
    return "independent" if case["lag"] is None else f"lag {case['lag']}"


def print_table(result: dict) -> None:
    print(
        f"{'imbalance':<13} {'ranks':>5} {'thr':>3} {'lag':>11} {'rows/s':>9} {'ms/batch':>9} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'vs lag 0':>8} {'saved ms':>8} {'of bound':>8} "
        f"{'delay ms':>8} {'vs 1 rank':>9} {'CPU us/row':>10}  same"
    )
    for c in result["cases"]:
        ratio = f"{c['per_batch_over_lag0']:.3f}" if "per_batch_over_lag0" in c else "-"
        saved = f"{c['saved_per_batch_s'] * 1e3:.2f}" if "saved_per_batch_s" in c else "-"
        bound = f"{c['saved_of_bound']:.0%}" if "saved_of_bound" in c else "-"
        cost = f"{c['delay_cost_s'] * 1e3:.2f}" if "delay_cost_s" in c else "-"
        speedup = f"{c['speedup_over_1_rank']:.2f}x" if "speedup_over_1_rank" in c else "-"
        same = {True: "yes", False: "NO"}.get(c.get("same_scores_as_lag0"), "-")
        lag = "indep." if c["lag"] is None else c["lag"]
        print(
            f"{c['imbalance']:<13} {c['ranks']:>5} {c['threads']:>3} {lag:>11} "
            f"{c['rows_per_s']:>9,.0f} "
            f"{c['per_batch_s'] * 1e3:>9.2f} {c['iteration_p50_s'] * 1e3:>7.2f} "
            f"{c['iteration_p99_s'] * 1e3:>7.2f} {ratio:>8} {saved:>8} {bound:>8} {cost:>8} "
            f"{speedup:>9} {c['cpu_us_per_row']:>10.2f}  {same}"
        )
    if "online" in result:
        o = result["online"]
        print(
            f"online path ({o['deployment']}, {o['candidates']} rows a request, "
            f"{o['budget_ms']:g} ms budget): {o['rows_per_s']:,.0f} rows/s; one rank / online "
            f"= {result.get('ratios', {}).get('rank1_over_online', float('nan')):.2f}x"
        )
    print(
        f"d = {result['delay_s'] * 1e3:g} ms; batch {result['batch_size']} rows; "
        f"{result['machine']['cores']} cores ({result['machine']['cpu']})"
    )


def plot_cases(result: dict, path: str | Path) -> Path:
    """Per-batch time against lag, one line per imbalance, lag 0's as the reference."""
    from cleave.bench.plot import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    cases = [c for c in result["cases"] if c["lag"] is not None]
    lines = dict.fromkeys((c["imbalance"], c["ranks"], c["threads"]) for c in cases)
    for imbalance, ranks, threads in lines:
        mine = [
            c
            for c in cases
            if (c["imbalance"], c["ranks"], c["threads"]) == (imbalance, ranks, threads)
        ]
        ax.plot(
            [c["lag"] for c in mine],
            [c["per_batch_s"] * 1e3 for c in mine],
            "o-",
            label=f"{imbalance}, {ranks} rank{'s' if ranks > 1 else ''} of {threads} thread(s)",
        )
    ax.set_xlabel("lag K (iterations)")
    ax.set_ylabel("per-batch time, ms")
    ax.set_title(f"cleave score, d = {result['delay_s'] * 1e3:g} ms")
    ax.legend()
    return save_figure(fig, path)
