"""`cleave simulate`'s outputs: the JSON document, the printed table, the PNG plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cleave.simulate.capacity import Study
from cleave.simulate.replay import DISAGGREGATED, MONOLITHIC

MODES = (MONOLITHIC, DISAGGREGATED)


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else 0.0


def _share(part: np.ndarray, whole: np.ndarray) -> float:
    return _mean(part / np.maximum(whole, 1e-9)) if len(part) else 0.0


def _reduction(before: float | None, after: float | None) -> float | None:
    if before is None or after is None or not before:
        return None
    return round(1 - after / before, 4)


def to_json(study: Study) -> dict:
    r = study.replays
    cap_cpu = r[DISAGGREGATED].capacity_cpu
    cap_gpu = r[DISAGGREGATED].capacity_gpu or 1.0

    def per_mode(fn) -> dict:
        return {m: fn(r[m]) for m in MODES}

    cpu_frag = per_mode(lambda x: round(_mean(x.cpu_fragments) / cap_cpu, 4))
    gpu_frag = per_mode(lambda x: round(_mean(x.gpu_fragments) / cap_gpu, 4))
    unplaced = per_mode(lambda x: round(_mean(x.unplaced_alive / np.maximum(x.alive, 1)), 4))
    loan = study.loaning
    return {
        "cpu_fragmentation": cpu_frag,
        "gpu_fragmentation": gpu_frag,
        "gpus_needed": dict(study.gpus_needed),
        "unplaced": unplaced,
        # Extras: GPUs needed when the pool's mix of GPU types is free; what the fractions
        # are made of.
        "gpus_needed_any_mix": dict(study.gpus_needed_any_mix),
        # gpus_needed is null where even this many GPUs (MAX_SCALE times the list's) were not
        # enough: instances that fit only a rare host type make a proportional pool huge.
        "gpus_needed_search_bound": study.search_bound,
        "fragments": per_mode(
            lambda x: {
                "cpus": round(_mean(x.cpu_fragments), 1),
                "gpus": round(_mean(x.gpu_fragments), 1),
            }
        ),
        # GPU fragments as Weng et al. count them: CPU-only types count every free GPU.
        "gpu_fragmentation_weng": per_mode(
            lambda x: round(_mean(x.gpu_fragments_weng) / cap_gpu, 4)
        ),
        # The share of the free CPUs (GPUs) that are fragments: blind to how much is free.
        "fragmentation_of_unallocated": per_mode(
            lambda x: {
                "cpu": round(_share(x.cpu_fragments, x.capacity_cpu * (1 - x.cpu_allocation)), 4),
                "gpu": round(_share(x.gpu_fragments, x.capacity_gpu * (1 - x.gpu_allocation)), 4),
            }
        ),
        "allocation": per_mode(
            lambda x: {
                "cpu": round(_mean(x.cpu_allocation), 4),
                "gpu": round(_mean(x.gpu_allocation), 4),
            }
        ),
        "instances": per_mode(
            lambda x: {"total": x.instances, "failed": x.failed, "unplaceable": x.unplaceable}
        ),
        "loaning": loan,
        "reductions": {
            "cpu_fragmentation": _reduction(cpu_frag[MONOLITHIC], cpu_frag[DISAGGREGATED]),
            "gpu_fragmentation": _reduction(gpu_frag[MONOLITHIC], gpu_frag[DISAGGREGATED]),
            "dedicated_gpus_by_loaning": _reduction(
                study.gpus_needed[DISAGGREGATED], study.gpus_needed["disaggregated_with_loaning"]
            ),
            "gpus_needed_any_mix": _reduction(
                study.gpus_needed_any_mix[MONOLITHIC], study.gpus_needed_any_mix[DISAGGREGATED]
            ),
            "borrowed_gpus_vs_monolithic": _reduction(
                loan["monolithic_borrowed_gpus"], loan["borrowed_gpus"]
            ),
        },
        "cluster": {
            "scale": round(study.scale, 4),
            "hosts": study.hosts,
            "cpus": cap_cpu,
            "gpus": r[DISAGGREGATED].capacity_gpu,
        },
        "samples": len(r[DISAGGREGATED].times),
        "cpu_seconds": round(study.seconds, 2),
    }


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def table(doc: dict) -> str:
    rows = [
        ("cpu fragmentation (of cluster CPUs)", doc["cpu_fragmentation"]),
        ("gpu fragmentation (of cluster GPUs)", doc["gpu_fragmentation"]),
        ("gpu fragmentation, Weng et al.'s count", doc["gpu_fragmentation_weng"]),
        ("fragmented CPUs (mean)", {m: v["cpus"] for m, v in doc["fragments"].items()}),
        ("fragmented GPUs (mean)", {m: v["gpus"] for m, v in doc["fragments"].items()}),
        (
            "cpu fragments of free CPUs",
            {m: v["cpu"] for m, v in doc["fragmentation_of_unallocated"].items()},
        ),
        (
            "gpu fragments of free GPUs",
            {m: v["gpu"] for m, v in doc["fragmentation_of_unallocated"].items()},
        ),
        ("cpu allocation", {m: v["cpu"] for m, v in doc["allocation"].items()}),
        ("gpu allocation", {m: v["gpu"] for m, v in doc["allocation"].items()}),
        ("unplaced (of alive instances)", doc["unplaced"]),
        (
            "instances failed / unplaceable",
            {m: f"{v['failed']} / {v['unplaceable']}" for m, v in doc["instances"].items()},
        ),
        (
            "gpus needed",
            {
                k: f"> {doc['gpus_needed_search_bound']}" if v is None else v
                for k, v in doc["gpus_needed"].items()
            },
        ),
        ("gpus needed, any mix, like for like", doc["gpus_needed_any_mix"]),
    ]
    width = max(len(r[0]) for r in rows)
    out = [f"{'':{width}}  {'monolithic':>14}  {'disaggregated':>14}  {'+loaning':>10}"]
    for name, values in rows:
        loan = values.get("disaggregated_with_loaning", "")
        out.append(
            f"{name:{width}}  {_fmt(values.get(MONOLITHIC)):>14}  "
            f"{_fmt(values.get(DISAGGREGATED)):>14}  {_fmt(loan) if loan != '' else '':>10}"
        )
    loan, red, c = doc["loaning"], doc["reductions"], doc["cluster"]
    out.append(
        f"loaning at p{loan['percentile']:g}: {_fmt(loan['dedicated_gpus'])} dedicated GPUs + "
        f"{_fmt(loan['borrowed_gpus'])} borrowed ({loan['borrowed_instances']} HN instances on "
        f"training hosts; monolithic would borrow {_fmt(loan['monolithic_borrowed_gpus'])}, "
        f"{loan['monolithic_borrowed_unplaceable']} of them too large for one)"
    )
    out.append(
        "reductions vs monolithic: cpu fragmentation "
        f"{_pct(red['cpu_fragmentation'])}, gpu fragmentation {_pct(red['gpu_fragmentation'])}; "
        f"GPUs needed (any mix) {_pct(red['gpus_needed_any_mix'])}; "
        f"dedicated GPUs by loaning {_pct(red['dedicated_gpus_by_loaning'])}; borrowed GPUs vs "
        f"monolithic {_pct(red['borrowed_gpus_vs_monolithic'])}"
    )
    out.append(
        f"cluster: scale {c['scale']:g} of the node list, {c['hosts']} hosts, "
        f"{c['cpus']:g} CPUs, {c['gpus']:g} GPUs; {doc['cpu_seconds']} CPU seconds"
    )
    return "\n".join(out)


def _pct(value: float | None) -> str:
    return (
        "-" if value is None else f"-{value * 100:.0f}%" if value >= 0 else f"+{-value * 100:.0f}%"
    )


def plots(study: Study, directory: Path) -> list[Path]:
    """fragmentation.png, allocation.png, unplaced.png: each deployment over time."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never a display
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    panels = {
        "fragmentation.png": (
            ("fragmented CPUs", lambda x: x.cpu_fragments),
            ("fragmented GPUs", lambda x: x.gpu_fragments),
        ),
        "allocation.png": (
            ("CPU allocation", lambda x: x.cpu_allocation),
            ("GPU allocation", lambda x: x.gpu_allocation),
        ),
        "unplaced.png": (
            ("alive instances", lambda x: x.alive),
            ("unplaced alive instances", lambda x: x.unplaced_alive),
        ),
    }
    written = []
    for name, specs in panels.items():
        fig, axes = plt.subplots(len(specs), 1, figsize=(9, 6), sharex=True)
        for ax, (label, series) in zip(axes, specs, strict=True):
            for mode in MODES:
                replay = study.replays[mode]
                ax.plot(replay.times / 3600, series(replay), label=mode)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend()
        axes[-1].set_xlabel("hours from the trace start")
        fig.tight_layout()
        path = directory / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
