"""Plots of `cleave bench serve` results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

# Stages the router reports, in pipeline order; other "_us" parameters are drawn after them.
STAGE_ORDER = ["parse_us", "lookup_us", "transfer_us", "queue_us", "compute_us"]
_SHORT = {"disaggregated": "disagg", "monolithic": "mono"}


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 100) -> Path:
    """Lays `fig` out, writes it to `path` (making its folder) and closes it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _stages(points: list[dict]) -> list[str]:
    seen = {k for p in points for k in p.get("stages_us", {}) if k != "total_us"}
    return [s for s in STAGE_ORDER if s in seen] + sorted(seen - set(STAGE_ORDER))


def plot_results(result: dict, path: str | Path) -> Path:
    """Left: p50 and p99 latency against offered rate per deployment, with the budget.
    Right: mean time per stage at each rate, stacked, per deployment."""
    plt = pyplot()

    deployments = result["deployments"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for name, dep in deployments.items():
        points = sorted(dep["rates"], key=lambda p: p["rate"])
        rates = [p["rate"] for p in points]
        line = left.plot(rates, [p["p99_ms"] for p in points], marker="o", label=f"{name} p99")
        left.plot(
            rates,
            [p["p50_ms"] for p in points],
            marker=".",
            linestyle="--",
            color=line[0].get_color(),
            label=f"{name} p50",
        )
    left.axhline(result["budget_ms"], color="grey", linestyle=":", label="budget")
    left.set_xlabel("offered load (requests/s)")
    left.set_ylabel("latency (ms)")
    left.set_yscale("log")
    left.set_title(f"{result['model']}: latency vs load ({result['candidates']} candidates)")
    left.legend(fontsize=8)

    labels, positions, width = [], [], 0.8
    stages = _stages([p for d in deployments.values() for p in d["rates"]])
    x = 0
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for name, dep in deployments.items():
        first = x
        for p in sorted(dep["rates"], key=lambda p: p["rate"]):
            bottom = 0.0
            for i, stage in enumerate(stages):
                value = p.get("stages_us", {}).get(stage, 0.0) / 1000
                right.bar(
                    x,
                    value,
                    width,
                    bottom=bottom,
                    color=colors[i % len(colors)],
                    label=stage.removesuffix("_us") if x == 0 else None,
                )
                bottom += value
            labels.append(f"{p['rate']:g}")
            positions.append(x)
            x += 1
        right.text(
            (first + x - 1) / 2,
            -0.12,
            name,
            transform=right.get_xaxis_transform(),
            ha="center",
            fontsize=9,
        )
        x += 0.5  # a gap between deployments
    right.set_xticks(positions, labels, fontsize=7, rotation=90)
    right.set_ylabel("mean time per request (ms)")
    right.set_title("stage breakdown (router-measured) by deployment and rate")
    if stages:
        right.legend(fontsize=8)
    return save_figure(fig, path, dpi=110)


def plot_stress(result: dict, path: str | Path) -> Path:
    """--overload: per burst, answers per second by status (stacked) and the 200s' p99, over
    time. --soak: each process's resident memory over time."""
    plt = pyplot()

    ((name, report),) = result["deployments"].items()
    if "bursts" not in report:
        fig, ax = plt.subplots(figsize=(11, 5))
        for proc, entry in report["processes"].items():
            ax.plot(entry["t"], [r / 2**20 for r in entry["rss"]], marker=".", label=proc)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("RSS (MiB)")
        ax.set_title(f"{name}: soak at {report['rate']:.0f} requests/s")
        ax.legend(loc="upper left", fontsize="small")
        return save_figure(fig, path, dpi=100)
    bursts = report["bursts"]
    fig, axes = plt.subplots(1, len(bursts), figsize=(6 * len(bursts), 5), squeeze=False)
    for ax, (factor, burst) in zip(axes[0], bursts.items(), strict=True):
        seconds = burst["timeline"]
        t = [s["t"] for s in seconds]
        keys = sorted({k for s in seconds for k in s["counts"]}, key=lambda k: (k != "200", k))
        bottom = [0] * len(t)
        for key in keys:
            counts = [s["counts"].get(key, 0) for s in seconds]
            ax.bar(t, counts, bottom=bottom, width=0.9, label=key)
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
        ax.axhline(report["capacity_rps"], color="grey", linestyle=":", label="capacity")
        ax.set_xlabel("scheduled send time (s)")
        ax.set_ylabel("requests per second, by answer")
        right = ax.twinx()
        right.plot(t, [s["p99_ms"] for s in seconds], color="black", marker=".", label="p99")
        right.set_ylabel("p99 of the 200s (ms)")
        ax.set_title(f"{name}: burst at {factor}x capacity")
        ax.legend(loc="upper left", fontsize="small")
    return save_figure(fig, path, dpi=100)


def plot_hosts(result: dict, path: str | Path) -> Path:
    """The shard-host sweep: p99 against offered rate per deployment, goodput within the
    budget per deployment, and the /metrics stage breakdown at each one's reference rate (its
    highest within budget), network stages hatched."""
    plt = pyplot()

    from cleave.bench.hosts import STAGES, reference_point, stage_means

    deployments = result["deployments"]
    fig, (lat, good, stages) = plt.subplots(1, 3, figsize=(16, 5))
    for name, dep in deployments.items():
        points = sorted(dep["rates"], key=lambda p: p["rate"])
        lat.plot([p["rate"] for p in points], [p["p99_ms"] for p in points], marker="o", label=name)
    lat.axhline(result["budget_ms"], color="grey", linestyle=":", label="budget")
    lat.set_xlabel("offered load (requests/s)")
    lat.set_ylabel("p99 latency (ms)")
    lat.set_yscale("log")
    lat.set_title(f"{result['model']}, {result['candidates']} candidates: p99 vs load")
    lat.legend(fontsize=8)

    names = list(deployments)
    good.bar(names, [d["max_rate_within_budget"] for d in deployments.values()], color="C0")
    good.set_ylabel(f"requests/s with p99 <= {result['budget_ms']:g} ms")
    good.set_title(f"goodput, {result.get('link_gbit', 1.0):g} Gbit/s host links")

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for x, dep in enumerate(deployments.values()):
        point = reference_point(dep)
        means = stage_means(point) if point else {}
        bottom = 0.0
        for i, stage in enumerate(STAGES):
            value = max(means.get(stage, 0.0), 0.0)
            stages.bar(
                x,
                value,
                0.7,
                bottom=bottom,
                color=colors[i % len(colors)],
                hatch="//" if stage in ("lookup_network", "transfer") else None,
                label=stage if x == 0 else None,
            )
            bottom += value
    stages.set_xticks(range(len(names)), names)
    stages.set_ylabel("mean ms per request (from /metrics)")
    stages.set_title("stages at each one's highest rate within budget")
    stages.legend(fontsize=8)
    return save_figure(fig, path, dpi=100)
