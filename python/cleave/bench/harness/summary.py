"""The one summariser of the serving benchmarks: a run's samples into percentiles, goodput and
errors; same-run ratios between deployments; the table and the JSON every command prints."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cleave.bench.machine import describe

if TYPE_CHECKING:
    from cleave.bench.harness.workload import Workload
    from cleave.bench.loadgen import Sample


def summarize(samples: list[Sample], duration_s: float, budget_ms: float) -> dict:
    """Throughput, goodput (answered within budget, per second), latency percentiles, errors
    by kind and mean per-stage times."""
    ok = [s for s in samples if not s.error]
    lat_ms = np.array([s.latency_s * 1e3 for s in ok]) if ok else np.zeros(0)
    errors: dict[str, int] = {}
    for s in samples:
        if s.error:
            errors[s.error] = errors.get(s.error, 0) + 1
    stages: dict[str, float] = {}
    for s in ok:
        for k, v in s.stages_us.items():
            stages[k] = stages.get(k, 0.0) + v
    diffs = [s.max_abs_diff for s in ok if s.max_abs_diff is not None]

    def pct(q):
        return float(np.percentile(lat_ms, q)) if len(lat_ms) else None

    return {
        "sent": len(samples),
        "ok": len(ok),
        "throughput_rps": len(ok) / duration_s,
        "goodput_rps": float(np.sum(lat_ms <= budget_ms)) / duration_s,
        "p50_ms": pct(50),
        "p95_ms": pct(95),
        "p99_ms": pct(99),
        "mean_ms": float(lat_ms.mean()) if len(lat_ms) else None,
        "max_client_lag_ms": max((s.lag_s * 1e3 for s in samples), default=0.0),
        "errors": errors,
        "stages_us": {k: v / len(ok) for k, v in sorted(stages.items())},
        "checked": len(diffs),
        "max_abs_diff": max(diffs) if diffs else None,
    }


def nearest_rank(values, q: float) -> float | None:
    """The `q`-quantile (0..1) of `values` by the nearest-rank method (one of the values, no
    interpolation: the shard and incast benchmarks' percentiles); None without values."""
    if len(values) == 0:
        return None
    v = np.sort(np.asarray(values, dtype=np.float64))
    return float(v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))])


@dataclass(frozen=True)
class Ratio:
    """A same-run ratio an experiment declares: `value(of, to)` of two deployments measured in
    the same run, reported under `key` when both were measured."""

    key: str
    of: str
    to: str
    value: Callable[[dict, dict], float | None]


def ratio_of(metric: Callable[[dict], float | None]) -> Callable[[dict, dict], float]:
    """The ratio of one metric of two deployments."""
    return lambda of, to: ratio(metric(of), metric(to))


def max_rate(deployment: dict) -> float:
    return deployment["max_rate_within_budget"]


def single_p50(deployment: dict) -> float | None:
    return deployment["single"]["p50_ms"]


def codec_cpu_us(deployment: dict, protocol: str) -> float | None:
    """The router's CPU per request in parsing and encoding `protocol`, µs: the mean over the
    probes within budget (over every probe when none was)."""
    points = [p for p in deployment["rates"] if p["within_budget"]] or deployment["rates"]
    per_probe = [
        sum(v for k, v in p["metrics"].get("codec_cpu_us", {}).items() if k.endswith(protocol))
        for p in points
    ]
    per_probe = [v for v in per_probe if v > 0]
    return sum(per_probe) / len(per_probe) if per_probe else None


def same_run_ratios(deployments: dict, declared: Iterable[Ratio]) -> dict:
    """The declared ratios whose two deployments this run measured, in declaration order."""
    return {
        r.key: r.value(deployments[r.of], deployments[r.to])
        for r in declared
        if r.of in deployments and r.to in deployments
    }


def new_result(args, workload: Workload) -> dict:
    """A serving run's JSON before its deployments are measured."""
    from cleave.bench.harness.workload import read_bundle_summary

    return {
        "benchmark": "serve",
        "machine": describe(),
        "model": args.model,
        "scale": workload.scale,
        "candidates": args.candidates,
        "alpha": args.alpha,
        "budget_ms": workload.budget_ms,
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


def within_budget(point: dict, budget_ms: float, max_error_pct: float = 0.0) -> bool:
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


def write_outputs(result: dict, args, plotter, log) -> None:
    """The JSON (--json) and the PNG (--plot, else next to the JSON)."""
    if args.json:
        write_json(result, args.json)
        log(f"wrote {args.json}")
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot:
        log(f"wrote {plotter(result, plot)}")


def ms(value: float | None, width: int = 0) -> str:
    """A latency for the table; "-" when nothing succeeded (every request over budget)."""
    return f"{value:{width}.2f}" if value is not None else f"{'-':>{width}}"


def ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else float("nan")


def cpu_per_request(of: dict, to: dict) -> float:
    """CPU per request answered (every process) of `of` over `to`, at the highest rate both
    served within budget: a request costs less CPU as batches grow with the rate."""

    def served(deployment: dict) -> dict[float, float]:
        return {
            p["rate"]: p["cpu_ms_per_request"]
            for p in deployment["rates"]
            if p["within_budget"] and "cpu_ms_per_request" in p
        }

    a, b = served(of), served(to)
    both = sorted(set(a) & set(b))
    return ratio(a[both[-1]], b[both[-1]]) if both else float("nan")


def max_goodput(deployment: dict) -> float:
    return max((p["goodput_rps"] for p in deployment["rates"]), default=0.0)


def print_table(result: dict) -> None:
    print(
        f"{'deployment':<22} {'rate/s':>8} {'tput/s':>8} {'good/s':>8} {'p50 ms':>8} "
        f"{'p95 ms':>8} {'p99 ms':>8}  errors"
    )
    for name, dep in result["deployments"].items():
        s = dep["single"]
        print(
            f"{name:<22} {'single':>8} {'':>8} {'':>8} {ms(s['p50_ms'], 8)} "
            f"{ms(s['p95_ms'], 8)} {ms(s['p99_ms'], 8)}  {s['errors'] or ''}"
        )
        for p in sorted(dep["rates"], key=lambda p: p["rate"]):
            fmt = [ms(p[k], 8) for k in ("p50_ms", "p95_ms", "p99_ms")]
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
            print(f"{key}: " + ", ".join(f"{k}/s {ratio_text(v)}" for k, v in value.items()))
        else:
            print(f"{key}: {ratio_text(value)}")


def ratio_text(value: float | None) -> str:
    """None: the baseline had none (no rate within budget, say)."""
    return "-" if value is None else f"{value:.3f}"
