"""`cleave bench cache`: the router's embedding cache (docs/cache.md) off, fixed and adaptive on
skewed traffic, the load stepping from 20% to 120% of the no-cache deployment's capacity
(FlexEMR Fig. 7). Per mode and step: hit rate, lookups avoided, bytes not sent, p50/p99, the
rankers' largest batch the memory budget allows, goodput. Ids are drawn as the tier
benchmark draws them (`cleave.bench.tier`: Zipf ranks scattered over each table). Prints JSON
and a table; the ratios compare modes of the same run. `--quick`: a small run for tests."""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

STEPS = (0.2, 0.4, 0.6, 0.8, 1.0, 1.2)
MODES = ("off", "fixed", "adaptive")
# The rankers' memory per row of a batch, and the host budget it shares with the cache: room
# for one and a half full batches of MAX_BATCH rows. The fixed cache takes half the budget and
# so leaves 0.75 of a full batch; the adaptive one takes what the batches leave.
ACTIVATION_BYTES = 256 << 10
MAX_BATCH = 64
BUDGET = MAX_BATCH * ACTIVATION_BYTES * 3 // 2
FIXED = BUDGET // 2
# Rows a request: four requests fill a batch of MAX_BATCH.
CANDIDATES = 16
# Closed-loop clients that find the capacity: enough to keep every stage busy.
CAPACITY_CLIENTS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a short run (tests)")
    parser.add_argument("--step-s", type=float, default=4.0, help="seconds per load step")
    parser.add_argument("--alpha", type=float, default=1.05, help="the ids' Zipf skew")
    parser.add_argument("--scale", type=float, default=0.05, help="the dlrm model's scale")
    parser.add_argument("--pin", default="auto", help="SERVER:CLIENT CPU lists, auto or off")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="the rankers' device: on a GPU the budget stands for the GPU's memory",
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="the PNG (default: the --json path with .png)")


def skewed_bodies(partitioned, manifest: dict, alpha: float, count: int, seed: int) -> list:
    """Request bodies of CANDIDATES rows whose ids follow the tier benchmark's skew."""
    from cleave.bench.loadgen import infer_body
    from cleave.bench.tier import scatter, zipf_ranks
    from cleave.models import RequestGenerator

    rng = np.random.default_rng(seed)
    generator = RequestGenerator("dlrm", scale=manifest["_scale"], seed=seed, min_pooling=1)
    rows = {t["name"]: int(t["rows"]) for t in manifest["tables"]}
    bodies = []
    for _ in range(count):
        named = partitioned.named_inputs(*generator.batch(CANDIDATES))
        for f in manifest["features"]:
            ids = np.asarray(named[f["ids"]])
            n = rows[f["table"]]
            skewed = scatter(zipf_ranks(rng, alpha, n, ids.size), n).reshape(ids.shape)
            named[f["ids"]] = skewed.astype(ids.dtype)
        bodies.append(infer_body(named))
    return bodies


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


