"""`cleave bench rack`: a hot shard host on the rack testbed, ToR mode vs pool mode
(docs/testbed.md "Racks", docs/benchmarks.md; DRack §7.2, Fig. 9).

One embedding table of dim 64 is split by row ranges over the 8 shard hosts of two racks
(2 racks x 4 hosts, one `cleave shard` per host, each host's NIC shaped at --link-gbit). The
embedding stage of every request is one gather of 2,048 ids through `ShardClient` (the
router's shard client): the ids are split by range, each shard returns its rows (256 bytes
an id), and the stage ends when the last shard's reply is in. The client runs on the first
host of a third rack whose NICs are shaped at 100 Gbit/s (in effect unshaped), so its own
link is never the bottleneck.
Every connection is `mptcp:`.

* `zipf` ids: Zipf(1.05) ranks taken as row numbers, so the first shard host (h0) holds the
  hot rows and sends about 90% of the bytes: in ToR mode its NIC saturates while the 7 others
  idle; in pool mode its replies leave by all 4 NICs of its rack (MPTCP subflows).
* `uniform` ids: every host sends an equal share; the NICs are loaded alike in both modes.

Both modes run on the same links at the same offered load (Poisson arrivals at --rate, the
same seeds), each with a budget per request (--budget-ms: the client's timeout). Both
testbeds are up at once and the four cases run interleaved, round after round (--rounds of
--case-s each), so the shared machine's other load falls on both modes alike. Reported
per case: the embedding stage's average and p99 latency (from each request's scheduled
arrival, so queueing in front of a saturated NIC counts), goodput at the budget (requests
answered within it, per second offered), and each shard NIC's bytes per 100 ms (what its
bridge port received: the NIC's sent bytes). Ratios: `embedding_avg_pool_over_tor` (zipf;
DRack reports 0.626) and `embedding_avg_pool_over_tor_uniform`. The plot is per-NIC
utilisation over time for each case (like DRack's Fig. 9(j)).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from cleave.bench.harness.bundles import Table, write_bundle
from cleave.bench.harness.summary import nearest_rank, write_json
from cleave.bench.machine import describe
from cleave.errors import CleaveError, UsageError

RACKS, HOSTS_PER_RACK = 2, 4  # shard racks; a third rack holds the client
# The client rack's NICs: the most htb takes, far above what a veth here carries, so the
# client's own link never queues (8 replies arriving at once overflowed a 2 Gbit/s one's
# 256 KiB queue in ToR mode: losses and 200 ms retransmissions that were not the shards').
CLIENT_GBIT = 100.0
DIM = 64
IDS_PER_REQUEST = 2048
ZIPF_ALPHA = 1.05
SHARD_PORT, METRICS_PORT = 7600, 8600
SAMPLE_S = 0.1  # per-NIC byte counters
READY_TIMEOUT_S = 120.0
MODES = ("tor", "pool")
IDS = ("zipf", "uniform")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="write the results here (and the plot beside it)")
    parser.add_argument("--plot", help="the PNG (default: the --json path with .png)")
    parser.add_argument("--quick", action="store_true", help="tests: small table, short cases")
    parser.add_argument("--link-gbit", type=float, default=0.2, help="each shard NIC (default 0.2)")
    parser.add_argument(
        "--rate", type=float, help="requests/s offered (default: 70%% of the hot NIC in ToR)"
    )
    parser.add_argument(
        "--case-s", type=float, help="seconds offered per case and round (default 20)"
    )
    parser.add_argument("--rounds", type=int, help="rounds of the 4 cases (default 3; quick 1)")
    parser.add_argument(
        "--budget-ms", type=float, default=1000.0, help="per request (default 1000)"
    )
    parser.add_argument("--rows", type=int, help="table rows (default 800000; quick 80000)")
    parser.add_argument(
        "--workdir", help="where the scratch bundle goes (default: a temporary directory)"
    )


def zipf_ids(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Bounded Zipf(ZIPF_ALPHA) over the rows by inverse CDF, rank r -> row r: the hot rows
    are the first ones, so they sit on the first shard host."""
    cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -ZIPF_ALPHA)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(n)), rows - 1).astype(np.int64)


def request_ids(kind: str, rows: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if kind == "zipf":
        return [zipf_ids(rng, rows, IDS_PER_REQUEST) for _ in range(count)]
    return [rng.integers(0, rows, IDS_PER_REQUEST, dtype=np.int64) for _ in range(count)]


def hot_share(rows: int) -> float:
    """The fraction of zipf ids that fall on the first shard host."""
    w = np.arange(1, rows + 1, dtype=np.float64) ** -ZIPF_ALPHA
    return float(w[: rows // (RACKS * HOSTS_PER_RACK)].sum() / w.sum())


# -- the client, run inside the client rack's namespace -------------------------------------


def drive() -> None:
    """Takes the case (JSON) as its argument, sends it, writes the per-request results on
    stdout."""
    from concurrent.futures import ThreadPoolExecutor

    from cleave import _native

    case = json.loads(sys.argv[1])
    client = _native.ShardClient(
        [tuple(r) for r in case["routes"]], timeout_s=case["budget_ms"] / 1e3, connections=2
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:  # bounded by READY_TIMEOUT_S
        try:
            client.ready()
            break
        except _native.ShardError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    ids = request_ids(case["ids"], case["rows"], case["distinct"], case["seed"])
    for i in range(8):  # warm: connections and subflows up before the clock starts
        client.lookup([("t0", "gather", ids[i % len(ids)], [])])
    rng = np.random.default_rng(case["seed"] + 1)
    gaps = rng.exponential(1.0 / case["rate"], int(case["rate"] * case["case_s"] * 1.2) + 8)
    times = np.cumsum(gaps)
    times = times[times < case["case_s"]]
    results: list[tuple[float, float, bool]] = []
    lock = threading.Lock()

    def one(i: int, due: float) -> None:
        ok = True
        try:
            client.lookup([("t0", "gather", ids[i % len(ids)], [])])
        except _native.ShardError:
            ok = False
        with lock:
            results.append((due, time.monotonic() - due, ok))

    print("start", flush=True)
    start = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        for i, t in enumerate(times):
            wait = start + t - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            pool.submit(one, i, start + t)
    json.dump({"start": start, "results": results}, sys.stdout)
    sys.stdout.flush()


# -- the harness ------------------------------------------------------------------------------


class NicSampler:
    """Bytes each shard NIC sends, every SAMPLE_S: its bridge port's rx counter (root
    namespace), read by a thread until stopped."""

    def __init__(self, ports: dict[str, str]):
        self.ports = ports  # host name -> bridge port
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> dict[str, int]:
        out = {}
        for host, port in self.ports.items():
            with open(f"/sys/class/net/{port}/statistics/rx_bytes") as f:
                out[host] = int(f.read())
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self._read()))
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> NicSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def start_mode(stack: contextlib.ExitStack, mode: str, args, bundle: Path, rows: int):
    """A testbed wired `mode` with a shard on each of its 8 shard hosts: (testbed, routes,
    client host, shard host name -> bridge port)."""
    from cleave.testbed.testbed import Testbed

    gbit = [args.link_gbit] * RACKS + [CLIENT_GBIT]
    hosts = (RACKS + 1) * HOSTS_PER_RACK
    shards = RACKS * HOSTS_PER_RACK
    per = rows // shards
    tb = stack.enter_context(
        Testbed(hosts, args.link_gbit, racks=RACKS + 1, mode=mode, rack_gbit=gbit)
    )
    routes = []
    for i in range(shards):
        h = tb.host(i)
        lo, hi = i * per, rows if i == shards - 1 else (i + 1) * per
        argv = [sys.executable, "-m", "cleave.cli", "shard", "--bundle", str(bundle)]
        argv += ["--listen", f"mptcp:{h.address}:{SHARD_PORT}", "--rows", f"t0={lo}:{hi}"]
        argv += ["--metrics-port", str(METRICS_PORT), "--threads", "1"]
        tb.popen(h, argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        routes.append(("t0", lo, hi, f"mptcp:{h.address}:{SHARD_PORT}"))
    ports = {tb.host(i).name: tb.host(i).bridge_port for i in range(shards)}
    return tb, routes, tb.host(shards), ports  # the client: the client rack's first host


def drive_case(tb, client, case: dict, ports: dict, args) -> dict:
    """One round of one case: each request's (latency ms, answered) and the NICs' bytes."""
    argv = [sys.executable, "-c", "from cleave.bench.rack import drive; drive()"]
    proc = tb.popen(client, [*argv, json.dumps(case)], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "start":
        raise CleaveError(f"the client did not start (exit code {proc.wait(30)})")
    with NicSampler(ports) as sampler:
        try:
            out, _ = proc.communicate(timeout=case["case_s"] + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise CleaveError("the client did not finish within its case + 120 s") from None
    if proc.returncode != 0:
        raise CleaveError(f"the client failed (exit code {proc.returncode})")
    data = json.loads(out)
    t0 = sampler.samples[0][0]
    link = args.link_gbit * 1e9 / 8
    times: list[float] = []
    series: dict[str, list[int]] = {h: [] for h in ports}
    util: dict[str, list[float]] = {h: [] for h in ports}
    for (ta, a), (tb_, b) in zip(sampler.samples, sampler.samples[1:], strict=False):
        times.append(round(tb_ - t0, 3))
        for h in ports:
            series[h].append(b[h] - a[h])
            util[h].append(round((b[h] - a[h]) / ((tb_ - ta) * link), 4))
    return {
        "latency_ms": [r[1] * 1e3 for r in data["results"]],
        "answered": [r[2] for r in data["results"]],
        "nic_times_s": times,
        "nic_bytes_per_sample": series,
        "nic_utilisation": util,
    }


def summarise(kind: str, mode: str, rounds: list[dict], rate: float, case_s: float, args):
    """One case over its rounds: every request of every round together; the NIC series of
    the first round (what the plot draws)."""
    lat = np.array([v for r in rounds for v in r["latency_ms"]])
    ok = np.array([v for r in rounds for v in r["answered"]], dtype=bool)
    answered = lat[ok]
    within = ok & (lat <= args.budget_ms)
    sent = {
        h: sum(sum(r["nic_bytes_per_sample"][h]) for r in rounds)
        for h in rounds[0]["nic_bytes_per_sample"]
    }
    per_round = [
        float(np.mean(np.array(r["latency_ms"])[np.array(r["answered"], dtype=bool)]))
        for r in rounds
        if any(r["answered"])
    ]
    return {
        "ids": kind,
        "mode": mode,
        "offered_rps": rate,
        "rounds": len(rounds),
        "requests": int(len(lat)),
        "failed": int((~ok).sum()),
        "embedding_avg_ms": float(answered.mean()) if len(answered) else None,
        "embedding_avg_ms_per_round": per_round,
        "embedding_p50_ms": nearest_rank(answered, 0.5),
        "embedding_p99_ms": nearest_rank(answered, 0.99),
        "goodput_rps": float(within.sum() / (case_s * len(rounds))),
        "nic_sent_bytes": {h: int(v) for h, v in sent.items()},
        "nic_times_s": rounds[0]["nic_times_s"],
        "nic_bytes_per_sample": rounds[0]["nic_bytes_per_sample"],
        "nic_utilisation": rounds[0]["nic_utilisation"],
    }


def plot(result: dict, path: Path) -> Path:
    from cleave.bench.plot import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(len(IDS), len(MODES), figsize=(13, 7), sharey=True, squeeze=False)
    for case in result["cases"]:
        ax = axes[IDS.index(case["ids"])][MODES.index(case["mode"])]
        t = case["nic_times_s"]
        for host, util in case["nic_utilisation"].items():
            ax.plot(t, [u * 100 for u in util], label=f"{host} NIC", linewidth=0.8)
        avg = case["embedding_avg_ms"]
        ax.set_title(f"{case['ids']} ids, {case['mode']}: embedding avg {avg:.1f} ms")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("NIC utilisation (%)")
    axes[0][-1].legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    from cleave.testbed import commands

    if commands.unavailable() is not None:
        raise UsageError(f"cleave bench rack needs the testbed: {commands.unavailable()}")
    rows = args.rows or (80_000 if args.quick else 800_000)
    if rows < RACKS * HOSTS_PER_RACK:
        raise UsageError(f"--rows must be >= {RACKS * HOSTS_PER_RACK}, got {rows}")
    case_s = args.case_s or (4.0 if args.quick else 20.0)
    rounds = args.rounds or (1 if args.quick else 3)
    share = hot_share(rows)
    hot_bytes = share * IDS_PER_REQUEST * 4 * DIM  # per request, zipf
    # 70% of the hot NIC in ToR mode: it saturates in bursts, and not at all when pooled.
    rate = args.rate or 0.7 * args.link_gbit * 1e9 / 8 / hot_bytes
    checks = (("--rate", rate), ("--case-s", case_s), ("--budget-ms", args.budget_ms))
    for what, v in (*checks, ("--rounds", rounds)):
        if not v > 0:
            raise UsageError(f"{what} must be > 0, got {v}")
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cleave-bench-rack-", dir=args.workdir) as tmp:
        rng = np.random.default_rng(3)
        bundle = write_bundle(
            Path(tmp) / "bundle",
            [Table("t0", rows, DIM)],
            lambda t, n: rng.standard_normal((n, DIM), dtype=np.float32),
            "cleave bench rack",
        )
        # Both testbeds up at once and the cases interleaved, round after round: the
        # machine's other load (it is shared) falls on ToR and pool alike.
        raw: dict[tuple[str, str], list[dict]] = {(k, m): [] for k in IDS for m in MODES}
        with contextlib.ExitStack() as stack:
            beds = {m: start_mode(stack, m, args, bundle, rows) for m in MODES}
            for r in range(rounds):
                for kind in IDS:
                    for mode in MODES:
                        tb, routes, client, ports = beds[mode]
                        case = {
                            "routes": routes,
                            "ids": kind,
                            "rows": rows,
                            "distinct": 256,
                            "seed": 11 + r,
                            "rate": rate,
                            "case_s": case_s,
                            "budget_ms": args.budget_ms,
                        }
                        print(
                            f"cleave bench rack: round {r + 1}/{rounds}, {kind} ids, {mode}",
                            file=sys.stderr,
                            flush=True,
                        )
                        raw[(kind, mode)].append(drive_case(tb, client, case, ports, args))
        cases = [summarise(k, m, raw[(k, m)], rate, case_s, args) for k in IDS for m in MODES]
    by = {(c["ids"], c["mode"]): c for c in cases}

    def ratio(kind: str) -> float | None:
        pool, tor = by[(kind, "pool")]["embedding_avg_ms"], by[(kind, "tor")]["embedding_avg_ms"]
        return pool / tor if pool and tor else None

    result = {
        "benchmark": "rack",
        "machine": describe(),
        "racks": RACKS,
        "hosts_per_rack": HOSTS_PER_RACK,
        "link_gbit": args.link_gbit,
        "client_link_gbit": CLIENT_GBIT,
        "rows": rows,
        "dim": DIM,
        "ids_per_request": IDS_PER_REQUEST,
        "zipf_alpha": ZIPF_ALPHA,
        "zipf_hot_share": share,
        "rate_rps": rate,
        "case_s": case_s,
        "rounds": rounds,
        "budget_ms": args.budget_ms,
        "transport": "mptcp",
        "cases": cases,
        "ratios": {
            "embedding_avg_pool_over_tor": ratio("zipf"),
            "embedding_avg_pool_over_tor_uniform": ratio("uniform"),
            "goodput_pool_over_tor": _goodput_ratio(by),
        },
    }
    print_table(result)
    if args.json:
        path = write_json(result, args.json)
        png = Path(args.plot) if args.plot else path.with_suffix(".png")
        plot(result, png)
    print(json.dumps(_without_series(result)))
    return 0


def _goodput_ratio(by: dict) -> float | None:
    tor = by[("zipf", "tor")]["goodput_rps"]
    return by[("zipf", "pool")]["goodput_rps"] / tor if tor else None


def _without_series(result: dict) -> dict:
    drop = ("nic_times_s", "nic_bytes_per_sample", "nic_utilisation")
    return {
        **result,
        "cases": [{k: v for k, v in c.items() if k not in drop} for c in result["cases"]],
    }


def print_table(result: dict) -> None:
    head = f"{'ids':8} {'mode':5} {'avg ms':>8} {'p99 ms':>8} {'goodput/s':>10} {'failed':>7}"
    print(head + "  hot NIC MB", file=sys.stderr)
    for c in result["cases"]:
        hot = max(c["nic_sent_bytes"].values()) / 1e6
        avg = c["embedding_avg_ms"] or float("nan")
        p99 = c["embedding_p99_ms"] or float("nan")
        print(
            f"{c['ids']:8} {c['mode']:5} {avg:8.2f} {p99:8.2f} {c['goodput_rps']:10.1f} "
            f"{c['failed']:7d}  {hot:.1f}",
            file=sys.stderr,
        )
    for k, v in result["ratios"].items():
        print(f"{k}: {v:.3f}" if v is not None else f"{k}: -", file=sys.stderr)