class Poller:
    """The router's cache figures every `every_s` seconds while the load runs."""

    def __init__(self, base: str, every_s: float = 0.25):
        self.base, self.every_s = base, every_s
        self.points: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.wait(self.every_s):  # bounded by stop()
            try:
                point = _get(f"{self.base}/admin/v1/cache")
            except OSError:
                continue
            point["t"] = time.monotonic() - start
            self.points.append(point)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def config_toml(path: Path, mode: str, device: str = "cpu") -> Path:
    lines = ["[router]", f'cache = "{mode}"']
    if mode != "off":
        lines += [
            f"memory_budget_bytes = {BUDGET}",
            f"activation_bytes_per_sample = {ACTIVATION_BYTES}",
        ]
    if mode == "fixed":
        lines.append(f"cache_bytes = {FIXED}")
    lines += ["[ranker]", f"max_batch = {MAX_BATCH}", f'device = "{device}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def nocache_max_batch() -> int:
    return min(MAX_BATCH, BUDGET // ACTIVATION_BYTES)


def step_rows(samples, stats: list[dict], step_s: float, rates: list[float], budget_s: float):
    """Per step: p50/p99 of the 200s, goodput (200s within the budget per second), the cache's
    counters' increase over the step and its smallest allowed batch."""
    out = []
    for i, rate in enumerate(rates):
        lo, hi = i * step_s, (i + 1) * step_s
        inside = [s for s in samples if lo <= s.scheduled_s < hi]
        ok = [s.latency_s for s in inside if not s.error]
        good = sum(1 for x in ok if x <= budget_s)
        window = [p for p in stats if lo <= p["t"] < hi]
        # The counters' increase from the last reading before the step to the last in it.
        before = [p for p in stats if p["t"] < lo]
        first = before[-1] if before else (window[0] if window else {})
        last = window[-1] if window else first
        diff = {
            k: last.get(k, 0) - first.get(k, 0)
            for k in ("hits", "misses", "lookups_avoided", "bytes_not_sent")
        }
        looked = diff["hits"] + diff["misses"]
        batches = [p["ranker_max_batch"] for p in window if "ranker_max_batch" in p]
        out.append(
            {
                "load": rate,
                "sent": len(inside),
                "p50_ms": float(np.percentile(ok, 50) * 1e3) if ok else None,
                "p99_ms": float(np.percentile(ok, 99) * 1e3) if ok else None,
                "goodput": good / step_s,
                "hit_rate": diff["hits"] / looked if looked else 0.0,
                "lookups_sent": diff["misses"],
                "lookups_avoided": diff["lookups_avoided"],
                "bytes_not_sent": diff["bytes_not_sent"],
                "max_batch": min(batches) if batches else nocache_max_batch(),
                "limit_bytes": last.get("limit_bytes", 0),
            }
        )
    return out


def run_mode(bundle: Path, workdir: Path, mode: str, bodies, capacity, args, pins, log):
    from cleave.bench.loadgen import closed_loop, open_loop_phases, sequential
    from cleave.bench.machine import pinned
    from cleave.launch.process import ServeProcess

    server_cpus, client_cpus = pins
    toml = config_toml(workdir / f"{mode}.toml", mode, args.device)
    with pinned(server_cpus):
        shards = "1" if args.quick else "2"  # --quick: the shape of a run, started sooner
        server = ServeProcess(bundle, "--shards", shards, "--config", str(toml)).start()
    try:
        url = f"{server.url}/v2/models/{bundle.name}/infer"
        with pinned(client_cpus):
            # Every body once, one at a time: the working set is inserted at idle, so that the
            # steps compare the caches' sizes, not their cold starts.
            sequential(url, bodies, len(bodies))
            if capacity is None:  # the no-cache deployment's
                closed_loop(url, bodies, CAPACITY_CLIENTS, args.step_s / 2)
                done = closed_loop(url, bodies, CAPACITY_CLIENTS, args.step_s)
                capacity = sum(1 for s in done if not s.error) / args.step_s
                log(f"  capacity {capacity:.1f}/s")
            rates = [capacity * f for f in STEPS]
            with Poller(server.url, min(0.25, args.step_s / 4)) as poller:
                samples = open_loop_phases(
                    url, bodies, [(r, args.step_s) for r in rates], timeout_s=2.0, replies=False
                )
        rows = step_rows(samples, poller.points, args.step_s, rates, budget_s=1.0)
    finally:
        server.stop()
    for r in rows:
        r["load_share"] = round(r["load"] / capacity, 2)
    return capacity, rows


def ratios(by_mode: dict) -> dict:
    low, over = 0, len(STEPS) - 1

    def at(mode, step, key):
        return by_mode[mode][step][key]

    def ratio(a, b):
        if a == b == 0:  # e.g. no lookup sent by either: equal
            return 1.0
        return a / b if b else None

    return {
        "overload_max_batch_adaptive_over_nocache": ratio(
            at("adaptive", over, "max_batch"), at("off", over, "max_batch")
        ),
        "overload_max_batch_fixed_over_nocache": ratio(
            at("fixed", over, "max_batch"), at("off", over, "max_batch")
        ),
        "overload_goodput_adaptive_over_nocache": ratio(
            at("adaptive", over, "goodput"), at("off", over, "goodput")
        ),
        "low_load_p99_adaptive_over_fixed": ratio(
            at("adaptive", low, "p99_ms") or 0, at("fixed", low, "p99_ms") or 0
        ),
        "low_load_lookups_sent_adaptive_over_fixed": ratio(
            at("adaptive", low, "lookups_sent"), at("fixed", low, "lookups_sent")
        ),
    }


def plot(result: dict, path: Path) -> Path:
    from cleave.bench.plot import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for mode, rows in result["modes"].items():
        x = [r["load_share"] * 100 for r in rows]
        axes[0].plot(x, [r["max_batch"] for r in rows], marker="o", label=mode)
        axes[1].plot(x, [r["p99_ms"] or float("nan") for r in rows], marker="o", label=mode)
        axes[2].plot(x, [r["hit_rate"] for r in rows], marker="o", label=mode)
    titles = ("rankers' largest batch (rows)", "p99 (ms)", "cache hit rate")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xlabel("load (% of no-cache capacity)")
        ax.set_title(title)
        ax.legend()
    return save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    import tempfile

    import cleave
    from cleave.bench.machine import parse_pin
    from cleave.models import MODELS

    if args.quick:  # the shape of a run, not a measurement
        args.step_s, args.scale = 0.2, 0.01

    def log(m):
        print(m, flush=True, file=__import__("sys").stderr)

    pins = parse_pin(args.pin)
    with tempfile.TemporaryDirectory(prefix="cleave-bench-cache-") as tmp:
        workdir = Path(tmp)
        model, example = MODELS["dlrm"].factory(scale=args.scale, seed=0)
        model.eval()
        partitioned = cleave.partition(model, example)
        bundle = partitioned.save(workdir / "dlrm")
        manifest = json.loads((bundle / "manifest.json").read_text())
        manifest["_scale"] = args.scale
        bodies = skewed_bodies(partitioned, manifest, args.alpha, 16 if args.quick else 1024, 3)
        capacity, by_mode = None, {}
        for mode in MODES:
            log(f"cache {mode}")
            capacity, by_mode[mode] = run_mode(
                bundle, workdir, mode, bodies, capacity, args, pins, log
            )
    result = {
        "bench": "cache",
        "capacity_rps": capacity,
        "steps": list(STEPS),
        "budget_bytes": BUDGET,
        "fixed_cache_bytes": FIXED,
        "activation_bytes_per_sample": ACTIVATION_BYTES,
        "ranker_max_batch": MAX_BATCH,
        "device": args.device,
        "pin": {"server": pins[0], "client": pins[1]},
        "modes": by_mode,
        "ratios": ratios(by_mode),
    }
    print(json.dumps(result))
    print(
        f"{'mode':9} {'load':>5} {'p50 ms':>7} {'p99 ms':>7} {'good/s':>7} {'hit':>5} "
        f"{'sent':>7} {'avoided':>8} {'batch':>5}"
    )
    for mode, rows in by_mode.items():
        for r in rows:
            p50 = f"{r['p50_ms']:.1f}" if r["p50_ms"] is not None else "-"
            p99 = f"{r['p99_ms']:.1f}" if r["p99_ms"] is not None else "-"
            print(
                f"{mode:9} {r['load_share']:5.1f} {p50:>7} {p99:>7} {r['goodput']:7.1f} "
                f"{r['hit_rate']:5.2f} {r['lookups_sent']:7d} {r['lookups_avoided']:8d} "
                f"{r['max_batch']:5d}"
            )
    for k, v in result["ratios"].items():
        print(f"{k}: {v if v is None else round(v, 3)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    target = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if target:
        plot(result, Path(target))
    return 0
